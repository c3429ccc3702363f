//! Each GGUF block type as the integer kernel sees it, a panel of 8 or 16 weight
//! rows at once: per 32-element sub-block, 32 small integers `q` (unsigned, but
//! signed for Q8_0), a float scale per 16-element half, an offset per half and an
//! integer bias, so that the weights
//! are `w = scale · (q - bias) + offset` (Q4_1: `offset = m`; Q4_K: `-dmin ·
//! min_j`; Q4_0: `bias = 8`). The kernel then needs `Σ q·x_q` (an integer dot
//! product) and the activation block's `dx · Σ x_q` (`gguf_int::Q8Rows`), which
//! `bias` and `offset` multiply. The reference decoding is `gguf::decode_row`.

use super::gguf_panel::Panel;

pub(super) trait IntBlock {
    /// Bytes of one block.
    const BYTES: usize;
    /// 32-element sub-blocks per block.
    const SUBS: usize = 1;
    /// Whether `q` is signed (Q8_0), else unsigned and at most 63.
    const SIGNED: bool = false;
    /// Subtracted from every `q` (as `BIAS · dx · Σ x_q`, a power of two times
    /// a float: exact).
    const BIAS: i32 = 0;
    /// Whether both halves share a scale and offset (all but Q6_K).
    const UNIFORM: bool = true;
    /// Whether the offset is ever non-zero (Q4_1, Q5_1, Q4_K, Q5_K).
    const OFFSET: bool = true;
    /// The byte of a lone f16 scale `d` in the block (`gguf_panels` moves it out
    /// of the body), if the type has one.
    const D_AT: Option<usize> = None;
    /// Calls `f(s, w, scale, offset)` for each sub-block `s` of block `b` of the
    /// panel's lanes (`src`), unpacked for the whole panel at once: `w[j]` holds
    /// quants `4j..4j + 4` of each lane (as `Panel::words4` gives bytes), then
    /// the scales and offsets by half: `w = scale · (q - BIAS) + offset`.
    ///
    /// SAFETY (for the caller): `src` holds block `b` of each lane, and the
    /// instructions of `P` are available.
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    );
}

/// Where a panel's blocks are read: rows in the GGUF layout (`Rows`) or the panel
/// layout (`Panels`); both give the same vectors.
pub(super) trait Source<P: Panel>: Copy {
    /// Bytes `o..o + 16` of block `b` of each lane, as `Panel::words4` gives them
    /// (for a block with a lone `d`, `o` past it).
    unsafe fn words4<B: IntBlock>(self, b: usize, o: usize) -> [P::V; 4];
    /// Each lane's lone `d` (`B::D_AT`) of block `b`, as f32.
    unsafe fn d<B: IntBlock>(self, b: usize) -> P::F;
}

/// The GGUF layout: one pointer per lane to its row.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a>(pub &'a [*const u8; 16]);

impl<P: Panel> Source<P> for Rows<'_> {
    #[inline(always)]
    unsafe fn words4<B: IntBlock>(self, b: usize, o: usize) -> [P::V; 4] {
        // SAFETY: the caller's rows hold block `b`, and `o + 16 <= B::BYTES`.
        unsafe { P::words4(self.0, b * B::BYTES + o) }
    }
    #[inline(always)]
    unsafe fn d<B: IntBlock>(self, b: usize) -> P::F {
        let at = b * B::BYTES;
        // SAFETY: as `words4`: a `d` at the start is the low half of the first
        // word; one at the end the high half of the block's last word
        unsafe {
            match B::D_AT {
                Some(0) => P::halves::<false>(P::words4(self.0, at)[0]),
                _ => P::halves::<true>(P::words4(self.0, at + B::BYTES - 16)[3]),
            }
        }
    }
}

/// The panel layout (`gguf_panels`): the panel's first byte, and the first of the
/// 16 lanes this `P` takes (0, or 8 for the second half on eight lanes).
#[derive(Clone, Copy)]
pub(super) struct Panels {
    pub base: *const u8,
    pub lane: usize,
}

