//! The arithmetic of decode attention on one block of the paged cache for one
//! KV head and its group of query heads: the scores `q_g · k_t`, and the
//! accumulation of `p_g[t] * v_t` into the group's outputs. Written once over
//! `Simd` (the vector width and instructions of each variant) and compiled
//! inside each `#[target_feature]` variant of `paged_attention`.
//!
//! Why this shape: the K and V rows of a block are in L1 or L2 when these run
//! (the caller's prefetches of the next block ride along), so the cost is
//! instructions. A key row is loaded once for the whole group, and the output
//! accumulators of a slice of `LANES` dimensions stay in registers for the whole
//! block: per token and query head that is one fused multiply-add with a
//! broadcast per `LANES` dimensions, where a row-by-row `out += p * v` loads and
//! stores every output vector for every token.

use super::bf16::bf16_to_f32;
use super::linear::Elem;
use super::linear_simd::Simd;

/// Query heads of a group whose output vectors are held in registers at once.
const GROUP_TILE: usize = 8;

/// One KV head's rows in one block: token `t`'s row is `d` elements at
/// `t * stride` of `rows` (`stride` = the cache's token stride).
#[derive(Clone, Copy)]
pub(super) struct Rows<'a, E> {
    rows: &'a [E],
    stride: usize,
    d: usize,
    tokens: usize,
}

impl<'a, E: Elem> Rows<'a, E> {
    /// The rows of `tokens` tokens starting at `rows[0]`. Panics when `rows` is
    /// too short, so the unchecked reads below rest on this check alone.
    pub(super) fn new(rows: &'a [E], stride: usize, d: usize, tokens: usize) -> Self {
        assert!(
            tokens == 0 || (tokens - 1) * stride + d <= rows.len(),
            "{tokens} rows of {d} at stride {stride} need more than {} elements",
            rows.len()
        );
        Rows {
            rows,
            stride,
            d,
            tokens,
        }
    }

    #[inline(always)]
    fn row(&self, t: usize) -> &'a [E] {
        debug_assert!(t < self.tokens);
        // SAFETY: t < tokens, and `new` checked (tokens - 1) * stride + d <= len.
        unsafe {
            self.rows
                .get_unchecked(t * self.stride..t * self.stride + self.d)
        }
    }

    /// Asks for token `t`'s row to be brought into L2 (block ids are random, so
    /// the hardware prefetchers cannot guess the next block; into L2, not L1:
    /// measured 2x faster on a 39 MB working set, as L1 prefetches stall once
    /// the L1 miss buffers fill). Nothing past the last token.
    #[inline(always)]
    pub(super) fn prefetch(&self, t: usize) {
        if t >= self.tokens {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            let row = self.row(t);
            let (p, bytes) = (row.as_ptr().cast::<i8>(), std::mem::size_of_val(row));
            // a plain stride over the row's lines (a `chunks` iterator cost a
            // compare and a conditional move per line, on every token)
            let mut at = 0;
            while at < bytes {
                // SAFETY: a prefetch is a hint; it never faults, and `at` is in the row.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(at)) };
                at += 64;
            }
        }
    }
}

