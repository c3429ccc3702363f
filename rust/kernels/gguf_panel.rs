//! The GGUF integer kernel's dot products with output features in the lanes: a
//! panel of `LANES` weight rows (8 or 16) has one sub-block of each row unpacked
//! (`gguf_int_blocks`) and transposed so that vector `j` holds quant bytes
//! `4j..4j + 4` of every row; each activation row then takes eight
//! `vpdpbusd`s (or `vpmaddubsw` + `vpmaddwd`) with its four bytes broadcast, and
//! the panel's exact integer sums meet the scales as one f32 vector per half.
//! Per output the float steps are one chain: `acc + f32(Σ) · (scale · dx)` per
//! half (a product, a product, a sum: never fused) and `acc + offset · sx`, so
//! every ISA, and a row in any batch, gives the portable path's bits
//! (`tests_gguf_int.rs`).
//!
//! Dotting lanes with lanes (one weight row at a time, as before) left every
//! block's eight partial sums to combine per row, six vector instructions per
//! block and row; here it is about one per block and row at 16 rows.

use super::gguf_simd::IntSimd;

/// What `gguf_int` computes a panel with.
pub(super) trait Panel {
    /// The per-row unpacking operations.
    type S: IntSimd;
    /// `LANES` lanes of 32 bits: four quant bytes, or an i32 sum.
    type V: Copy;
    /// `LANES` f32 lanes.
    type F: Copy;
    const LANES: usize;
    /// The most activation rows sharing one unpacked panel: their accumulators,
    /// the eight weight vectors and a few temporaries fit the registers.
    const MAX_GROUP: usize;
    /// What `signed` adds to each weight, to be subtracted as `SIGNED_BIAS · Σ x_q`.
    const SIGNED_BIAS: i32;
    /// The lane that row `i` of `transpose`'s input lands in.
    fn slot(i: usize) -> usize;
    /// `rows[i]` (`i < LANES`): 32 quant bytes of a weight row; vector `j` of the
    /// result holds bytes `4j..4j + 4` of row `i` in lane `slot(i)`.
    unsafe fn transpose(rows: &[<Self::S as IntSimd>::Q; 16]) -> [Self::V; 8];
    /// Signed weights as `dot_s` takes them.
    unsafe fn signed(w: Self::V) -> Self::V;
    unsafe fn izero() -> Self::V;
    /// `acc + Σ_t w_t · x_t` per lane, over its four bytes `w_t` (unsigned) and
    /// the four bytes of `x` (signed, never -128).
    unsafe fn dot(acc: Self::V, w: Self::V, x: i32) -> Self::V;
    /// `dot` for signed weights prepared by `signed`: the sum gains
    /// `SIGNED_BIAS · Σ_t x_t`.
    unsafe fn dot_s(acc: Self::V, w: Self::V, x: i32) -> Self::V;
    /// `a - b` per lane.
    unsafe fn isub(a: Self::V, b: i32) -> Self::V;
    unsafe fn fzero() -> Self::F;
    /// `LANES` f32 from `p`.
    unsafe fn loadf(p: *const f32) -> Self::F;
    /// `acc + f32(i) · (scale · dx)`, each step rounded.
    unsafe fn acc(acc: Self::F, i: Self::V, scale: Self::F, dx: f32) -> Self::F;
    /// `acc + offset · sx`, each step rounded.
    unsafe fn acc_off(acc: Self::F, offset: Self::F, sx: f32) -> Self::F;
    /// The lanes into `out[..LANES]`.
    unsafe fn store(v: Self::F, out: &mut [f32; 16]);
    /// The 16 bytes at `rows[l] + at` of each lane `l`: vector `j` holds bytes
    /// `4j..4j + 4` (loads and shuffles: a gather costs several times more).
    unsafe fn words4(rows: &[*const u8; 16], at: usize) -> [Self::V; 4];
    /// Each lane's low (`HIGH` false) or high 16 bits as an IEEE half, as f32.
    unsafe fn halves<const HIGH: bool>(v: Self::V) -> Self::F;
    /// Each byte's low nibble (`HIGH` false) or high nibble.
    unsafe fn nibbles<const HIGH: bool>(v: Self::V) -> Self::V;
    /// `(v >> shift) & mask` per 32-bit lane (a logical shift).
    unsafe fn field(v: Self::V, shift: u32, mask: i32) -> Self::V;
    /// `v << shift` per 32-bit lane.
    unsafe fn shl(v: Self::V, shift: u32) -> Self::V;
    unsafe fn or(a: Self::V, b: Self::V) -> Self::V;
    /// Byte `byte` (0..4) of each lane as a signed integer.
    unsafe fn sbyte(v: Self::V, byte: u32) -> Self::V;
    /// Each lane as an integer converted to f32 (exact below 2^24).
    unsafe fn to_f32(v: Self::V) -> Self::F;
    unsafe fn mulf(a: Self::F, b: Self::F) -> Self::F;
    unsafe fn negf(a: Self::F) -> Self::F;
}

