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
use super::gguf::GgufType;
use super::gguf_int_blocks::{
    IntBlock, Panels, Rows, Source, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0, QK4,
};
use super::gguf_panel::{Panel, Portable8};
#[cfg(target_arch = "x86_64")]
use super::gguf_panel::{Ymm, Zmm, AVX_VNNI, MADDUBS};
use super::gguf_panels::PANEL;
use super::gguf_q8::Q8Rows;
use super::team;
use super::KernelError;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Output features per work item (one panel of the panel layout; one or two
/// of the kernel's).
const ITEM_ROWS: usize = PANEL;

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

    /// One item's weight rows `w` (one panel of the panel layout when `panel`)
    /// against every row of `xq`, on this path.
    fn rows<B: IntBlock>(self, w: Item<'_>, xq: &Q8Rows, store: &dyn Fn(usize, usize, &[f32])) {
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

/// One work item's weight rows: the item's bytes, the next item's (read ahead),
/// and whether they are one panel of the panel layout (`gguf_panels`).
#[derive(Clone, Copy)]
struct Item<'a> {
    w: &'a [u8],
    after: &'a [u8],
    panel: bool,
}

/// `gguf_linear_int` on the path `isa` (tests run each); `w` is `(blocks, whether
/// they are in the panel layout)`.
pub(super) fn run(
    isa: QuantIsa,
    t: GgufType,
    (m, k): (usize, usize),
    x: &[f32],
    (w, panels): (&[u8], bool),
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if matches!(t, GgufType::F32 | GgufType::F16 | GgufType::Bf16) {
        return Err(KernelError::Shape(format!(
            "gguf_linear_int: {t:?} is not a block type (use gguf_linear)"
        )));
    }
    let rb = t.row_bytes(k)?;
    let n = w.len().checked_div(rb).unwrap_or(0);
    if num_threads == 0 || k == 0 || w.len() != n * rb || x.len() != m * k || out.len() != m * n {
        return Err(KernelError::Shape(format!(
            "gguf_linear_int {t:?}: x has {} elements, w {} bytes, out {}; [m={m}, k={k}] \
             needs w of whole rows of {rb} bytes and out of m*n ({num_threads} threads)",
            x.len(),
            w.len(),
            out.len()
        )));
    }
    let xq = Q8Rows::quantize(isa, k, x, num_threads)?;
    let out_ptr = OutPtr(out.as_mut_ptr());
    let item = |idx: usize, _: &mut Vec<f32>| {
        let rows = idx * ITEM_ROWS..((idx + 1) * ITEM_ROWS).min(n);
        let store = |r: usize, j: usize, v: &[f32]| {
            assert!(
                r < m && rows.start + j + v.len() <= rows.end,
                "within the item"
            );
            // SAFETY: `out` holds m * n elements (checked above) that only this
            // call writes; (r, rows.start + j + i) is in bounds (asserted) and in
            // this item's range of output features alone, so no two threads
            // write it.
            unsafe {
                let to = out_ptr.get().add(r * n + rows.start + j);
                std::ptr::copy_nonoverlapping(v.as_ptr(), to, v.len());
            }
        };
        let it = Item {
            w: &w[rows.start * rb..rows.end * rb],
            after: &w[rows.end * rb..(rows.end + ITEM_ROWS).min(n) * rb],
            // items are panels; the rows past the last whole one stay plain
            panel: panels && rows.len() == PANEL,
        };
        match t {
            GgufType::Q8_0 => isa.rows::<Q8_0>(it, &xq, &store),
            GgufType::Q4_0 => isa.rows::<Q4_0>(it, &xq, &store),
            GgufType::Q4_1 => isa.rows::<Q4_1>(it, &xq, &store),
            GgufType::Q5_0 => isa.rows::<Q5_0>(it, &xq, &store),
            GgufType::Q5_1 => isa.rows::<Q5_1>(it, &xq, &store),
            GgufType::Q4K => isa.rows::<QK4<false>>(it, &xq, &store),
            GgufType::Q5K => isa.rows::<QK4<true>>(it, &xq, &store),
            _ => isa.rows::<Q6K>(it, &xq, &store),
        }
    };
    team::run_items(n.div_ceil(ITEM_ROWS), num_threads, &item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_avx2<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: &dyn Fn(usize, usize, &[f32])) {
    rows::<Ymm<MADDUBS>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn rows_avxvnni<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: &dyn Fn(usize, usize, &[f32])) {
    rows::<Ymm<AVX_VNNI>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn rows_avx512vnni<B: IntBlock>(w: Item<'_>, xq: &Q8Rows, store: &dyn Fn(usize, usize, &[f32])) {
    rows::<Zmm, B>(w, xq, store)
}

/// Every weight row of the item against every row of `xq`, a panel of
/// `P::LANES` weight rows at a time (in the GGUF layout, the last panel repeats
/// its last row into the lanes it lacks, whose results are dropped), x rows in
/// groups that share each unpacked block (a row's result does not depend on its
/// group): all of them up to `P::MAX_GROUP` rows (one unpack of each block for
/// a verification's k + 1 rows: 1.4-1.7x at 5 rows on Zen 5), groups of
/// `P::MAX_GROUP` (or 8) below 32 rows, else 32 or 64, whose
/// accumulators live in memory but which unpack each block once for all of them
/// (1.04-1.25x at 64 rows on Zen 5).
#[inline(always)]
fn rows<P: Panel, B: IntBlock>(it: Item<'_>, xq: &Q8Rows, store: &dyn Fn(usize, usize, &[f32])) {
    let rb = xq.blocks / B::SUBS * B::BYTES;
    let (w, n) = (it.w, it.w.len() / rb);
    for first_row in (0..n).step_by(P::LANES) {
        let lanes = P::LANES.min(n - first_row);
        // lane l holds weight row first_row + l (the last one repeated)
        let rows: [*const u8; 16] = std::array::from_fn(|l| {
            let j = first_row + l.min(lanes - 1);
            w[j * rb..(j + 1) * rb].as_ptr()
        });
        // the next panel's bytes (past this item's rows: the next item's, which
        // the same thread usually takes), read ahead while this one runs; only
        // the first group of x rows needs them, the others find them cached
        let ahead = (first_row + P::LANES).min(n) * rb..(first_row + 2 * P::LANES).min(n) * rb;
        let next = if ahead.is_empty() {
            it.after
        } else {
            &w[ahead]
        };
        if it.panel {
            assert!(n == PANEL, "a panel is whole");
            let src = Panels {
                base: w.as_ptr(),
                lane: first_row,
            };
            groups::<P, B, Panels>(src, w, next, xq, lanes, first_row, store);
        } else {
            groups::<P, B, Rows>(Rows(&rows), &[], next, xq, lanes, first_row, store);
        }
    }
}

/// The `lanes` weight rows of `src` against every row of `xq`, in groups of x
/// rows (see `rows`), stored as output features `first_row..`.
#[inline(always)]
fn groups<P: Panel, B: IntBlock, S: Source<P>>(
    src: S,
    mut cur: &[u8],
    mut next: &[u8],
    xq: &Q8Rows,
    lanes: usize,
    first_row: usize,
    store: &dyn Fn(usize, usize, &[f32]),
) {
    let mut r = 0;
    while r < xq.rows {
        let size = match xq.rows - r {
            64.. => 64,
            32.. => 32,
            16.. if P::MAX_GROUP == 16 => 16,
            // below MAX_GROUP, one group of them all: each unpacks the blocks
            // once (a verification of k = 8 drafts is 9 rows)
            few if few <= P::MAX_GROUP => few,
            _ => 8,
        };
        let mut out = [[0.0f32; 16]; 64];
        match size {
            64 => panel::<P, B, S, 64>(src, cur, next, xq, r, &mut out),
            32 => panel::<P, B, S, 32>(src, cur, next, xq, r, &mut out),
            16 => panel::<P, B, S, 16>(src, cur, next, xq, r, &mut out),
            15 => panel::<P, B, S, 15>(src, cur, next, xq, r, &mut out),
            14 => panel::<P, B, S, 14>(src, cur, next, xq, r, &mut out),
            13 => panel::<P, B, S, 13>(src, cur, next, xq, r, &mut out),
            12 => panel::<P, B, S, 12>(src, cur, next, xq, r, &mut out),
            11 => panel::<P, B, S, 11>(src, cur, next, xq, r, &mut out),
            10 => panel::<P, B, S, 10>(src, cur, next, xq, r, &mut out),
            9 => panel::<P, B, S, 9>(src, cur, next, xq, r, &mut out),
            8 => panel::<P, B, S, 8>(src, cur, next, xq, r, &mut out),
            7 => panel::<P, B, S, 7>(src, cur, next, xq, r, &mut out),
            6 => panel::<P, B, S, 6>(src, cur, next, xq, r, &mut out),
            5 => panel::<P, B, S, 5>(src, cur, next, xq, r, &mut out),
            4 => panel::<P, B, S, 4>(src, cur, next, xq, r, &mut out),
            3 => panel::<P, B, S, 3>(src, cur, next, xq, r, &mut out),
            2 => panel::<P, B, S, 2>(src, cur, next, xq, r, &mut out),
            _ => panel::<P, B, S, 1>(src, cur, next, xq, r, &mut out),
        }
        for (i, row) in out[..size].iter().enumerate() {
            store(r + i, first_row, &row[..lanes]);
        }
        (cur, next) = (&[], &[]);
        r += size;
    }
}

/// The panel of weight rows `src` (one a lane, each `xq.blocks` elements)
/// dotted with rows `first..first + R` of `xq`, into `out[..R][..P::LANES]`.
///
/// The caller's `src` holds whole rows of blocks: `Rows` from `rows`' slices
/// of whole rows, `Panels` from a whole panel.
#[inline(always)]
fn panel<P: Panel, B: IntBlock, S: Source<P>, const R: usize>(
    src: S,
    cur: &[u8],
    next: &[u8],
    xq: &Q8Rows,
    first: usize,
    out: &mut [[f32; 16]; 64],
) {
    let nb = xq.blocks;
    assert!(
        (first + R) * nb <= xq.dx.len()
            && xq.qs.len() == 32 * xq.dx.len()
            && xq.xs.len() == xq.dx.len()
            && xq.sx.len() == xq.dx.len(),
        "rows first..first + R of xq"
    );
    // SAFETY: each block read lies in its row or panel (whole rows of `nb`
    // elements: the caller's); the activation block `at = (first + r) * nb + xb`
    // (r < R, xb < nb) lies in `xq` (asserted); the instructions of `P` are those
    // of the wrapper this is inlined into (see `QuantIsa::rows`).
    unsafe {
        let mut acc = [P::fzero(); R];
        let blocks = nb / B::SUBS;
        // the stream this panel's reads walk: its own lines (the GGUF layout's
        // rows are not one stream: as many as the next's), then the next's
        let lines = next.len().div_ceil(64);
        let own = if cur.is_empty() {
            lines
        } else {
            cur.len() / 64
        };
        // lines a sub-block in 16.16 fixed point, rounded up: no division a
        // sub-block (the shares' bounds are hints; the last may overshoot by a
        // line, which the bounds check below drops)
        let step = (own << 16).div_ceil(nb);
        let mut done = own;
        for bi in 0..blocks {
            // a share of the stream's lines one panel ahead: a panel's rows are
            // each too short a stream for the CPU's prefetcher to learn (Q8_0
            // rows of 576: ten lines), and demand misses had left a 49152 x 576
            // LM head at 8 GB/s. A share a block where several x rows make the
            // call compute-bound (a share a sub-block there cost 9 rows of Q8_0
            // 1.1-1.2x)...
            if R > 2 {
                for line in bi * lines / blocks..(bi + 1) * lines / blocks {
                    prefetch(next.as_ptr().add(64 * line));
                }
            }
            B::panel::<P, S>(src, bi, |s, wv, sc, off| {
                // ...and a share a sub-block at one or two, where the stream
                // binds: a K type's block had asked for 36-53 lines at once
                // (out of cache, one row, two threads, Zen 5: Q4_K 28 -> 41
                // GB/s, Q6_K 25 -> 34). Written with the branch on this panel's
                // own lines (which one panel ahead never takes): the branch-free
                // loop unrolls into bursts, Q8_0 1.2x slower. In cache (a
                // matrix in L2, one thread) one row is 1.1-1.3x slower than a
                // share a block; out of cache, where a model's weights are,
                // SmolLM2's batch-1 decode is 1.07x faster.
                let xb = bi * B::SUBS + s;
                let to = if R > 2 {
                    done
                } else {
                    own + (((xb + 1) * step) >> 16)
                };
                for line in done..to {
                    if line < own {
                        prefetch(cur.as_ptr().add(64 * line));
                    } else if line - own < lines {
                        prefetch(next.as_ptr().add(64 * (line - own)));
                    }
                }
                done = to;
                let wv = if B::SIGNED { signed::<P>(*wv) } else { *wv };
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = sub_dot::<P, B>(*acc, &wv, sc, off, xq, (first + r) * nb + xb);
                }
            });
        }
        for (r, acc) in acc.into_iter().enumerate() {
            P::store(acc, &mut out[r]);
        }
    }
}

/// Asks for the cache line at `p` ahead of its use (a hint: never faults).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that reads nothing architecturally and never
    // faults, whatever the address; SSE is part of x86-64.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>())
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Signed weights as `P::dot_s` takes them.
#[inline(always)]
unsafe fn signed<P: Panel>(mut wv: [P::V; 8]) -> [P::V; 8] {
    for v in wv.iter_mut() {
        // SAFETY: the caller runs on `P`'s instructions.
        *v = unsafe { P::signed(*v) };
    }
    wv
}

/// `acc` plus one 32-element sub-block `wv` of the panel (scales and offsets by
/// half) dotted with activation block `at` of `xq`.
///
/// SAFETY (for the caller): `at` < `xq`'s blocks, and `P`'s instructions run.
#[inline(always)]
unsafe fn sub_dot<P: Panel, B: IntBlock>(
    acc: P::F,
    wv: &[P::V; 8],
    scale: [P::F; 2],
    offset: [P::F; 2],
    xq: &Q8Rows,
    at: usize,
) -> P::F {
    // SAFETY: `qs` holds 32 bytes per block and the other vectors one entry.
    unsafe {
        let x = xq.qs.as_ptr().add(32 * at).cast::<i32>();
        let (mut i0, mut i1) = (P::izero(), P::izero());
        for j in 0..4 {
            let (x0, x1) = (x.add(j).read_unaligned(), x.add(4 + j).read_unaligned());
            if B::SIGNED {
                i0 = P::dot_s(i0, wv[j], x0);
                i1 = P::dot_s(i1, wv[4 + j], x1);
            } else {
                i0 = P::dot(i0, wv[j], x0);
                i1 = P::dot(i1, wv[4 + j], x1);
            }
        }
        // the signed weights' bias of this ISA's dot product (Q8_0 on `vpdpbusd`)
        // leaves in integers, so every path has the same sums
        if B::SIGNED && P::SIGNED_BIAS != 0 {
            let xs = *xq.xs.get_unchecked(at);
            i0 = P::isub(i0, P::SIGNED_BIAS * xs[0]);
            i1 = P::isub(i1, P::SIGNED_BIAS * xs[1]);
        }
        let dx = *xq.dx.get_unchecked(at);
        let sx = *xq.sx.get_unchecked(at);
        let bias = P::splat(-(B::BIAS as f32));
        let mut acc = acc;
        if B::UNIFORM {
            // one scale for the block: both halves' sums meet it once
            let mut t = P::scaled_add(P::scaled(i0, dx[0]), i1, dx[1]);
            if B::BIAS != 0 {
                t = P::fma_s(bias, sx[2], t);
            }
            acc = P::fma(t, scale[0], acc);
            if B::OFFSET {
                acc = P::fma_s(offset[0], sx[2], acc);
            }
        } else {
            for (h, i) in [i0, i1].into_iter().enumerate() {
                let mut t = P::scaled(i, dx[h]);
                if B::BIAS != 0 {
                    t = P::fma_s(bias, sx[h], t);
                }
                acc = P::fma(t, scale[h], acc);
                if B::OFFSET {
                    acc = P::fma_s(offset[h], sx[h], acc);
                }
            }
        }
        acc
    }
}

/// The output's base pointer, shared by the work items (see `run`).
struct OutPtr(*mut f32);

impl OutPtr {
    /// A method, not the field: closures then capture the whole (Sync) wrapper.
    fn get(&self) -> *mut f32 {
        self.0
    }
}
// SAFETY: the items behind this pointer write disjoint elements (see `run`), and
// the pointer outlives them: `run_items` returns only after every item is done.
unsafe impl Sync for OutPtr {}
