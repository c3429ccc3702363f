//! The paged decode-attention kernel against a naive f64 reference, for every
//! instruction-set variant this machine runs, with f32 and bf16 caches.

use super::paged_attention::{exp_for_tests, run, Isa};
use super::{bf16_to_f32, f32_to_bf16, paged_decode_attention, DecodeShape, KernelError, KvCache};

/// A small deterministic generator (xorshift), values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub(super) struct Case {
    pub(super) shape: DecodeShape,
    pub(super) q: Vec<f32>,
    pub(super) cache: Vec<f32>,
    pub(super) tables: Vec<i64>,
    pub(super) seq_lens: Vec<i64>,
    pub(super) scale: f32,
}

/// Sequences of the given lengths whose blocks are scattered over the cache in a
/// random order; table entries past a sequence's last block point out of range
/// (-1), which the kernel must never read.
pub(super) fn case(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    seq_lens: &[usize],
    seed: u64,
) -> Case {
    let block_size = 16;
    let mut rng = Rng(seed * 0x9E37_79B9_7F4A_7C15 + 1);
    let blocks_per_seq = seq_lens
        .iter()
        .map(|l| l.div_ceil(block_size))
        .max()
        .unwrap()
        + 1;
    let needed: usize = seq_lens.iter().map(|l| l.div_ceil(block_size)).sum();
    let num_blocks = needed + 3;
    let mut ids: Vec<usize> = (0..num_blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut tables = vec![-1i64; seq_lens.len() * blocks_per_seq];
    let mut next = ids.into_iter();
    for (b, len) in seq_lens.iter().enumerate() {
        for j in 0..len.div_ceil(block_size) {
            tables[b * blocks_per_seq + j] = next.next().unwrap() as i64;
        }
    }
    let shape = DecodeShape {
        num_seqs: seq_lens.len(),
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        num_blocks,
        block_size,
        blocks_per_seq,
    };
    // Larger values than N(0, 1) after scaling, so the softmax is far from uniform
    // and the running max moves.
    let q = (0..seq_lens.len() * heads * head_dim)
        .map(|_| 3.0 * rng.uniform())
        .collect();
    let cache = (0..2 * num_blocks * block_size * kv_heads * head_dim)
        .map(|_| 2.0 * rng.uniform())
        .collect();
    Case {
        shape,
        q,
        cache,
        tables,
        seq_lens: seq_lens.iter().map(|&l| l as i64).collect(),
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

/// Gathers each sequence's keys and values and runs a two-pass softmax in f64.
fn reference(c: &Case) -> Vec<f64> {
    reference_windowed(c, 0)
}

/// Gathers each sequence's last `window` keys and values (0: all) and runs a
/// two-pass softmax in f64.
fn reference_windowed(c: &Case, window: usize) -> Vec<f64> {
    let s = &c.shape;
    let (d, bs, group) = (s.head_dim, s.block_size, s.num_heads / s.num_kv_heads);
    let half = c.cache.len() / 2;
    let at = |kv: usize, b: usize, t: usize, h: usize| {
        let block = c.tables[b * s.blocks_per_seq + t / bs] as usize;
        let start = kv * half + ((block * bs + t % bs) * s.num_kv_heads + h) * d;
        &c.cache[start..start + d]
    };
    let mut out = vec![0.0f64; s.num_seqs * s.num_heads * d];
    for b in 0..s.num_seqs {
        let len = c.seq_lens[b] as usize;
        let first = if window > 0 {
            len.saturating_sub(window)
        } else {
            0
        };
        for h in 0..s.num_heads {
            let q = &c.q[(b * s.num_heads + h) * d..][..d];
            let scores: Vec<f64> = (first..len)
                .map(|t| {
                    let k = at(0, b, t, h / group);
                    let dot: f64 = q.iter().zip(k).map(|(x, y)| *x as f64 * *y as f64).sum();
                    dot * c.scale as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let o = &mut out[(b * s.num_heads + h) * d..][..d];
            for (t, w) in (first..len).zip(&weights) {
                for (o, v) in o.iter_mut().zip(at(1, b, t, h / group)) {
                    *o += w / total * *v as f64;
                }
            }
        }
    }
    out
}

/// Every variant this CPU runs (by feature detection, not `ASYNCLLM_KERNEL_ISA`);
/// `bf16` adds the AVX512-BF16 one where present.
pub(super) fn isas(bf16: bool) -> Vec<Isa> {
    #[allow(unused_mut)]
    let mut isas = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        isas.push(Isa::Avx2Fma);
        if is_x86_feature_detected!("avx512f") {
            isas.push(Isa::Avx512);
            if bf16 && is_x86_feature_detected!("avx512bf16") {
                isas.push(Isa::Avx512Bf16);
            }
        }
    }
    let _ = bf16;
    isas
}

/// The case with q and the cache rounded to bf16 (the rounded values, as f32,
/// and the cache's bits).
fn rounded(c: &Case) -> (Case, Vec<u16>) {
    let round = |x: &f32| bf16_to_f32(f32_to_bf16(*x));
    let bits = c.cache.iter().map(|&x| f32_to_bf16(x)).collect();
    let case = Case {
        shape: c.shape,
        q: c.q.iter().map(round).collect(),
        cache: c.cache.iter().map(round).collect(),
        tables: c.tables.clone(),
        seq_lens: c.seq_lens.clone(),
        scale: c.scale,
    };
    (case, bits)
}

/// The bf16 cache, every variant and thread count, against the f64 reference of
/// the rounded inputs: widening is exact and products of bf16 pairs are exact in
/// f32, so only the f32 accumulation differs.
fn check_bf16(c: &Case) {
    let (c, bits) = rounded(c);
    let want = reference(&c);
    for isa in isas(true) {
        for threads in [1, 3] {
            let mut out = vec![f32::NAN; want.len()];
            run(
                &c.shape,
                &c.q,
                KvCache::new(&bits),
                &c.tables,
                &c.seq_lens,
                c.scale,
                threads,
                &mut out,
                isa,
                0,
            )
            .unwrap();
            for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                let err = (*got as f64 - want).abs();
                assert!(
                    err <= 1e-5 * want.abs().max(0.1),
                    "bf16 {isa:?} {:?} threads={threads}: out[{i}] = {got}, expected {want}",
                    c.shape
                );
            }
        }
    }
}

/// Every instruction-set variant, with one thread (a work item per sequence, all
/// its KV heads) and with three (few sequences per thread: an item per KV head).
fn check(c: &Case) {
    check_windowed(c, 0)
}

fn check_windowed(c: &Case, window: usize) {
    let want = reference_windowed(c, window);
    for isa in isas(false) {
        for threads in [1, 3] {
            let mut out = vec![f32::NAN; want.len()];
            run(
                &c.shape,
                &c.q,
                KvCache::new(&c.cache),
                &c.tables,
                &c.seq_lens,
                c.scale,
                threads,
                &mut out,
                isa,
                window,
            )
            .unwrap();
            for (i, (got, want)) in out.iter().zip(&want).enumerate() {
                let err = (*got as f64 - want).abs();
                assert!(
                    err <= 1e-5 * want.abs().max(0.1),
                    "{isa:?} {:?} threads={threads}: out[{i}] = {got}, expected {want}",
                    c.shape
                );
            }
        }
    }
}

#[test]
fn matches_reference_across_groups_and_head_dims() {
    // Ragged lengths: a single token, partial and exact blocks, several blocks;
    // groups of 1 to 12 query heads (past the 8 whose outputs share registers).
    let lens = [1, 7, 16, 17, 33, 100, 64, 250];
    for (seed, &(heads, kv_heads)) in [(4, 4), (4, 2), (8, 2), (16, 4), (24, 2)]
        .iter()
        .enumerate()
    {
        for head_dim in [32, 64, 128] {
            check(&case(heads, kv_heads, head_dim, &lens, seed as u64));
        }
    }
}

#[test]
fn odd_head_dims_use_the_scalar_tail() {
    for head_dim in [1, 8, 24, 40, 80] {
        check(&case(6, 3, head_dim, &[5, 31, 48], head_dim as u64));
    }
}

#[test]
fn seq_len_one_returns_the_single_value() {
    let c = case(4, 2, 64, &[1, 1, 1], 9);
    check(&c);
}

#[test]
fn thread_counts_give_identical_results() {
    let c = case(8, 2, 64, &[300, 17, 95, 1, 160, 47, 200, 33], 4);
    let mut outs = Vec::new();
    for threads in [1, 2, 3, 8] {
        let mut out = vec![0.0; c.q.len()];
        paged_decode_attention(
            &c.shape,
            &c.q,
            KvCache::new(&c.cache),
            &c.tables,
            &c.seq_lens,
            c.scale,
            threads,
            &mut out,
        )
        .unwrap();
        outs.push(out);
    }
    assert!(outs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn int32_tables_and_lengths_work() {
    let c = case(4, 2, 32, &[20, 40], 5);
    let tables: Vec<i32> = c.tables.iter().map(|&x| x as i32).collect();
    let lens: Vec<i32> = c.seq_lens.iter().map(|&x| x as i32).collect();
    let (mut a, mut b) = (vec![0.0; c.q.len()], vec![0.0; c.q.len()]);
    paged_decode_attention(
        &c.shape,
        &c.q,
        KvCache::new(&c.cache),
        &tables,
        &lens,
        c.scale,
        2,
        &mut a,
    )
    .unwrap();
    paged_decode_attention(
        &c.shape,
        &c.q,
        KvCache::new(&c.cache),
        &c.tables,
        &c.seq_lens,
        c.scale,
        2,
        &mut b,
    )
    .unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_arguments_are_rejected_before_writing() {
    let c = case(4, 2, 32, &[20, 40], 6);
    let call = |shape: &DecodeShape, tables: &[i64], lens: &[i64], threads: usize| {
        let mut out = vec![7.0f32; c.q.len()];
        let result = paged_decode_attention(
            shape,
            &c.q,
            KvCache::new(&c.cache),
            tables,
            lens,
            c.scale,
            threads,
            &mut out,
        );
        assert!(out.iter().all(|&x| x == 7.0));
        result.unwrap_err()
    };
    let err = call(&c.shape, &c.tables, &[20, 0], 1);
    assert!(
        matches!(err, KernelError::SeqLen { seq: 1, len: 0, .. }),
        "{err}"
    );
    let too_long = (c.shape.blocks_per_seq * 16 + 1) as i64;
    assert!(matches!(
        call(&c.shape, &c.tables, &[too_long, 1], 1),
        KernelError::SeqLen { .. }
    ));
    let mut tables = c.tables.clone();
    tables[c.shape.blocks_per_seq + 2] = c.shape.num_blocks as i64;
    let err = call(&c.shape, &tables, &c.seq_lens, 1);
    assert!(
        matches!(err, KernelError::BlockId { seq: 1, pos: 2, .. }),
        "{err}"
    );
    let gqa = DecodeShape {
        num_kv_heads: 3,
        ..c.shape
    };
    assert!(matches!(
        call(&gqa, &c.tables, &c.seq_lens, 1),
        KernelError::Shape(_)
    ));
    let more_blocks = DecodeShape {
        num_blocks: c.shape.num_blocks + 1,
        ..c.shape
    };
    let err = call(&more_blocks, &c.tables, &c.seq_lens, 1);
    assert!(err.to_string().starts_with("kv_cache has"), "{err}");
    assert!(matches!(
        call(&c.shape, &c.tables, &c.seq_lens, 0),
        KernelError::Shape(_)
    ));
}

#[test]
fn exp_is_accurate_on_the_softmax_range() {
    let mut x = 0.0f32;
    while x > -87.0 {
        let want = (x as f64).exp();
        let (portable, fused) = exp_for_tests(x);
        for got in [portable, fused] {
            assert!(
                ((got as f64 - want) / want).abs() < 3e-7,
                "exp({x}) = {got}, want {want}"
            );
        }
        x -= 0.0137;
    }
    assert!(exp_for_tests(-1e4).0 < 1e-37);
    assert_eq!(exp_for_tests(0.0).0, 1.0);
}

#[test]
fn bf16_cache_matches_reference_on_every_variant() {
    let lens = [1, 7, 16, 17, 33, 100, 64, 250];
    for (seed, &(heads, kv_heads)) in [(4, 4), (8, 2), (16, 4)].iter().enumerate() {
        for head_dim in [32, 64, 128] {
            check_bf16(&case(heads, kv_heads, head_dim, &lens, 40 + seed as u64));
        }
    }
    // Head dims off the 32-wide `vdpbf16ps` chunk and the 16-wide f32 one.
    for head_dim in [1, 8, 24, 40, 80] {
        check_bf16(&case(6, 3, head_dim, &[5, 31, 48], head_dim as u64));
    }
}

#[test]
fn bf16_cache_equals_f32_cache_of_the_same_values() {
    let (c, bits) = rounded(&case(8, 2, 64, &[300, 17, 95, 1, 160], 11));
    let (mut a, mut b) = (vec![0.0; c.q.len()], vec![0.0; c.q.len()]);
    let run_with = |out: &mut [f32], f32_cache: bool| {
        if f32_cache {
            paged_decode_attention(
                &c.shape,
                &c.q,
                KvCache::new(&c.cache),
                &c.tables,
                &c.seq_lens,
                c.scale,
                2,
                out,
            )
        } else {
            paged_decode_attention(
                &c.shape,
                &c.q,
                KvCache::new(&bits),
                &c.tables,
                &c.seq_lens,
                c.scale,
                2,
                out,
            )
        }
        .unwrap()
    };
    run_with(&mut a, true);
    run_with(&mut b, false);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs().max(0.1), "{x} vs {y}");
    }
}

#[test]
fn bf16_rounding_is_to_nearest_even() {
    assert_eq!(f32_to_bf16(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0).
    assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(bf16_to_f32(0xc000), -2.0);
    assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
}

/// Sliding window: only each sequence's last `window` tokens count, and the blocks
/// wholly before the window are never read (they hold NaN here, which would
/// poison the output).
#[test]
fn windowed_reads_only_the_window() {
    let lens = [1, 15, 16, 17, 40, 70];
    for window in [1, 5, 16, 20, 100] {
        let mut c = case(4, 2, 8, &lens, window as u64);
        let s = c.shape;
        let half = c.cache.len() / 2;
        let block_len = s.block_size * s.num_kv_heads * s.head_dim;
        for (b, &len) in lens.iter().enumerate() {
            for j in 0..len.saturating_sub(window) / s.block_size {
                let block = c.tables[b * s.blocks_per_seq + j] as usize;
                for kv in 0..2 {
                    c.cache[kv * half + block * block_len..][..block_len].fill(f32::NAN);
                }
            }
        }
        check_windowed(&c, window);
    }
}