impl<P: Panel> Source<P> for Panels {
    #[inline(always)]
    unsafe fn words4<B: IntBlock>(self, b: usize, o: usize) -> [P::V; 4] {
        let word = (o - if B::D_AT == Some(0) { 2 } else { 0 }) / 4;
        // SAFETY: the caller's panel holds block `b` (16 · BYTES bytes from
        // `b · 16 · BYTES`); words `word..word + 4` lie in its body.
        unsafe {
            let at = self.base.add(16 * b * B::BYTES + 4 * self.lane + 64 * word);
            // written out, not `array::from_fn`: its closure is compiled for the
            // baseline ISA, so in a large caller (Q6_K's) the loads became calls
            [
                P::load(at),
                P::load(at.add(64)),
                P::load(at.add(128)),
                P::load(at.add(192)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn d<B: IntBlock>(self, b: usize) -> P::F {
        // SAFETY: as `words4`; the 16 `d`s follow the body's 16 · (BYTES - 2) bytes.
        unsafe {
            let at = self.base.add(16 * b * B::BYTES + 16 * (B::BYTES - 2));
            P::load_halves(at.add(2 * self.lane))
        }
    }
}

/// Sixteen quant bytes at `o` of each lane's block `b` as 32 nibbles (lows, then
/// highs), transposed.
#[inline(always)]
unsafe fn nibble_panel<P: Panel, S: Source<P>, B: IntBlock>(
    src: S,
    b: usize,
    o: usize,
) -> [P::V; 8] {
    // SAFETY: the caller's blocks hold 16 bytes at `o`.
    let raw = unsafe { src.words4::<B>(b, o) };
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

/// The fifth bits `qh` of each lane (bit `i` for quant `i`) added to the nibbles
/// `w` as 16 (Q5_0, Q5_1).
#[inline(always)]
unsafe fn fifth_bits<P: Panel>(w: &mut [P::V; 8], qh: P::V) {
    for (t, w) in w.iter_mut().enumerate() {
        // byte b of w[t] is quant 4t + b (the nibble panel's order)
        for b in 0..4u32 {
            // SAFETY: the caller runs on `P`'s instructions.
            unsafe {
                let bit = P::field(qh, 4 * t as u32 + b, 1);
                *w = P::or(*w, P::shl(bit, 8 * b + 4));
            }
        }
    }
}

pub(super) struct Q8_0;
impl IntBlock for Q8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    const OFFSET: bool = false;
    const D_AT: Option<usize> = Some(0);
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let [w0, w1, w2, w3] = src.words4::<Self>(b, 2);
            let [w4, w5, w6, w7] = src.words4::<Self>(b, 18);
            let d = src.d::<Self>(b);
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
    const D_AT: Option<usize> = Some(0);
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let d = src.d::<Self>(b);
            f(
                0,
                &nibble_panel::<P, S, Self>(src, b, 2),
                [d; 2],
                [P::fzero(); 2],
            )
        }
    }
}

pub(super) struct Q4_1;
impl IntBlock for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let dm = src.words4::<Self>(b, 0)[0];
            let (d, m) = (P::halves::<false>(dm), P::halves::<true>(dm));
            f(0, &nibble_panel::<P, S, Self>(src, b, 4), [d; 2], [m; 2])
        }
    }
}

pub(super) struct Q5_0;
impl IntBlock for Q5_0 {
    const BYTES: usize = 22;
    const BIAS: i32 = 16;
    const OFFSET: bool = false;
    const D_AT: Option<usize> = Some(0);
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let d = src.d::<Self>(b);
            let mut w = nibble_panel::<P, S, Self>(src, b, 6);
            fifth_bits::<P>(&mut w, src.words4::<Self>(b, 2)[0]);
            f(0, &w, [d; 2], [P::fzero(); 2])
        }
    }
}

pub(super) struct Q5_1;
impl IntBlock for Q5_1 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let dm = src.words4::<Self>(b, 0)[0];
            let (d, m) = (P::halves::<false>(dm), P::halves::<true>(dm));
            let mut w = nibble_panel::<P, S, Self>(src, b, 8);
            fifth_bits::<P>(&mut w, src.words4::<Self>(b, 4)[0]);
            f(0, &w, [d; 2], [m; 2])
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
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            // d and dmin, then the twelve bytes of 6-bit scales and mins
            // (`gguf::scale_min_k4`, lane by lane)
            let [dm, s0, s1, s2] = src.words4::<Self>(b, 0);
            let (d, dmin) = (P::halves::<false>(dm), P::halves::<true>(dm));
            let qh = if FIFTH {
                let [a0, a1, a2, a3] = src.words4::<Self>(b, 16);
                let [a4, a5, a6, a7] = src.words4::<Self>(b, 32);
                [a0, a1, a2, a3, a4, a5, a6, a7]
            } else {
                [P::izero(); 8]
            };
            for g in 0..4 {
                let [r0, r1, r2, r3] = src.words4::<Self>(b, Self::BYTES - 128 + 32 * g);
                let [r4, r5, r6, r7] = src.words4::<Self>(b, Self::BYTES - 112 + 32 * g);
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
    const D_AT: Option<usize> = Some(208);
    #[inline(always)]
    unsafe fn panel<P: Panel, S: Source<P>>(
        src: S,
        b: usize,
        mut f: impl FnMut(usize, &[P::V; 8], [P::F; 2], [P::F; 2]),
    ) {
        unsafe {
            let scales = src.words4::<Self>(b, 192);
            let d = src.d::<Self>(b);
            for h in 0..2 {
                let [q0, q1, q2, q3] = src.words4::<Self>(b, 128 + h * 32);
                let [q4, q5, q6, q7] = src.words4::<Self>(b, 144 + h * 32);
                let qh = [q0, q1, q2, q3, q4, q5, q6, q7];
                for half in 0..2 {
                    let [l0, l1, l2, l3] = src.words4::<Self>(b, h * 64 + half * 32);
                    let [l4, l5, l6, l7] = src.words4::<Self>(b, h * 64 + half * 32 + 16);
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
