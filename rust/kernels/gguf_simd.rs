//! The integer vector operations the GGUF integer kernels (`gguf_int`) are written
//! in: 32 bytes of quants, their dot product with 32 int8 activations as eight i32
//! lanes (lane `l` sums bytes `4l..4l + 4`, on every ISA), and eight f32
//! accumulators. One kernel source; a few lines of intrinsics per ISA here.
//!
//! The lanes are exact integers on every path, and the float steps are the same
//! operations in the same order (a product, then a sum: never fused), so every
//! ISA gives the portable path's result bit for bit (`tests_gguf_int.rs`).

pub(super) trait IntSimd {
    /// 32 bytes.
    type Q: Copy;
    /// Eight i32 lanes.
    type I: Copy;
    /// Eight f32 lanes.
    type F: Copy;
    /// 32 bytes from `p`.
    unsafe fn load(p: *const u8) -> Self::Q;
    /// The 16 bytes at `p`: their low nibbles, then their high nibbles.
    unsafe fn nibbles(p: *const u8) -> Self::Q;
    unsafe fn splat(b: u8) -> Self::Q;
    unsafe fn and(a: Self::Q, b: Self::Q) -> Self::Q;
    unsafe fn or(a: Self::Q, b: Self::Q) -> Self::Q;
    /// Bytewise `a - b`, wrapping.
    unsafe fn sub8(a: Self::Q, b: Self::Q) -> Self::Q;
    /// Each 16-bit lane shifted right by `n` < 16, zeros shifted in.
    unsafe fn srl16(a: Self::Q, n: u32) -> Self::Q;
    /// Each 16-bit lane shifted left by 4.
    unsafe fn sll16_4(a: Self::Q) -> Self::Q;
    /// 0xff in the bytes where `a` and `b` are equal, else 0.
    unsafe fn eq(a: Self::Q, b: Self::Q) -> Self::Q;
    /// Byte `i` is `value` where bit `i` of `bits` is set, else 0.
    unsafe fn bits(bits: u32, value: u8) -> Self::Q;
    /// Lanes of Σ u·s, `u` unsigned (at most 63: no i16 saturation on AVX2), `s`
    /// signed.
    unsafe fn dot_us(u: Self::Q, s: Self::Q) -> Self::I;
    /// Lanes of Σ a·s, both signed, `s` never -128.
    unsafe fn dot_ss(a: Self::Q, s: Self::Q) -> Self::I;
    unsafe fn fzero() -> Self::F;
    unsafe fn splatf(v: f32) -> Self::F;
    /// Eight f32 from `p`.
    unsafe fn loadf(p: *const f32) -> Self::F;
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F;
    /// `a` in lanes 0..4, `b` in lanes 4..8 (the halves of a 32-block).
    unsafe fn halves(a: f32, b: f32) -> Self::F;
    /// `acc + f32(i) * scale`, rounded after the product and after the sum.
    unsafe fn acc(acc: Self::F, i: Self::I, scale: Self::F) -> Self::F;
    unsafe fn lanes(v: Self::F) -> [f32; 8];
    /// The IEEE half at `p` (2 bytes) as f32, exactly.
    unsafe fn half(p: *const u8) -> f32;
    /// The IEEE half at `p` as f32 in every lane (a broadcast and one conversion:
    /// cheaper than `splatf(half(p))` on x86).
    unsafe fn halfv(p: *const u8) -> Self::F;
}

/// Plain Rust on arrays: what a CPU without AVX2 runs, and the bit-exact reference
/// the vector paths are tested against.
pub(super) struct Portable;

