//! The sampler's argument checks: every shape, list and parameter is checked
//! before anything is written, so a bad call fails whole with a message naming
//! the row and the field.

use super::{Batch, Bias, Masks, Outputs, TokenLists};
use crate::kernels::KernelError;

fn bad(msg: String) -> KernelError {
    KernelError::Shape(msg)
}

pub(super) fn check(
    b: &Batch<'_>,
    out: &Outputs<'_>,
    num_threads: usize,
) -> Result<(), KernelError> {
    let n = b.rows.len();
    if num_threads == 0 {
        return Err(bad("num_threads must be at least 1".into()));
    }
    if b.vocab == 0 || b.vocab > u32::MAX as usize {
        return Err(bad(format!("vocab must be in 1..2^32, got {}", b.vocab)));
    }
    if b.logits.len() != n * b.vocab {
        return Err(bad(format!(
            "logits must be [rows={n}, vocab={}], got {} values",
            b.vocab,
            b.logits.len()
        )));
    }
    if out.sampled.len() != n || out.ranks.len() != n {
        return Err(bad(format!("sampled and ranks must have {n} entries")));
    }
    if out.logprob_ids.len() != n * out.width || out.logprob_values.len() != n * out.width {
        return Err(bad(format!("logprob outputs must be [{n}, {}]", out.width)));
    }
    check_masks(b, n)?;
    check_lists(&b.seen, n, b.vocab, "seen")?;
    check_lists(&b.banned, n, b.vocab, "banned")?;
    check_bias(&b.bias, n, b.vocab)?;
    if b.seen_counts.len() != b.seen.tokens.len() {
        return Err(bad("seen_counts must be as long as seen_tokens".into()));
    }
    for (r, p) in b.rows.iter().enumerate() {
        if p.num_logprobs >= 0 && p.num_logprobs as usize + 1 > out.width {
            return Err(bad(format!(
                "row {r}: num_logprobs {} needs logprob outputs of width {}, got {}",
                p.num_logprobs,
                p.num_logprobs + 1,
                out.width
            )));
        }
        let finite = p.frequency.is_finite() && p.presence.is_finite();
        if !(p.repetition > 0.0 && p.repetition.is_finite() && finite) {
            return Err(bad(format!(
                "row {r}: penalties must be finite and repetition > 0, got {p:?}"
            )));
        }
        if p.greedy {
            continue;
        }
        if !(p.temperature > 0.0 && p.temperature.is_finite()) {
            return Err(bad(format!(
                "row {r}: temperature must be > 0 and finite, got {}",
                p.temperature
            )));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(bad(format!(
                "row {r}: top_p must be in (0, 1], got {}",
                p.top_p
            )));
        }
        if !(0.0..=1.0).contains(&p.min_p) {
            return Err(bad(format!(
                "row {r}: min_p must be in [0, 1], got {}",
                p.min_p
            )));
        }
    }
    Ok(())
}

fn check_masks(b: &Batch<'_>, n: usize) -> Result<(), KernelError> {
    let k = &b.masks;
    if k.of_row.is_empty() {
        return Ok(());
    }
    if k.of_row.len() != n {
        return Err(bad(format!(
            "mask rows must have {n} entries, got {}",
            k.of_row.len()
        )));
    }
    if k.words < b.vocab.div_ceil(32) || !k.bits.len().is_multiple_of(k.words) {
        return Err(bad(format!(
            "bitmask of {} words per row does not cover vocab {}",
            k.words, b.vocab
        )));
    }
    let m = k.bits.len() / k.words;
    if let Some(i) = k
        .of_row
        .iter()
        .find(|&&i| i != Masks::UNCONSTRAINED && i >= m)
    {
        return Err(bad(format!("mask {i} is not in 0..{m}")));
    }
    Ok(())
}

fn check_lists(l: &TokenLists<'_>, n: usize, vocab: usize, name: &str) -> Result<(), KernelError> {
    if l.offsets.len() != n + 1 || l.offsets[0] != 0 || l.offsets[n] != l.tokens.len() {
        return Err(bad(format!(
            "{name}_offsets must be {} nondecreasing offsets from 0 to {}",
            n + 1,
            l.tokens.len()
        )));
    }
    if l.offsets.windows(2).any(|w| w[0] > w[1]) {
        return Err(bad(format!("{name}_offsets must be nondecreasing")));
    }
    if let Some(t) = l.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(bad(format!("{name} token {t} is not in 0..{vocab}")));
    }
    Ok(())
}

fn check_bias(b: &Bias<'_>, n: usize, vocab: usize) -> Result<(), KernelError> {
    if b.offsets.is_empty() {
        return Ok(());
    }
    let lists = TokenLists {
        offsets: b.offsets,
        tokens: b.tokens,
    };
    check_lists(&lists, n, vocab, "bias")?;
    if b.values.len() != b.tokens.len() {
        return Err(bad("bias_values must be as long as bias_tokens".into()));
    }
    if let Some(v) = b.values.iter().find(|v| !v.is_finite()) {
        return Err(bad(format!("bias value {v} is not finite")));
    }
    for r in 0..n {
        let row = &b.tokens[b.offsets[r]..b.offsets[r + 1]];
        if row.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad(format!(
                "row {r}: bias tokens must be sorted and distinct"
            )));
        }
    }
    Ok(())
}
