//! Batched incremental detokenization and stop-string matching. Pure Rust.
//!
//! # The reference decode (what "correct" means)
//!
//! Let `D(ids)` be the Python `tokenizers` package's
//! `tokenizer.decode(ids, skip_special_tokens=...)` when
//! `spaces_between_special_tokens` is true (the default). When it is false,
//! `D` decodes each maximal run of non-added tokens separately and puts every
//! kept added token's content between them with no space
//! (`"".join(decode(run) | content)`, the `transformers` slow-tokenizer
//! meaning of the flag); skipped special tokens do not split runs.
//!
//! For a request with prompt `P` whose output tokens are `O`, the text released
//! over the whole request (everything `step` returned, up to the finish) is
//!
//! ```text
//!     D(P + O)[len(lcp(D(P), D(P + O))):]
//! ```
//!
//! where `lcp` is the longest common prefix: the continuation of the prompt's
//! text, as a user streaming a completion sees it (vLLM's convention). Usually
//! `D(P)` is a prefix of `D(P + O)` and this is plain `D(P + O)` minus `D(P)`;
//! the `lcp` settles the cases where it is not, e.g. a prompt ending inside a
//! UTF-8 character (its U+FFFD becomes the completed character, which belongs
//! to the output). With an empty prompt this is `D(O)`; note that for
//! SentencePiece tokenizers `D(O)` drops the leading space of the first token
//! while `D(P + O) - D(P)` keeps it.
//!
//! With stop strings, the released text is that reference truncated at the
//! earliest-ending match (see `stop.rs`), only matches ending in text of the
//! `min_tokens`-th token or later counting.
//!
//! Text is released as soon as it is decided and never retracted; see
//! `stream.rs` for what is held back and why.

mod batch;
mod stop;
mod stream;
mod table;

#[cfg(test)]
mod tests;

pub use batch::{Detokenizer, RequestParams, StepBatch, StepItem, StepOutputs};
pub use stop::{StopMatch, StopMatcher};
pub use stream::{DecodeOptions, IncrementalDecoder};
pub use table::{DecodeTable, Piece};

use thiserror::Error;

/// Why a detokenizer call failed.
#[derive(Debug, Error)]
pub enum DetokError {
    #[error("cannot load tokenizer: {0}")]
    Load(String),
    #[error("unsupported tokenizer decoder for incremental detokenization: {0}")]
    Unsupported(String),
    #[error("request {0} is already in the detokenizer")]
    DuplicateRequest(u64),
    #[error("request {0} is not in the detokenizer")]
    UnknownRequest(u64),
    #[error("request {0} appears more than once in one step")]
    RepeatedRequest(u64),
    #[error("request {0}: stop strings must not be empty")]
    EmptyStopString(u64),
    #[error("step: request ids, token lists and finished flags differ in length")]
    BatchShape,
    #[error("step: finished request {0} is not in the batch")]
    FinishedNotInBatch(u64),
    #[error("the detokenizer is unusable: an earlier call panicked")]
    Poisoned,
}
