//! An output batch decoded into columns: one allocation per column instead of
//! one per request, which is what the per-step hot path of the front end wants
//! (the Python `OutputBatch` view wraps this). `decode` builds the owned
//! `OutputBatch` from the same parse, so there is one reader of the layout; the
//! compound fields' readers are `fields.rs`'s.

use super::encode::{OUTPUT_BATCH_FIELDS, REQUEST_OUTPUT_FIELDS};
use super::error::{WireError, WireResult};
use super::fields::{
    read_finish_reason, read_opt_logprobs, read_stats, LOGPROBS_PATHS, PROMPT_LOGPROBS_PATHS,
};
use super::frame::split_frame;
use super::messages::{
    FinishReason, Logprobs, MessageType, OutputBatch, RequestOutput, SchedulerStats,
};
use super::reader::Reader;

/// A decoded output batch, column by column; output i is entry i of each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutputBatchColumns {
    pub wire_ids: Vec<u64>,
    /// Output i's new token ids are `token_ids[token_ends[i - 1]..token_ends[i]]`.
    pub token_ends: Vec<usize>,
    pub token_ids: Vec<u32>,
    pub finish_reasons: Vec<Option<FinishReason>>,
    pub stop_reasons: Vec<Option<u32>>,
    pub errors: Vec<Option<String>>,
    pub logprobs: Vec<Option<Logprobs>>,
    pub prompt_logprobs: Vec<Option<Logprobs>>,
    pub num_cached_tokens: Vec<Option<u32>>,
    pub embeddings: Vec<Option<Vec<f32>>>,
    pub stats: SchedulerStats,
    pub timestamp: f64,
}

impl OutputBatchColumns {
    pub fn len(&self) -> usize {
        self.wire_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.wire_ids.is_empty()
    }

    /// Output `i`'s new token ids (`i < len()`).
    pub fn new_token_ids(&self, i: usize) -> &[u32] {
        let start = if i == 0 { 0 } else { self.token_ends[i - 1] };
        &self.token_ids[start..self.token_ends[i]]
    }

    pub fn into_batch(self) -> OutputBatch {
        let mut outputs = Vec::with_capacity(self.len());
        let mut start = 0;
        let columns = self
            .wire_ids
            .into_iter()
            .zip(self.token_ends)
            .zip(self.finish_reasons)
            .zip(self.stop_reasons)
            .zip(self.errors)
            .zip(self.logprobs)
            .zip(self.prompt_logprobs)
            .zip(self.num_cached_tokens)
            .zip(self.embeddings);
        for ((((((((wire_id, end), finish_reason), stop_reason), error), lp), plp), cached), emb) in
            columns
        {
            outputs.push(RequestOutput {
                wire_id,
                new_token_ids: self.token_ids[start..end].to_vec(),
                finish_reason,
                stop_reason,
                error,
                logprobs: lp,
                prompt_logprobs: plp,
                num_cached_tokens: cached,
                embedding: emb,
            });
            start = end;
        }
        OutputBatch {
            outputs,
            stats: self.stats,
            timestamp: self.timestamp,
        }
    }
}

impl From<OutputBatch> for OutputBatchColumns {
    fn from(batch: OutputBatch) -> OutputBatchColumns {
        let mut c = OutputBatchColumns {
            stats: batch.stats,
            timestamp: batch.timestamp,
            ..OutputBatchColumns::default()
        };
        for o in batch.outputs {
            c.wire_ids.push(o.wire_id);
            c.token_ids.extend_from_slice(&o.new_token_ids);
            c.token_ends.push(c.token_ids.len());
            c.finish_reasons.push(o.finish_reason);
            c.stop_reasons.push(o.stop_reason);
            c.errors.push(o.error);
            c.logprobs.push(o.logprobs);
            c.prompt_logprobs.push(o.prompt_logprobs);
            c.num_cached_tokens.push(o.num_cached_tokens);
            c.embeddings.push(o.embedding);
        }
        c
    }
}

/// Decodes an `OutputBatch` frame into columns; any other message type is an
/// error.
pub fn decode_output_batch(frame: &[u8], max_frame_size: usize) -> WireResult<OutputBatchColumns> {
    let (message_type, body) = split_frame(frame, max_frame_size)?;
    if message_type != MessageType::OutputBatch {
        return Err(WireError::malformed(
            "frame header",
            format!(
                "expected an OutputBatch frame, found {}",
                message_type.name()
            ),
        ));
    }
    let mut r = Reader::new(body);
    let columns = read_output_batch_columns(&mut r)?;
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes {
            message: message_type.name(),
            count: r.remaining(),
        });
    }
    Ok(columns)
}

pub(super) fn read_output_batch_columns(r: &mut Reader<'_>) -> WireResult<OutputBatchColumns> {
    r.expect_array(OUTPUT_BATCH_FIELDS, "OutputBatch")?;
    let n = r.array_len("OutputBatch.outputs")?;
    let mut c = OutputBatchColumns {
        wire_ids: Vec::with_capacity(n),
        token_ends: Vec::with_capacity(n),
        token_ids: Vec::with_capacity(n),
        finish_reasons: Vec::with_capacity(n),
        stop_reasons: Vec::with_capacity(n),
        errors: Vec::with_capacity(n),
        logprobs: Vec::with_capacity(n),
        prompt_logprobs: Vec::with_capacity(n),
        num_cached_tokens: Vec::with_capacity(n),
        embeddings: Vec::with_capacity(n),
        ..OutputBatchColumns::default()
    };
    for i in 0..n {
        read_output_into(r, &mut c).map_err(|e| e.within(&format!("OutputBatch.outputs[{i}]")))?;
    }
    c.stats = read_stats(r).map_err(|e| e.within("OutputBatch.stats"))?;
    c.timestamp = r.f64("OutputBatch.timestamp")?;
    Ok(c)
}

fn read_output_into(r: &mut Reader<'_>, c: &mut OutputBatchColumns) -> WireResult<()> {
    r.expect_array(REQUEST_OUTPUT_FIELDS, "")?;
    c.wire_ids.push(r.u64("wire_id")?);
    let words = r.words("new_token_ids")?;
    c.token_ids.extend(
        words
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
    );
    c.token_ends.push(c.token_ids.len());
    c.finish_reasons.push(r.opt(read_finish_reason)?);
    c.stop_reasons.push(r.opt(|r| r.u32("stop_reason"))?);
    c.errors
        .push(r.opt(|r| r.str("error").map(str::to_string))?);
    c.logprobs.push(read_opt_logprobs(r, &LOGPROBS_PATHS)?);
    c.prompt_logprobs
        .push(read_opt_logprobs(r, &PROMPT_LOGPROBS_PATHS)?);
    c.num_cached_tokens
        .push(r.opt(|r| r.u32("num_cached_tokens"))?);
    c.embeddings.push(r.opt(|r| r.f32s("embedding"))?);
    Ok(())
}
