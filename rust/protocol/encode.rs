//! Encoders: one per message, each writing the positional msgpack layout that
//! `decode.rs` reads. `OutputBatchWriter` streams an output batch request by
//! request from borrowed slices, so a caller holding columns (the Python glue)
//! needs no per-request allocation.

use super::add_request::{write_add_request, AddRequest};
use super::error::{WireError, WireResult};
use super::frame::header;
use super::messages::{
    FinishReason, LogprobsRef, Message, MessageType, OutputBatch, Ready, SchedulerStats,
};
use super::value::{write_value, Value};
use super::writer::Writer;

// Field counts of the positional arrays; `decode.rs` checks the same numbers.
pub(super) const REQUEST_OUTPUT_FIELDS: usize = 9;
pub(super) const LOGPROBS_FIELDS: usize = 5;
pub(super) const STATS_FIELDS: usize = 6;
pub(super) const OUTPUT_BATCH_FIELDS: usize = 3;
pub(super) const READY_FIELDS: usize = 6;

fn frame_writer(message_type: MessageType, capacity: usize) -> Writer {
    frame_writer_in(Vec::new(), message_type, capacity)
}

/// A writer that appends the frame to `buf` (normally empty), reusing its
/// allocation: callers that encode large frames over and over keep one warm
/// buffer instead of faulting in fresh pages on every frame.
fn frame_writer_in(buf: Vec<u8>, message_type: MessageType, capacity: usize) -> Writer {
    let mut w = Writer::from_vec(buf);
    w.reserve(capacity);
    w.raw(&header(message_type));
    w
}

/// Encodes any message.
pub fn encode(message: &Message) -> WireResult<Vec<u8>> {
    match message {
        Message::AddRequests(requests) => encode_add_requests(requests),
        Message::Abort { wire_ids } => encode_abort(wire_ids),
        Message::UtilityCall {
            call_id,
            method,
            args,
        } => encode_utility_call(*call_id, method, args),
        Message::UtilityResult { call_id, result } => {
            encode_utility_result(*call_id, result.as_ref().map_err(|e| e.as_str()))
        }
        Message::Ready(ready) => encode_ready(ready),
        Message::EngineError { message } => encode_engine_error(message),
        Message::Shutdown => Ok(encode_shutdown()),
        Message::OutputBatch(batch) => encode_output_batch(batch),
    }
}

/// A burst of new requests (one request is a burst of one).
pub fn encode_add_requests<'a, I>(requests: I) -> WireResult<Vec<u8>>
where
    I: IntoIterator<Item = &'a AddRequest>,
    I::IntoIter: ExactSizeIterator + Clone,
{
    encode_add_requests_in(Vec::new(), requests)
}

/// `encode_add_requests`, appending the frame to `buf` (see `frame_writer_in`).
pub fn encode_add_requests_in<'a, I>(buf: Vec<u8>, requests: I) -> WireResult<Vec<u8>>
where
    I: IntoIterator<Item = &'a AddRequest>,
    I::IntoIter: ExactSizeIterator + Clone,
{
    let requests = requests.into_iter();
    let capacity: usize = requests.clone().map(AddRequest::wire_capacity).sum();
    let mut w = frame_writer_in(buf, MessageType::AddRequests, 8 + capacity);
    w.array_len(requests.len(), "AddRequests")?;
    for (i, r) in requests.enumerate() {
        write_add_request(&mut w, r).map_err(|e| e.within(&format!("AddRequests[{i}]")))?;
    }
    Ok(w.into_bytes())
}

pub fn encode_abort(wire_ids: &[u64]) -> WireResult<Vec<u8>> {
    let mut w = frame_writer(MessageType::Abort, 8 + 9 * wire_ids.len());
    w.array_len(1, "Abort")?;
    w.array_len(wire_ids.len(), "Abort.wire_ids")?;
    for &id in wire_ids {
        w.uint(id);
    }
    Ok(w.into_bytes())
}

pub fn encode_utility_call(call_id: u64, method: &str, args: &Value) -> WireResult<Vec<u8>> {
    let mut w = frame_writer(MessageType::UtilityCall, 64 + method.len());
    w.array_len(3, "UtilityCall")?;
    w.uint(call_id);
    w.str(method, "UtilityCall.method")?;
    write_value(&mut w, args, "UtilityCall.args")?;
    Ok(w.into_bytes())
}

/// `result` is the call's value, or the error message when it failed.
pub fn encode_utility_result(call_id: u64, result: Result<&Value, &str>) -> WireResult<Vec<u8>> {
    let mut w = frame_writer(MessageType::UtilityResult, 64);
    w.array_len(3, "UtilityResult")?;
    w.uint(call_id);
    w.bool(result.is_ok());
    match result {
        Ok(value) => write_value(&mut w, value, "UtilityResult.value")?,
        Err(message) => w.str(message, "UtilityResult.error")?,
    }
    Ok(w.into_bytes())
}

pub fn encode_ready(ready: &Ready) -> WireResult<Vec<u8>> {
    let mut w = frame_writer(MessageType::Ready, 32 + 4 * ready.eos_token_ids.len());
    w.array_len(READY_FIELDS, "Ready")?;
    w.uint(ready.max_model_len as u64);
    w.uint(ready.num_kv_blocks as u64);
    w.uint(ready.block_size as u64);
    w.uint(ready.vocab_size as u64);
    w.u32s(&ready.eos_token_ids, "Ready.eos_token_ids")?;
    w.uint(ready.hidden_size as u64);
    Ok(w.into_bytes())
}

