//! Sparse logit changes: a request's penalties touch only the tokens it has
//! seen and its `min_tokens` mask only its stop tokens, so a row's changes are
//! a short sorted list of (token, new logit) — the row itself is never copied.

use super::RowParams;

/// Fills `out` with the changed logits of a row, sorted by token: the banned
/// tokens (-inf) and the seen tokens with their penalties applied as the torch
/// reference does — repetition (prompt and outputs) divides a positive logit
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
    out: &mut Vec<(u32, f32)>,
) {
    out.clear();
    if p.repetition != 1.0 || p.frequency != 0.0 || p.presence != 0.0 {
        for (&t, &c) in seen.iter().zip(counts) {
            let mut v = row[t as usize];
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
    // Stable: for a token both seen and banned the ban (pushed last) wins.
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
