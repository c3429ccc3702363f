//! `out = x · dequantize(W)ᵀ` on GGUF blocks with integer dot products, for the
//! few rows of a decode step (as llama.cpp's CPU backend computes it).
//!
//! Each row of `x` is quantized to int8 per 16 elements (`Q8Rows`: a scale
//! `dx = max|x| / 127` and `x_q = round(x / dx)`, with `Σ x_q` and `dx · Σ x_q`);
//! each weight block is unpacked to small integers `q` in registers
//! (`gguf_int_blocks`), a panel of 8 or 16 weight rows at a time, and `Σ q · x_q`
//! runs on the CPU's integer dot-product instructions with the rows in the lanes
//! (`gguf_panel`). The weight is read once per call, as blocks; float weights
//! never exist.
//!
//! Not equal to dequantize + fp32: `x` is rounded to int8, so each term carries
//! an error of at most `|w_i| · dx / 2` (`tests_gguf_int.rs` checks the bound).
//! Every ISA gives the same bits, and a row the same bits in any batch.
//!
//! `ASYNCLLM_KERNEL_ISA` caps the path: `portable`, `avx2` (`vpmaddubsw`),
//! `avxvnni` (and `avx512`: AVX-VNNI is no AVX-512 extension), `avx512vnni`,
//! `auto` / unset (the best this CPU has).

use super::bf16::{isa_cap, IsaCap};
use super::elementwise::narrow;
use super::gguf::GgufType;
use super::gguf_int_blocks::{IntBlock, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0, QK4};
use super::gguf_int_loop::{rows, Item, Store};
use super::gguf_panel::Portable8;
#[cfg(target_arch = "x86_64")]
use super::gguf_panel::{Ymm, Zmm, AVX_VNNI, MADDUBS};
use super::gguf_panels::PANEL;
use super::gguf_q8::Q8Rows;
use super::linear::Elem;
use super::team;
use super::KernelError;

/// Output features per work item: two panels of the panel layout (two or four
/// of the kernel's). Against one panel an item, SmolLM2's 120 projections out of
/// cache (Zen 5, builds alternated in one process, same bits) took 0.95-0.97x
/// the time at 9 to 128 rows, the same at one or two; four panels an item was
/// 0.97-1.03x, its items too few to share out evenly (a 576-wide layer has 36
/// panels: nine items for two threads).
const ITEM_ROWS: usize = PANELS_PER_ITEM * PANEL;
const PANELS_PER_ITEM: usize = 2;

/// The integer kernel's instruction sets, in order of preference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum QuantIsa {
    Portable,
    Avx2,
    AvxVnni,
    Avx512Vnni,
}

impl QuantIsa {
    /// The best path this CPU runs within the cap of `ASYNCLLM_KERNEL_ISA`.
    pub(super) fn detect() -> Result<QuantIsa, KernelError> {
        let cap = isa_cap()?;
        let allowed = |isa: &QuantIsa| match cap {
            IsaCap::Portable => *isa == QuantIsa::Portable,
            IsaCap::Avx2 => *isa <= QuantIsa::Avx2,
            IsaCap::AvxVnni | IsaCap::Avx512 => *isa <= QuantIsa::AvxVnni,
            IsaCap::Avx512Vnni | IsaCap::Auto => true,
        };
        let best = QuantIsa::available().into_iter().filter(allowed).max();
        Ok(best.unwrap_or(QuantIsa::Portable))
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            QuantIsa::Portable => "portable",
            QuantIsa::Avx2 => "avx2",
            QuantIsa::AvxVnni => "avxvnni",
            QuantIsa::Avx512Vnni => "avx512vnni",
        }
    }

    /// `dst = src` rounded to `E`, compiled for this path's vectors (a bf16
    /// output's rounding, on the baseline ISA's four lanes, had been 4 % of a
    /// 102-token prompt's profile's samples; now 2.4 %).
    fn narrow<E: Elem>(self, src: &[f32], dst: &mut [E]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: these paths are only constructed where the CPU has AVX2
            // (`available`), and AVX512F with Avx512Vnni.
            QuantIsa::Avx2 | QuantIsa::AvxVnni => unsafe { narrow_avx2(src, dst) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            QuantIsa::Avx512Vnni => unsafe { narrow_avx512(src, dst) },
            _ => narrow(src, dst),
        }
    }

    /// Every path this CPU can run (tests force each one).
    pub(super) fn available() -> Vec<QuantIsa> {
        #[allow(unused_mut)]
        let mut isas = vec![QuantIsa::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            isas.push(QuantIsa::Avx2);
            if is_x86_feature_detected!("avxvnni") {
                isas.push(QuantIsa::AvxVnni);
            }
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                isas.push(QuantIsa::Avx512Vnni);
            }
        }
        isas
    }

    /// One item's weight rows `w` (whole panels of the panel layout when `panel`)
    /// against every row of `xq`, on this path.
    fn rows<B: IntBlock>(self, w: Item<'_>, xq: &Q8Rows, store: Store<'_>) {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx2` is only constructed where the CPU has AVX2, FMA and
            // F16C (`available` checks them).
            QuantIsa::Avx2 => unsafe { rows_avx2::<B>(w, xq, store) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `AvxVnni` is only constructed where the CPU has AVX2, FMA,
            // F16C and AVX-VNNI (`available`).
            QuantIsa::AvxVnni => unsafe { rows_avxvnni::<B>(w, xq, store) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx512Vnni` is only constructed where the CPU has AVX2, FMA,
            // F16C, AVX512F, AVX512VL and AVX512-VNNI (`available`).
            QuantIsa::Avx512Vnni => unsafe { rows_avx512vnni::<B>(w, xq, store) },
            _ => rows::<Portable8, B>(w, xq, store),
        }
    }
}