pub fn encode_engine_error(message: &str) -> WireResult<Vec<u8>> {
    let mut w = frame_writer(MessageType::EngineError, 8 + message.len());
    w.array_len(1, "EngineError")?;
    w.str(message, "EngineError.message")?;
    Ok(w.into_bytes())
}

pub fn encode_shutdown() -> Vec<u8> {
    let mut w = frame_writer(MessageType::Shutdown, 3);
    w.raw(&[0x90]);
    w.into_bytes()
}

pub fn encode_output_batch(batch: &OutputBatch) -> WireResult<Vec<u8>> {
    let num_tokens: usize = batch.outputs.iter().map(|o| o.new_token_ids.len()).sum();
    let mut w = OutputBatchWriter::new(batch.outputs.len(), num_tokens)?;
    for o in &batch.outputs {
        w.push(&RequestOutputRef {
            wire_id: o.wire_id,
            new_token_ids: &o.new_token_ids,
            finish_reason: o.finish_reason,
            stop_reason: o.stop_reason,
            error: o.error.as_deref(),
            logprobs: o.logprobs.as_ref().map(|lp| lp.as_ref()),
            prompt_logprobs: o.prompt_logprobs.as_ref().map(|lp| lp.as_ref()),
            num_cached_tokens: o.num_cached_tokens,
            embedding: o.embedding.as_deref(),
        })?;
    }
    w.finish(&batch.stats, batch.timestamp)
}

/// One request's output, borrowed: what `OutputBatchWriter::push` takes.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestOutputRef<'a> {
    pub wire_id: u64,
    pub new_token_ids: &'a [u32],
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<u32>,
    pub error: Option<&'a str>,
    pub logprobs: Option<LogprobsRef<'a>>,
    pub prompt_logprobs: Option<LogprobsRef<'a>>,
    pub num_cached_tokens: Option<u32>,
    pub embedding: Option<&'a [f32]>,
}

/// Writes an output batch of a known number of outputs, one `push` per output,
/// then `finish` with the stats.
pub struct OutputBatchWriter {
    w: Writer,
    declared: usize,
    pushed: usize,
}

impl OutputBatchWriter {
    /// `num_tokens` (all outputs' new tokens together) sizes the buffer.
    pub fn new(num_outputs: usize, num_tokens: usize) -> WireResult<OutputBatchWriter> {
        OutputBatchWriter::new_in(Vec::new(), num_outputs, num_tokens)
    }

    /// Like `new`, appending the frame to `buf` (see `frame_writer_in`).
    pub fn new_in(
        buf: Vec<u8>,
        num_outputs: usize,
        num_tokens: usize,
    ) -> WireResult<OutputBatchWriter> {
        let capacity = 64 + 24 * num_outputs + 4 * num_tokens;
        let mut w = frame_writer_in(buf, MessageType::OutputBatch, capacity);
        w.array_len(OUTPUT_BATCH_FIELDS, "OutputBatch")?;
        w.array_len(num_outputs, "OutputBatch.outputs")?;
        Ok(OutputBatchWriter {
            w,
            declared: num_outputs,
            pushed: 0,
        })
    }

    #[inline]
    pub fn push(&mut self, o: &RequestOutputRef<'_>) -> WireResult<()> {
        if self.pushed == self.declared {
            return Err(self.count_mismatch(self.pushed + 1));
        }
        let i = self.pushed;
        self.pushed += 1;
        let w = &mut self.w;
        w.array_len(REQUEST_OUTPUT_FIELDS, "")?;
        w.uint(o.wire_id);
        w.u32s(o.new_token_ids, "new_token_ids")
            .map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?;
        w.opt_uint(o.finish_reason.map(|r| r as u64));
        w.opt_uint(o.stop_reason.map(u64::from));
        match o.error {
            Some(e) => w
                .str(e, "error")
                .map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?,
            None => w.nil(),
        }
        write_opt_logprobs(w, o.logprobs, "logprobs")
            .map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?;
        write_opt_logprobs(w, o.prompt_logprobs, "prompt_logprobs")
            .map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?;
        w.opt_uint(o.num_cached_tokens.map(u64::from));
        match o.embedding {
            Some(v) => w
                .f32s(v, "embedding")
                .map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?,
            None => w.nil(),
        }
        Ok(())
    }

    pub fn finish(mut self, stats: &SchedulerStats, timestamp: f64) -> WireResult<Vec<u8>> {
        if self.pushed != self.declared {
            return Err(self.count_mismatch(self.pushed));
        }
        let w = &mut self.w;
        w.array_len(STATS_FIELDS, "OutputBatch.stats")?;
        w.uint(stats.num_running as u64);
        w.uint(stats.num_waiting as u64);
        w.f32(stats.kv_cache_usage);
        w.uint(stats.prefix_cache_queries);
        w.uint(stats.prefix_cache_hits);
        w.uint(stats.num_preemptions);
        w.f64(timestamp);
        Ok(self.w.into_bytes())
    }

    #[cold]
    fn count_mismatch(&self, got: usize) -> WireError {
        WireError::encode(
            "OutputBatch.outputs",
            format!("declared {} outputs, got {got}", self.declared),
        )
    }
}

#[inline]
fn write_opt_logprobs(w: &mut Writer, lp: Option<LogprobsRef<'_>>, path: &str) -> WireResult<()> {
    let Some(lp) = lp else {
        w.nil();
        return Ok(());
    };
    lp.check_shape()
        .map_err(|reason| WireError::encode(path, reason))?;
    w.array_len(LOGPROBS_FIELDS, path)?;
    w.uint(lp.num_positions as u64);
    w.uint(lp.width as u64);
    w.u32s(lp.token_ids, path)?;
    w.f32s(lp.logprobs, path)?;
    w.u32s(lp.ranks, path)?;
    Ok(())
}
