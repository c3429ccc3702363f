//! The GGUF integer kernel's dot products with output features in the lanes: a
//! panel of `LANES` weight rows (8 or 16) has one sub-block of each row unpacked
//! (`gguf_int_blocks`) and transposed so that vector `j` holds quant bytes
//! `4j..4j + 4` of every row; each activation row then takes eight
//! `vpdpbusd`s (or `vpmaddubsw` + `vpmaddwd`) with its four bytes broadcast, and
//! the panel's exact integer sums meet the scales as f32 vectors. Per output the
//! float steps are one chain of fused multiply-adds (`gguf_int::sub_dot`): the
//! two halves' `f32(Σ) · dx`, less `bias · sx`, times the block's scale into
//! the accumulator, then `offset · sx`; so every ISA, and a row in any batch,
//! gives the portable path's bits (`tests_gguf_int.rs`). Five vector float
//! steps a block and activation row beside the eight dot products: the float
//! side had been twice the integer one at 64 rows.
//!
//! Dotting lanes with lanes (one weight row at a time, as before) left every
//! block's eight partial sums to combine per row, six vector instructions per
//! block and row; here it is about one per block and row at 16 rows.

/// What `gguf_int` computes a panel with.
pub(super) trait Panel {
    /// `LANES` lanes of 32 bits: four quant bytes, or an i32 sum.
    type V: Copy;
    /// `LANES` f32 lanes.
    type F: Copy;
    const LANES: usize;
    /// The most activation rows sharing one unpacked panel below 32 rows: their
    /// accumulators, the eight weight vectors and a few temporaries fit the
    /// registers.
    const MAX_GROUP: usize;
    /// What `signed` adds to each weight, to be subtracted as `SIGNED_BIAS · Σ x_q`.
    const SIGNED_BIAS: i32;
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
    /// `f32(i) · dx`, rounded.
    unsafe fn scaled(i: Self::V, dx: f32) -> Self::F;
    /// `f32(i) · dx + t`, fused (one rounding).
    unsafe fn scaled_add(t: Self::F, i: Self::V, dx: f32) -> Self::F;
    /// `a · s + c` per lane, fused.
    unsafe fn fma_s(a: Self::F, s: f32, c: Self::F) -> Self::F;
    /// `a · b + c` per lane, fused.
    unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `s` in every lane.
    unsafe fn splat(s: f32) -> Self::F;
    /// The lanes into `out[..LANES]`.
    unsafe fn store(v: Self::F, out: &mut [f32; 16]);
    /// The 16 bytes at `rows[l] + at` of each lane `l`: vector `j` holds bytes
    /// `4j..4j + 4` (loads and shuffles: a gather costs several times more).
    unsafe fn words4(rows: &[*const u8; 16], at: usize) -> [Self::V; 4];
    /// `LANES` 32-bit words at `p` (the panel layout's one load for 16 lanes).
    unsafe fn load(p: *const u8) -> Self::V;
    /// `LANES` IEEE halves at `p`, as f32.
    unsafe fn load_halves(p: *const u8) -> Self::F;
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
    type V = [[u8; 4]; 8];
    type F = [f32; 8];
    const LANES: usize = 8;
    const MAX_GROUP: usize = 8;
    const SIGNED_BIAS: i32 = 0;
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
    unsafe fn scaled(i: [[u8; 4]; 8], dx: f32) -> [f32; 8] {
        i.map(|l| i32::from_le_bytes(l) as f32 * dx)
    }
    #[inline(always)]
    unsafe fn scaled_add(t: [f32; 8], i: [[u8; 4]; 8], dx: f32) -> [f32; 8] {
        std::array::from_fn(|l| (i32::from_le_bytes(i[l]) as f32).mul_add(dx, t[l]))
    }
    #[inline(always)]
    unsafe fn fma_s(a: [f32; 8], s: f32, c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l].mul_add(s, c[l]))
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    #[inline(always)]
    unsafe fn splat(s: f32) -> [f32; 8] {
        [s; 8]
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
    unsafe fn load(p: *const u8) -> [[u8; 4]; 8] {
        // SAFETY: the caller's `p` holds 32 readable bytes.
        std::array::from_fn(|l| unsafe { p.add(4 * l).cast::<[u8; 4]>().read_unaligned() })
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> [f32; 8] {
        // SAFETY: the caller's `p` holds 16 readable bytes.
        std::array::from_fn(|l| unsafe {
            super::gguf::f16_to_f32(p.add(2 * l).cast::<u16>().read_unaligned())
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
pub(super) use super::gguf_panel_x86::{Ymm, Zmm, AVX_VNNI, MADDUBS};
