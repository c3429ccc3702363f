//! A branch-free `exp` the compiler vectorises (libm's `expf` is a scalar call):
//! the attention kernel's softmax and the SiLU of the elementwise kernels.
//! Generic over the instruction set only for its fused multiply-add (`Simd::
//! scalar_fma`: one instruction inside an AVX2 or AVX-512 variant, a plain
//! multiply and add in the portable one).

use super::linear_simd::Simd;

/// `exp(x)` for `x <= 0`, within 2e-7 relative error. Inputs below -87 (where
/// the result leaves the normal range) give about 1.6e-38 instead of a smaller
/// number: nothing next to the terms of 1 it is summed or compared with.
#[inline(always)]
pub(super) fn exp_nonpositive<S: Simd>(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let fma = S::scalar_fma;
    let x = x.max(-87.0);
    // x = n ln2 + r, |r| <= ln2 / 2; exp(x) = 2^n exp(r).
    let shifted = fma(x, std::f32::consts::LOG2_E, ROUND);
    let n = shifted - ROUND;
    let r = fma(-n, LN2_LO, fma(-n, LN2_HI, x));
    // Taylor terms to r^6: the truncation error is below |r|^7 / 7! < 1.3e-7.
    let mut p = 1.0 / 720.0;
    p = fma(p, r, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    // The low bits of `shifted` hold n + 2^22; n is in -126..=0.
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// Replaces each score `x` by `exp(x - max)` and returns their sum, 8 lanes at a
/// time (a single running sum is a chain the compiler cannot vectorise).
#[inline(always)]
pub(super) fn exp_shifted_sum<S: Simd>(row: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for chunk in &mut chunks {
        for i in 0..8 {
            let e = exp_nonpositive::<S>(chunk[i] - max);
            chunk[i] = e;
            lanes[i] += e;
        }
    }
    let mut total = 0.0;
    for x in chunks.into_remainder() {
        *x = exp_nonpositive::<S>(*x - max);
        total += *x;
    }
    total + lanes.iter().sum::<f32>()
}

/// The largest of `row` (NEG_INFINITY when empty), 8 lanes at a time: a fold
/// through one running max is a chain of compares the compiler cannot reorder.
#[inline(always)]
pub(super) fn max_of(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        for i in 0..8 {
            lanes[i] = lanes[i].max(chunk[i]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    lanes.iter().fold(tail, |m, &x| m.max(x))
}

/// `x * sigmoid(x)` (SiLU) from `exp(-|x|)`, so the exponent is never positive
/// and never overflows: `sigmoid(x) = 1 / (1 + e)` for `x >= 0`, `e / (1 + e)`
/// below, with `e = exp(-|x|)`. Within a few ulps of the exact value.
#[inline(always)]
pub(super) fn silu<S: Simd>(x: f32) -> f32 {
    let e = exp_nonpositive::<S>(-x.abs());
    let numerator = if x >= 0.0 { x } else { x * e };
    numerator / (1.0 + e)
}
