//! The vector operations `linear`'s `dot` is written in, per instruction set: one source
//! for the kernel, a few lines of intrinsics per ISA here.

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
    /// The lanes' sum by a fixed tree.
    unsafe fn sum(v: Self::V) -> f32;
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
    unsafe fn sum(v: [f32; 8]) -> f32 {
        ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
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
            // SAFETY (all methods): run only inside `columns_avx2`, compiled
            // with AVX2 and FMA for CPUs that have them; loads read the 8
            // elements the caller guarantees readable (unaligned allowed).
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
        unsafe fn sum(v: __m256) -> f32 {
            unsafe {
                let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
                _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
            }
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
            // SAFETY (all methods): run only inside `columns_avx512`, compiled
            // with AVX2, FMA and AVX512F for CPUs that have them; loads read
            // the 16 elements the caller guarantees readable.
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
        fn scalar_fma(a: f32, b: f32, c: f32) -> f32 {
            a.mul_add(b, c)
        }
    }
}
