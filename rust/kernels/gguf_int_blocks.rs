//! Each GGUF block type as the integer kernel sees it: per 32-element sub-block,
//! 32 small integers `q` (unsigned, but signed for Q8_0), a float scale per
//! 16-element half, an offset per half and an integer bias, so that the weights
//! are `w = scale · (q - bias) + offset` (Q4_1: `offset = m`; Q4_K: `-dmin ·
//! min_j`; Q4_0: `bias = 8`). The kernel then needs `Σ q·x_q` (an integer dot
//! product), `bias · Σ x_q` (an exact integer) and the activation block's
//! `dx · Σ x_q` (`gguf_int::Q8Rows`). The reference decoding is `gguf::decode_row`.

use super::gguf::scale_min_k4;
use super::gguf_panel::Panel;
use super::gguf_simd::IntSimd;

/// One sub-block of 32 weights: `w[i] = scale[h] · (q[i] - BIAS) + offset[h]`,
/// with `h = i / 16` the half.
pub(super) struct Sub<S: IntSimd> {
    pub q: S::Q,
    pub scale: [f32; 2],
    pub offset: [f32; 2],
}

pub(super) trait IntBlock {
    /// Bytes of one block.
    const BYTES: usize;
    /// 32-element sub-blocks per block.
    const SUBS: usize = 1;
    /// Whether `q` is signed (Q8_0), else unsigned and at most 63.
    const SIGNED: bool = false;
    /// Subtracted from every `q` (as `BIAS · Σ x_q`, in integers).
    const BIAS: i32 = 0;
    /// Whether both halves share a scale and offset (all but Q6_K).
    const UNIFORM: bool = true;
    /// Whether the offset is ever non-zero (Q4_1, Q5_1, Q4_K, Q5_K).
    const OFFSET: bool = true;
    /// Calls `f(s, sub)` for each sub-block `s` of the block at `b`, in order.
    ///
    /// SAFETY (for the caller): `b` points at `BYTES` readable bytes, and the
    /// instructions of `S` are available.
    unsafe fn each<S: IntSimd>(b: *const u8, f: impl FnMut(usize, Sub<S>));
    /// Whether `panel` is implemented.
    const PANEL: bool = false;
    /// Calls `f(s, w, scale, offset)` for each sub-block `s` of the blocks at
    /// `rows[l] + at` (lane `l`), unpacked for the whole panel at once (loads and
    /// shuffles, where `each` row by row costs a dozen instructions a row): `w`
    /// as `Panel::transpose` gives it, scales and offsets by half.
    ///
    /// SAFETY (for the caller): each lane's block is `BYTES` readable bytes, and
    /// the instructions of `P` are available.
    #[allow(unused_variables)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unreachable!("no panel form")
    }
}

/// Sixteen quant bytes at `at` of each lane's block as 32 nibbles (lows, then
/// highs), transposed.
#[inline(always)]
unsafe fn nibble_panel<P: Panel>(rows: &[*const u8; 16], at: usize) -> [P::V; 8] {
    // SAFETY: the caller's blocks hold 16 bytes at `at`.
    let raw = unsafe { P::words4(rows, at) };
    // SAFETY: the caller runs on `P`'s instructions.
    unsafe {
        [
            P::nibbles::<false>(raw[0]),
            P::nibbles::<false>(raw[1]),
            P::nibbles::<false>(raw[2]),
            P::nibbles::<false>(raw[3]),
            P::nibbles::<true>(raw[0]),
            P::nibbles::<true>(raw[1]),
            P::nibbles::<true>(raw[2]),
            P::nibbles::<true>(raw[3]),
        ]
    }
}

/// A sub-block with one scale and offset.
#[inline(always)]
fn sub<S: IntSimd>(q: S::Q, scale: f32, offset: f32) -> Sub<S> {
    Sub {
        q,
        scale: [scale; 2],
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
        unsafe { f(0, sub(S::load(b.add(2)), S::half(b), 0.0)) }
    }
    const PANEL: bool = true;
    #[inline(always)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let [w0, w1, w2, w3] = P::words4(rows, at + 2);
            let [w4, w5, w6, w7] = P::words4(rows, at + 18);
            let d = P::halves::<false>(P::words4(rows, at)[0]);
            f(
                0,
                &[w0, w1, w2, w3, w4, w5, w6, w7],
                [d; 2],
                [P::fzero(); 2],
            )
        }
    }
}

/// The types with `w = d · (q - o)` (Q4_0, Q5_0) keep `q` unsigned and subtract
/// `o` in integers: no float offset.
pub(super) struct Q4_0;
impl IntBlock for Q4_0 {
    const BYTES: usize = 18;
    const BIAS: i32 = 8;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe { f(0, sub(S::nibbles(b.add(2)), S::half(b), 0.0)) }
    }
    const PANEL: bool = true;
    #[inline(always)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let d = P::halves::<false>(P::words4(rows, at)[0]);
            f(0, &nibble_panel::<P>(rows, at + 2), [d; 2], [P::fzero(); 2])
        }
    }
}

