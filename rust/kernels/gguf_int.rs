//! `out = x · dequantize(W)ᵀ` on GGUF blocks with integer dot products, for the
//! few rows of a decode step (as llama.cpp's CPU backend computes it).
//!
//! Each row of `x` is quantized to int8 per 16 elements (`Q8Rows`: a scale
//! `dx = max|x| / 127` and `x_q = round(x / dx)`, with `dx · Σ x_q`); each weight block is unpacked to small integers `q` in registers
//! (`gguf_int_blocks`) and `Σ q · x_q` runs on the CPU's integer dot-product
//! instructions, then `scale · dx` multiplies it into eight f32 lanes, and the
//! blocks' offsets meet the activation sums in a scalar. The weight is read once
//! per call, as blocks; float weights never exist.
//!
//! Not equal to dequantize + fp32: `x` is rounded to int8, so each term carries
//! an error of at most `|w_i| · dx / 2` (`tests_gguf_int.rs` checks the bound).
//! Every ISA gives the same bits (see `gguf_simd`).
//!
//! `ASYNCLLM_KERNEL_ISA` caps the path: `portable`, `avx2` (`vpmaddubsw`),
//! `avxvnni` (and `avx512`: AVX-VNNI is no AVX-512 extension), `avx512vnni`,
//! `auto` / unset (the best this CPU has).

use super::bf16::{isa_cap, IsaCap};
use super::gguf::GgufType;
use super::gguf_int_blocks::{IntBlock, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0, QK4};
#[cfg(target_arch = "x86_64")]
use super::gguf_simd::X86;
use super::gguf_simd::{IntSimd, Portable};
use super::team;
use super::KernelError;

/// Output features per work item.
const ITEM_ROWS: usize = 16;

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

    /// One item's weight rows `w` against every row of `xq`, on this path.
    fn rows<B: IntBlock>(self, w: &[u8], xq: &Q8Rows, store: &dyn Fn(usize, usize, f32)) {
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
            _ => rows::<Portable, B>(w, xq, store),
        }
    }
}

/// The path `gguf_linear_int` runs here (for tests and benchmarks).
pub fn gguf_int_isa() -> Result<&'static str, KernelError> {
    Ok(QuantIsa::detect()?.name())
}

/// `x`'s rows quantized to int8 as llama.cpp's Q8 activations, but with a scale
/// per 16 elements (half a block) instead of 32: it costs one multiply a block and
/// an outlier then coarsens 16 neighbours, not 32 (on SmolLM2 the held-out
/// perplexity moved 1.05 % from the float kernel's with scales per 32).
pub(super) struct Q8Rows {
    /// 32-blocks per row.
    blocks: usize,
    qs: Vec<i8>,
    /// Each block's scales `dx` as the eight i32 lanes of a dot product see them:
    /// the first half's in lanes 0..4, the second's in 4..8 (one vector load).
    d: Vec<[f32; 8]>,
    /// Each block's `dx · Σ x_q` over its first half (`[0]`), its second half and
    /// whole, by block and then row (`[blocks][rows]`): the rows of a group are
    /// adjacent, so a group's offsets are one vector multiply-add per block (row
    /// by row they were a gather).
    sums: [Vec<f32>; 3],
    rows: usize,
}