/// Plain Rust, eight lanes: what a CPU without AVX2 runs, and the reference.
pub(super) struct Portable8;

impl Panel for Portable8 {
    type S = super::gguf_simd::Portable;
    type V = [[u8; 4]; 8];
    type F = [f32; 8];
    const LANES: usize = 8;
    const MAX_GROUP: usize = 8;
    const SIGNED_BIAS: i32 = 0;
    fn slot(i: usize) -> usize {
        i
    }
    #[inline(always)]
    unsafe fn transpose(rows: &[[u8; 32]; 16]) -> [[[u8; 4]; 8]; 8] {
        std::array::from_fn(|j| {
            std::array::from_fn(|i| std::array::from_fn(|t| rows[i][4 * j + t]))
        })
    }
    #[inline(always)]
    unsafe fn signed(w: [[u8; 4]; 8]) -> [[u8; 4]; 8] {
        w
    }
    #[inline(always)]
    unsafe fn izero() -> [[u8; 4]; 8] {
        [[0; 4]; 8]
    }
    #[inline(always)]
    unsafe fn dot(acc: [[u8; 4]; 8], w: [[u8; 4]; 8], x: i32) -> [[u8; 4]; 8] {
        dot4(acc, w, x, i32::from)
    }
    #[inline(always)]
    unsafe fn dot_s(acc: [[u8; 4]; 8], w: [[u8; 4]; 8], x: i32) -> [[u8; 4]; 8] {
        dot4(acc, w, x, |b| i32::from(b as i8))
    }
    #[inline(always)]
    unsafe fn isub(a: [[u8; 4]; 8], b: i32) -> [[u8; 4]; 8] {
        a.map(|l| (i32::from_le_bytes(l) - b).to_le_bytes())
    }
    #[inline(always)]
    unsafe fn fzero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn loadf(p: *const f32) -> [f32; 8] {
        // SAFETY: the caller's `p` points at eight readable f32.
        unsafe { p.cast::<[f32; 8]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn acc(acc: [f32; 8], i: [[u8; 4]; 8], scale: [f32; 8], dx: f32) -> [f32; 8] {
        std::array::from_fn(|l| acc[l] + i32::from_le_bytes(i[l]) as f32 * (scale[l] * dx))
    }
    #[inline(always)]
    unsafe fn acc_off(acc: [f32; 8], offset: [f32; 8], sx: f32) -> [f32; 8] {
        std::array::from_fn(|l| acc[l] + offset[l] * sx)
    }
    #[inline(always)]
    unsafe fn store(v: [f32; 8], out: &mut [f32; 16]) {
        out[..8].copy_from_slice(&v);
    }
    #[inline(always)]
    unsafe fn words4(rows: &[*const u8; 16], at: usize) -> [[[u8; 4]; 8]; 4] {
        // SAFETY: the caller's rows hold 16 readable bytes at `at`.
        std::array::from_fn(|j| {
            std::array::from_fn(|l| unsafe {
                rows[l].add(at + 4 * j).cast::<[u8; 4]>().read_unaligned()
            })
        })
    }
    #[inline(always)]
    unsafe fn halves<const HIGH: bool>(v: [[u8; 4]; 8]) -> [f32; 8] {
        let at = if HIGH { 2 } else { 0 };
        v.map(|l| super::gguf::f16_to_f32(u16::from_le_bytes([l[at], l[at + 1]])))
    }
    #[inline(always)]
    unsafe fn nibbles<const HIGH: bool>(v: [[u8; 4]; 8]) -> [[u8; 4]; 8] {
        v.map(|l| l.map(|b| if HIGH { b >> 4 } else { b & 0x0f }))
    }
    #[inline(always)]
    unsafe fn field(v: [[u8; 4]; 8], shift: u32, mask: i32) -> [[u8; 4]; 8] {
        v.map(|l| ((u32::from_le_bytes(l) >> shift) & mask as u32).to_le_bytes())
    }
    #[inline(always)]
    unsafe fn shl(v: [[u8; 4]; 8], shift: u32) -> [[u8; 4]; 8] {
        v.map(|l| (u32::from_le_bytes(l) << shift).to_le_bytes())
    }
    #[inline(always)]
    unsafe fn or(a: [[u8; 4]; 8], b: [[u8; 4]; 8]) -> [[u8; 4]; 8] {
        std::array::from_fn(|l| std::array::from_fn(|t| a[l][t] | b[l][t]))
    }
    #[inline(always)]
    unsafe fn sbyte(v: [[u8; 4]; 8], byte: u32) -> [[u8; 4]; 8] {
        v.map(|l| i32::from(l[byte as usize] as i8).to_le_bytes())
    }
    #[inline(always)]
    unsafe fn to_f32(v: [[u8; 4]; 8]) -> [f32; 8] {
        v.map(|l| i32::from_le_bytes(l) as f32)
    }
    #[inline(always)]
    unsafe fn mulf(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l] * b[l])
    }
    #[inline(always)]
    unsafe fn negf(a: [f32; 8]) -> [f32; 8] {
        a.map(|v| -v)
    }
}

