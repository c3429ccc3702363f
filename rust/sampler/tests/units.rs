//! The pieces on their own: Philox, the exponential, the selections, greedy,
//! batch independence, logprobs, non-finite rows, bad arguments.

use super::super::select;
use super::super::top_k::TopK;
use super::*;

#[test]
fn philox_known_answers() {
    // Random123's kat_vectors for philox4x32_10
    assert_eq!(
        philox4x32_10([0; 4], [0; 2]),
        [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    );
    assert_eq!(
        philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
        [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    );
    assert_eq!(
        philox4x32_10(
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0]
        ),
        [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
    );
}
#[test]
fn uniforms_are_in_range_and_keyed() {
    let mut sum = 0.0;
    for pos in 0..10_000 {
        let u = uniform(5, 0, pos);
        assert!((0.0..1.0).contains(&u));
        sum += u;
    }
    assert!((sum / 10_000.0 - 0.5).abs() < 0.02);
    assert_ne!(uniform(5, 0, 0), uniform(6, 0, 0));
    assert_ne!(uniform(5, 0, 0), uniform(5, 1, 0));
    assert_ne!(uniform(5, 0, 0), uniform(5, 0, 1));
}
#[test]
fn fast_exp_is_accurate() {
    fn check<A: select::Arith>() {
        let mut x = -87.0f32;
        while x < 0.5 {
            let got = f64::from(select::exp::<A>(x));
            let want = f64::from(x).exp();
            assert!(
                ((got - want) / want).abs() < 5e-7,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(select::exp::<A>(f32::NEG_INFINITY), 0.0);
        assert_eq!(select::exp::<A>(f32::NAN), 0.0);
    }
    check::<select::Split>();
    check::<select::Fused>();
}

#[test]
fn row_exponentials_are_accurate() {
    fn check<A: select::Arith>() {
        let xs: Vec<f32> = (0..12_000).map(|i| -87.0 + i as f32 * 0.00725).collect();
        for inv_t in [1.0f32, 0.7, 2.5] {
            let mut e = vec![0.0f32; xs.len()];
            select::exp_into::<A>(&xs, 0.0, inv_t, &mut e);
            for (&x, &got) in xs.iter().zip(&e) {
                let z = f64::from(x) * f64::from(inv_t);
                let want = z.exp();
                if z < -87.0 {
                    assert!(got == 0.0 || (f64::from(got) - want).abs() < 1e-37);
                    continue;
                }
                let rel = ((f64::from(got) - want) / want).abs();
                assert!(
                    rel < 2e-7 * (1.0 + z.abs()),
                    "exp({z}) = {got}, want {want}"
                );
            }
        }
        let mut e = [1.0f32; 3];
        select::exp_into::<A>(&[f32::NEG_INFINITY, f32::NAN, 0.0], 0.0, 1.0, &mut e);
        assert_eq!(e, [0.0, 0.0, 1.0]);
    }
    check::<select::Split>();
    check::<select::Fused>();
}
#[test]
fn top_k_candidates_match_a_sort() {
    let mut g = Lcg(1);
    for (n, k) in [
        (1000, 1),
        (1000, 50),
        (5000, 700),
        (37, 40),
        (3000, 3000),
        (40_000, 50),
        (40_000, 3000),
    ] {
        // few distinct values: many ties
        let row: Vec<f32> = g.logits(n, 8.0).iter().map(|x| x.round()).collect();
        let mut sel = TopK::new(k, Vec::new());
        for (i, part) in row.chunks(333).enumerate() {
            sel.push(i * 333, part);
        }
        let got = sel.finish();
        let mut whole = TopK::new(k, Vec::new());
        whole.push_all(&row, &mut Vec::new(), &mut Vec::new());
        assert_eq!(whole.finish(), got, "n {n} k {k}: push_all");
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k.min(n) - 1];
        let want: Vec<usize> = (0..n).filter(|&i| row[i] >= kth).collect();
        let mut got_ids: Vec<usize> = got.iter().map(|c| c.1 as usize).collect();
        got_ids.sort();
        assert_eq!(got_ids, want, "n {n} k {k}");
        assert!(got
            .windows(2)
            .all(|w| w[0].0 > w[1].0 || (w[0].0 == w[1].0 && w[0].1 < w[1].1)));
    }
}
#[test]
fn top_p_floor_matches_a_sort() {
    let mut g = Lcg(2);
    for trial in 0..200 {
        let n = 1 + trial * 7;
        let e: Vec<f32> = g
            .logits(n, 1.0)
            .iter()
            .map(|x| ((x + 0.5) * 6.0).round() / 6.0)
            .collect();
        let total: f64 = e.iter().map(|&x| f64::from(x)).sum();
        let p = f64::from(g.next()).max(0.01);
        let mut sorted = e.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut before = 0.0;
        let mut want = f32::INFINITY;
        for &x in &sorted {
            if before >= p * total {
                break;
            }
            before += f64::from(x);
            want = x;
        }
        let got = select::top_p_floor(&e, p * total, &mut Vec::new());
        assert_eq!(got, want, "trial {trial}");
    }
}
#[test]
fn greedy_is_the_first_argmax_after_changes() {
    let row = [1.0, 3.0, f32::NAN, 3.0, 2.0];
    let g = RowParams {
        greedy: true,
        ..params()
    };
    assert_eq!(run(&row, 5, &[g], &[], 1).0, [1]);
    let ban = [Extra {
        seen: &[],
        counts: &[],
        banned: &[1],
    }];
    assert_eq!(run(&row, 5, &[g], &ban, 1).0, [3]);
    let rep = RowParams {
        repetition: 2.0,
        ..g
    };
    let seen = [Extra {
        seen: &[1, 3],
        counts: &[0, 0],
        banned: &[],
    }];
    assert_eq!(run(&row, 5, &[rep], &seen, 1).0, [4]);
}
#[test]
fn tiny_top_p_and_top_k_1_are_greedy() {
    let mut g = Lcg(5);
    let row = g.logits(1000, 4.0);
    let want = run(
        &row,
        1000,
        &[RowParams {
            greedy: true,
            ..params()
        }],
        &[],
        1,
    )
    .0[0];
    for pos in 0..200 {
        for p in [
            RowParams {
                top_p: 1e-6,
                ..params()
            },
            RowParams {
                top_k: 1,
                ..params()
            },
        ] {
            assert_eq!(
                run(&row, 1000, &[RowParams { position: pos, ..p }], &[], 1).0[0],
                want
            );
        }
    }
}
#[test]
fn a_row_draws_the_same_alone_and_in_any_batch() {
    let mut g = Lcg(6);
    let vocab = 2000;
    let n = 50;
    let logits = g.logits(n * vocab, 8.0);
    let rows: Vec<RowParams> = (0..n)
        .map(|i| RowParams {
            seed: i as u64 % 3,
            stream: i as u64,
            position: i as u64 * 11,
            top_k: [0, 40][i % 2],
            top_p: [1.0, 0.9][i % 3 / 2],
            greedy: i % 7 == 0,
            ..params()
        })
        .collect();
    let (batched, _) = run(&logits, vocab, &rows, &[], 3);
    let (single, _) = run(&logits, vocab, &rows, &[], 1);
    assert_eq!(batched, single);
    for i in (0..n).step_by(7) {
        let alone = run(
            &logits[i * vocab..(i + 1) * vocab],
            vocab,
            &rows[i..=i],
            &[],
            2,
        )
        .0;
        assert_eq!(alone[0], batched[i]);
    }
    // a different seed changes the draws
    let reseeded: Vec<RowParams> = rows
        .iter()
        .map(|r| RowParams {
            seed: r.seed + 100,
            ..*r
        })
        .collect();
    assert_ne!(run(&logits, vocab, &reseeded, &[], 2).0, batched);
}
#[test]
fn logprobs_are_of_the_raw_logits() {
    let mut g = Lcg(7);
    let vocab = 5000;
    let mut row = g.logits(vocab, 12.0);
    row[10] = row[20]; // a tie
    let p = RowParams {
        num_logprobs: 5,
        repetition: 3.0,
        ..params()
    };
    let seen = [20u32, 10];
    let so = [0usize, 2];
    let batch = Batch {
        logits: &row,
        vocab,
        rows: &[p],
        seen: TokenLists {
            offsets: &so,
            tokens: &seen,
        },
        seen_counts: &[1, 1],
        banned: TokenLists {
            offsets: &[0, 0],
            tokens: &[],
        },
        masks: Masks::NONE,
        bias: Bias::NONE,
    };
    let (mut s, mut r, mut ids, mut vals) = ([0i64], [0i64], [0i64; 7], [0f32; 7]);
    let out = Outputs {
        sampled: &mut s,
        ranks: &mut r,
        logprob_ids: &mut ids,
        logprob_values: &mut vals,
        width: 7,
    };
    sample(&batch, out, 1).unwrap();
    let m = row
        .iter()
        .cloned()
        .fold(f64::NEG_INFINITY, |a, b| a.max(f64::from(b)));
    let lse = m + row
        .iter()
        .map(|&x| (f64::from(x) - m).exp())
        .sum::<f64>()
        .ln();
    let tok = s[0] as usize;
    assert_eq!(ids[0], s[0]);
    assert!((f64::from(vals[0]) - (f64::from(row[tok]) - lse)).abs() < 1e-5);
    assert_eq!(
        r[0] as usize,
        1 + row.iter().filter(|&&x| x > row[tok]).count()
    );
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    for j in 0..5 {
        assert_eq!(ids[1 + j] as usize, order[j]);
        assert!((f64::from(vals[1 + j]) - (f64::from(row[order[j]]) - lse)).abs() < 1e-5);
    }
    assert_eq!(ids[6], -1);
}
#[test]
fn nonfinite_rows_are_argmaxed_and_reported() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let logits = [
        0.0,
        inf,
        1.0,
        inf, // +inf: the first
        nan,
        nan,
        nan,
        nan, // all NaN: 0
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        nan,
        f32::NEG_INFINITY, // all -inf: the first
        nan,
        2.0,
        nan,
        1.0, // NaN ignored: fine
    ];
    for p in [
        params(),
        RowParams {
            top_k: 2,
            ..params()
        },
        RowParams {
            greedy: true,
            ..params()
        },
    ] {
        let (tok, bad) = run(&logits, 4, &[p; 4], &[], 2);
        assert_eq!(&tok[..3], &[1, 0, 0], "{p:?}");
        assert!(tok[3] == 1 || tok[3] == 3);
        assert_eq!(bad, [0, 1, 2]);
    }
}
#[test]
fn bad_arguments_are_errors() {
    let row = [0.0f32; 4];
    let so = [0usize, 0];
    let mk = |p: RowParams, tokens: &[u32], counts: &[u32], offsets: &[usize]| {
        let batch = Batch {
            logits: &row,
            vocab: 4,
            rows: &[p],
            seen: TokenLists { offsets, tokens },
            seen_counts: counts,
            banned: TokenLists {
                offsets: &so,
                tokens: &[],
            },
            masks: Masks::NONE,
            bias: Bias::NONE,
        };
        let (mut s, mut r) = ([0i64], [0i64]);
        let out = Outputs {
            sampled: &mut s,
            ranks: &mut r,
            logprob_ids: &mut [],
            logprob_values: &mut [],
            width: 0,
        };
        sample(&batch, out, 1)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(mk(
        RowParams {
            temperature: 0.0,
            ..params()
        },
        &[],
        &[],
        &so
    )
    .unwrap_err()
    .contains("temperature"));
    assert!(mk(
        RowParams {
            top_p: 0.0,
            ..params()
        },
        &[],
        &[],
        &so
    )
    .unwrap_err()
    .contains("top_p"));
    assert!(mk(
        RowParams {
            min_p: 2.0,
            ..params()
        },
        &[],
        &[],
        &so
    )
    .unwrap_err()
    .contains("min_p"));
    assert!(mk(
        RowParams {
            num_logprobs: 1,
            ..params()
        },
        &[],
        &[],
        &so
    )
    .unwrap_err()
    .contains("num_logprobs"));
    assert!(mk(params(), &[4], &[0], &[0, 1])
        .unwrap_err()
        .contains("not in 0..4"));
    assert!(mk(params(), &[1], &[0], &[0, 0])
        .unwrap_err()
        .contains("offsets"));
    assert!(mk(params(), &[], &[], &so).is_ok());
}

/// Timing of the pieces on one 32,000-entry row (not a test: `cargo test
/// --release -- --ignored --nocapture time_pieces`).
#[test]
#[ignore]
fn time_pieces() {
    for _ in 0..4 {
        time_pieces_once();
        eprintln!();
    }
}

/// Prints the mean time of `f` over `reps` calls (each given its index).
fn timed(name: &str, reps: usize, mut f: impl FnMut(usize)) {
    let t = std::time::Instant::now();
    for i in 0..reps {
        f(i);
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
    eprintln!("{name:12} {us:8.1} us");
}

fn time_pieces_once() {
    use std::hint::black_box;
    let mut g = Lcg(9);
    let row: Vec<f32> = g.logits(32_000, 12.0);
    let mut e = vec![0.0f32; row.len()];
    let mut sums = vec![0.0f32; row.len().div_ceil(select::CHUNK)];
    let reps = 200;
    timed("max", reps, |_| {
        black_box(select::max(black_box(&row)));
    });
    timed("argmax", reps, |_| {
        black_box(select::argmax(black_box(&row)));
    });
    timed("exp_sums", reps, |_| {
        select::exp_sums::<select::Fused>(black_box(&row), 6.0, 1.0, &mut e, &mut sums);
        black_box(&e);
    });
    timed("mass_above", reps, |_| {
        black_box(select::mass_above(black_box(&e), 0.01));
    });
    timed("exp_into_fma", reps, |_| {
        select::exp_into::<select::Fused>(black_box(&row), 6.0, 1.0, &mut e);
        black_box(&e);
    });
    timed("exp_into", reps, |_| {
        select::exp_into::<select::Split>(black_box(&row), 6.0, 1.0, &mut e);
        black_box(&e);
    });
    timed("chunk_sums", reps, |_| {
        black_box(select::chunk_sums(black_box(&e), 0.0, &mut sums));
    });
    let total: f64 = e.iter().map(|&x| f64::from(x)).sum();
    let mut work = Vec::new();
    timed("top_p_floor", reps, |_| {
        black_box(select::top_p_floor(&e, 0.95 * total, &mut work));
    });
    timed("top_k 50", reps, |_| {
        let mut sel = TopK::new(50, Vec::new());
        sel.push_all(black_box(&row), &mut work, &mut Vec::new());
        black_box(sel.finish());
    });
    let rows = [
        ("row top_k", 50, 0.95, false),
        ("row top_p", 0, 0.95, false),
        ("row plain", 0, 1.0, false),
        ("row greedy", 0, 1.0, true),
    ];
    for (name, top_k, top_p, greedy) in rows {
        timed(name, reps, |i| {
            let p = RowParams {
                top_k,
                top_p,
                greedy,
                position: i as u64,
                ..params()
            };
            black_box(run(&row, row.len(), &[p], &[], 1));
        });
    }
}
#[test]
fn mask_into_keeps_allowed_entries_only() {
    let x: Vec<f32> = (0..70).map(|i| i as f32).collect();
    // word 0: mixed, word 1: all set, word 2 (6 entries): all clear
    let bits = [0b1010_0000_0000_0000_0000_0000_0000_0101u32, u32::MAX, 0];
    let mut out = vec![1.0; 3]; // resized
    select::mask_into(&x, &bits, &mut out);
    assert_eq!(out.len(), 70);
    for (i, &v) in out.iter().enumerate() {
        let allowed = matches!(i, 0 | 2 | 29 | 31) || (32..64).contains(&i);
        assert_eq!(v, if allowed { i as f32 } else { f32::NEG_INFINITY }, "{i}");
    }
}
#[test]
fn masked_rows_draw_allowed_tokens_only() {
    let vocab = 100;
    let mut g = Lcg(9);
    let logits = g.logits(3 * vocab, 8.0);
    // row 0: only token 77; row 1: unconstrained; row 2: tokens 3 and 40
    let bits = [[0u32, 0, 1 << 13, 0], [(1 << 3), (1 << 8), 0, 0]].concat();
    let of_row = [0, Masks::UNCONSTRAINED, 1];
    let so = [0usize; 4];
    for p in [
        params(),
        RowParams {
            greedy: true,
            ..params()
        },
        RowParams {
            top_k: 5,
            top_p: 0.5,
            ..params()
        },
    ] {
        for position in 0..20 {
            let rows = [RowParams { position, ..p }; 3];
            let batch = Batch {
                logits: &logits,
                vocab,
                rows: &rows,
                seen: TokenLists {
                    offsets: &so,
                    tokens: &[],
                },
                seen_counts: &[],
                banned: TokenLists {
                    offsets: &so,
                    tokens: &[],
                },
                masks: Masks {
                    bits: &bits,
                    words: 4,
                    of_row: &of_row,
                },
                bias: Bias::NONE,
            };
            let (mut s, mut r) = ([0i64; 3], [0i64; 3]);
            let out = Outputs {
                sampled: &mut s,
                ranks: &mut r,
                logprob_ids: &mut [],
                logprob_values: &mut [],
                width: 0,
            };
            assert!(sample(&batch, out, 1).unwrap().is_empty());
            assert_eq!(s[0], 77, "{p:?}");
            assert!(s[2] == 3 || s[2] == 40, "{p:?}");
            let (plain, _) = run(&logits[vocab..2 * vocab], vocab, &rows[..1], &[], 1);
            assert_eq!(s[1], plain[0], "the unconstrained row is untouched");
        }
    }
}

/// Samples one greedy-or-random row with the given bias and penalties.
fn sample_biased(row: &[f32], p: RowParams, bias: (&[u32], &[f32]), seen: &[u32]) -> i64 {
    let offsets = [0usize, bias.0.len()];
    let so = [0usize, seen.len()];
    let counts: Vec<u32> = seen.iter().map(|_| 1).collect();
    let batch = Batch {
        logits: row,
        vocab: row.len(),
        rows: &[p],
        seen: TokenLists {
            offsets: &so,
            tokens: seen,
        },
        seen_counts: &counts,
        banned: TokenLists {
            offsets: &[0, 0],
            tokens: &[],
        },
        masks: Masks::NONE,
        bias: Bias {
            offsets: &offsets,
            tokens: bias.0,
            values: bias.1,
        },
    };
    let (mut s, mut r) = ([0i64], [0i64]);
    let out = Outputs {
        sampled: &mut s,
        ranks: &mut r,
        logprob_ids: &mut [],
        logprob_values: &mut [],
        width: 0,
    };
    sample(&batch, out, 1).unwrap();
    s[0]
}

#[test]
fn logit_bias_moves_the_choice() {
    let row = [5.0f32, 1.0, 0.0, -2.0];
    let greedy = RowParams {
        greedy: true,
        ..params()
    };
    assert_eq!(sample_biased(&row, greedy, (&[], &[]), &[]), 0);
    // +100 on a weak token wins under greedy, and under sampling at temperature 1
    assert_eq!(sample_biased(&row, greedy, (&[3], &[100.0]), &[]), 3);
    for position in 0..50 {
        let p = RowParams {
            position,
            ..params()
        };
        assert_eq!(sample_biased(&row, p, (&[3], &[100.0]), &[]), 3);
        // -100 on every other token leaves only token 2
        let all_but_2 = (&[0u32, 1, 3][..], &[-100.0f32, -100.0, -100.0][..]);
        assert_eq!(sample_biased(&row, p, all_but_2, &[]), 2);
    }
}

#[test]
fn penalties_apply_to_the_biased_logit() {
    // token 1: 1.0 + 4.0 = 5.0, then presence 0.5 -> 4.5 (< token 0's 5.0 with
    // no bias, so token 0 wins); without the bias first it would be 0.5
    let row = [4.75f32, 1.0, 0.0];
    let p = RowParams {
        greedy: true,
        presence: 0.5,
        ..params()
    };
    let mut ov = Vec::new();
    penalties::overrides(&row, &p, &[1], &[1], &[], (&[1], &[4.0]), &mut ov);
    assert_eq!(ov, vec![(1, 4.5)]);
    assert_eq!(sample_biased(&row, p, (&[1], &[4.0]), &[1]), 0);
    assert_eq!(sample_biased(&row, p, (&[1], &[4.5]), &[1]), 1);
}

#[test]
fn bias_lists_are_checked() {
    let row = [0.0f32; 4];
    let p = params();
    let run = |tokens: &[u32], values: &[f32]| {
        let offsets = [0usize, tokens.len()];
        let batch = Batch {
            logits: &row,
            vocab: 4,
            rows: &[p],
            seen: TokenLists {
                offsets: &[0, 0],
                tokens: &[],
            },
            seen_counts: &[],
            banned: TokenLists {
                offsets: &[0, 0],
                tokens: &[],
            },
            masks: Masks::NONE,
            bias: Bias {
                offsets: &offsets,
                tokens,
                values,
            },
        };
        let (mut s, mut r) = ([0i64], [0i64]);
        let out = Outputs {
            sampled: &mut s,
            ranks: &mut r,
            logprob_ids: &mut [],
            logprob_values: &mut [],
            width: 0,
        };
        sample(&batch, out, 1)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(run(&[1, 2], &[1.0, 2.0]).is_ok());
    assert!(run(&[4], &[1.0])
        .unwrap_err()
        .contains("bias token 4 is not in 0..4"));
    assert!(run(&[2, 1], &[1.0, 2.0])
        .unwrap_err()
        .contains("sorted and distinct"));
    assert!(run(&[1], &[f32::NAN]).unwrap_err().contains("not finite"));
}