impl IntSimd for Portable {
    type Q = [u8; 32];
    type I = [i32; 8];
    type F = [f32; 8];
    #[inline(always)]
    unsafe fn load(p: *const u8) -> [u8; 32] {
        // SAFETY (all methods): the caller guarantees the bytes read readable.
        unsafe { p.cast::<[u8; 32]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> [u8; 32] {
        let b = unsafe { p.cast::<[u8; 16]>().read_unaligned() };
        std::array::from_fn(|i| if i < 16 { b[i] & 0x0f } else { b[i - 16] >> 4 })
    }
    #[inline(always)]
    unsafe fn splat(b: u8) -> [u8; 32] {
        [b; 32]
    }
    #[inline(always)]
    unsafe fn and(a: [u8; 32], b: [u8; 32]) -> [u8; 32] {
        std::array::from_fn(|i| a[i] & b[i])
    }
    #[inline(always)]
    unsafe fn or(a: [u8; 32], b: [u8; 32]) -> [u8; 32] {
        std::array::from_fn(|i| a[i] | b[i])
    }
    #[inline(always)]
    unsafe fn sub8(a: [u8; 32], b: [u8; 32]) -> [u8; 32] {
        std::array::from_fn(|i| a[i].wrapping_sub(b[i]))
    }
    #[inline(always)]
    unsafe fn srl16(a: [u8; 32], n: u32) -> [u8; 32] {
        shift16(a, |v| v >> n)
    }
    #[inline(always)]
    unsafe fn sll16_4(a: [u8; 32]) -> [u8; 32] {
        shift16(a, |v| v << 4)
    }
    #[inline(always)]
    unsafe fn eq(a: [u8; 32], b: [u8; 32]) -> [u8; 32] {
        std::array::from_fn(|i| if a[i] == b[i] { 0xff } else { 0 })
    }
    #[inline(always)]
    unsafe fn bits(bits: u32, value: u8) -> [u8; 32] {
        std::array::from_fn(|i| if bits >> i & 1 == 1 { value } else { 0 })
    }
    #[inline(always)]
    unsafe fn dot_us(u: [u8; 32], s: [u8; 32]) -> [i32; 8] {
        std::array::from_fn(|l| {
            (4 * l..4 * l + 4)
                .map(|i| i32::from(u[i]) * i32::from(s[i] as i8))
                .sum()
        })
    }
    #[inline(always)]
    unsafe fn dot_ss(a: [u8; 32], s: [u8; 32]) -> [i32; 8] {
        std::array::from_fn(|l| {
            (4 * l..4 * l + 4)
                .map(|i| i32::from(a[i] as i8) * i32::from(s[i] as i8))
                .sum()
        })
    }
    #[inline(always)]
    unsafe fn fzero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splatf(v: f32) -> [f32; 8] {
        [v; 8]
    }
    #[inline(always)]
    unsafe fn loadf(p: *const f32) -> [f32; 8] {
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn mulf(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|i| a[i] * b[i])
    }
    #[inline(always)]
    unsafe fn halves(a: f32, b: f32) -> [f32; 8] {
        std::array::from_fn(|i| if i < 4 { a } else { b })
    }
    #[inline(always)]
    unsafe fn acc(acc: [f32; 8], i: [i32; 8], scale: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| acc[l] + i[l] as f32 * scale[l])
    }
    #[inline(always)]
    unsafe fn lanes(v: [f32; 8]) -> [f32; 8] {
        v
    }
    #[inline(always)]
    unsafe fn half(p: *const u8) -> f32 {
        let h = unsafe { p.cast::<[u8; 2]>().read_unaligned() };
        super::gguf::f16_to_f32(u16::from_le_bytes(h))
    }
    #[inline(always)]
    unsafe fn halfv(p: *const u8) -> [f32; 8] {
        [unsafe { Self::half(p) }; 8]
    }
}

/// `f` on each little-endian 16-bit lane of `a`.
#[inline(always)]
fn shift16(a: [u8; 32], f: impl Fn(u16) -> u16) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (o, c) in out.chunks_exact_mut(2).zip(a.chunks_exact(2)) {
        o.copy_from_slice(&f(u16::from_le_bytes([c[0], c[1]])).to_le_bytes());
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{AVX512_VNNI, AVX_VNNI, MADDUBS, X86};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::IntSimd;

    /// The dot product's instructions: AVX2 `vpmaddubsw` + `vpmaddwd`.
    pub(in super::super) const MADDUBS: u8 = 0;
    /// AVX-VNNI's `vpdpbusd` (VEX).
    pub(in super::super) const AVX_VNNI: u8 = 1;
    /// AVX512-VNNI's `vpdpbusd` on 256-bit registers (EVEX, AVX512VL).
    pub(in super::super) const AVX512_VNNI: u8 = 2;

    /// 256-bit AVX2 (+ F16C), the dot product by `DOT`. Call only from code
    /// compiled with AVX2, FMA and F16C, and with the features `DOT` needs.
    pub(in super::super) struct X86<const DOT: u8>;

    impl<const DOT: u8> IntSimd for X86<DOT> {
        type Q = __m256i;
        type I = __m256i;
        type F = __m256;
        // SAFETY (all methods): run only inside the `gguf_int` wrappers compiled
        // with AVX2, FMA, F16C and (for `DOT` != MADDUBS) the VNNI feature named
        // by `DOT`, on CPUs that have them; loads read the bytes the caller
        // guarantees readable (unaligned loads allowed).
        #[inline(always)]
        unsafe fn load(p: *const u8) -> __m256i {
            unsafe { _mm256_loadu_si256(p.cast()) }
        }
        #[inline(always)]
        unsafe fn nibbles(p: *const u8) -> __m256i {
            unsafe {
                // the 16 bytes in both halves (a load, no shuffle), the upper
                // half shifted by 4 bits, then each byte's low nibble
                let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
                let v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
                _mm256_and_si256(v, _mm256_set1_epi8(0x0f))
            }
        }
        #[inline(always)]
        unsafe fn splat(b: u8) -> __m256i {
            unsafe { _mm256_set1_epi8(b as i8) }
        }
        #[inline(always)]
        unsafe fn and(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_and_si256(a, b) }
        }
        #[inline(always)]
        unsafe fn or(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_or_si256(a, b) }
        }
        #[inline(always)]
        unsafe fn sub8(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_sub_epi8(a, b) }
        }
        #[inline(always)]
        unsafe fn srl16(a: __m256i, n: u32) -> __m256i {
            unsafe { _mm256_srl_epi16(a, _mm_cvtsi32_si128(n as i32)) }
        }
        #[inline(always)]
        unsafe fn sll16_4(a: __m256i) -> __m256i {
            unsafe { _mm256_slli_epi16::<4>(a) }
        }
        #[inline(always)]
        unsafe fn eq(a: __m256i, b: __m256i) -> __m256i {
            unsafe { _mm256_cmpeq_epi8(a, b) }
        }
        #[inline(always)]
        unsafe fn bits(bits: u32, value: u8) -> __m256i {
            unsafe {
                // byte i = byte i / 8 of `bits`, then all ones where its bit i % 8
                // is set (llama.cpp's bytes_from_bits_32)
                let v = _mm256_set1_epi32(bits as i32);
                let pick = _mm256_setr_epi64x(
                    0,
                    0x0101_0101_0101_0101,
                    0x0202_0202_0202_0202,
                    0x0303_0303_0303_0303,
                );
                let bytes = _mm256_shuffle_epi8(v, pick);
                let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
                let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi8(-1));
                _mm256_and_si256(set, _mm256_set1_epi8(value as i8))
            }
        }
        #[inline(always)]
        unsafe fn dot_us(u: __m256i, s: __m256i) -> __m256i {
            unsafe {
                match DOT {
                    AVX_VNNI => _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s),
                    AVX512_VNNI => _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s),
                    _ => _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
                }
            }
        }
        #[inline(always)]
        unsafe fn dot_ss(a: __m256i, s: __m256i) -> __m256i {
            // |a| (at most 128) times s with a's sign: 2 · 128 · 127 fits i16
            unsafe { Self::dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(s, a)) }
        }
        #[inline(always)]
        unsafe fn fzero() -> __m256 {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn splatf(v: f32) -> __m256 {
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn loadf(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn mulf(a: __m256, b: __m256) -> __m256 {
            unsafe { _mm256_mul_ps(a, b) }
        }
        #[inline(always)]
        unsafe fn halves(a: f32, b: f32) -> __m256 {
            unsafe { _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)) }
        }
        #[inline(always)]
        unsafe fn acc(acc: __m256, i: __m256i, scale: __m256) -> __m256 {
            unsafe { _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(i), scale)) }
        }
        #[inline(always)]
        unsafe fn lanes(v: __m256) -> [f32; 8] {
            let mut out = [0.0f32; 8];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
            out
        }
        #[inline(always)]
        unsafe fn half(p: *const u8) -> f32 {
            unsafe {
                let h = p.cast::<u16>().read_unaligned();
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
            }
        }
        #[inline(always)]
        unsafe fn halfv(p: *const u8) -> __m256 {
            unsafe { _mm256_cvtph_ps(_mm_set1_epi16(p.cast::<i16>().read_unaligned())) }
        }
    }
}
