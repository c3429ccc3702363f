//! The byte operations that unpack one GGUF block's quants into 32 small integers
//! (`gguf_int_blocks`), for the integer kernel (`gguf_int`): one source for every
//! block type, a few lines of intrinsics per ISA here. The dot products over
//! several weight rows at once are `gguf_panel`'s.

pub(super) trait IntSimd {
    /// 32 bytes.
    type Q: Copy;
    /// 32 bytes from `p`.
    unsafe fn load(p: *const u8) -> Self::Q;
    /// The 16 bytes at `p`: their low nibbles, then their high nibbles.
    unsafe fn nibbles(p: *const u8) -> Self::Q;
    unsafe fn splat(b: u8) -> Self::Q;
    unsafe fn and(a: Self::Q, b: Self::Q) -> Self::Q;
    unsafe fn or(a: Self::Q, b: Self::Q) -> Self::Q;
    /// Each 16-bit lane shifted right by `n` < 16, zeros shifted in.
    unsafe fn srl16(a: Self::Q, n: u32) -> Self::Q;
    /// Each 16-bit lane shifted left by 4.
    unsafe fn sll16_4(a: Self::Q) -> Self::Q;
    /// 0xff in the bytes where `a` and `b` are equal, else 0.
    unsafe fn eq(a: Self::Q, b: Self::Q) -> Self::Q;
    /// Byte `i` is `value` where bit `i` of `bits` is set, else 0.
    unsafe fn bits(bits: u32, value: u8) -> Self::Q;
    /// The IEEE half at `p` (2 bytes) as f32, exactly.
    unsafe fn half(p: *const u8) -> f32;
}

/// Plain Rust on arrays: what a CPU without AVX2 runs, and the bit-exact reference
/// the vector paths are tested against.
pub(super) struct Portable;

impl IntSimd for Portable {
    type Q = [u8; 32];
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
    unsafe fn half(p: *const u8) -> f32 {
        let h = unsafe { p.cast::<[u8; 2]>().read_unaligned() };
        super::gguf::f16_to_f32(u16::from_le_bytes(h))
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
pub(super) use x86::X86;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::IntSimd;

    /// 256-bit AVX2 (+ F16C). Call only from code compiled with AVX2, FMA and F16C.
    pub(in super::super) struct X86;

    impl IntSimd for X86 {
        type Q = __m256i;
        // SAFETY (all methods): run only inside the `gguf_int` wrappers compiled
        // with AVX2, FMA and F16C, on CPUs that have them; loads read the bytes
        // the caller guarantees readable (unaligned loads allowed).
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
        unsafe fn half(p: *const u8) -> f32 {
            unsafe {
                let h = p.cast::<u16>().read_unaligned();
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
            }
        }
    }
}
