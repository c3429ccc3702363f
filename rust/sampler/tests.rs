//! The sampler against a plain f64 reference of the same semantics (a full sort
//! per row), by chi-square over many draws, plus the pieces on their own.

use super::*;

mod units;

const SEED: u64 = 1234;

fn params() -> RowParams {
    RowParams {
        greedy: false,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition: 1.0,
        frequency: 0.0,
        presence: 0.0,
        seed: SEED,
        stream: 7,
        position: 0,
        num_logprobs: -1,
    }
}

/// A tiny deterministic generator for test data.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32) / (1u64 << 24) as f32
    }
    fn logits(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| (self.next() - 0.5) * scale).collect()
    }
}

struct Extra<'a> {
    seen: &'a [u32],
    counts: &'a [u32],
    banned: &'a [u32],
}
const NONE: Extra<'static> = Extra {
    seen: &[],
    counts: &[],
    banned: &[],
};

/// Samples each (logits row, params) pair as a batch; returns (tokens, nonfinite).
fn run(
    logits: &[f32],
    vocab: usize,
    rows: &[RowParams],
    extra: &[Extra<'_>],
    threads: usize,
) -> (Vec<i64>, Vec<usize>) {
    let n = rows.len();
    let mut so = vec![0usize];
    let mut st = vec![];
    let mut sc = vec![];
    let mut bo = vec![0usize];
    let mut bt = vec![];
    for r in 0..n {
        let e = extra.get(r).unwrap_or(&NONE);
        st.extend_from_slice(e.seen);
        sc.extend_from_slice(e.counts);
        so.push(st.len());
        bt.extend_from_slice(e.banned);
        bo.push(bt.len());
    }
    let batch = Batch {
        logits,
        vocab,
        rows,
        seen: TokenLists {
            offsets: &so,
            tokens: &st,
        },
        seen_counts: &sc,
        banned: TokenLists {
            offsets: &bo,
            tokens: &bt,
        },
        masks: Masks::NONE,
        bias: Bias::NONE,
    };
    let mut sampled = vec![0i64; n];
    let mut ranks = vec![0i64; n];
    let out = Outputs {
        sampled: &mut sampled,
        ranks: &mut ranks,
        logprob_ids: &mut [],
        logprob_values: &mut [],
        width: 0,
    };
    let bad = sample(&batch, out, threads).unwrap();
    (sampled, bad)
}

/// The reference probabilities: penalties, temperature, top-k (ties kept),
/// softmax, top-p (ties kept together), min-p — by a full sort, in f64.
fn reference(row: &[f32], p: &RowParams, e: &Extra<'_>) -> Vec<f64> {
    let mut v: Vec<f64> = row.iter().map(|&x| f64::from(x)).collect();
    let mut ov = Vec::new();
    penalties::overrides(row, p, e.seen, e.counts, e.banned, (&[], &[]), &mut ov);
    for (t, x) in ov {
        v[t as usize] = f64::from(x);
    }
    let t = f64::from(p.temperature);
    let z: Vec<f64> = v.iter().map(|x| x / t).collect();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
    let mut keep = vec![true; z.len()];
    if p.top_k > 0 && (p.top_k as usize) < z.len() {
        let kth = z[order[p.top_k as usize - 1]];
        for i in 0..z.len() {
            keep[i] = z[i] >= kth;
        }
    }
    let m = z[order[0]];
    let mut pr: Vec<f64> = (0..z.len())
        .map(|i| if keep[i] { (z[i] - m).exp() } else { 0.0 })
        .collect();
    let total: f64 = pr.iter().sum();
    if p.top_p < 1.0 {
        let mut before = 0.0;
        let mut cut = f64::NEG_INFINITY;
        for &i in &order {
            if before >= f64::from(p.top_p) * total {
                break;
            }
            before += pr[i];
            cut = z[i];
        }
        for i in 0..z.len() {
            if z[i] < cut {
                pr[i] = 0.0;
            }
        }
    }
    if p.min_p > 0.0 {
        for x in pr.iter_mut() {
            if *x < f64::from(p.min_p) {
                *x = 0.0;
            }
        }
    }
    let s: f64 = pr.iter().sum();
    pr.iter().map(|x| x / s).collect()
}

/// Draws `n` tokens from one row (positions 0..n) and checks the counts against
/// `expected` by chi-square (bins of expected count < 5 pooled), at a
/// significance far below any fixed-seed run's bad luck: fails on real bias.
fn chi_square(row: &[f32], p: RowParams, e: &Extra<'_>, n: usize) {
    let vocab = row.len();
    let expected = reference(row, &p, e);
    let batch_rows = 64;
    let mut counts = vec![0usize; vocab];
    let mut logits = Vec::with_capacity(batch_rows * vocab);
    for _ in 0..batch_rows {
        logits.extend_from_slice(row);
    }
    let extras: Vec<Extra<'_>> = (0..batch_rows)
        .map(|_| Extra {
            seen: e.seen,
            counts: e.counts,
            banned: e.banned,
        })
        .collect();
    for start in (0..n).step_by(batch_rows) {
        let rows: Vec<RowParams> = (0..batch_rows)
            .map(|i| RowParams {
                position: (start + i) as u64,
                ..p
            })
            .collect();
        let (tok, bad) = run(&logits, vocab, &rows, &extras, 2);
        assert!(bad.is_empty());
        for t in tok {
            counts[t as usize] += 1;
        }
    }
    let total = (n.div_ceil(batch_rows) * batch_rows) as f64;
    let (mut stat, mut dof) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (i, &pr) in expected.iter().enumerate() {
        let o = counts[i] as f64;
        if pr == 0.0 {
            assert_eq!(counts[i], 0, "token {i} has probability 0 but was drawn");
            continue;
        }
        let ex = pr * total;
        if ex < 5.0 {
            pool_o += o;
            pool_e += ex;
        } else {
            stat += (o - ex).powi(2) / ex;
            dof += 1;
        }
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        dof += 1;
    }
    let dof = dof.saturating_sub(1).max(1) as f64;
    // mean dof, sd sqrt(2 dof): 6 sd is far beyond chance
    let limit = dof + 6.0 * (2.0 * dof).sqrt();
    assert!(
        stat < limit,
        "chi-square {stat:.1} over {dof} dof (limit {limit:.1}) for {p:?}"
    );
}

#[test]
fn distributions_match_the_reference() {
    let mut g = Lcg(3);
    let small = g.logits(40, 6.0);
    let big = g.logits(3000, 10.0);
    let n = 40_000;
    let cases = [
        params(),
        RowParams {
            temperature: 0.5,
            ..params()
        },
        RowParams {
            temperature: 2.0,
            ..params()
        },
        RowParams {
            top_k: 5,
            ..params()
        },
        RowParams {
            top_p: 0.7,
            ..params()
        },
        RowParams {
            min_p: 0.1,
            ..params()
        },
        RowParams {
            top_k: 10,
            top_p: 0.8,
            temperature: 0.7,
            ..params()
        },
        RowParams {
            top_k: 20,
            min_p: 0.05,
            ..params()
        },
        RowParams {
            top_p: 0.9,
            min_p: 0.02,
            temperature: 1.3,
            ..params()
        },
    ];
    for p in cases {
        chi_square(&small, p, &NONE, n);
    }
    for p in [
        RowParams {
            top_p: 0.5,
            ..params()
        },
        RowParams {
            top_k: 30,
            top_p: 0.9,
            ..params()
        },
        RowParams {
            min_p: 0.2,
            ..params()
        },
    ] {
        chi_square(&big, p, &NONE, n);
    }
}
#[test]
fn penalties_and_bans_match_the_reference() {
    let mut g = Lcg(4);
    let row = g.logits(50, 6.0);
    let e = Extra {
        seen: &[3, 7, 11, 20, 49],
        counts: &[0, 2, 1, 0, 3],
        banned: &[7, 0],
    };
    let pen = RowParams {
        repetition: 1.5,
        frequency: 0.4,
        presence: 0.3,
        ..params()
    };
    chi_square(&row, pen, &e, 40_000);
    chi_square(&row, RowParams { top_k: 8, ..pen }, &e, 40_000);
    chi_square(&row, RowParams { top_p: 0.6, ..pen }, &e, 40_000);
}
#[test]
fn ties_at_the_boundaries_are_kept_together() {
    // top-k 2 with three tied at the 2nd place; top-p boundary inside a tie
    let row = [3.0, 1.0, 1.0, 1.0, 0.0, -1.0];
    for (top_k, top_p) in [(2, 1.0), (0, 0.7), (3, 0.7)] {
        let p = RowParams {
            top_k,
            top_p,
            ..params()
        };
        chi_square(&row, p, &NONE, 30_000);
    }
}