/// `scores[g * stride + t] = scale * q[g] · key_t` for the group's query heads
/// `g` (rows of `d` in `q`) and tokens `t0..keys.tokens`; the next block's key
/// rows are prefetched on the way. With `DPBF16` and a bf16 cache the products
/// run on `vdpbf16ps` with `q_bits` (q in bf16).
///
/// A run of `LANES` tokens is done at once: each dot product leaves a vector of
/// partial sums, and one `sum_each` reduces them all (a horizontal sum per dot
/// product costs more than its multiply-adds at head_dim 64).
///
/// `DV` > 0: head_dim is `DV * LANES`, known when compiled, so a query head's
/// vectors stay in registers over the run and each dot product is straight-line
/// code (the same operations in the same order as the general loop: the same
/// bits); 0: any head_dim.
///
/// # Safety
/// Call only from code compiled for the instruction set of `S` (and AVX512-BF16
/// when `DPBF16`), on a CPU that has it.
#[allow(clippy::too_many_arguments)] // the block's operands, all distinct
#[inline(always)]
pub(super) unsafe fn scores<S: Simd, const DPBF16: bool, E: Elem, const DV: usize>(
    q: &[f32],
    q_bits: &[u16],
    keys: Rows<'_, E>,
    next: Option<Rows<'_, E>>,
    t0: usize,
    scale: f32,
    scores: &mut [f32],
    stride: usize,
) {
    let (d, n) = (keys.d, keys.tokens);
    assert!(
        DV == 0 || d == DV * S::LANES,
        "head_dim {d} is not DV * LANES"
    );
    let dp = DPBF16 && E::IS_BF16;
    // The elements the vector loop covers; the rest is the scalar tail. With DV
    // (head_dim = DV * LANES) a constant: straight-line dot products.
    let d = if DV > 0 { DV * S::LANES } else { d };
    let full = if dp { d - d % 32 } else { d - d % S::LANES };
    let mut start = t0;
    while start < n {
        let run = S::LANES.min(n - start);
        for (g, qg) in q.chunks_exact(d).enumerate() {
            // SAFETY: every load reads LANES f32 (32 bf16) at c < full <= d of
            // a row of d (q's, q_bits', the key's); the ISA is the caller's.
            let lanes = unsafe {
                let mut acc = [S::zero(); 16];
                // with DV, the query head's vectors in registers over the run
                // (loops, not `array::from_fn`: a closure is not compiled for the
                // caller's target features, so its intrinsics stay calls)
                let mut qv = [S::zero(); DV];
                for (c, qc) in qv.iter_mut().enumerate() {
                    *qc = S::load(qg.as_ptr().add(c * S::LANES));
                }
                for (j, a) in acc.iter_mut().enumerate().take(run) {
                    // the next block's row a token at a time, between this block's
                    // dot products: a burst of every line overflows the miss queue
                    if let (0, Some(next)) = (g, &next) {
                        next.prefetch(start + j);
                    }
                    let key = keys.row(start + j);
                    if dp {
                        let (qb, kb) = (q_bits[g * d..].as_ptr(), E::bits(key).unwrap_or(&[]));
                        for c in (0..full).step_by(32) {
                            *a = S::dpbf16(*a, qb.add(c), kb.as_ptr().add(c));
                        }
                    } else if DV > 0 {
                        for (c, qc) in qv.iter().enumerate() {
                            *a = S::fma(*qc, S::load_w(key.as_ptr().add(c * S::LANES)), *a);
                        }
                    } else {
                        for c in (0..full).step_by(S::LANES) {
                            let k = S::load_w(key.as_ptr().add(c));
                            *a = S::fma(S::load(qg.as_ptr().add(c)), k, *a);
                        }
                    }
                }
                let mut lanes = [0.0f32; 16];
                S::store(lanes.as_mut_ptr(), S::sum_each(&acc));
                lanes
            };
            for (j, &sum) in lanes.iter().enumerate().take(run) {
                let key = keys.row(start + j);
                let mut sum = sum;
                for i in full..d {
                    let qi = if dp {
                        bf16_to_f32(q_bits[g * d + i])
                    } else {
                        qg[i]
                    };
                    sum = S::scalar_fma(qi, key[i].to_f32(), sum);
                }
                scores[g * stride + start + j] = sum * scale;
            }
        }
        start += run;
    }
}

/// `out[g] += sum_t p[g * stride + t] * value_t` over tokens `t0..values.tokens`
/// for the group's query heads `g` (rows of `d` in `out`); the next block's
/// value rows are prefetched on the way.
///
/// # Safety
/// As `scores`: only inside code compiled for `S`'s instruction set.
#[inline(always)]
pub(super) unsafe fn values<S: Simd, E: Elem, const DV: usize>(
    p: &[f32],
    stride: usize,
    values: Rows<'_, E>,
    next: Option<Rows<'_, E>>,
    t0: usize,
    out: &mut [f32],
) {
    let d = values.d;
    // The next block's rows a token at a time, in the first pass over the
    // tokens: a burst of every line at once overflows the core's miss queue.
    let prefetch = |t: usize| {
        if let Some(next) = &next {
            next.prefetch(t);
        }
    };
    if d < S::LANES {
        (t0..values.tokens).for_each(prefetch);
    }
    let group = out.len() / d;
    // head_dim known (DV > 0): a tile of heads whose every output vector is a
    // register (16 of them: half the AVX-512 registers; 8 of AVX2's 16), each
    // value row loaded once for the tile and the tokens the inner loop
    if let Some(per) = (if S::LANES == 16 { 16usize } else { 8 }).checked_div(DV) {
        let tile = per.clamp(1, 8);
        let mut g0 = 0;
        while g0 < group {
            let (p, out) = (&p[g0 * stride..], &mut out[g0 * d..]);
            let first = g0 == 0;
            let g = tile.min(group - g0);
            // SAFETY: the caller's ISA is `S`'s.
            unsafe {
                match g {
                    8 => {
                        values_cols::<S, E, 8, DV>(p, stride, values, t0, out, 0, first, &prefetch)
                    }
                    4.. => {
                        values_cols::<S, E, 4, DV>(p, stride, values, t0, out, 0, first, &prefetch)
                    }
                    2 | 3 => {
                        values_cols::<S, E, 2, DV>(p, stride, values, t0, out, 0, first, &prefetch)
                    }
                    _ => {
                        values_cols::<S, E, 1, DV>(p, stride, values, t0, out, 0, first, &prefetch)
                    }
                }
            }
            g0 += match g {
                8 => 8,
                4.. => 4,
                2 | 3 => 2,
                _ => 1,
            };
        }
        return;
    }
    let mut g0 = 0;
    while g0 < group {
        // A tile of a constant number of heads, so its accumulators are registers.
        let tile = GROUP_TILE.min(group - g0);
        let (p, out) = (&p[g0 * stride..], &mut out[g0 * d..(g0 + tile) * d]);
        let first = g0 == 0;
        // SAFETY: the caller's ISA is `S`'s.
        unsafe {
            match tile {
                1 => values_tile::<S, E, 1>(p, stride, values, t0, out, first, &prefetch),
                2 => values_tile::<S, E, 2>(p, stride, values, t0, out, first, &prefetch),
                3 => values_tile::<S, E, 3>(p, stride, values, t0, out, first, &prefetch),
                4 => values_tile::<S, E, 4>(p, stride, values, t0, out, first, &prefetch),
                5 => values_tile::<S, E, 5>(p, stride, values, t0, out, first, &prefetch),
                6 => values_tile::<S, E, 6>(p, stride, values, t0, out, first, &prefetch),
                7 => values_tile::<S, E, 7>(p, stride, values, t0, out, first, &prefetch),
                _ => values_tile::<S, E, GROUP_TILE>(p, stride, values, t0, out, first, &prefetch),
            }
        }
        g0 += tile;
    }
}

