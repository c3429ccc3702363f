//! SuffixDecoding proposals over every row of a step in one call.
//!
//! Each row has a suffix trie of its own prompt and output (`local`), and every
//! row's output also goes into one trie shared by all (`global`), which keeps
//! the outputs of requests that left for later ones: where answers repeat each
//! other, a request drafts from what earlier ones said. Both grow as tokens
//! arrive (`suffix_trie::Cursor`). A row's draft is the better scoring of its
//! local and global ones: the most frequent continuation of a suffix of its
//! context, at most `max_spec_factor` times the match long and cut where its
//! frequency falls below `min_token_prob` (`suffix_trie::DraftLimits`).
//!
//! The global trie is bounded: once more than `max_cached_requests` requests
//! that left are kept, or it holds more than `max_cached_tokens` tokens, the
//! oldest that left are taken out (the outputs of rows still running stay).
//! A request that comes back (resumed after preemption) replaces its copy.

use std::collections::VecDeque;

use super::backoff::Backoff;
use super::ngram::MAX_DRAFTS;
use super::suffix_trie::{Cursor, DraftLimits, SuffixTrie};

/// The deepest trie a proposer may build.
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy)]
pub struct SuffixConfig {
    pub max_tree_depth: usize,
    pub max_cached_requests: usize,
    pub max_cached_tokens: usize,
    pub max_spec_factor: f32,
    pub min_token_prob: f32,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SuffixError {
    #[error("suffix_decoding_max_tree_depth={0} must be in [2, {MAX_DEPTH}]")]
    BadDepth(usize),
    #[error("suffix_decoding_max_spec_factor={0} must be > 0")]
    BadFactor(f32),
    #[error("suffix_decoding_min_token_prob={0} must be in [0, 1]")]
    BadProb(f32),
    #[error("row {row} is out of range: the proposer has {num_rows} rows")]
    BadRow { row: usize, num_rows: usize },
    #[error("row {0} is not in use (add it first)")]
    NoRow(usize),
    #[error("row {row}: num_prompt={num_prompt} exceeds its {len} tokens")]
    BadPrompt {
        row: usize,
        num_prompt: usize,
        len: usize,
    },
}

/// One running request.
struct Row {
    key: u64,
    local: SuffixTrie,
    local_cursor: Cursor,
    /// The context's last tokens (at least the depth's worth), to match globally.
    tail: Vec<u32>,
    /// Its output so far, as inserted into the global trie.
    output: Vec<u32>,
    global_cursor: Cursor,
    backoff: Backoff,
}

/// The shared trie of outputs and the queue of those whose requests left.
struct Global {
    trie: SuffixTrie,
    /// (request key, its output), oldest first.
    left: VecDeque<(u64, Vec<u32>)>,
    /// Tokens inserted and not yet removed (running rows' outputs included).
    num_tokens: usize,
}

pub struct SuffixProposer {
    config: SuffixConfig,
    rows: Vec<Option<Row>>,
    /// None when `max_cached_requests` is 0: no sharing.
    global: Option<Global>,
}

impl SuffixProposer {
    pub fn new(num_rows: usize, config: SuffixConfig) -> Result<Self, SuffixError> {
        let c = config;
        if !(2..=MAX_DEPTH).contains(&c.max_tree_depth) {
            return Err(SuffixError::BadDepth(c.max_tree_depth));
        }
        if c.max_spec_factor.is_nan() || c.max_spec_factor <= 0.0 {
            return Err(SuffixError::BadFactor(c.max_spec_factor));
        }
        if !(0.0..=1.0).contains(&c.min_token_prob) {
            return Err(SuffixError::BadProb(c.min_token_prob));
        }
        let global = (c.max_cached_requests > 0).then(|| Global {
            trie: SuffixTrie::new(c.max_tree_depth),
            left: VecDeque::new(),
            num_tokens: 0,
        });
        Ok(SuffixProposer {
            config,
            rows: (0..num_rows).map(|_| None).collect(),
            global,
        })
    }

    fn check_row(&self, row: usize) -> Result<(), SuffixError> {
        if row >= self.rows.len() {
            return Err(SuffixError::BadRow {
                row,
                num_rows: self.rows.len(),
            });
        }
        Ok(())
    }

