//! Prompt-lookup (n-gram) proposals over every row of a step in one call.
//!
//! Each row keeps its tokens and, for every n in `min_n..=max_n`, a map from
//! the hash of an n-gram to the position right after its latest occurrence.
//! Invariant: every n-gram that ends before the row's last token (its end `e`
//! satisfies `e <= indexed < len`) is in the maps, so an n-gram found for the
//! sequence's last n tokens is an earlier occurrence, and its continuation
//! (`tokens[e..]`) exists. Appending tokens indexes only the n-grams that end
//! at the new positions: a step costs O(new tokens * (max_n - min_n + 1)),
//! never a rescan of the context.
//!
//! A row whose drafts keep being rejected outright stops proposing for a
//! while (`super::backoff`), so text with nothing to copy costs almost nothing.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::backoff::Backoff;
/// The most tokens one proposal may hold.
pub const MAX_DRAFTS: usize = 64;
/// The longest n-gram a proposer may match.
pub const MAX_N: usize = 64;

/// Keys are already hashes: pass them through.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys are hashed")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Index = HashMap<u64, u32, BuildHasherDefault<KeyHasher>>;

fn hash_tokens(tokens: &[u32]) -> u64 {
    let mut h = tokens.len() as u64;
    for &t in tokens {
        h = (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    h
}

/// One request's tokens, index and proposal history.
#[derive(Default)]
struct Row {
    tokens: Vec<u32>,
    /// One map per n in `min_n..=max_n`.
    maps: Vec<Index>,
    /// n-grams ending at positions `<= indexed` are in `maps`.
    indexed: usize,
    /// When this row proposes.
    backoff: Backoff,
}

/// Prompt-lookup proposer for up to `num_rows` rows (the runner's input-batch rows).
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
    rows: Vec<Option<Row>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NgramError {
    #[error("prompt_lookup_min={min} and prompt_lookup_max={max} must satisfy 1 <= min <= max <= {MAX_N}")]
    BadRange { min: usize, max: usize },
    #[error("row {row} is out of range: the proposer has {num_rows} rows")]
    BadRow { row: usize, num_rows: usize },
    #[error("row {0} is not in use (add it first)")]
    NoRow(usize),
}

impl NgramProposer {
    pub fn new(num_rows: usize, min_n: usize, max_n: usize) -> Result<Self, NgramError> {
        if min_n == 0 || min_n > max_n || max_n > MAX_N {
            return Err(NgramError::BadRange {
                min: min_n,
                max: max_n,
            });
        }
        let rows = (0..num_rows).map(|_| None).collect();
        Ok(NgramProposer { min_n, max_n, rows })
    }

    fn check_row(&self, row: usize) -> Result<(), NgramError> {
        if row >= self.rows.len() {
            return Err(NgramError::BadRow {
                row,
                num_rows: self.rows.len(),
            });
        }
        Ok(())
    }

    /// Start (or restart) `row` with `tokens`, its prompt and any output so far.
    pub fn add(&mut self, row: usize, tokens: &[u32]) -> Result<(), NgramError> {
        self.check_row(row)?;
        let num_maps = self.max_n - self.min_n + 1;
        let mut state = Row {
            tokens: tokens.to_vec(),
            maps: (0..num_maps).map(|_| Index::default()).collect(),
            indexed: 0,
            backoff: Backoff::default(),
        };
        self.index(&mut state);
        self.rows[row] = Some(state);
        Ok(())
    }

    /// Forget `row` (its request left the batch). Unknown rows are ignored.
    pub fn remove(&mut self, row: usize) {
        if let Some(slot) = self.rows.get_mut(row) {
            *slot = None;
        }
    }

    /// Index the n-grams that end at the positions `indexed + 1 ..= len - 1`.
    fn index(&self, state: &mut Row) {
        let len = state.tokens.len();
        if len == 0 {
            return;
        }
        for end in state.indexed + 1..len {
            for (i, n) in (self.min_n..=self.max_n).enumerate() {
                if end < n {
                    break;
                }
                let key = hash_tokens(&state.tokens[end - n..end]);
                state.maps[i].insert(key, end as u32);
            }
        }
        state.indexed = state.indexed.max(len - 1);
    }

    /// Append `new_tokens` to `row`, note how many of its last drafts were
    /// accepted (`accepted` of `drafted`; 0 of 0 when it had none), and write up
    /// to `max_drafts` proposed tokens into `out`. Returns how many it wrote.
    pub fn step(
        &mut self,
        row: usize,
        new_tokens: &[u32],
        drafted: usize,
        accepted: usize,
        max_drafts: usize,
        out: &mut Vec<u32>,
    ) -> Result<usize, NgramError> {
        self.check_row(row)?;
        let mut state = self.rows[row].take().ok_or(NgramError::NoRow(row))?;
        state.tokens.extend_from_slice(new_tokens);
        self.index(&mut state);
        let written = if state.backoff.may_propose(drafted, accepted) {
            self.lookup(&state, max_drafts.min(MAX_DRAFTS), out)
        } else {
            0
        };
        self.rows[row] = Some(state);
        Ok(written)
    }

    /// The continuation of the latest earlier occurrence of the row's last n
    /// tokens, longest n first; a repeating tail is continued by its period.
    fn lookup(&self, state: &Row, max_drafts: usize, out: &mut Vec<u32>) -> usize {
        let tokens = &state.tokens;
        let len = tokens.len();
        if max_drafts == 0 {
            return 0;
        }
        for (i, n) in (self.min_n..self.max_n + 1).enumerate().rev() {
            if len < n + 1 {
                continue;
            }
            let suffix = &tokens[len - n..];
            let Some(&end) = state.maps[i].get(&hash_tokens(suffix)) else {
                continue;
            };
            let end = end as usize;
            if tokens[end - n..end] != *suffix {
                continue; // a hash collision
            }
            // The continuation runs on past the context when the match is
            // within the last `max_drafts` tokens: the text repeats with
            // period `len - end`, so it goes on repeating (token `end + i` of
            // the context followed by the drafts themselves).
            let start = out.len();
            for i in 0..max_drafts {
                let at = end + i;
                let token = if at < len {
                    tokens[at]
                } else {
                    out[start + at - len]
                };
                out.push(token);
            }
            return max_drafts;
        }
        0
    }
}