/// `values` for `G` query heads (`out` holds `G` rows of `d`), a vector of
/// columns at a time and the scalar tail; `prefetch(t)` is called for every
/// token in the first pass when `first`.
///
/// # Safety
/// As `scores`: only inside code compiled for `S`'s instruction set.
#[inline(always)]
unsafe fn values_tile<S: Simd, E: Elem, const G: usize>(
    p: &[f32],
    stride: usize,
    values: Rows<'_, E>,
    t0: usize,
    out: &mut [f32],
    first: bool,
    prefetch: &impl Fn(usize),
) {
    let (d, n) = (values.d, values.tokens);
    let full = d - d % S::LANES;
    assert!(out.len() == G * d && p.len() >= (G - 1) * stride + n);
    for c in (0..full).step_by(S::LANES) {
        // SAFETY: the caller's ISA is `S`'s; c + LANES <= d.
        unsafe {
            values_cols::<S, E, G, 1>(p, stride, values, t0, out, c, first && c == 0, prefetch)
        };
    }
    for i in full..d {
        for g in 0..G {
            let mut o = out[g * d + i];
            for t in t0..n {
                o = S::scalar_fma(p[g * stride + t], values.row(t)[i].to_f32(), o);
            }
            out[g * d + i] = o;
        }
    }
}

/// Columns `c0..c0 + DV * LANES` of `values` for `G` query heads: every output
/// vector of them held in a register over the block's tokens, each value vector
/// loaded once for the tile (per output element, the sum over tokens in order).
///
/// # Safety
/// As `scores`: only inside code compiled for `S`'s instruction set.
#[allow(clippy::too_many_arguments)] // the block's operands, all distinct
#[inline(always)]
unsafe fn values_cols<S: Simd, E: Elem, const G: usize, const DV: usize>(
    p: &[f32],
    stride: usize,
    values: Rows<'_, E>,
    t0: usize,
    out: &mut [f32],
    c0: usize,
    first: bool,
    prefetch: &impl Fn(usize),
) {
    let (d, n) = (values.d, values.tokens);
    assert!(c0 + DV * S::LANES <= d && out.len() >= G * d && p.len() >= (G - 1) * stride + n);
    // SAFETY: loads and stores touch LANES elements at c0 + c * LANES, below d
    // (asserted), of rows of d (out's first G rows, value rows); p is read at
    // g * stride + t < (G - 1) * stride + n (asserted); the ISA is the caller's.
    unsafe {
        // loops, not `array::from_fn` (see `scores`)
        let mut acc = [[S::zero(); DV]; G];
        for (g, acc) in acc.iter_mut().enumerate() {
            for (c, a) in acc.iter_mut().enumerate() {
                *a = S::load(out.as_ptr().add(g * d + c0 + c * S::LANES));
            }
        }
        for t in t0..n {
            if first {
                prefetch(t);
            }
            let row = values.row(t).as_ptr().add(c0);
            let mut v = [S::zero(); DV];
            for (c, vc) in v.iter_mut().enumerate() {
                *vc = S::load_w(row.add(c * S::LANES));
            }
            for (g, acc) in acc.iter_mut().enumerate() {
                let pg = S::splat(*p.get_unchecked(g * stride + t));
                for (a, vc) in acc.iter_mut().zip(&v) {
                    *a = S::fma(pg, *vc, *a);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (c, a) in acc.iter().enumerate() {
                S::store(out.as_mut_ptr().add(g * d + c0 + c * S::LANES), *a);
            }
        }
    }
}
