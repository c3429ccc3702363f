//! Top-k candidates: every entry >= the row's k-th largest, found without
//! sorting the row (see `TopK::push_all` for the whole-row pass).

use super::select::L;

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
            self.compact_and_grow();
        }
    }

    fn compact_and_grow(&mut self) {
        self.compact();
        if self.buf.len() * 2 > self.limit {
            // many ties at the boundary: let the buffer grow instead of
            // compacting on every push
            self.limit = self.buf.len() * 2;
        }
    }

    /// All of `xs` at once (a whole row, no changed entries). One vector pass
    /// folds each group of 1,024 entries into 16 lane maxima — lane i's is the
    /// maximum of the group's entries i, i + 16, ... (64 of them), with no
    /// horizontal step. The k-th largest of those maxima is a floor no k-th
    /// largest entry can be below (k lanes hold an entry at least that large),
    /// so only the lanes whose maximum reaches it are read again. `maxes` and
    /// `work` are scratch.
    #[inline(always)] // into the row function: its instruction set (see `mod.rs`)
    pub(super) fn push_all(&mut self, xs: &[f32], maxes: &mut Vec<f32>, work: &mut Vec<f32>) {
        const G: usize = 64 * L;
        let groups = xs.chunks_exact(G);
        let tail = groups.remainder();
        maxes.clear();
        for g in groups.clone() {
            let mut w = [f32::NEG_INFINITY; L];
            for c in g.chunks_exact(L) {
                for i in 0..L {
                    w[i] = if c[i] > w[i] { c[i] } else { w[i] };
                }
            }
            maxes.extend_from_slice(&w);
        }
        if maxes.len() >= self.k {
            work.clear();
            work.extend_from_slice(maxes);
            let (_, kth, _) = work.select_nth_unstable_by(self.k - 1, |a, b| b.total_cmp(a));
            self.floor = *kth;
        }
        for (gi, g) in groups.enumerate() {
            for lane in 0..L {
                if maxes[gi * L + lane] >= self.floor {
                    let base = gi * G + lane;
                    for j in 0..G / L {
                        let x = g[j * L + lane];
                        if x >= self.floor {
                            self.buf.push((x, (base + j * L) as u32));
                        }
                    }
                    if self.buf.len() >= self.limit {
                        self.compact_and_grow();
                    }
                }
            }
        }
        self.push(xs.len() - tail.len(), tail);
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
