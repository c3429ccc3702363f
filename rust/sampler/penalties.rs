//! Sparse logit changes: a request's penalties touch only the tokens it has
//! seen, its logit bias only the tokens it names, and its bans (`min_tokens`,
//! bad words) only those tokens, so a row's changes are a short sorted list of
//! (token, new logit) — the row itself is never copied.

use super::RowParams;

/// Fills `out` with the changed logits of a row, sorted by token: the biased
/// tokens (logit + bias; `bias` is (tokens sorted and distinct, values)), the
/// banned tokens (-inf) and the seen tokens with their penalties applied to the
/// biased logit as the torch reference does — repetition (prompt and outputs) divides a positive logit
/// and multiplies a negative one, then frequency × output count and presence
/// (output count > 0) are subtracted. `seen` and `counts` are parallel: a seen
/// token and how often it occurs among the outputs (0: only in the prompt).
/// Token ids were checked to be in range.
pub(super) fn overrides(
    row: &[f32],
    p: &RowParams,
    seen: &[u32],
    counts: &[u32],
    banned: &[u32],
    bias: (&[u32], &[f32]),
    out: &mut Vec<(u32, f32)>,
) {
    out.clear();
    let (bias_tokens, bias_values) = bias;
    out.extend(
        bias_tokens
            .iter()
            .zip(bias_values)
            .map(|(&t, &b)| (t, row[t as usize] + b)),
    );
    if p.repetition != 1.0 || p.frequency != 0.0 || p.presence != 0.0 {
        for (&t, &c) in seen.iter().zip(counts) {
            let mut v = row[t as usize];
            if !bias_tokens.is_empty() {
                if let Ok(i) = bias_tokens.binary_search(&t) {
                    v += bias_values[i];
                }
            }
            if p.repetition != 1.0 {
                v = if v > 0.0 {
                    v / p.repetition
                } else {
                    v * p.repetition
                };
            }
            v -= p.frequency * c as f32;
            if c > 0 {
                v -= p.presence;
            }
            out.push((t, v));
        }
    }
    out.extend(banned.iter().map(|&t| (t, f32::NEG_INFINITY)));
    // Stable: a token's last entry wins: penalised over biased (the penalty was
    // applied to the biased logit), banned over both.
    out.sort_by_key(|o| o.0);
    out.dedup_by(|later, earlier| {
        if later.0 == earlier.0 {
            earlier.1 = later.1;
            true
        } else {
            false
        }
    });
}

/// Calls `f(start, values)` for the row's entries in index order, with the
/// changed entries (`ov`, sorted by token) given as one-element slices.
#[inline(always)]
pub(super) fn segments(row: &[f32], ov: &[(u32, f32)], mut f: impl FnMut(usize, &[f32])) {
    let mut start = 0;
    for (t, v) in ov {
        let t = *t as usize;
        if t > start {
            f(start, &row[start..t]);
        }
        f(t, std::slice::from_ref(v));
        start = t + 1;
    }
    if start < row.len() {
        f(start, &row[start..]);
    }
}
