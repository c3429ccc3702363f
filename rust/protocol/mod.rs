//! The engine wire protocol: message types, framing, encode/decode. Pure Rust.
//!
//! A frame is `[message type: u8][WIRE_VERSION: u8][msgpack body]`. Each body is
//! a positional msgpack array (never a map) whose layout is fixed per message
//! type and version; token ids and other bulk arrays travel as msgpack `bin` of
//! raw little-endian 4-byte items. Layouts (`?` = nil or the value):
//!
//! ```text
//! AddRequests    [AddRequest, ...]: each a positional array whose fields are
//!                declared once in python/asyncllm/engine/wire_schema.py (the
//!                generated add_request.rs lists them; kinds.rs says how each travels)
//! Abort          [[wire_id, ...]]
//! UtilityCall    [call_id, method:str, args:value]
//! UtilityResult  [call_id, ok:bool, value (ok) | error message:str (not ok)]
//! Ready          [max_model_len, num_kv_blocks, block_size, vocab_size, eos_token_ids:bin,
//!                 hidden_size]
//! EngineError    [message:str]
//! Shutdown       []
//! OutputBatch    [[[wire_id, new_token_ids:bin, finish_reason?:u8, stop_reason?,
//!                   error?:str, logprobs?, prompt_logprobs?, num_cached_tokens?,
//!                   embedding?:bin(f32)], ...],
//!                 [num_running, num_waiting, kv_cache_usage:f32, prefix_cache_queries,
//!                  prefix_cache_hits, num_preemptions],
//!                 timestamp:f64]
//! Logprobs       [num_positions, width, token_ids:bin, logprobs:bin(f32), ranks:bin]
//! ```
//!
//! Golden frames of every message live in `tests/fixtures/wire/`; the Rust and
//! the Python tests both decode them.

mod add_request;
mod columns;
mod decode;
mod encode;
mod error;
mod fields;
mod frame;
mod kinds;
mod messages;
mod reader;
mod value;
mod writer;

#[cfg(test)]
mod tests;

pub use add_request::{AddRequest, WIRE_VERSION};
pub use columns::{decode_output_batch, OutputBatchColumns};
pub use decode::{decode, decode_with_limit};
pub use encode::{
    encode, encode_abort, encode_add_requests, encode_add_requests_in, encode_engine_error,
    encode_output_batch, encode_ready, encode_shutdown, encode_utility_call, encode_utility_result,
    OutputBatchWriter, RequestOutputRef,
};
pub use error::{WireError, WireResult};
pub use frame::{split_frame, DEFAULT_MAX_FRAME_SIZE, HEADER_LEN};
pub use messages::{
    FinishReason, Logprobs, LogprobsRef, Message, MessageType, OutputBatch, Ready, RequestOutput,
    SchedulerStats, StructuredSpec, MAX_STRUCTURED_SPEC_BYTES, STRUCTURED_KINDS,
};
pub use value::{Value, MAX_VALUE_DEPTH};