    /// Start `row` for the request `key` with its tokens so far, the first
    /// `num_prompt` its prompt (the rest, output generated before a
    /// preemption, goes into the global trie, replacing any copy kept of it).
    pub fn add(
        &mut self,
        row: usize,
        key: u64,
        tokens: &[u32],
        num_prompt: usize,
    ) -> Result<(), SuffixError> {
        self.check_row(row)?;
        if num_prompt > tokens.len() {
            return Err(SuffixError::BadPrompt {
                row,
                num_prompt,
                len: tokens.len(),
            });
        }
        self.remove(row);
        let mut local = SuffixTrie::new(self.config.max_tree_depth);
        let local_cursor = local.insert(tokens);
        let mut state = Row {
            key,
            local,
            local_cursor,
            tail: tokens[tokens.len().saturating_sub(self.config.max_tree_depth)..].to_vec(),
            output: Vec::new(),
            global_cursor: Cursor::default(),
            backoff: Backoff::default(),
        };
        if let Some(g) = &mut self.global {
            if let Some(i) = g.left.iter().position(|(k, _)| *k == key) {
                let (_, out) = g.left.remove(i).unwrap_or_default();
                g.trie.remove(&out);
                g.num_tokens -= out.len();
            }
            g.extend(&mut state, &tokens[num_prompt..]);
            g.evict(&self.config);
        }
        self.rows[row] = Some(state);
        Ok(())
    }

    /// `row`'s request left the batch (finished, aborted or preempted): its
    /// output stays in the global trie, now among the evictable ones.
    pub fn remove(&mut self, row: usize) {
        let Some(state) = self.rows.get_mut(row).and_then(Option::take) else {
            return;
        };
        if let Some(g) = &mut self.global {
            g.left.push_back((state.key, state.output));
            g.evict(&self.config);
        }
    }

    /// Append `new_tokens` to `row`, note how many of its last drafts were
    /// accepted (`accepted` of `drafted`), and write up to `max_drafts`
    /// proposed tokens into `out`. Returns how many it wrote.
    pub fn step(
        &mut self,
        row: usize,
        new_tokens: &[u32],
        drafted: usize,
        accepted: usize,
        max_drafts: usize,
        out: &mut Vec<u32>,
    ) -> Result<usize, SuffixError> {
        self.check_row(row)?;
        let depth = self.config.max_tree_depth;
        let state = self.rows[row].as_mut().ok_or(SuffixError::NoRow(row))?;
        for &t in new_tokens {
            state.local.append(&mut state.local_cursor, t);
        }
        state.tail.extend_from_slice(new_tokens);
        if state.tail.len() > 2 * depth {
            state.tail.drain(..state.tail.len() - depth);
        }
        if let Some(g) = &mut self.global {
            g.extend(state, new_tokens);
            g.evict(&self.config);
        }
        if !state.backoff.may_propose(drafted, accepted) || max_drafts == 0 {
            return Ok(0);
        }
        let limits = DraftLimits {
            max_tokens: max_drafts.min(MAX_DRAFTS),
            max_spec_factor: self.config.max_spec_factor,
            min_token_prob: self.config.min_token_prob,
        };
        let mut best = state.local.best_draft_at(&state.local_cursor, &limits);
        if let Some(g) = &self.global {
            let other = g.trie.best_draft_for(&state.tail, &limits);
            if other.score > best.score {
                best = other;
            }
        }
        out.extend_from_slice(&best.tokens);
        Ok(best.tokens.len())
    }

    /// Requests whose output the global trie keeps after they left.
    pub fn num_cached_requests(&self) -> usize {
        self.global.as_ref().map_or(0, |g| g.left.len())
    }

    /// Tokens in the global trie (outputs of running rows and kept ones).
    pub fn num_global_tokens(&self) -> usize {
        self.global.as_ref().map_or(0, |g| g.num_tokens)
    }

    /// The global trie (tests compare it with one built from scratch).
    pub fn global_trie(&self) -> Option<&SuffixTrie> {
        self.global.as_ref().map(|g| &g.trie)
    }
}

impl Global {
    fn extend(&mut self, row: &mut Row, tokens: &[u32]) {
        for &t in tokens {
            self.trie.append(&mut row.global_cursor, t);
        }
        row.output.extend_from_slice(tokens);
        self.num_tokens += tokens.len();
    }

    /// Take out the oldest outputs of requests that left while over a bound.
    fn evict(&mut self, config: &SuffixConfig) {
        while self.left.len() > config.max_cached_requests
            || (self.num_tokens > config.max_cached_tokens && !self.left.is_empty())
        {
            let Some((_, out)) = self.left.pop_front() else {
                break;
            };
            self.trie.remove(&out);
            self.num_tokens -= out.len();
        }
    }
}
