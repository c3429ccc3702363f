//! The per-row building blocks, written as plain loops over fixed-width lane
//! arrays that the compiler vectorises (with AVX2 + FMA when the row function is
//! instantiated under `#[target_feature]`, see `mod.rs`). NaN is ignored
//! everywhere: every comparison with it is false, so it is never the maximum,
//! never a candidate and contributes no probability mass.

/// Lanes per vector step.
const L: usize = 16;
/// Elements per chunk sum of the exponentials (the draw's coarse index).
pub(super) const CHUNK: usize = 64;

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
    let mut m = f32::NEG_INFINITY;
    for &x in it.remainder().iter().chain(lanes.iter()) {
        if x > m {
            m = x;
        }
    }
    m
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
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, which lands in the low mantissa
    // bits (its bit pattern is 0x4B40_0000 + n for |n| < 2^22)
    const ROUND: f32 = 12_582_912.0;
    let keep = x >= -87.0; // false for NaN and very small x
    let xc = x.clamp(-87.0, 88.0);
    let big = xc * LOG2E + ROUND;
    let n = big - ROUND;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(big.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23);
    if keep {
        y * scale
    } else {
        0.0
    }
}

/// Writes `e[i] = exp((x[i] - m) * inv_t)`.
#[inline(always)]
pub(super) fn exp_into(x: &[f32], m: f32, inv_t: f32, e: &mut [f32]) {
    for (xv, ev) in x.iter().zip(e.iter_mut()) {
        *ev = exp((xv - m) * inv_t);
    }
}

/// Sum of exp(x - m) over `xs` (the log-sum-exp's sum), in f64.
#[inline(always)]
pub(super) fn sum_exp(xs: &[f32], m: f32) -> f64 {
    let mut total = 0.0f64;
    for block in xs.chunks(4096) {
        let mut lanes = [0.0f32; L];
        let mut it = block.chunks_exact(L);
        for c in &mut it {
            for i in 0..L {
                lanes[i] += exp(c[i] - m);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&x| exp(x - m)).sum();
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
        *s = lanes.iter().sum::<f32>() + tail;
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
fn pick_in_chunk(e: &[f32], c: usize, floor: f32, target: f64) -> Option<usize> {
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

/// Candidates for the `k` largest values of a row fed in segments: every
/// element >= the current k-th largest is kept (ties at the boundary included),
/// the rest rejected a vector chunk at a time once the buffer has filled.
pub(super) struct TopK {
    k: usize,
    floor: f32,
    limit: usize,
    pub(super) buf: Vec<(f32, u32)>,
}

impl TopK {
    pub(super) fn new(k: usize, buf: Vec<(f32, u32)>) -> Self {
        let mut buf = buf;
        buf.clear();
        TopK {
            k,
            floor: f32::NEG_INFINITY,
            limit: (2 * k).max(32),
            buf,
        }
    }

    /// Adds the elements of `xs`, the row's entries from index `base` on.
    #[inline(always)]
    pub(super) fn push(&mut self, base: usize, xs: &[f32]) {
        const BLOCK: usize = 4 * L;
        let mut it = xs.chunks_exact(BLOCK);
        let mut start = base;
        for c in &mut it {
            // `>=`: -inf entries still fill the buffer; NaN never passes
            let floor = self.floor;
            let mut any = false;
            for &x in c {
                any |= x >= floor;
            }
            if any {
                self.push_scalar(start, c);
            }
            start += BLOCK;
        }
        self.push_scalar(start, it.remainder());
    }

    fn push_scalar(&mut self, base: usize, xs: &[f32]) {
        for (i, &x) in xs.iter().enumerate() {
            if x >= self.floor {
                self.buf.push((x, (base + i) as u32));
            }
        }
        if self.buf.len() >= self.limit {
            self.compact();
            if self.buf.len() * 2 > self.limit {
                // many ties at the boundary: let the buffer grow instead of
                // compacting on every push
                self.limit = self.buf.len() * 2;
            }
        }
    }

    /// All of `xs` at once (a whole row, no changed entries): one vectorised pass
    /// takes the maximum of every block of 64; the k-th largest of those is a
    /// floor no k-th largest element can be below (k blocks hold an element at
    /// least that large), so only the blocks whose maximum reaches it are scanned.
    pub(super) fn push_all(&mut self, xs: &[f32], maxes: &mut Vec<f32>) {
        const BLOCK: usize = 4 * L;
        maxes.clear();
        maxes.extend(xs.chunks(BLOCK).map(max));
        if maxes.len() > self.k {
            let k = self.k;
            let mut sorted = std::mem::take(&mut self.buf); // borrow the allocation
            sorted.clear();
            sorted.extend(maxes.iter().map(|&m| (m, 0)));
            let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
            self.floor = kth.0;
            sorted.clear();
            self.buf = sorted;
        }
        for (b, (c, &m)) in xs.chunks(BLOCK).zip(maxes.iter()).enumerate() {
            if m >= self.floor {
                self.push_scalar(b * BLOCK, c);
            }
        }
    }

    /// Raises the floor to the current k-th largest and drops what is below it.
    fn compact(&mut self) {
        if self.buf.len() <= self.k {
            return;
        }
        let k = self.k;
        let (_, kth, _) = self
            .buf
            .select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
        self.floor = kth.0;
        let floor = self.floor;
        self.buf.retain(|c| c.0 >= floor);
    }

    /// The candidates, largest first (lower index first among equal values):
    /// every element >= the k-th largest, so possibly more than k on ties.
    pub(super) fn finish(mut self) -> Vec<(f32, u32)> {
        self.compact();
        // no NaN is ever a candidate; -0.0 and 0.0 are equal here, as in `>=`
        self.buf.sort_unstable_by(|a, b| {
            b.0.partial_cmp(&a.0)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.1.cmp(&b.1))
        });
        self.buf
    }
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