impl Q8Rows {
    /// `x` holds rows of `k`, a multiple of 32.
    pub(super) fn new(k: usize, x: &[f32]) -> Q8Rows {
        let n = x.len() / 32;
        let (blocks, m) = (k / 32, x.len() / k.max(1));
        let mut rows = Q8Rows {
            blocks,
            qs: vec![0; x.len()],
            d: Vec::with_capacity(n),
            sums: [vec![0.0; n], vec![0.0; n], vec![0.0; n]],
            rows: m,
        };
        for (i, (xb, qb)) in x
            .chunks_exact(32)
            .zip(rows.qs.chunks_exact_mut(32))
            .enumerate()
        {
            let (mut d, mut s) = ([0.0f32; 2], [0.0f32; 2]);
            for (h, (xh, qh)) in xb.chunks_exact(16).zip(qb.chunks_exact_mut(16)).enumerate() {
                let amax = xh.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                // a NaN anywhere makes the scale NaN, so it reaches the output
                let nan = xh.iter().any(|v| v.is_nan());
                d[h] = if nan { f32::NAN } else { amax / 127.0 };
                let id = if d[h] > 0.0 { 1.0 / d[h] } else { 0.0 };
                for (q, v) in qh.iter_mut().zip(xh) {
                    *q = (v * id).round().clamp(-127.0, 127.0) as i8;
                }
                s[h] = d[h] * qh.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
            }
            rows.d.push(std::array::from_fn(|l| d[l / 4]));
            let at = (i % blocks) * m + i / blocks;
            for (sums, v) in rows.sums.iter_mut().zip([s[0], s[1], s[0] + s[1]]) {
                sums[at] = v;
            }
        }
        rows
    }
}

/// `out[m, n] = x[m, k] · dequantize(w)[n, k]ᵀ` on `num_threads` threads, with
/// the best integer path this CPU has; `w` is `n` rows of blocks of `t`, a
/// quantized type. Every check runs before `out` is written.
pub fn gguf_linear_int(
    t: GgufType,
    m: usize,
    k: usize,
    x: &[f32],
    w: &[u8],
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    run(QuantIsa::detect()?, t, (m, k), x, w, num_threads, out)
}

