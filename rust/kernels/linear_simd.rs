//! The vector operations the linear and attention kernels are written in, per
//! instruction set: one source for each kernel, a few lines of intrinsics per ISA here.

use super::linear::Elem;

pub(super) trait Simd {
    const LANES: usize;
    type V: Copy;
    unsafe fn zero() -> Self::V;
    /// `LANES` f32 from `p`.
    unsafe fn load(p: *const f32) -> Self::V;
    /// `LANES` weights from `p`, widened to f32 when bf16.
    unsafe fn load_w<W: Elem>(p: *const W) -> Self::V;
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `x` in every lane.
    unsafe fn splat(x: f32) -> Self::V;
    /// The `LANES` lanes to `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The lanes' sum by a fixed tree.
    unsafe fn sum(v: Self::V) -> f32;
    /// Lane `i` = the sum of `vs[i]`'s lanes by a fixed tree, for `i < LANES`
    /// (the rest of `vs` is ignored): `LANES` reductions for the price of a few.
    unsafe fn sum_each(vs: &[Self::V; 16]) -> Self::V;
    /// `acc` plus the products of 32 bf16 pairs at `a`, `b`, adjacent pairs summed
    /// into each lane (`vdpbf16ps`). Only the AVX512-BF16 variant calls it.
    unsafe fn dpbf16(acc: Self::V, a: *const u16, b: *const u16) -> Self::V;
    fn scalar_fma(a: f32, b: f32, c: f32) -> f32;
}

/// Eight lanes in plain Rust, no fused multiply-add (a library call where
/// the CPU has none): what a CPU without AVX2 runs.
pub(super) struct Portable;

