//! Readers of the compound fields that more than one message carries (logprobs,
//! finish reasons, scheduler stats). Both decoders use them — `decode` for owned
//! messages and `columns` for the front end's column view of an output batch — so
//! each layout has one reader.

use super::encode::{LOGPROBS_FIELDS, STATS_FIELDS};
use super::error::{WireError, WireResult};
use super::messages::{FinishReason, Logprobs, SchedulerStats};
use super::reader::Reader;

/// Field paths of a `Logprobs` in errors: the whole, then each field.
pub(super) type LogprobsPaths = [&'static str; LOGPROBS_FIELDS + 1];

pub(super) const LOGPROBS_PATHS: LogprobsPaths = [
    "logprobs",
    "logprobs.num_positions",
    "logprobs.width",
    "logprobs.token_ids",
    "logprobs.logprobs",
    "logprobs.ranks",
];
pub(super) const PROMPT_LOGPROBS_PATHS: LogprobsPaths = [
    "prompt_logprobs",
    "prompt_logprobs.num_positions",
    "prompt_logprobs.width",
    "prompt_logprobs.token_ids",
    "prompt_logprobs.logprobs",
    "prompt_logprobs.ranks",
];

pub(super) fn read_finish_reason(r: &mut Reader<'_>) -> WireResult<FinishReason> {
    let code = r.u8("finish_reason")?;
    FinishReason::from_u8(code).ok_or_else(|| {
        WireError::malformed("finish_reason", format!("unknown finish reason {code}"))
    })
}

pub(super) fn read_opt_logprobs(
    r: &mut Reader<'_>,
    paths: &LogprobsPaths,
) -> WireResult<Option<Logprobs>> {
    if r.try_nil() {
        return Ok(None);
    }
    r.expect_array(LOGPROBS_FIELDS, paths[0])?;
    let lp = Logprobs {
        num_positions: r.u32(paths[1])?,
        width: r.u32(paths[2])?,
        token_ids: r.u32s(paths[3])?,
        logprobs: r.f32s(paths[4])?,
        ranks: r.u32s(paths[5])?,
    };
    lp.check_shape()
        .map_err(|reason| WireError::malformed(paths[0], reason))?;
    Ok(Some(lp))
}

pub(super) fn read_stats(r: &mut Reader<'_>) -> WireResult<SchedulerStats> {
    r.expect_array(STATS_FIELDS, "")?;
    Ok(SchedulerStats {
        num_running: r.u32("num_running")?,
        num_waiting: r.u32("num_waiting")?,
        kv_cache_usage: r.f32("kv_cache_usage")?,
        prefix_cache_queries: r.u64("prefix_cache_queries")?,
        prefix_cache_hits: r.u64("prefix_cache_hits")?,
        num_preemptions: r.u64("num_preemptions")?,
    })
}