/// The path `gguf_linear_int` runs here (for tests and benchmarks).
pub fn gguf_int_isa() -> Result<&'static str, KernelError> {
    Ok(QuantIsa::detect()?.name())
}

/// `out[m, n] = x[m, k] · dequantize(w)[n, k]ᵀ` on `num_threads` threads, with
/// the best integer path this CPU has; `w` is `n` rows of blocks of `t`, a
/// quantized type, in the panel layout (`gguf_panels`) when `panels` (the same
/// bits either way). Every check runs before `out` is written.
#[allow(clippy::too_many_arguments)] // the product's operands and the layout
pub fn gguf_linear_int(
    t: GgufType,
    m: usize,
    k: usize,
    x: &[f32],
    w: &[u8],
    panels: bool,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    run(
        QuantIsa::detect()?,
        t,
        (m, k),
        x,
        (w, panels),
        num_threads,
        out,
    )
}

/// `gguf_linear_int` from `x` of `E` into `out` (see `run_into`), on the best
/// integer path this CPU has.
#[allow(clippy::too_many_arguments)] // the product's operands and the layout
pub(super) fn gguf_linear_int_into<E: Elem>(
    t: GgufType,
    m: usize,
    k: usize,
    x: &[E],
    w: &[u8],
    panels: bool,
    num_threads: usize,
    out: OutRows<'_, E>,
) -> Result<(), KernelError> {
    run_into(
        QuantIsa::detect()?,
        t,
        (m, k),
        x,
        (w, panels),
        num_threads,
        out,
    )
}

/// `gguf_linear_int` on the path `isa` (tests run each); `w` is `(blocks, whether
/// they are in the panel layout)`.
pub(super) fn run(
    isa: QuantIsa,
    t: GgufType,
    mk: (usize, usize),
    x: &[f32],
    w: (&[u8], bool),
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let stride = w.0.len().checked_div(t.row_bytes(mk.1)?).unwrap_or(0);
    let out = OutRows {
        out,
        stride,
        first: 0,
    };
    run_into(isa, t, mk, x, w, num_threads, out)
}

/// Where a call's outputs go: rows of `stride` elements, the call's output
/// features at columns `first..` of each (one part of a fused projection
/// writes its columns of the whole output), rounded to `E` as they are stored,
/// by the thread that computed them.
pub(super) struct OutRows<'a, E> {
    pub(super) out: &'a mut [E],
    pub(super) stride: usize,
    pub(super) first: usize,
}

