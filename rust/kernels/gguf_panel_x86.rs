//! The x86 panels of the GGUF integer kernel (`gguf_panel`): eight lanes of AVX2
//! (`vpmaddubsw` or AVX-VNNI's `vpdpbusd`) and sixteen of AVX-512 with
//! AVX512-VNNI. The same operations as `gguf_panel::Portable8`, lane for lane.

use std::arch::x86_64::*;

use super::gguf_panel::Panel;

/// The dot product's instructions: AVX2 `vpmaddubsw` + `vpmaddwd`.
pub(super) const MADDUBS: u8 = 0;
/// AVX-VNNI's `vpdpbusd` (VEX).
pub(super) const AVX_VNNI: u8 = 1;

/// Eight lanes of 256-bit AVX2, the dot product by `DOT`. Call only from code
/// compiled with AVX2, FMA and F16C, and AVX-VNNI for `AVX_VNNI`.
pub(super) struct Ymm<const DOT: u8>;

// SAFETY (all methods of both impls): run only inside the `gguf_int`
// wrappers compiled with the features named above, on CPUs that have them;
// `loadf` reads the lanes the caller guarantees readable.
impl<const DOT: u8> Panel for Ymm<DOT> {
    type V = __m256i;
    type F = __m256;
    const LANES: usize = 8;
    const MAX_GROUP: usize = 8;
    // `vpdpbusd` takes weights unsigned: signed ones get 128 added (their
    // top bit flipped); `vpmaddubsw` takes their sign off instead
    const SIGNED_BIAS: i32 = if DOT == MADDUBS { 0 } else { 128 };
    #[inline(always)]
    unsafe fn signed(w: __m256i) -> __m256i {
        unsafe {
            if DOT == MADDUBS {
                w
            } else {
                _mm256_xor_si256(w, _mm256_set1_epi8(-128))
            }
        }
    }
    #[inline(always)]
    unsafe fn izero() -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m256i, w: __m256i, x: i32) -> __m256i {
        unsafe {
            let x = _mm256_set1_epi32(x);
            if DOT == MADDUBS {
                // unsigned weights are at most 63: 2 · 63 · 127 fits i16
                let pairs = _mm256_maddubs_epi16(w, x);
                _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
            } else {
                _mm256_dpbusd_avx_epi32(acc, w, x)
            }
        }
    }
    #[inline(always)]
    unsafe fn dot_s(acc: __m256i, w: __m256i, x: i32) -> __m256i {
        unsafe {
            if DOT == MADDUBS {
                // |w| (at most 128) times x with w's sign: 2 · 128 · 127 fits i16
                let x = _mm256_sign_epi8(_mm256_set1_epi32(x), w);
                let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), x);
                _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
            } else {
                Self::dot(acc, w, x)
            }
        }
    }
    #[inline(always)]
    unsafe fn isub(a: __m256i, b: i32) -> __m256i {
        unsafe { _mm256_sub_epi32(a, _mm256_set1_epi32(b)) }
    }
    #[inline(always)]
    unsafe fn fzero() -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn scaled(i: __m256i, dx: f32) -> __m256 {
        unsafe { _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(dx)) }
    }
    #[inline(always)]
    unsafe fn scaled_add(t: __m256, i: __m256i, dx: f32) -> __m256 {
        unsafe { _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(dx), t) }
    }
    #[inline(always)]
    unsafe fn fma_s(a: __m256, s: f32, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, _mm256_set1_ps(s), c) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn splat(s: f32) -> __m256 {
        unsafe { _mm256_set1_ps(s) }
    }
    #[inline(always)]
    unsafe fn store(v: __m256, out: &mut [f32; 16]) {
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) }
    }
    #[inline(always)]
    unsafe fn words4(rows: &[*const u8; 16], at: usize) -> [__m256i; 4] {
        unsafe {
            // z(a) holds lanes a and 4 + a in its 128-bit halves; the 4 x 4
            // transposes within the halves then put lane 4h + a in place
            let z = |a: usize| {
                let lo = _mm_loadu_si128(rows[a].add(at).cast());
                let hi = _mm_loadu_si128(rows[4 + a].add(at).cast());
                _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
            };
            let (z0, z1, z2, z3) = (z(0), z(1), z(2), z(3));
            let (t0, t1) = (_mm256_unpacklo_epi32(z0, z1), _mm256_unpackhi_epi32(z0, z1));
            let (t2, t3) = (_mm256_unpacklo_epi32(z2, z3), _mm256_unpackhi_epi32(z2, z3));
            [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        unsafe { _mm256_loadu_si256(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn halves<const HIGH: bool>(v: __m256i) -> __m256 {
        unsafe {
            // each lane's half to the low 8 bytes of its 128-bit lane, then
            // the two 8-byte groups side by side
            let pick = if HIGH {
                _mm256_setr_epi8(
                    2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11,
                    14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                )
            } else {
                _mm256_setr_epi8(
                    0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12,
                    13, -1, -1, -1, -1, -1, -1, -1, -1,
                )
            };
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(v, pick));
            _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
        }
    }
    #[inline(always)]
    unsafe fn nibbles<const HIGH: bool>(v: __m256i) -> __m256i {
        unsafe {
            let v = if HIGH { _mm256_srli_epi32::<4>(v) } else { v };
            _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
        }
    }
    #[inline(always)]
    unsafe fn field(v: __m256i, shift: u32, mask: i32) -> __m256i {
        unsafe {
            let v = _mm256_srl_epi32(v, _mm_cvtsi32_si128(shift as i32));
            _mm256_and_si256(v, _mm256_set1_epi32(mask))
        }
    }
    #[inline(always)]
    unsafe fn shl(v: __m256i, shift: u32) -> __m256i {
        unsafe { _mm256_sll_epi32(v, _mm_cvtsi32_si128(shift as i32)) }
    }
    #[inline(always)]
    unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn sbyte(v: __m256i, byte: u32) -> __m256i {
        unsafe {
            let v = _mm256_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * byte as i32));
            _mm256_srai_epi32::<24>(v)
        }
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn mulf(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn negf(a: __m256) -> __m256 {
        unsafe { _mm256_xor_ps(a, _mm256_set1_ps(-0.0)) }
    }
}

/// Sixteen lanes of AVX-512 with AVX512-VNNI's `vpdpbusd`. Call only from code
/// compiled with AVX2, FMA, F16C, AVX512F and AVX512-VNNI.
pub(super) struct Zmm;

impl Panel for Zmm {
    type V = __m512i;
    type F = __m512;
    const LANES: usize = 16;
    const MAX_GROUP: usize = 16;
    const SIGNED_BIAS: i32 = 128;
    #[inline(always)]
    unsafe fn signed(w: __m512i) -> __m512i {
        unsafe { _mm512_xor_si512(w, _mm512_set1_epi8(-128)) }
    }
    #[inline(always)]
    unsafe fn izero() -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn dot(acc: __m512i, w: __m512i, x: i32) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x)) }
    }
    #[inline(always)]
    unsafe fn dot_s(acc: __m512i, w: __m512i, x: i32) -> __m512i {
        unsafe { Self::dot(acc, w, x) }
    }
    #[inline(always)]
    unsafe fn isub(a: __m512i, b: i32) -> __m512i {
        unsafe { _mm512_sub_epi32(a, _mm512_set1_epi32(b)) }
    }
    #[inline(always)]
    unsafe fn fzero() -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn scaled(i: __m512i, dx: f32) -> __m512 {
        unsafe { _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(dx)) }
    }
    #[inline(always)]
    unsafe fn scaled_add(t: __m512, i: __m512i, dx: f32) -> __m512 {
        unsafe { _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(dx), t) }
    }
    #[inline(always)]
    unsafe fn fma_s(a: __m512, s: f32, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, _mm512_set1_ps(s), c) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn splat(s: f32) -> __m512 {
        unsafe { _mm512_set1_ps(s) }
    }
    #[inline(always)]
    unsafe fn store(v: __m512, out: &mut [f32; 16]) {
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v) }
    }
    #[inline(always)]
    unsafe fn words4(rows: &[*const u8; 16], at: usize) -> [__m512i; 4] {
        unsafe {
            // z[a] holds lanes a, 4 + a, 8 + a and 12 + a in its 128-bit
            // lanes; the transposes within them put lane 4i + a in place
            let z = |a: usize| {
                let v = _mm512_castsi128_si512(_mm_loadu_si128(rows[a].add(at).cast()));
                let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(rows[4 + a].add(at).cast()));
                let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(rows[8 + a].add(at).cast()));
                _mm512_inserti32x4::<3>(v, _mm_loadu_si128(rows[12 + a].add(at).cast()))
            };
            let (z0, z1, z2, z3) = (z(0), z(1), z(2), z(3));
            let (t0, t1) = (_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
            let (t2, t3) = (_mm512_unpacklo_epi32(z2, z3), _mm512_unpackhi_epi32(z2, z3));
            [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ]
        }
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m512i {
        unsafe { _mm512_loadu_si512(p.cast()) }
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
    #[inline(always)]
    unsafe fn halves<const HIGH: bool>(v: __m512i) -> __m512 {
        unsafe {
            let v = if HIGH { _mm512_srli_epi32::<16>(v) } else { v };
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
        }
    }
    #[inline(always)]
    unsafe fn nibbles<const HIGH: bool>(v: __m512i) -> __m512i {
        unsafe {
            let v = if HIGH { _mm512_srli_epi32::<4>(v) } else { v };
            _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
        }
    }
    #[inline(always)]
    unsafe fn field(v: __m512i, shift: u32, mask: i32) -> __m512i {
        unsafe {
            let v = _mm512_srl_epi32(v, _mm_cvtsi32_si128(shift as i32));
            _mm512_and_si512(v, _mm512_set1_epi32(mask))
        }
    }
    #[inline(always)]
    unsafe fn shl(v: __m512i, shift: u32) -> __m512i {
        unsafe { _mm512_sll_epi32(v, _mm_cvtsi32_si128(shift as i32)) }
    }
    #[inline(always)]
    unsafe fn or(a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn sbyte(v: __m512i, byte: u32) -> __m512i {
        unsafe {
            let v = _mm512_sll_epi32(v, _mm_cvtsi32_si128(24 - 8 * byte as i32));
            _mm512_srai_epi32::<24>(v)
        }
    }
    #[inline(always)]
    unsafe fn to_f32(v: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    unsafe fn mulf(a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn negf(a: __m512) -> __m512 {
        unsafe {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(a),
                _mm512_set1_epi32(i32::MIN),
            ))
        }
    }
}
