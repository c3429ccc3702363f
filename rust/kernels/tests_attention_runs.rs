//! Runs of rows that read the same keys (speculative decoding's verification
//! tokens): every row of a run gives the bits it gives alone, on every variant,
//! thread count and cache type, in batches that mix runs and single rows.

use super::bf16::KvElem;
use super::paged_attention::{run, Isa};
use super::tests::{case, isas, Case};
use super::{f32_to_bf16, DecodeShape, KvCache};

/// `requests` as (keys of the first row, rows): each a run of rows one key
/// longer than the row before, all through the request's block table.
fn runs(heads: usize, kv_heads: usize, head_dim: usize, requests: &[(usize, usize)]) -> Case {
    let longest: Vec<usize> = requests.iter().map(|&(len, rows)| len + rows - 1).collect();
    let base = case(heads, kv_heads, head_dim, &longest, 7);
    let bps = base.shape.blocks_per_seq;
    let (mut tables, mut lens) = (Vec::new(), Vec::new());
    for (r, &(len, rows)) in requests.iter().enumerate() {
        for i in 0..rows {
            tables.extend_from_slice(&base.tables[r * bps..(r + 1) * bps]);
            lens.push((len + i) as i64);
        }
    }
    let num_seqs = lens.len();
    // every row its own queries
    let q = case(heads, kv_heads, head_dim, &vec![1; num_seqs], 11).q;
    Case {
        shape: DecodeShape {
            num_seqs,
            ..base.shape
        },
        q,
        tables,
        seq_lens: lens,
        ..base
    }
}

fn attend<E: KvElem>(c: &Case, cache: &[E], isa: Isa, threads: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; c.q.len()];
    run(
        &c.shape,
        &c.q,
        KvCache::new(cache),
        &c.tables,
        &c.seq_lens,
        c.scale,
        threads,
        &mut out,
        isa,
        0,
    )
    .unwrap();
    out
}

/// Row `b` of `c` as a call of its own.
fn alone(c: &Case, b: usize) -> Case {
    let (bps, qs) = (c.shape.blocks_per_seq, c.shape.num_heads * c.shape.head_dim);
    Case {
        shape: DecodeShape {
            num_seqs: 1,
            ..c.shape
        },
        q: c.q[b * qs..(b + 1) * qs].to_vec(),
        cache: c.cache.clone(),
        tables: c.tables[b * bps..(b + 1) * bps].to_vec(),
        seq_lens: vec![c.seq_lens[b]],
        scale: c.scale,
    }
}

fn check<E: KvElem>(c: &Case, cache: &[E], bf16: bool) {
    let qs = c.shape.num_heads * c.shape.head_dim;
    for isa in isas(bf16) {
        for threads in [1, 2, 3] {
            let all = attend(c, cache, isa, threads);
            for b in 0..c.shape.num_seqs {
                let one = attend(&alone(c, b), cache, isa, 1);
                let got = &all[b * qs..(b + 1) * qs];
                assert!(
                    got.iter()
                        .zip(&one)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{isa:?} threads={threads} row {b} of {:?} (lens {:?})",
                    c.shape,
                    c.seq_lens
                );
            }
        }
    }
}

#[test]
fn a_runs_rows_give_the_bits_each_gives_alone() {
    // a lone verification (9 rows, cut into pieces), runs that cross a block
    // edge or start on one, single rows between runs, long runs (16, 40 rows)
    let batches: [&[(usize, usize)]; 5] = [
        &[(150, 9)],
        &[(15, 3), (1, 1), (16, 5), (31, 2)],
        &[(40, 16), (7, 1), (64, 4)],
        &[(1, 40)],
        &[(5, 1), (9, 1)],
    ];
    for (heads, kv_heads, head_dim) in [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 20)] {
        for requests in batches {
            let c = runs(heads, kv_heads, head_dim, requests);
            check(&c, &c.cache, false);
            let bits: Vec<u16> = c.cache.iter().map(|&x| f32_to_bf16(x)).collect();
            check(&c, &bits, true);
        }
    }
}
