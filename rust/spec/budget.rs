//! The draft caps of `asyncllm.worker.draft_budget.DraftBudget.caps`: which of
//! the requests' draft positions a step verifies, those that maximise the
//! step's expected tokens per second. Pure Rust: its dozen numpy calls on
//! arrays of a few elements had cost ~175 µs a step at batch 1 (SmolLM2 GGUF,
//! Zen 5; the step's weight reads evict what they touch), one call costs a few.

/// What `caps` reads: per proposing request, its decayed counts of drafts that
/// reached and were accepted at each of the `k` positions (row-major `[n, k]`).
pub struct Acceptance<'a> {
    pub accepted: &'a [f64],
    pub reached: &'a [f64],
    pub k: usize,
    /// The all-request acceptance rate: the prior of each request's own.
    pub overall: f64,
    /// How many verifications the prior weighs as.
    pub prior_weight: f64,
}

/// The step's cost `t0 + t1 * rows` (seconds), its requests, and the share of a
/// row's cost a position may fall short of paying by and still be taken.
pub struct StepCost {
    pub t0: f64,
    pub t1: f64,
    pub num_rows: usize,
    pub slack: f64,
}

/// Each request's draft cap. A position's gain is the probability that it and
/// every one before it are accepted (per position: the request's own rate with
/// its rate over all positions as the prior, that one with `overall`); the
/// positions are ranked by gain (ties: the earlier request and position
/// first), the ranking's prefix of the best tokens per second taken, then every
/// further position whose gain pays for its row at that rate within `slack`.
/// A request's share is a prefix of its own positions (its gains fall).
pub fn caps(acc: &Acceptance<'_>, cost: &StepCost) -> Vec<usize> {
    let k = acc.k;
    let n = acc.accepted.len().checked_div(k).unwrap_or(0);
    assert!(
        acc.accepted.len() == n * k && acc.reached.len() == n * k,
        "caps: [n, k] counts"
    );
    let w = acc.prior_weight;
    let mut gains = Vec::with_capacity(n * k);
    for i in 0..n {
        let took = &acc.accepted[i * k..(i + 1) * k];
        let reached = &acc.reached[i * k..(i + 1) * k];
        let own = (took.iter().sum::<f64>() + w * acc.overall) / (reached.iter().sum::<f64>() + w);
        let mut gain = 1.0;
        for (t, r) in took.iter().zip(reached) {
            gain *= ((t + w * own) / (r + w)).min(1.0);
            gains.push(gain);
        }
    }
    // descending, stable: equal gains keep their order
    let mut order: Vec<usize> = (0..gains.len()).collect();
    order.sort_by(|&a, &b| gains[b].total_cmp(&gains[a]));
    let rows = cost.num_rows as f64;
    let rate =
        |taken: usize, tokens: f64| tokens / (cost.t0 + cost.t1 * (rows + taken as f64)).max(1e-9);
    let (mut best, mut best_rate) = (0, rate(0, rows));
    let mut tokens = rows;
    for (m, &at) in order.iter().enumerate() {
        tokens += gains[at];
        let r = rate(m + 1, tokens);
        if r > best_rate {
            (best, best_rate) = (m + 1, r);
        }
    }
    let need = best_rate * cost.t1 * (1.0 - cost.slack);
    best = best.max(gains.iter().filter(|&&g| g >= need).count());
    let mut out = vec![0; n];
    for &at in &order[..best] {
        out[at / k] += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acceptance<'a>(accepted: &'a [f64], reached: &'a [f64], k: usize) -> Acceptance<'a> {
        Acceptance {
            accepted,
            reached,
            k,
            overall: 0.7,
            prior_weight: 2.0,
        }
    }

    fn cost(t0: f64, t1: f64, num_rows: usize) -> StepCost {
        StepCost {
            t0,
            t1,
            num_rows,
            slack: 0.1,
        }
    }

    #[test]
    fn free_rows_take_every_draft_and_dear_ones_only_likely_ones() {
        let (took, reached) = ([4.0; 8], [4.0; 8]);
        let acc = acceptance(&took, &reached, 8);
        assert_eq!(caps(&acc, &cost(1e-3, 0.0, 1)), vec![8]);
        // a row costing the whole step: a draft pays when it is near certain
        assert_eq!(caps(&acc, &cost(1e-3, 1.0, 1)), vec![8]);
        let rare = [1.0; 8];
        let acc = acceptance(&rare, &reached, 8);
        assert_eq!(caps(&acc, &cost(1e-3, 1.0, 1)), vec![0]);
        assert_eq!(caps(&acc, &cost(1e-3, 0.0, 1)), vec![8]);
    }

    #[test]
    fn each_request_gets_what_its_own_acceptance_pays_for() {
        // request 0 always accepted, request 1 never
        let took = [[5.0; 4], [0.0; 4]].concat();
        let reached = [5.0; 8];
        let acc = acceptance(&took, &reached, 4);
        let got = caps(&acc, &cost(4e-3, 1e-3, 2));
        assert_eq!(got, vec![4, 0]);
    }

    #[test]
    fn a_request_cap_is_a_prefix_and_ties_go_to_the_earlier_request() {
        let (took, reached) = ([1.0; 6], [2.0; 6]);
        let acc = acceptance(&took, &reached, 3);
        let got = caps(&acc, &cost(4e-3, 1.5e-3, 2));
        assert!(got[0] >= got[1] && got[0] - got[1] <= 1, "{got:?}");
    }

    #[test]
    fn nothing_to_propose_gives_nothing() {
        let acc = acceptance(&[], &[], 8);
        assert!(caps(&acc, &cost(1e-3, 1e-4, 1)).is_empty());
    }
}
