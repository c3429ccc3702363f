//! Speculative decoding's proposers: pure Rust, no pyo3.
//!
//! `ngram` is prompt-lookup decoding: each request's own prompt and output are
//! indexed as they grow, and the continuation of the latest earlier occurrence
//! of the sequence's last n tokens is proposed as draft tokens. `suffix` is
//! SuffixDecoding: suffix tries (`suffix_trie`) over each request's tokens and
//! over recent requests' outputs propose the most frequent continuation, as
//! long as it is likely. Both back off rows whose drafts are rejected
//! (`backoff`). `budget` computes how many drafts each request's verification
//! pays for (the runner's `DraftBudget`).

pub mod backoff;
pub mod budget;
pub mod ngram;
pub mod suffix;
pub mod suffix_trie;

#[cfg(test)]
mod suffix_tests;
#[cfg(test)]
mod tests;
