//! Speculative decoding's proposers: pure Rust, no pyo3.
//!
//! `ngram` is prompt-lookup decoding: each request's own prompt and output are
//! indexed as they grow, and the continuation of the latest earlier occurrence
//! of the sequence's last n tokens is proposed as draft tokens.

pub mod ngram;

#[cfg(test)]
mod tests;
