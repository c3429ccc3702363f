//! The messages exchanged between the front end and EngineCore, as owned Rust
//! values. Their wire layout (positional msgpack arrays) is in `encode.rs` and
//! `decode.rs`; the one-byte type tags are `MessageType`.

use super::add_request::AddRequest;
use super::value::Value;

/// The one-byte tag that starts every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageType {
    // front end -> EngineCore
    AddRequests = 0x01,
    Abort = 0x02,
    UtilityCall = 0x03,
    Shutdown = 0x04,
    // EngineCore -> front end
    OutputBatch = 0x10,
    UtilityResult = 0x11,
    Ready = 0x12,
    EngineError = 0x13,
}

impl MessageType {
    pub const ALL: [MessageType; 8] = [
        MessageType::AddRequests,
        MessageType::Abort,
        MessageType::UtilityCall,
        MessageType::Shutdown,
        MessageType::OutputBatch,
        MessageType::UtilityResult,
        MessageType::Ready,
        MessageType::EngineError,
    ];

    pub fn from_u8(tag: u8) -> Option<MessageType> {
        MessageType::ALL.into_iter().find(|t| *t as u8 == tag)
    }

    /// The name used in error messages and the Python constants (`MSG_<NAME>`).
    pub fn name(self) -> &'static str {
        match self {
            MessageType::AddRequests => "AddRequests",
            MessageType::Abort => "Abort",
            MessageType::UtilityCall => "UtilityCall",
            MessageType::Shutdown => "Shutdown",
            MessageType::OutputBatch => "OutputBatch",
            MessageType::UtilityResult => "UtilityResult",
            MessageType::Ready => "Ready",
            MessageType::EngineError => "EngineError",
        }
    }
}

/// A request's output constraint as the grammar compiler takes it: `kind` one
/// of [`STRUCTURED_KINDS`], `spec` its text (`StructuredOutputsParams.spec()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructuredSpec {
    pub kind: String,
    pub spec: String,
}

/// The constraint kinds (`asyncllm.structured_output.params.KINDS`, then
/// `AFTER_REASONING`: one of the others applied to the answer after a
/// reasoning model's reasoning).
pub const STRUCTURED_KINDS: [&str; 6] = [
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "after_reasoning",
];

/// The most bytes a constraint's spec may take on the wire: above what the
/// Python side's bounds allow (64 Ki chars of schema, regex, grammar or
/// choices, JSON-escaped), so only a forged frame meets it.
pub const MAX_STRUCTURED_SPEC_BYTES: usize = 1 << 20;

impl StructuredSpec {
    /// Why this spec may not go on (or come off) the wire, if it may not.
    pub fn check(&self) -> Result<(), String> {
        if !STRUCTURED_KINDS.contains(&self.kind.as_str()) {
            return Err(format!(
                "kind {:?} is not one of {}",
                self.kind,
                STRUCTURED_KINDS.join(", ")
            ));
        }
        if self.spec.len() > MAX_STRUCTURED_SPEC_BYTES {
            return Err(format!(
                "spec of {} bytes is over the limit of {MAX_STRUCTURED_SPEC_BYTES}",
                self.spec.len()
            ));
        }
        Ok(())
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FinishReason {
    /// A stop token, EOS, or (after the front end's abort) a stop string.
    Stop = 0,
    /// `max_tokens` or `max_model_len` reached.
    Length = 1,
    /// Aborted by the client.
    Abort = 2,
    /// The request failed on its own; `RequestOutput::error` says why.
    Error = 3,
}

impl FinishReason {
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Abort,
        FinishReason::Error,
    ];

    pub fn from_u8(code: u8) -> Option<FinishReason> {
        FinishReason::ALL.get(code as usize).copied()
    }

    /// The lower-case name used by the Python API (`"stop"`, `"length"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }

    pub fn from_name(name: &str) -> Option<FinishReason> {
        FinishReason::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// Log-probabilities of `num_positions` positions, each with `width` entries:
/// the sampled (or, for prompts, the actual) token first, then the top-N.
/// `token_ids` and `logprobs` are row-major `num_positions x width`; `ranks`
/// holds the rank of the sampled/actual token at each position.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub num_positions: u32,
    pub width: u32,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub ranks: Vec<u32>,
}

impl Logprobs {
    /// A borrowed view, what the encoder takes.
    pub fn as_ref(&self) -> LogprobsRef<'_> {
        LogprobsRef {
            num_positions: self.num_positions,
            width: self.width,
            token_ids: &self.token_ids,
            logprobs: &self.logprobs,
            ranks: &self.ranks,
        }
    }

    /// Checks that the arrays have the lengths the shape says.
    pub fn check_shape(&self) -> Result<(), String> {
        self.as_ref().check_shape()
    }
}

/// `Logprobs` with borrowed arrays, so a caller holding flat columns (the
/// Python glue) encodes without a per-request allocation.
#[derive(Debug, Clone, Copy)]
pub struct LogprobsRef<'a> {
    pub num_positions: u32,
    pub width: u32,
    pub token_ids: &'a [u32],
    pub logprobs: &'a [f32],
    pub ranks: &'a [u32],
}