/// `acc` (i32 lanes as bytes) plus each lane's four `w` bytes, read by `weight`,
/// times the four signed bytes of `x`.
#[inline(always)]
fn dot4(acc: [[u8; 4]; 8], w: [[u8; 4]; 8], x: i32, weight: impl Fn(u8) -> i32) -> [[u8; 4]; 8] {
    let x = x.to_le_bytes().map(|b| i32::from(b as i8));
    std::array::from_fn(|l| {
        let sum: i32 = (0..4).map(|t| weight(w[l][t]) * x[t]).sum();
        (i32::from_le_bytes(acc[l]) + sum).to_le_bytes()
    })
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Ymm, Zmm, AVX_VNNI, MADDUBS};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::gguf_simd::X86;
    use super::Panel;

    /// The dot product's instructions: AVX2 `vpmaddubsw` + `vpmaddwd`.
    pub(in super::super) const MADDUBS: u8 = 0;
    /// AVX-VNNI's `vpdpbusd` (VEX).
    pub(in super::super) const AVX_VNNI: u8 = 1;

    /// Eight lanes of 256-bit AVX2, the dot product by `DOT`. Call only from code
    /// compiled with AVX2, FMA and F16C, and AVX-VNNI for `AVX_VNNI`.
    pub(in super::super) struct Ymm<const DOT: u8>;

    // SAFETY (all methods of both impls): run only inside the `gguf_int`
    // wrappers compiled with the features named above, on CPUs that have them;
    // `loadf` reads the lanes the caller guarantees readable.
    impl<const DOT: u8> Panel for Ymm<DOT> {
        type S = X86;
        type V = __m256i;
        type F = __m256;
        const LANES: usize = 8;
        const MAX_GROUP: usize = 8;
        // `vpdpbusd` takes weights unsigned: signed ones get 128 added (their
        // top bit flipped); `vpmaddubsw` takes their sign off instead
        const SIGNED_BIAS: i32 = if DOT == MADDUBS { 0 } else { 128 };
        fn slot(i: usize) -> usize {
            i
        }
        #[inline(always)]
        unsafe fn transpose(rows: &[__m256i; 16]) -> [__m256i; 8] {
            unsafe {
                // an 8 x 8 transpose of 32-bit words: within 128-bit halves, then
                // the halves across rows 0..4 and 4..8
                let [a0, a1, a2, a3, a4, a5, a6, a7, ..] = *rows;
                let (t0, t1) = (_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
                let (t2, t3) = (_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
                let (t4, t5) = (_mm256_unpacklo_epi32(a4, a5), _mm256_unpackhi_epi32(a4, a5));
                let (t6, t7) = (_mm256_unpacklo_epi32(a6, a7), _mm256_unpackhi_epi32(a6, a7));
                let lo = [
                    _mm256_unpacklo_epi64(t0, t2),
                    _mm256_unpackhi_epi64(t0, t2),
                    _mm256_unpacklo_epi64(t1, t3),
                    _mm256_unpackhi_epi64(t1, t3),
                ];
                let hi = [
                    _mm256_unpacklo_epi64(t4, t6),
                    _mm256_unpackhi_epi64(t4, t6),
                    _mm256_unpacklo_epi64(t5, t7),
                    _mm256_unpackhi_epi64(t5, t7),
                ];
                [
                    _mm256_permute2x128_si256::<0x20>(lo[0], hi[0]),
                    _mm256_permute2x128_si256::<0x20>(lo[1], hi[1]),
                    _mm256_permute2x128_si256::<0x20>(lo[2], hi[2]),
                    _mm256_permute2x128_si256::<0x20>(lo[3], hi[3]),
                    _mm256_permute2x128_si256::<0x31>(lo[0], hi[0]),
                    _mm256_permute2x128_si256::<0x31>(lo[1], hi[1]),
                    _mm256_permute2x128_si256::<0x31>(lo[2], hi[2]),
                    _mm256_permute2x128_si256::<0x31>(lo[3], hi[3]),
                ]
            }
        }
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
        unsafe fn loadf(p: *const f32) -> __m256 {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn acc(acc: __m256, i: __m256i, scale: __m256, dx: f32) -> __m256 {
            unsafe {
                let s = _mm256_mul_ps(scale, _mm256_set1_ps(dx));
                _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(i), s))
            }
        }
        #[inline(always)]
        unsafe fn acc_off(acc: __m256, offset: __m256, sx: f32) -> __m256 {
            unsafe { _mm256_add_ps(acc, _mm256_mul_ps(offset, _mm256_set1_ps(sx))) }
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
        unsafe fn halves<const HIGH: bool>(v: __m256i) -> __m256 {
            unsafe {
                // each lane's half to the low 8 bytes of its 128-bit lane, then
                // the two 8-byte groups side by side
                let pick = if HIGH {
                    _mm256_setr_epi8(
                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10,
                        11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                    )
                } else {
                    _mm256_setr_epi8(
                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9,
                        12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
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
    pub(in super::super) struct Zmm;

    /// Two rows side by side.
    #[inline(always)]
    unsafe fn pair(a: __m256i, b: __m256i) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b) }
    }

    /// Four pairs of rows with 32-bit words, then 64-bit pairs, interleaved within
    /// 128-bit lanes: result `j` holds word `j` of rows 0, 2, 4, 6 in lane 0,
    /// word `j + 4` of them in lane 1, and of rows 1, 3, 5, 7 in lanes 2 and 3.
    #[inline(always)]
    unsafe fn half(a0: __m512i, a1: __m512i, a2: __m512i, a3: __m512i) -> [__m512i; 4] {
        unsafe {
            let (t0, t1) = (_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
            let (t2, t3) = (_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
            [
                _mm512_unpacklo_epi64(t0, t2),
                _mm512_unpackhi_epi64(t0, t2),
                _mm512_unpacklo_epi64(t1, t3),
                _mm512_unpackhi_epi64(t1, t3),
            ]
        }
    }

    impl Panel for Zmm {
        type S = X86;
        type V = __m512i;
        type F = __m512;
        const LANES: usize = 16;
        const MAX_GROUP: usize = 16;
        const SIGNED_BIAS: i32 = 128;
        fn slot(i: usize) -> usize {
            // see `transpose`: rows 0, 2, 4, 6 land in lanes 0..4, rows 1, 3, 5, 7
            // in 4..8, and rows 8..16 likewise in 8..16
            (i & 8) | ((i & 1) << 2) | ((i & 7) >> 1)
        }
        #[inline(always)]
        unsafe fn transpose(rows: &[__m256i; 16]) -> [__m512i; 8] {
            unsafe {
                // rows side by side in pairs, then 32-bit words and 64-bit pairs
                // interleaved within 128-bit lanes, then those lanes gathered
                // across the two halves (rows 0..8 and 8..16)
                let [r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15] = *rows;
                let u = half(pair(r0, r1), pair(r2, r3), pair(r4, r5), pair(r6, r7));
                let v = half(pair(r8, r9), pair(r10, r11), pair(r12, r13), pair(r14, r15));
                [
                    _mm512_shuffle_i32x4::<0x88>(u[0], v[0]),
                    _mm512_shuffle_i32x4::<0x88>(u[1], v[1]),
                    _mm512_shuffle_i32x4::<0x88>(u[2], v[2]),
                    _mm512_shuffle_i32x4::<0x88>(u[3], v[3]),
                    _mm512_shuffle_i32x4::<0xdd>(u[0], v[0]),
                    _mm512_shuffle_i32x4::<0xdd>(u[1], v[1]),
                    _mm512_shuffle_i32x4::<0xdd>(u[2], v[2]),
                    _mm512_shuffle_i32x4::<0xdd>(u[3], v[3]),
                ]
            }
        }
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
        unsafe fn loadf(p: *const f32) -> __m512 {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn acc(acc: __m512, i: __m512i, scale: __m512, dx: f32) -> __m512 {
            unsafe {
                let s = _mm512_mul_ps(scale, _mm512_set1_ps(dx));
                _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(i), s))
            }
        }
        #[inline(always)]
        unsafe fn acc_off(acc: __m512, offset: __m512, sx: f32) -> __m512 {
            unsafe { _mm512_add_ps(acc, _mm512_mul_ps(offset, _mm512_set1_ps(sx))) }
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
}
