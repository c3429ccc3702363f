//! The per-row building blocks, written as plain loops over fixed-width lane
//! arrays that the compiler vectorises (with AVX2 + FMA when the row function is
//! instantiated under `#[target_feature]`, see `mod.rs`). NaN is ignored
//! everywhere: every comparison with it is false, so it is never the maximum,
//! never a candidate and contributes no probability mass.

/// Multiply-add as one fused instruction where the row function's instance
/// has it (`Fused`), else as two (`Split`): the compiler never fuses `a * b + c`
/// by itself, and `mul_add` without hardware FMA is a slow library call.
pub(super) trait Arith {
    fn fma(a: f32, b: f32, c: f32) -> f32;
}

pub(super) struct Fused;
pub(super) struct Split;

impl Arith for Fused {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Arith for Split {
    #[inline(always)]
    fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Lanes per vector step.
pub(super) const L: usize = 16;
/// Elements per chunk sum of the exponentials (the draw's coarse index).
pub(super) const CHUNK: usize = 256;

/// Writes `x` into `out` (resized to match) with -inf at every entry whose bit
/// in `bits` is clear: whole 32-entry words at a time where a word is all clear
/// (the common case under a grammar) or all set, a branch-free select otherwise,
/// so that every case vectorises.
#[inline(always)]
pub(super) fn mask_into(x: &[f32], bits: &[u32], out: &mut Vec<f32>) {
    out.resize(x.len(), 0.0);
    for ((xc, oc), &word) in x.chunks(32).zip(out.chunks_mut(32)).zip(bits) {
        if word == u32::MAX {
            oc.copy_from_slice(xc);
        } else if word == 0 {
            oc.fill(f32::NEG_INFINITY);
        } else {
            for (b, (xv, ov)) in xc.iter().zip(oc.iter_mut()).enumerate() {
                *ov = if (word >> b) & 1 != 0 {
                    *xv
                } else {
                    f32::NEG_INFINITY
                };
            }
        }
    }
}

/// The largest value of `xs` (NaN ignored), or -inf.
#[inline(always)]
pub(super) fn max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; L];
    let mut it = xs.chunks_exact(L);
    for c in &mut it {
        for i in 0..L {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    let mut m = reduce_max(lanes);
    for &x in it.remainder() {
        if x > m {
            m = x;
        }
    }
    m
}

/// The largest of 16 lanes by halving (vector maxima, not a 16-long chain).
#[inline(always)]
fn reduce_max(mut w: [f32; L]) -> f32 {
    let mut half = L / 2;
    while half > 0 {
        for i in 0..half {
            w[i] = if w[i + half] > w[i] {
                w[i + half]
            } else {
                w[i]
            };
        }
        half /= 2;
    }
    w[0]
}

/// The first index of the largest value of `xs` and that value (NaN ignored);
/// `None` when no value is above -inf (all -inf or NaN: the caller's cold path).
/// The maxima of 1,024-entry blocks are vector folds (`max`; per-lane indices
/// do not vectorise), then the first block that holds the largest is searched.
#[inline(always)]
pub(super) fn argmax(xs: &[f32]) -> Option<(usize, f32)> {
    const B: usize = 1024;
    let mut best = f32::NEG_INFINITY;
    let mut at = None;
    for (b, c) in xs.chunks(B).enumerate() {
        let m = max(c);
        if m > best {
            best = m;
            at = Some(b);
        }
    }
    let start = at? * B;
    let i = xs[start..].iter().position(|&x| x == best)?; // always found
    Some((start + i, best))
}

/// Writes `e[i] = exp((x[i] - m) * inv_t)` and the chunk sums of `e` (as
/// `chunk_sums` with floor 0) in one pass; returns the total.
#[inline(always)]
pub(super) fn exp_sums<A: Arith>(
    x: &[f32],
    m: f32,
    inv_t: f32,
    e: &mut [f32],
    sums: &mut [f32],
) -> f64 {
    let mut total = 0.0f64;
    let whole = x.len() / CHUNK * CHUNK;
    let (xs, x_tail) = x.split_at(whole);
    let (es, e_tail) = e[..x.len()].split_at_mut(whole);
    for ((xc, ec), s) in xs
        .chunks_exact(CHUNK)
        .zip(es.chunks_exact_mut(CHUNK))
        .zip(sums.iter_mut())
    {
        exp_into::<A>(xc, m, inv_t, ec);
        *s = sum_wide(ec); // from L1, just written
        total += f64::from(*s);
    }
    if !x_tail.is_empty() {
        exp_into::<A>(x_tail, m, inv_t, e_tail);
        let s: f32 = e_tail.iter().sum();
        sums[whole / CHUNK] = s;
        total += f64::from(s);
    }
    total
}

/// The sum of `xs` (a multiple of 4 × `L` long) with four independent
/// accumulator vectors, so that the adds' latency does not chain.
#[inline(always)]
fn sum_wide(xs: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 4 * L];
    for v in xs.chunks_exact(4 * L) {
        for i in 0..4 * L {
            lanes[i] += v[i];
        }
    }
    let mut w = [0.0f32; L];
    for i in 0..L {
        w[i] = (lanes[i] + lanes[i + L]) + (lanes[i + 2 * L] + lanes[i + 3 * L]);
    }
    reduce_sum(w)
}

/// The sum of 16 lanes by halving.
#[inline(always)]
fn reduce_sum(mut w: [f32; L]) -> f32 {
    let mut half = L / 2;
    while half > 0 {
        for i in 0..half {
            w[i] += w[i + half];
        }
        half /= 2;
    }
    w[0]
}

/// The sum of the entries of `e` strictly greater than `v` (in f64).
#[inline(always)]
pub(super) fn mass_above(e: &[f32], v: f32) -> f64 {
    let mut total = 0.0f64;
    for block in e.chunks(4096) {
        let mut lanes = [0.0f32; L];
        let mut it = block.chunks_exact(L);
        for c in &mut it {
            for i in 0..L {
                lanes[i] += if c[i] > v { c[i] } else { 0.0 };
            }
        }
        let tail: f32 = it.remainder().iter().filter(|&&x| x > v).sum();
        total += f64::from(lanes.iter().sum::<f32>() + tail);
    }
    total
}

/// How many elements of `xs` are greater than `v`.
#[inline(always)]
pub(super) fn count_greater(xs: &[f32], v: f32) -> usize {
    let mut lanes = [0u32; L];
    let mut it = xs.chunks_exact(L);
    for c in &mut it {
        for i in 0..L {
            lanes[i] += u32::from(c[i] > v);
        }
    }
    let tail = it.remainder().iter().filter(|&&x| x > v).count();
    lanes.iter().map(|&n| n as usize).sum::<usize>() + tail
}

/// exp(x) to about 2 ulp for x in [-87, 88] (Cephes' `expf` polynomial), 0 below
/// -87 and for NaN; branch-free and conversion-free so that it vectorises.
#[inline(always)]
pub(super) fn exp<A: Arith>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, which lands in the low mantissa
    // bits (its bit pattern is 0x4B40_0000 + n for |n| < 2^22)
    const ROUND: f32 = 12_582_912.0;
    let keep = x >= -87.0; // false for NaN and very small x
    let xc = x.clamp(-87.0, 88.0);
    let big = A::fma(xc, LOG2E, ROUND);
    let n = big - ROUND;
    let r = A::fma(n, -C2, A::fma(n, -C1, xc));
    let mut p = 1.987_569_1e-4_f32;
    p = A::fma(p, r, 1.398_2e-3);
    p = A::fma(p, r, 8.333_452e-3);
    p = A::fma(p, r, 4.166_579_6e-2);
    p = A::fma(p, r, 1.666_666_5e-1);
    p = A::fma(p, r, 0.5);
    let y = A::fma(p * r, r, r + 1.0);
    let scale = f32::from_bits(big.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23);
    if keep {
        y * scale
    } else {
        0.0
    }
}