pub(super) struct Q4_1;
impl IntBlock for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe { f(0, sub(S::nibbles(b.add(4)), S::half(b), S::half(b.add(2)))) }
    }
    const PANEL: bool = true;
    #[inline(always)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let dm = P::words4(rows, at)[0];
            let (d, m) = (P::halves::<false>(dm), P::halves::<true>(dm));
            f(0, &nibble_panel::<P>(rows, at + 4), [d; 2], [m; 2])
        }
    }
}

pub(super) struct Q5_0;
impl IntBlock for Q5_0 {
    const BYTES: usize = 22;
    const BIAS: i32 = 16;
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn each<S: IntSimd>(b: *const u8, mut f: impl FnMut(usize, Sub<S>)) {
        unsafe {
            let qh = b.add(2).cast::<u32>().read_unaligned();
            let q = S::or(S::nibbles(b.add(6)), S::bits(u32::from_le(qh), 0x10));
            f(0, sub(q, S::half(b), 0.0))
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
            f(0, sub(q, S::half(b), S::half(b.add(2))))
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
                    f(j, sub(q, d * f32::from(sc[j]), -(dmin * f32::from(mn[j]))));
                }
            }
        }
    }
    const PANEL: bool = true;
    #[inline(always)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            // d and dmin, then the twelve bytes of 6-bit scales and mins
            // (`gguf::scale_min_k4`, lane by lane)
            let [dm, s0, s1, s2] = P::words4(rows, at);
            let (d, dmin) = (P::halves::<false>(dm), P::halves::<true>(dm));
            let qh = if FIFTH {
                let [a0, a1, a2, a3] = P::words4(rows, at + 16);
                let [a4, a5, a6, a7] = P::words4(rows, at + 32);
                [a0, a1, a2, a3, a4, a5, a6, a7]
            } else {
                [P::izero(); 8]
            };
            for g in 0..4 {
                let [r0, r1, r2, r3] = P::words4(rows, at + Self::BYTES - 128 + 32 * g);
                let [r4, r5, r6, r7] = P::words4(rows, at + Self::BYTES - 112 + 32 * g);
                let raw = [r0, r1, r2, r3, r4, r5, r6, r7];
                for h in 0..2 {
                    let j = 2 * g + h;
                    let mut w = raw;
                    for (t, w) in w.iter_mut().enumerate() {
                        *w = if h == 0 {
                            P::nibbles::<false>(*w)
                        } else {
                            P::nibbles::<true>(*w)
                        };
                        if FIFTH {
                            let bit = P::field(qh[t], j as u32, 0x0101_0101);
                            *w = P::or(*w, P::shl(bit, 4));
                        }
                    }
                    let shift = 8 * (j as u32 % 4);
                    let (sc, mn) = if j < 4 {
                        (P::field(s0, shift, 63), P::field(s1, shift, 63))
                    } else {
                        let lo = P::field(s2, shift, 0x0f);
                        let hi = P::shl(P::field(s0, shift + 6, 3), 4);
                        let mlo = P::field(s2, shift + 4, 0x0f);
                        let mhi = P::shl(P::field(s1, shift + 6, 3), 4);
                        (P::or(lo, hi), P::or(mlo, mhi))
                    };
                    let scale = P::mulf(d, P::to_f32(sc));
                    let offset = P::negf(P::mulf(dmin, P::to_f32(mn)));
                    f(j, &w, [scale; 2], [offset; 2]);
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
    const BIAS: i32 = 32;
    const UNIFORM: bool = false;
    const OFFSET: bool = false;
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
                        scale,
                        offset: [0.0; 2],
                    },
                );
            }
        }
    }
    const PANEL: bool = true;
    #[inline(always)]
    unsafe fn panel<P: Panel>(
        rows: &[*const u8; 16],
        at: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let scales = P::words4(rows, at + 192);
            // bytes 206..210: `d` is the high half of the last word
            let d = P::halves::<true>(P::words4(rows, at + 194)[3]);
            for h in 0..2 {
                let [q0, q1, q2, q3] = P::words4(rows, at + 128 + h * 32);
                let [q4, q5, q6, q7] = P::words4(rows, at + 144 + h * 32);
                let qh = [q0, q1, q2, q3, q4, q5, q6, q7];
                for half in 0..2 {
                    let [l0, l1, l2, l3] = P::words4(rows, at + h * 64 + half * 32);
                    let [l4, l5, l6, l7] = P::words4(rows, at + h * 64 + half * 32 + 16);
                    let low = [l0, l1, l2, l3, l4, l5, l6, l7];
                    // quarters c = half (low nibbles) and c = half + 2 (high)
                    for c in [half, half + 2] {
                        let s = 4 * h + c;
                        let mut w = low;
                        for (t, w) in w.iter_mut().enumerate() {
                            let l = if c < 2 {
                                P::nibbles::<false>(*w)
                            } else {
                                P::nibbles::<true>(*w)
                            };
                            let high = P::field(qh[t], 2 * c as u32, 0x0303_0303);
                            *w = P::or(l, P::shl(high, 4));
                        }
                        let scale = [2 * s, 2 * s + 1]
                            .map(|g| P::mulf(d, P::to_f32(P::sbyte(scales[g / 4], g as u32 % 4))));
                        f(s, &w, scale, [P::fzero(); 2]);
                    }
                }
            }
        }
    }
}
