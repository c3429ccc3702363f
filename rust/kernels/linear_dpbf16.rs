//! The linear kernel's variant for bf16 weights and bf16 activations on CPUs with
//! AVX512-BF16: `vdpbf16ps` multiplies 32 bf16 pairs and accumulates them into 16
//! f32 lanes, so a weight is read as it is stored — no widening to f32 before the
//! multiply (two instructions per 16 weights on the plain AVX-512 path) and half
//! the multiply-adds.
//!
//! One reduction order for every row count, as the other variants: per output,
//! four accumulators over blocks of 128 elements, one over the remaining whole
//! 32-element chunks, summed as ((a0 + a1) + (a2 + a3)) + a4, then across lanes
//! (`_mm512_reduce_add_ps`, a fixed tree), then the tail (k not a multiple of 32)
//! in f32 in order, then the bias. The order differs from the FMA variants', so
//! this variant's bits are its own; a row gives the same bits alone and in a batch.

use std::ops::Range;

/// The tile `out[m, cols]` of `x[m, k] · w[n, k]ᵀ (+ bias)`.
///
/// # Safety
/// Call only on a CPU with AVX512F and AVX512-BF16 (`LinearIsa::Avx512Bf16` is
/// only constructed there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bf16")]
pub(super) unsafe fn columns_dpbf16(
    (m, k): (usize, usize),
    x: &[u16],
    w: &[u16],
    bias: Option<&[f32]>,
    cols: Range<usize>,
    out: &mut [f32],
) {
    let width = cols.len();
    for (c, j) in cols.enumerate() {
        let row = &w[j * k..(j + 1) * k];
        let b = bias.map_or(0.0, |b| b[j]);
        for i in 0..m {
            out[i * width + c] = dot(&x[i * k..(i + 1) * k], row) + b;
        }
    }
}

/// `x · w` in the order described at the top.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn dot(x: &[u16], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;

    use super::bf16_to_f32;

    let (cx, rx) = x.as_chunks::<32>();
    let (cw, rw) = w.as_chunks::<32>();
    // SAFETY: inlined only into `columns_dpbf16`, compiled with AVX512F and
    // AVX512-BF16 for CPUs that have them; every load reads one whole 32-element
    // chunk of a slice (`as_chunks`; unaligned loads allowed), and `__m512i` and
    // `__m512bh` are both 512 bits, so the transmutes reinterpret bits only.
    unsafe {
        let load = |c: &[u16; 32]| -> __m512bh {
            std::mem::transmute(_mm512_loadu_si512(c.as_ptr().cast()))
        };
        let mut acc = [_mm512_setzero_ps(); 4];
        let blocks = cx.len() / 4 * 4;
        for b in (0..blocks).step_by(4) {
            for (a, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_dpbf16_ps(*acc, load(&cx[b + a]), load(&cw[b + a]));
            }
        }
        let mut last = _mm512_setzero_ps();
        for (xc, wc) in cx[blocks..].iter().zip(&cw[blocks..]) {
            last = _mm512_dpbf16_ps(last, load(xc), load(wc));
        }
        let sum = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])),
            last,
        );
        let mut s = _mm512_reduce_add_ps(sum);
        for (a, b) in rx.iter().zip(rw) {
            s = bf16_to_f32(*a).mul_add(bf16_to_f32(*b), s);
        }
        s
    }
}
