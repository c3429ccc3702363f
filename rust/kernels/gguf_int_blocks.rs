//! Each GGUF block type as the integer kernel sees it: per 32-element sub-block,
//! 32 small integers `q` (unsigned; signed for Q8_0, Q4_0 and Q5_0), a float scale
//! per 16-element half and an offset per half, so that the weights are
//! `w = scale · q + offset` (Q4_1: `offset = m`; Q4_K: `-dmin · min_j`; ...).
//! The kernel then needs `Σ q·x_q` (an integer dot product) and the activation
//! block's `Σ x_q` (`gguf_int::Q8Rows`). The reference decoding is `gguf::decode_row`.

use super::gguf::scale_min_k4;
use super::gguf_simd::IntSimd;

/// One sub-block of 32 weights: `w[i] = scale[l] · q[i] + offset[h]`, with `l = i
/// / 4` the lane of a dot product that sums `q[i]` and `h = i / 16` the half.
pub(super) struct Sub<S: IntSimd> {
    pub q: S::Q,
    pub scale: S::F,
    pub offset: [f32; 2],
}

pub(super) trait IntBlock {
    /// Bytes of one block.
    const BYTES: usize;
    /// 32-element sub-blocks per block.
    const SUBS: usize = 1;
    /// Whether `q` is signed (Q8_0, Q4_0, Q5_0), else unsigned and at most 63.
    const SIGNED: bool = false;
    /// Whether both halves share a scale and offset (all but Q6_K).
    const UNIFORM: bool = true;
    /// Whether the offset is ever non-zero (all but Q8_0, Q4_0, Q5_0).
    const OFFSET: bool = true;
    /// Calls `f(s, sub)` for each sub-block `s` of the block at `b`, in order.
    ///
    /// SAFETY (for the caller): `b` points at `BYTES` readable bytes, and the
    /// instructions of `S` are available.
    unsafe fn each<S: IntSimd>(b: *const u8, f: impl FnMut(usize, Sub<S>));
}

/// A sub-block with one scale (in every lane) and offset.
#[inline(always)]
fn sub<S: IntSimd>(q: S::Q, scale: S::F, offset: f32) -> Sub<S> {
    Sub {
        q,
        scale,
        offset: [offset; 2],
    }
}

pub(super) struct Q8_0;
impl IntBlock for Q8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        // SAFETY (every `each`): the reads lie within the block's `BYTES` (the
        // offsets below are those of llama.cpp's block layouts).
        unsafe { f(0, sub(S::load(b.add(2)), S::halfv(b), 0.0)) }
    }
}

/// The offset types with `w = d · (q - o)` (Q4_0, Q5_0) take `q - o` as signed
/// integers: no float offset, and only the broadcast `d`.
pub(super) struct Q4_0;
impl IntBlock for Q4_0 {
    const BYTES: usize = 18;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let q = S::sub8(S::nibbles(b.add(2)), S::splat(8));
            f(0, sub(q, S::halfv(b), 0.0))
        }
    }
}

pub(super) struct Q4_1;
impl IntBlock for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe { f(0, sub(S::nibbles(b.add(4)), S::halfv(b), S::half(b.add(2)))) }
    }
}

pub(super) struct Q5_0;
impl IntBlock for Q5_0 {
    const BYTES: usize = 22;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let qh = b.add(2).cast::<u32>().read_unaligned();
            let q = S::or(S::nibbles(b.add(6)), S::bits(u32::from_le(qh), 0x10));
            f(0, sub(S::sub8(q, S::splat(16)), S::halfv(b), 0.0))
        }
    }
}

pub(super) struct Q5_1;
impl IntBlock for Q5_1 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let qh = b.add(4).cast::<u32>().read_unaligned();
            let q = S::or(S::nibbles(b.add(8)), S::bits(u32::from_le(qh), 0x10));
            f(0, sub(q, S::halfv(b), S::half(b.add(2))))
        }
    }
}

/// Q4_K (`FIFTH` false) and Q5_K (`FIFTH` true): 256 weights in eight sub-blocks,
/// each with a 6-bit scale and min under the block's `d` and `dmin`.
pub(super) struct QK4<const FIFTH: bool>;
impl<const FIFTH: bool> IntBlock for QK4<FIFTH> {
    const BYTES: usize = if FIFTH { 176 } else { 144 };
    const SUBS: usize = 8;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let (d, dmin) = (S::half(b), S::half(b.add(2)));
            let (sc, mn) = scale_min_k4(&*b.add(4).cast::<[u8; 12]>());
            let qs = b.add(Self::BYTES - 128);
            let qh = if FIFTH {
                S::load(b.add(16))
            } else {
                S::splat(0)
            };
            let low4 = S::splat(0x0f);
            for g in 0..4 {
                let v = S::load(qs.add(32 * g));
                let halves = [S::and(v, low4), S::and(S::srl16(v, 4), low4)];
                for (h, mut q) in halves.into_iter().enumerate() {
                    let j = 2 * g + h;
                    if FIFTH {
                        let bit = S::splat(1 << j);
                        let set = S::eq(S::and(qh, bit), bit);
                        q = S::or(q, S::and(set, S::splat(0x10)));
                    }
                    let scale = S::splatf(d * f32::from(sc[j]));
                    f(j, sub(q, scale, -(dmin * f32::from(mn[j]))));
                }
            }
        }
    }
}

/// Q6_K: 256 weights of 6 bits (4 low in `ql`, 2 high in `qh`), minus 32, in
/// sixteen groups of 16 with int8 scales under the block's `d`.
pub(super) struct Q6K;
impl IntBlock for Q6K {
    const BYTES: usize = 210;
    const SUBS: usize = 8;
    const UNIFORM: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let d = S::half(b.add(208));
            let scales = &*b.add(192).cast::<[u8; 16]>();
            let low4 = S::splat(0x0f);
            for s in 0..8 {
                // elements 32s.. are, in their 128-half h, the quarter c
                let (h, c) = (s / 4, s % 4);
                let l = S::load(b.add(h * 64 + (c % 2) * 32));
                let low = S::and(if c < 2 { l } else { S::srl16(l, 4) }, low4);
                let high = S::and(
                    S::srl16(S::load(b.add(128 + h * 32)), 2 * c as u32),
                    S::splat(3),
                );
                let q = S::or(low, S::sll16_4(high));
                let scale = [2 * s, 2 * s + 1].map(|g| d * f32::from(scales[g] as i8));
                f(
                    s,
                    Sub {
                        q,
                        scale: S::halves(scale[0], scale[1]),
                        offset: scale.map(|v| -32.0 * v),
                    },
                );
            }
        }
    }
}
