//! Wire codec throughput: encode and decode of a 256-request output batch (one
//! new token each, without and with top-5 logprobs) and of a burst of 256
//! AddRequests with 512-token prompts. Pure Rust, no Python.
//!
//!     cargo bench --bench codec

use std::hint::black_box;

use asyncllm_core::protocol::{
    decode, decode_output_batch, encode_add_requests, encode_output_batch, AddRequest,
    FinishReason, Logprobs, OutputBatch, RequestOutput, SchedulerStats, DEFAULT_MAX_FRAME_SIZE,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const NUM_REQUESTS: usize = 256;
const PROMPT_LEN: usize = 512;

/// A small deterministic generator, so every run encodes the same bytes.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 128_000) as u32
        })
        .collect()
}

fn output_batch(top_n: Option<u32>) -> OutputBatch {
    let outputs = (0..NUM_REQUESTS)
        .map(|i| {
            let token = ids(i as u64, 1);
            RequestOutput {
                wire_id: 1_000 + i as u64,
                new_token_ids: token.clone(),
                finish_reason: (i % 64 == 0).then_some(FinishReason::Length),
                stop_reason: None,
                error: None,
                logprobs: top_n.map(|n| {
                    let width = n + 1;
                    let mut token_ids = token.clone();
                    token_ids.extend(ids(7 * i as u64, n as usize));
                    Logprobs {
                        num_positions: 1,
                        width,
                        token_ids,
                        logprobs: (0..width).map(|k| -0.25 * k as f32).collect(),
                        ranks: vec![1],
                    }
                }),
                prompt_logprobs: None,
                num_cached_tokens: None,
                embedding: None,
            }
        })
        .collect();
    OutputBatch {
        outputs,
        stats: SchedulerStats {
            num_running: 256,
            num_waiting: 12,
            kv_cache_usage: 0.62,
            prefix_cache_queries: 10_000,
            prefix_cache_hits: 4_000,
            num_preemptions: 3,
        },
        timestamp: 1_700_000_000.5,
    }
}

fn add_requests() -> Vec<AddRequest> {
    (0..NUM_REQUESTS)
        .map(|i| {
            let mut r = AddRequest::new(i as u64, ids(i as u64, PROMPT_LEN));
            r.max_tokens = 128;
            r.temperature = 0.7;
            r.top_p = 0.9;
            r.seed = Some(i as u64);
            r.stop_token_ids = vec![2, 128_009];
            r
        })
        .collect()
}

fn bench_output_batch(c: &mut Criterion, name: &str, batch: &OutputBatch) {
    let frame = encode_output_batch(batch).unwrap();
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(NUM_REQUESTS as u64));
    group.bench_function("encode", |b| {
        b.iter(|| encode_output_batch(black_box(batch)).unwrap())
    });
    group.bench_function("decode", |b| b.iter(|| decode(black_box(&frame)).unwrap()));
    // What the Python view wraps: one allocation per column, not per request.
    group.bench_function("decode_columns", |b| {
        b.iter(|| decode_output_batch(black_box(&frame), DEFAULT_MAX_FRAME_SIZE).unwrap())
    });
    group.finish();
}

fn codec(c: &mut Criterion) {
    bench_output_batch(c, "output_batch_256x1", &output_batch(None));
    bench_output_batch(c, "output_batch_256x1_top5", &output_batch(Some(5)));

    let requests = add_requests();
    let frame = encode_add_requests(&requests).unwrap();
    let mut group = c.benchmark_group("add_requests_256x512");
    group.throughput(Throughput::Elements(NUM_REQUESTS as u64));
    group.bench_function("encode", |b| {
        b.iter(|| encode_add_requests(black_box(&requests)).unwrap())
    });
    group.bench_function("decode", |b| b.iter(|| decode(black_box(&frame)).unwrap()));
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
