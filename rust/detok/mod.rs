//! Batched incremental detokenization and stop-string matching. Pure Rust.

use thiserror::Error;

/// Why a detokenizer call failed.
#[derive(Debug, Error)]
pub enum DetokError {
    #[error("cannot load tokenizer: {0}")]
    Load(String),
}
