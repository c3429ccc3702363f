//! The per-row inputs beside the logits that change some rows' tokens: logit
//! biases and allowed-token bitmasks (the token lists of penalties and bans are
//! `TokenLists`, in `mod.rs`).

/// Per-row logit biases in CSR form: row r's tokens are
/// `tokens[offsets[r]..offsets[r+1]]`, sorted and distinct, with `values` parallel
/// to `tokens`. Empty `offsets`: no row has any.
#[derive(Clone, Copy)]
pub struct Bias<'a> {
    pub offsets: &'a [usize],
    pub tokens: &'a [u32],
    pub values: &'a [f32],
}

impl Bias<'_> {
    /// No row has a bias.
    pub const NONE: Bias<'static> = Bias {
        offsets: &[],
        tokens: &[],
        values: &[],
    };

    /// Row `r`'s (tokens, values).
    #[inline(always)]
    pub(super) fn of(&self, r: usize) -> (&[u32], &[f32]) {
        match (self.offsets.get(r), self.offsets.get(r + 1)) {
            (Some(&a), Some(&b)) => (&self.tokens[a..b], &self.values[a..b]),
            _ => (&[], &[]),
        }
    }
}

/// Allowed-token bitmasks: a constrained row samples as if every token its
/// mask does not allow had logit -inf (penalties, logprobs and ranks included).
/// The row is masked into scratch as the first pass over it, so the passes that
/// follow read it from cache: no separate pass over the whole batch.
#[derive(Clone, Copy)]
pub struct Masks<'a> {
    /// `[m, words]`: bit `t % 32` of word `t / 32` of a mask allows token `t`.
    pub bits: &'a [u32],
    /// At least `vocab.div_ceil(32)`.
    pub words: usize,
    /// `[rows]` (or empty: no row is constrained): the mask of each logits row,
    /// or `Masks::UNCONSTRAINED`.
    pub of_row: &'a [usize],
}

impl Masks<'_> {
    /// `of_row` entry of a row without a mask.
    pub const UNCONSTRAINED: usize = usize::MAX;
    /// No row is constrained.
    pub const NONE: Masks<'static> = Masks {
        bits: &[],
        words: 0,
        of_row: &[],
    };

    #[inline(always)]
    pub(super) fn of(&self, r: usize) -> Option<&[u32]> {
        let m = *self.of_row.get(r)?;
        (m != Self::UNCONSTRAINED).then(|| &self.bits[m * self.words..(m + 1) * self.words])
    }
}
