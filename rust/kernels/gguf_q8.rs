//! The activations of the GGUF integer kernel (`gguf_int`): each row of `x`
//! quantized to int8 per 16 elements, as llama.cpp quantizes its Q8 activations.

use super::gguf_int::QuantIsa;

/// `x`'s rows quantized to int8 as llama.cpp's Q8 activations, but with a scale
/// per 16 elements (half a block) instead of 32: it costs one multiply a block and
/// an outlier then coarsens 16 neighbours, not 32 (on SmolLM2 the held-out
/// perplexity moved 1.05 % from the float kernel's with scales per 32). Indexed by
/// `row * blocks + block`.
pub(super) struct Q8Rows {
    /// 32-blocks per row.
    pub(super) blocks: usize,
    pub(super) qs: Vec<i8>,
    /// Each block's scales `dx`, by half.
    pub(super) dx: Vec<[f32; 2]>,
    /// Each block's `Σ x_q` by half (for signed weights on `vpdpbusd`).
    pub(super) xs: Vec<[i32; 2]>,
    /// Each block's `dx · Σ x_q` over its first half, its second half and whole
    /// (for weights with a float offset or a bias).
    pub(super) sx: Vec<[f32; 3]>,
    pub(super) rows: usize,
}

impl Q8Rows {
    /// `Q8Rows::new` compiled for `isa`'s instructions: the same IEEE operations
    /// (the same bits), but rounding in vectors rather than a `roundf` call per
    /// element (at 16 rows a tenth of a SmolLM2 step went there).
    pub(super) fn quantize(isa: QuantIsa, k: usize, x: &[f32]) -> Q8Rows {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: every path but `Portable` is only constructed where the CPU
            // has AVX2, FMA and F16C (`available`).
            QuantIsa::Avx2 | QuantIsa::AvxVnni => unsafe { quantize_avx2(k, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Avx512Vnni` is only constructed where the CPU has AVX2, FMA,
            // F16C, AVX512F and AVX512VL (`available`).
            QuantIsa::Avx512Vnni => unsafe { quantize_avx512(k, x) },
            _ => Q8Rows::new(k, x),
        }
    }

    /// `x` holds rows of `k`, a multiple of 32.
    #[inline(always)]
    pub(super) fn new(k: usize, x: &[f32]) -> Q8Rows {
        let n = x.len() / 32;
        let mut rows = Q8Rows {
            blocks: k / 32,
            qs: vec![0; x.len()],
            dx: vec![[0.0; 2]; n],
            xs: vec![[0; 2]; n],
            sx: vec![[0.0; 3]; n],
            rows: x.len() / k.max(1),
        };
        let blocks = x.chunks_exact(32).zip(rows.qs.chunks_exact_mut(32));
        let sums = rows.dx.iter_mut().zip(&mut rows.xs).zip(&mut rows.sx);
        for ((xb, qb), ((dx, xs), sx)) in blocks.zip(sums) {
            for (h, (xh, qh)) in xb.chunks_exact(16).zip(qb.chunks_exact_mut(16)).enumerate() {
                let (xh, qh) = (xh.try_into().unwrap(), qh.try_into().unwrap());
                (dx[h], xs[h]) = quantize_half(xh, qh);
            }
            let s = [dx[0] * xs[0] as f32, dx[1] * xs[1] as f32];
            *sx = [s[0], s[1], s[0] + s[1]];
        }
        rows
    }
}

/// One 16-element half of an activation block: its scale `max|x| / 127` and
/// `Σ x_q`, with `x_q = round(x / scale)` (ties to even: one vector instruction)
/// into `q`. Fixed-size arrays and no branches per element, so it compiles to
/// a few vector instructions on each ISA.
#[inline(always)]
fn quantize_half(x: &[f32; 16], q: &mut [i8; 16]) -> (f32, i32) {
    // max |x| as the largest magnitude's bits (an integer max, which
    // vectorizes); above infinity's bits it is a NaN
    let top = x.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff));
    // a NaN anywhere makes the scale NaN, so it reaches the output
    let d = if top > f32::INFINITY.to_bits() {
        f32::NAN
    } else {
        f32::from_bits(top) / 127.0
    };
    // an all-zero, infinite or NaN half, or a scale whose inverse overflows,
    // quantizes to zeros and NaNs (0 · inf) that become 0
    let id = if d > 0.0 && d.is_finite() {
        1.0 / d
    } else {
        0.0
    };
    let id = if id.is_finite() { id } else { 0.0 };
    let mut sum = 0;
    for (q, v) in q.iter_mut().zip(x) {
        let r = (v * id).round_ties_even().clamp(-127.0, 127.0);
        let r = if r.is_nan() { 0.0 } else { r };
        // SAFETY: `r` is finite and within [-127, 127] (clamped, NaN replaced)
        let r = unsafe { r.to_int_unchecked::<i32>() };
        *q = r as i8;
        sum += r;
    }
    (d, sum)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_avx2(k: usize, x: &[f32]) -> Q8Rows {
    Q8Rows::new(k, x)
}

/// 16 floats a vector: a half block is one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
fn quantize_avx512(k: usize, x: &[f32]) -> Q8Rows {
    Q8Rows::new(k, x)
}