impl Simd for Portable {
    const LANES: usize = 8;
    type V = [f32; 8];
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable f32 at `p`.
        unsafe { std::array::from_fn(|i| *p.add(i)) }
    }
    #[inline(always)]
    unsafe fn load_w<W: Elem>(p: *const W) -> [f32; 8] {
        // SAFETY: the caller guarantees 8 readable weights at `p`.
        unsafe { std::array::from_fn(|i| (*p.add(i)).to_f32()) }
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn add(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] + b[i])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        // SAFETY: the caller guarantees 8 writable f32 at `p`.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, 8) }
    }
    #[inline(always)]
    unsafe fn sum(v: [f32; 8]) -> f32 {
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
    }
    #[inline(always)]
    unsafe fn sum_each(vs: &[[f32; 8]; 16]) -> [f32; 8] {
        // SAFETY: `sum` has no precondition here.
        std::array::from_fn(|i| unsafe { Self::sum(vs[i]) })
    }
    unsafe fn dpbf16(_: [f32; 8], _: *const u16, _: *const u16) -> [f32; 8] {
        unreachable!("vdpbf16ps is the AVX512-BF16 variant's")
    }
    #[inline(always)]
    fn scalar_fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Elem, Simd};

    /// AVX2 + FMA: 8 lanes. Call only from code compiled with those features.
    pub(in super::super) struct Avx2;

    impl Simd for Avx2 {
        const LANES: usize = 8;
        type V = __m256;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY (all methods): run only inside code compiled with AVX2
            // and FMA for CPUs that have them (`columns_avx2`, the attention
            // kernel's AVX2 variant); loads and stores touch the 8 elements
            // the caller guarantees readable / writable (unaligned allowed).
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_w<W: Elem>(p: *const W) -> __m256 {
            unsafe {
                if W::IS_BF16 {
                    let h = _mm_loadu_si128(p.cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                } else {
                    _mm256_loadu_ps(p.cast())
                }
            }
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            unsafe { _mm256_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            unsafe {
                let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
            }
        }
        #[inline(always)]
        unsafe fn sum_each(v: &[__m256; 16]) -> __m256 {
            unsafe {
                // hadd pairs lanes within each 128-bit half: two rounds leave
                // each vector's half-sums, the cross-half add finishes them.
                let t0 = _mm256_hadd_ps(v[0], v[1]);
                let t1 = _mm256_hadd_ps(v[2], v[3]);
                let t2 = _mm256_hadd_ps(v[4], v[5]);
                let t3 = _mm256_hadd_ps(v[6], v[7]);
                let u0 = _mm256_hadd_ps(t0, t1); // [0..4 low halves | 0..4 high halves]
                let u1 = _mm256_hadd_ps(t2, t3);
                let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
                let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
                _mm256_add_ps(lo, hi)
            }
        }
        unsafe fn dpbf16(_: __m256, _: *const u16, _: *const u16) -> __m256 {
            unreachable!("vdpbf16ps is the AVX512-BF16 variant's")
        }
        #[inline(always)]
        fn scalar_fma(a: f32, b: f32, c: f32) -> f32 {
            a.mul_add(b, c)
        }
    }

    /// AVX-512F: 16 lanes. Call only from code compiled with it.
    pub(in super::super) struct Avx512;

    impl Simd for Avx512 {
        const LANES: usize = 16;
        type V = __m512;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY (all methods): run only inside code compiled with AVX2,
            // FMA and AVX512F for CPUs that have them (`columns_avx512`, the
            // attention kernel's AVX-512 variants); loads and stores touch the
            // 16 elements the caller guarantees readable / writable.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_w<W: Elem>(p: *const W) -> __m512 {
            unsafe {
                if W::IS_BF16 {
                    let h = _mm256_loadu_si256(p.cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                } else {
                    _mm512_loadu_ps(p.cast())
                }
            }
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            unsafe { _mm512_add_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            unsafe { _mm512_set1_ps(x) }
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            unsafe {
                let lo = _mm512_castps512_ps256(v);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                let x = _mm256_add_ps(lo, hi);
                let x = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
                let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
            }
        }
        #[inline(always)]
        unsafe fn sum_each(v: &[__m512; 16]) -> __m512 {
            unsafe {
                // Fold 512 -> 256 -> 128 bits, two vectors at a time, so each
                // 128-bit quarter holds four vectors' partial sums; then a 4x4
                // transpose-add per quarter, and the quarters put in order.
                let fold = |a: __m512, b: __m512| {
                    let x = _mm512_shuffle_f32x4::<0x44>(a, b); // a.q0 a.q1 b.q0 b.q1
                    let y = _mm512_shuffle_f32x4::<0xEE>(a, b); // a.q2 a.q3 b.q2 b.q3
                    _mm512_add_ps(x, y)
                };
                let w: [__m512; 8] = std::array::from_fn(|i| fold(v[i], v[i + 8]));
                let fold2 = |a: __m512, b: __m512| {
                    let x = _mm512_shuffle_f32x4::<0x88>(a, b); // a.q0 a.q2 b.q0 b.q2
                    let y = _mm512_shuffle_f32x4::<0xDD>(a, b); // a.q1 a.q3 b.q1 b.q3
                    _mm512_add_ps(x, y)
                };
                // x[i]'s quarters: partial sums of v[i], v[i + 8], v[i + 4], v[i + 12].
                let x: [__m512; 4] = std::array::from_fn(|i| fold2(w[i], w[i + 4]));
                let pair = |a: __m512, b: __m512| {
                    _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
                };
                let (s01, s23) = (pair(x[0], x[1]), pair(x[2], x[3]));
                let r = _mm512_add_ps(
                    _mm512_shuffle_ps::<0x44>(s01, s23),
                    _mm512_shuffle_ps::<0xEE>(s01, s23),
                );
                // Quarters of r: v0..4, v8..12, v4..8, v12..16.
                _mm512_shuffle_f32x4::<0xD8>(r, r)
            }
        }
        #[inline(always)]
        unsafe fn dpbf16(acc: __m512, a: *const u16, b: *const u16) -> __m512 {
            // SAFETY: called only inside the AVX512-BF16 variant (on CPUs with
            // it); 32 bf16 at each pointer are the caller's guarantee;
            // `__m512i` and `__m512bh` are both 512 bits.
            unsafe {
                let a: __m512bh = std::mem::transmute(_mm512_loadu_si512(a.cast()));
                let b: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.cast()));
                _mm512_dpbf16_ps(acc, a, b)
            }
        }
        #[inline(always)]
        fn scalar_fma(a: f32, b: f32, c: f32) -> f32 {
            a.mul_add(b, c)
        }
    }
}

/// Loop code written once over `Simd`, run in the variant `on_isa` picks: the
/// elementwise kernels' one dispatch (each variant compiled with its features).
pub(super) trait VectorBody {
    fn run<S: Simd>(self);
}

/// Runs `body` compiled for `isa` (a `LinearIsa::detect` result, so the CPU has it).
pub(super) fn on_isa<B: VectorBody>(isa: super::linear::LinearIsa, body: B) {
    use super::linear::LinearIsa;
    match isa {
        LinearIsa::Portable => body.run::<Portable>(),
        // SAFETY: `LinearIsa::detect` returns a variant only where the CPU has its
        // features (AVX2 + FMA; AVX-512F for the AVX-512 ones).
        #[cfg(target_arch = "x86_64")]
        LinearIsa::Avx2 => unsafe { body_avx2(body) },
        #[cfg(target_arch = "x86_64")]
        LinearIsa::Avx512 | LinearIsa::Avx512Bf16 => unsafe { body_avx512(body) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn body_avx2<B: VectorBody>(body: B) {
    body.run::<Avx2>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn body_avx512<B: VectorBody>(body: B) {
    body.run::<Avx512>()
}