/// `gguf_linear_int` on the path `isa` (tests run each).
pub(super) fn run(
    isa: QuantIsa,
    t: GgufType,
    (m, k): (usize, usize),
    x: &[f32],
    w: &[u8],
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
    let xq = Q8Rows::new(k, x);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let item = |idx: usize, _: &mut Vec<f32>| {
        let rows = idx * ITEM_ROWS..((idx + 1) * ITEM_ROWS).min(n);
        let store = |r: usize, j: usize, v: f32| {
            // SAFETY: `out` holds m * n elements (checked above) that only this
            // call writes; (r, rows.start + j) is in bounds and in this item's
            // range of output features alone, so no two threads write it.
            unsafe { out_ptr.get().add(r * n + rows.start + j).write(v) }
        };
        let w = &w[rows.start * rb..rows.end * rb];
        match t {
            GgufType::Q8_0 => isa.rows::<Q8_0>(w, &xq, &store),
            GgufType::Q4_0 => isa.rows::<Q4_0>(w, &xq, &store),
            GgufType::Q4_1 => isa.rows::<Q4_1>(w, &xq, &store),
            GgufType::Q5_0 => isa.rows::<Q5_0>(w, &xq, &store),
            GgufType::Q5_1 => isa.rows::<Q5_1>(w, &xq, &store),
            GgufType::Q4K => isa.rows::<QK4<false>>(w, &xq, &store),
            GgufType::Q5K => isa.rows::<QK4<true>>(w, &xq, &store),
            _ => isa.rows::<Q6K>(w, &xq, &store),
        }
    };
    team::run_items(n.div_ceil(ITEM_ROWS), num_threads, &item)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_avx2<B: IntBlock>(w: &[u8], xq: &Q8Rows, store: &dyn Fn(usize, usize, f32)) {
    rows::<X86<{ super::gguf_simd::MADDUBS }>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn rows_avxvnni<B: IntBlock>(w: &[u8], xq: &Q8Rows, store: &dyn Fn(usize, usize, f32)) {
    rows::<X86<{ super::gguf_simd::AVX_VNNI }>, B>(w, xq, store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn rows_avx512vnni<B: IntBlock>(w: &[u8], xq: &Q8Rows, store: &dyn Fn(usize, usize, f32)) {
    rows::<X86<{ super::gguf_simd::AVX512_VNNI }>, B>(w, xq, store)
}

/// Every weight row of `w` against every row of `xq`: x rows in groups of up to
/// 8 that share each unpacked weight block (a row's result does not depend on
/// its group). Group by group over all of the item's weight rows: one group's
/// activations (8 rows of k int8 values with their scales) stay in L1 while the
/// item's few weight rows are read again from L1/L2 for the next group, where
/// all rows of a many-row step at once overflow L1 (16 rows at k = 1536: 3x the
/// time of 8, not 2x).
#[inline(always)]
fn rows<S: IntSimd, B: IntBlock>(w: &[u8], xq: &Q8Rows, store: &dyn Fn(usize, usize, f32)) {
    let m = xq.rows;
    let rb = xq.blocks / B::SUBS * B::BYTES;
    let mut r = 0;
    while r < m {
        let size = match m - r {
            8.. => 8,
            4..=7 => 4,
            2 | 3 => 2,
            _ => 1,
        };
        for (j, row) in w.chunks_exact(rb).enumerate() {
            let group: &[f32] = match size {
                8 => &row_dots::<S, B, 8>(row, xq, r),
                4 => &row_dots::<S, B, 4>(row, xq, r),
                2 => &row_dots::<S, B, 2>(row, xq, r),
                _ => &row_dots::<S, B, 1>(row, xq, r),
            };
            for (i, v) in group.iter().enumerate() {
                store(r + i, j, *v);
            }
        }
        r += size;
    }
}

/// One weight row (`xq.blocks * 32` weights) dotted with rows `first..first + R`
/// of `xq`.
#[inline(always)]
fn row_dots<S: IntSimd, B: IntBlock, const R: usize>(
    row: &[u8],
    xq: &Q8Rows,
    first: usize,
) -> [f32; R] {
    let nb = xq.blocks;
    assert!(
        row.len() * B::SUBS == nb * B::BYTES,
        "a row of whole blocks"
    );
    assert!(
        (first + R) * nb <= xq.d.len(),
        "rows first..first + R of xq"
    );
    let (qs, d) = (xq.qs.as_ptr(), xq.d.as_ptr());
    let [lo, hi, all] = xq.sums.each_ref().map(|v| v.as_ptr());
    let m = xq.rows;
    assert!(
        xq.sums.iter().all(|v| v.len() == m * nb) && first + R <= m,
        "sums of every row's blocks"
    );
    // SAFETY: each block read lies in `row` (whole blocks: asserted); the
    // activation block `at = (first + r) * nb + s` (r < R, s < nb) lies in `xq`
    // (asserted), its 32 quants at `qs[32 * at..]`, its sums at `s * m + first +
    // r` < nb * m in each of `sums` (asserted); the instructions of `S` are those
    // of the wrapper this is inlined into (see `QuantIsa::rows`).
    unsafe {
        let mut acc = [S::fzero(); R];
        let mut off = [0.0f32; R];
        for (bi, b) in row.chunks_exact(B::BYTES).enumerate() {
            B::each::<S>(b.as_ptr(), |s, sub| {
                let xb = bi * B::SUBS + s;
                for (r, acc) in acc.iter_mut().enumerate() {
                    let at = (first + r) * nb + xb;
                    let xv = S::load(qs.add(32 * at).cast());
                    let lanes = if B::SIGNED {
                        S::dot_ss(sub.q, xv)
                    } else {
                        S::dot_us(sub.q, xv)
                    };
                    let scale = S::mulf(sub.scale, S::loadf(d.add(at).cast()));
                    *acc = S::acc(*acc, lanes, scale);
                }
                if B::OFFSET {
                    // the group's rows side by side: a vector load, not a gather
                    let at = xb * m + first;
                    for (r, off) in off.iter_mut().enumerate() {
                        *off += if B::UNIFORM {
                            sub.offset[0] * *all.add(at + r)
                        } else {
                            sub.offset[0] * *lo.add(at + r) + sub.offset[1] * *hi.add(at + r)
                        };
                    }
                }
            });
        }
        std::array::from_fn(|r| {
            let l = S::lanes(acc[r]);
            (((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))) + off[r]
        })
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