/// 2^t for t <= 0.5 to about 2 ulp (0 below -126 and for NaN): the nearest
/// integer n of t, then 2^(t - n) by a degree-5 polynomial on [-0.5, 0.5] fitted
/// for relative error (1.9e-7 evaluated in f32). Fewer operations than `exp`'s
/// two-constant reduction: this is the sampler's per-entry work.
#[inline(always)]
pub(super) fn exp2_neg<A: Arith>(t: f32) -> f32 {
    #[allow(clippy::approx_constant)] // the fit's own coefficient (0.69314698)
    const FITTED_LN2: f32 = 0.693_147;
    const ROUND: f32 = 12_582_912.0; // as in `exp`
    let keep = t >= -126.0; // false for NaN
    let tc = if t > -126.0 { t } else { -126.0 };
    let big = tc + ROUND;
    let n = big - ROUND;
    let f = tc - n;
    let mut q = 1.326_472_3e-3_f32;
    q = A::fma(q, f, 9.671_513e-3);
    q = A::fma(q, f, 5.550_734e-2);
    q = A::fma(q, f, 2.402_224_2e-1);
    q = A::fma(q, f, FITTED_LN2); // fitted with the rest, not ln 2
    let y = A::fma(q, f, 1.0);
    // n + 127 in the exponent field: 2^n for n in [-126, 1]
    let scale = f32::from_bits(big.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if keep {
        y * scale
    } else {
        0.0
    }
}

/// Writes `e[i] = exp((x[i] - m) * inv_t)` for `x[i] <= m` (as 2^((x[i] - m) ×
/// inv_t × log2 e): relative error about 2e-7 × (1 + |argument|), from rounding
/// the product).
#[inline(always)]
pub(super) fn exp_into<A: Arith>(x: &[f32], m: f32, inv_t: f32, e: &mut [f32]) {
    let scale = inv_t * std::f32::consts::LOG2_E;
    for (xv, ev) in x.iter().zip(e.iter_mut()) {
        *ev = exp2_neg::<A>((xv - m) * scale);
    }
}

/// Sum of exp(x - m) over `xs` (the log-sum-exp's sum), in f64.
#[inline(always)]
pub(super) fn sum_exp<A: Arith>(xs: &[f32], m: f32) -> f64 {
    let mut total = 0.0f64;
    for block in xs.chunks(4096) {
        let mut lanes = [0.0f32; L];
        let mut it = block.chunks_exact(L);
        for c in &mut it {
            for i in 0..L {
                lanes[i] += exp::<A>(c[i] - m);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&x| exp::<A>(x - m)).sum();
        total += f64::from(lanes.iter().sum::<f32>() + tail);
    }
    total
}

/// `sums[c]` = the sum of `e[CHUNK*c ..][..CHUNK]` over the entries >= `floor`
/// (all when `floor` is 0); returns the total in f64.
#[inline(always)]
pub(super) fn chunk_sums(e: &[f32], floor: f32, sums: &mut [f32]) -> f64 {
    let mut total = 0.0f64;
    for (c, s) in e.chunks(CHUNK).zip(sums.iter_mut()) {
        let mut lanes = [0.0f32; L];
        let mut it = c.chunks_exact(L);
        for v in &mut it {
            for i in 0..L {
                lanes[i] += if v[i] >= floor { v[i] } else { 0.0 };
            }
        }
        let tail: f32 = it.remainder().iter().filter(|&&v| v >= floor).sum();
        *s = reduce_sum(lanes) + tail;
        total += f64::from(*s);
    }
    total
}

/// Index of the entry of `e` (entries below `floor` excluded) where the running
/// sum first exceeds `target`, using the chunk sums `sums` (`chunk_sums`, same
/// floor) to skip whole chunks; `None` only if no entry is >= `floor` and > 0.
pub(super) fn inverse_cdf(e: &[f32], sums: &[f32], floor: f32, target: f64) -> Option<usize> {
    let mut acc = 0.0f64;
    let mut last = None; // the last chunk with mass: the fallback for rounding
    for (c, &s) in sums.iter().enumerate() {
        if s <= 0.0 {
            continue;
        }
        last = Some(c);
        if acc + f64::from(s) > target {
            return pick_in_chunk(e, c, floor, target - acc);
        }
        acc += f64::from(s);
    }
    last.and_then(|c| pick_in_chunk(e, c, floor, f64::INFINITY))
}

/// The entry of chunk `c` where the running sum exceeds `target`, or its last
/// entry with mass (rounding).
pub(super) fn pick_in_chunk(e: &[f32], c: usize, floor: f32, target: f64) -> Option<usize> {
    let start = c * CHUNK;
    let mut acc = 0.0f64;
    let mut last = None;
    for (i, &v) in e[start..(start + CHUNK).min(e.len())].iter().enumerate() {
        if v >= floor && v > 0.0 {
            acc += f64::from(v);
            last = Some(start + i);
            if acc > target {
                break;
            }
        }
    }
    last
}

/// The top-p floor of a row's exponentials `e` (each in [0, 1]): the smallest
/// value v among them such that the mass of the entries strictly greater than v
/// is below `mass`. Every entry >= v is kept: tokens tied at the boundary are
/// kept or dropped together. Two histogram levels (the exponent, then the top 8
/// bits of the mantissa within the boundary's exponent) find the narrow range
/// that holds the floor; its few entries go to `work`, where a quickselect on
/// mass finishes.
pub(super) fn top_p_floor(e: &[f32], mass: f64, work: &mut Vec<f32>) -> f32 {
    // level 1: by exponent (two interleaved histograms halve the add chains)
    let mut h = [[0.0f64; 256]; 2];
    let mut pairs = e.chunks_exact(2);
    for pair in &mut pairs {
        h[0][(pair[0].to_bits() >> 23) as usize & 255] += f64::from(pair[0]);
        h[1][(pair[1].to_bits() >> 23) as usize & 255] += f64::from(pair[1]);
    }
    for &v in pairs.remainder() {
        h[0][(v.to_bits() >> 23) as usize & 255] += f64::from(v);
    }
    let hist: Vec<f64> = (0..256).map(|b| h[0][b] + h[1][b]).collect();
    let (bucket, above) = boundary(&hist, mass);
    work.clear();
    work.extend(
        e.iter()
            .copied()
            .filter(|v| (v.to_bits() >> 23) as usize == bucket),
    );
    // level 2: by the top 8 mantissa bits within that exponent
    let mut hist2 = [0.0f64; 256];
    for &v in work.iter() {
        hist2[(v.to_bits() >> 15) as usize & 255] += f64::from(v);
    }
    let (sub, above2) = boundary(&hist2, mass - above);
    work.retain(|v| (v.to_bits() >> 15) as usize & 255 == sub);
    quickselect_floor(work, mass - above - above2)
}

/// The bucket where the mass summed from the top first reaches `mass`, and the
/// mass of the buckets above it (the lowest nonempty bucket if it never does).
fn boundary(hist: &[f64], mass: f64) -> (usize, f64) {
    let mut acc = 0.0;
    let mut last = 0;
    for b in (0..hist.len()).rev() {
        if hist[b] == 0.0 {
            continue;
        }
        if acc + hist[b] >= mass {
            return (b, acc);
        }
        acc += hist[b];
        last = b;
    }
    (last, acc - hist[last])
}

/// `top_p_floor` by a quickselect on mass over `a` (destroyed): expected linear.
fn quickselect_floor(a: &mut [f32], mass: f64) -> f32 {
    let mut a: &mut [f32] = a;
    let mut above = 0.0f64; // mass of the entries already known to be larger
    loop {
        let n = a.len();
        if n == 0 {
            return f32::INFINITY;
        }
        let pivot = median3(a[0], a[n / 2], a[n - 1]);
        // three-way partition: [> pivot | == pivot | < pivot]
        let (mut gt, mut i, mut lt) = (0, 0, n);
        let (mut mass_gt, mut mass_eq) = (0.0f64, 0.0f64);
        while i < lt {
            let v = a[i];
            if v > pivot {
                mass_gt += f64::from(v);
                a.swap(gt, i);
                gt += 1;
                i += 1;
            } else if v < pivot {
                lt -= 1;
                a.swap(i, lt);
            } else {
                mass_eq += f64::from(v);
                i += 1;
            }
        }
        if above + mass_gt >= mass {
            a = &mut a[..gt]; // the pivot is dropped: the floor is larger
        } else if above + mass_gt + mass_eq >= mass || lt == n {
            return pivot; // the pivot is kept and nothing smaller is
        } else {
            above += mass_gt + mass_eq;
            a = &mut a[lt..];
        }
    }
}

fn median3(a: f32, b: f32, c: f32) -> f32 {
    if (a <= b) == (b <= c) {
        b
    } else if (b <= a) == (a <= c) {
        a
    } else {
        c
    }
}