impl LogprobsRef<'_> {
    /// Checks that the arrays have the lengths the shape says.
    pub fn check_shape(&self) -> Result<(), String> {
        let cells = self.num_positions as u64 * self.width as u64;
        if self.token_ids.len() as u64 != cells || self.logprobs.len() as u64 != cells {
            return Err(format!(
                "{} positions x width {} needs {cells} token ids and logprobs, got {} and {}",
                self.num_positions,
                self.width,
                self.token_ids.len(),
                self.logprobs.len()
            ));
        }
        if self.ranks.len() as u64 != self.num_positions as u64 {
            return Err(format!(
                "{} positions need {} ranks, got {}",
                self.num_positions,
                self.num_positions,
                self.ranks.len()
            ));
        }
        Ok(())
    }
}

/// What one request produced in one engine step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestOutput {
    pub wire_id: u64,
    pub new_token_ids: Vec<u32>,
    pub finish_reason: Option<FinishReason>,
    /// The stop token id that finished the request, if one did.
    pub stop_reason: Option<u32>,
    /// Why this request failed on its own (with `FinishReason::Error`).
    pub error: Option<String>,
    pub logprobs: Option<Logprobs>,
    pub prompt_logprobs: Option<Logprobs>,
    /// Prompt tokens served from the prefix cache; carried on a request's first
    /// output only (nil afterwards, so later steps pay one byte for it).
    pub num_cached_tokens: Option<u32>,
    /// An embedding request's pooled hidden state, on its one (final) output;
    /// nil for every generated token.
    pub embedding: Option<Vec<f32>>,
}

/// The scheduler's counters after a step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SchedulerStats {
    pub num_running: u32,
    pub num_waiting: u32,
    pub kv_cache_usage: f32,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
}

/// Everything one engine step produced: one frame per step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutputBatch {
    pub outputs: Vec<RequestOutput>,
    pub stats: SchedulerStats,
    pub timestamp: f64,
}

/// The handshake EngineCore sends once it is ready to serve.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ready {
    pub max_model_len: u32,
    pub num_kv_blocks: u32,
    pub block_size: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    /// The length of the model's hidden states (of an embedding).
    pub hidden_size: u32,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    AddRequests(Vec<AddRequest>),
    Abort {
        wire_ids: Vec<u64>,
    },
    UtilityCall {
        call_id: u64,
        method: String,
        args: Value,
    },
    /// `result` is `Ok(value)` or `Err(error message)`.
    UtilityResult {
        call_id: u64,
        result: Result<Value, String>,
    },
    Ready(Ready),
    /// A fatal error: EngineCore is going away.
    EngineError {
        message: String,
    },
    Shutdown,
    OutputBatch(OutputBatch),
}

impl Message {
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::AddRequests(_) => MessageType::AddRequests,
            Message::Abort { .. } => MessageType::Abort,
            Message::UtilityCall { .. } => MessageType::UtilityCall,
            Message::UtilityResult { .. } => MessageType::UtilityResult,
            Message::Ready(_) => MessageType::Ready,
            Message::EngineError { .. } => MessageType::EngineError,
            Message::Shutdown => MessageType::Shutdown,
            Message::OutputBatch(_) => MessageType::OutputBatch,
        }
    }
}