/// `gguf_linear_int` from activations of `E` into `out` (f32 or bf16 either
/// way, the same bits as widening `x` to f32 and rounding the f32 result): a
/// fused decode step's projections take its bf16 rows as they are, where a
/// pass on the calling thread widened them and another rounded each output
/// (at a 102-token SmolLM2 prompt, ~9 % of the profile's samples, ~3 % of the time).
pub(super) fn run_into<E: Elem>(
    isa: QuantIsa,
    t: GgufType,
    (m, k): (usize, usize),
    x: &[E],
    (w, panels): (&[u8], bool),
    num_threads: usize,
    o: OutRows<'_, E>,
) -> Result<(), KernelError> {
    if matches!(t, GgufType::F32 | GgufType::F16 | GgufType::Bf16) {
        return Err(KernelError::Shape(format!(
            "gguf_linear_int: {t:?} is not a block type (use gguf_linear)"
        )));
    }
    let rb = t.row_bytes(k)?;
    let n = w.len().checked_div(rb).unwrap_or(0);
    let (stride, first) = (o.stride, o.first);
    if num_threads == 0
        || k == 0
        || w.len() != n * rb
        || x.len() != m * k
        || o.out.len() != m * stride
        || first + n > stride
    {
        return Err(KernelError::Shape(format!(
            "gguf_linear_int {t:?}: x has {} elements, w {} bytes, out {}; [m={m}, k={k}] \
             needs w of whole rows of {rb} bytes and out of m rows of {stride} holding \
             n={n} columns from {first} ({num_threads} threads)",
            x.len(),
            w.len(),
            o.out.len()
        )));
    }
    let args = (isa, (k, n, rb), x, (w, panels), num_threads, o);
    match t {
        GgufType::Q8_0 => typed::<Q8_0, E>(args),
        GgufType::Q4_0 => typed::<Q4_0, E>(args),
        GgufType::Q4_1 => typed::<Q4_1, E>(args),
        GgufType::Q5_0 => typed::<Q5_0, E>(args),
        GgufType::Q5_1 => typed::<Q5_1, E>(args),
        GgufType::Q4K => typed::<QK4<false>, E>(args),
        GgufType::Q5K => typed::<QK4<true>, E>(args),
        _ => typed::<Q6K, E>(args),
    }
}

/// `run_into`'s checked operands: the path, `(k, n, bytes a weight row)`, `x`,
/// the weights and their layout, the threads and the output.
type Checked<'a, E> = (
    QuantIsa,
    (usize, usize, usize),
    &'a [E],
    (&'a [u8], bool),
    usize,
    OutRows<'a, E>,
);

/// `run_into` for block type `B`, once the shapes are checked.
fn typed<B: IntBlock, E: Elem>(
    (isa, (k, n, rb), x, (w, panels), num_threads, o): Checked<'_, E>,
) -> Result<(), KernelError> {
    let m = x.len() / k;
    let (stride, first) = (o.stride, o.first);
    let xq = Q8Rows::quantize(isa, k, x, num_threads)?;
    let out_ptr = OutPtr(o.out.as_mut_ptr());
    // items of whole panels, then the rows past the last whole one (plain rows
    // in the panel layout) as an item of their own
    let whole = if panels { n / PANEL * PANEL } else { n };
    let items = whole.div_ceil(ITEM_ROWS) + usize::from(whole < n);
    let item = |idx: usize, _: &mut Vec<f32>| {
        let start = idx * ITEM_ROWS;
        let rows = if start < whole {
            start..(start + ITEM_ROWS).min(whole)
        } else {
            whole..n
        };
        let store = |r: usize, j: usize, v: &[[f32; 16]], lanes: usize| {
            assert!(
                r + v.len() <= m && lanes <= 16 && rows.start + j + lanes <= rows.end,
                "within the item"
            );
            for (i, v) in v.iter().enumerate() {
                // SAFETY: `out` holds m rows of `stride` elements (checked by
                // `run_into`) that only this call writes; (r + i, first +
                // rows.start + j + l) for l < lanes is in bounds (asserted, and
                // first + n <= stride) and in this item's range of output
                // features alone, so no two threads write it.
                let to = unsafe {
                    let at = out_ptr.get().add((r + i) * stride + first + rows.start + j);
                    std::slice::from_raw_parts_mut(at, lanes)
                };
                isa.narrow(&v[..lanes], to);
            }
        };
        let it = Item {
            w: &w[rows.start * rb..rows.end * rb],
            after: &w[rows.end * rb..(rows.end + PANEL).min(n) * rb],
            panel: panels && rows.end <= whole,
        };
        isa.rows::<B>(it, &xq, &store);
    };
    team::run_items(items, num_threads, &item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn narrow_avx2<E: Elem>(src: &[f32], dst: &mut [E]) {
    narrow(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
fn narrow_avx512<E: Elem>(src: &[f32], dst: &mut [E]) {
    narrow(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_avx2<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: Store<'_>) {
    rows::<Ymm<MADDUBS>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn rows_avxvnni<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: Store<'_>) {
    rows::<Ymm<AVX_VNNI>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn rows_avx512vnni<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: Store<'_>) {
    rows::<Zmm, B>(w, xq, store)
}

/// The output's base pointer, shared by the work items (see `typed`).
struct OutPtr<E>(*mut E);

impl<E> OutPtr<E> {
    /// A method, not the field: closures then capture the whole (Sync) wrapper.
    fn get(&self) -> *mut E {
        self.0
    }
}
// SAFETY: the items behind this pointer write disjoint elements (see `typed`), and
// the pointer outlives them: `run_items` returns only after every item is done.
// `E` is plain data sent between the team's threads (`Elem: Send + Sync`).
unsafe impl<E: Elem> Sync for OutPtr<E> {}
