//! Detokenization of 256 concurrent streams, one token each per step: the pure
//! Rust part of `Detokenizer.step` (no Python). Skips when the tokenizer assets
//! are absent.
//!
//!     cargo bench --bench detok

use std::path::PathBuf;
use std::time::{Duration, Instant};

use asyncllm_core::detok::{Detokenizer, RequestParams, StepBatch};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tokenizers::Tokenizer;

const NUM_STREAMS: usize = 256;
const NUM_TOKENS: usize = 512;

const CORPUS: &str = "The quick brown fox jumps over the lazy dog. Streaming detokenization \
    turns token ids back into text one step at a time. 日本語の文章です。中文也可以：你好，世界！\
    한국어 텍스트도 있습니다. Emoji: 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder. مرحبا بالعالم! \
    def main():\n\tfor i in range(10):\n\t\tprint(i,    end='  ')\n";

fn tokenizer_path(name: &str) -> Option<PathBuf> {
    let assets = std::env::var_os("ASYNCLLM_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/assets"));
    let path = assets.join("tokenizers").join(name).join("tokenizer.json");
    path.is_file().then_some(path)
}

/// Streams of `NUM_TOKENS` ids, each starting at a different place in the corpus.
fn streams(tok: &Tokenizer) -> Vec<Vec<u32>> {
    let text = CORPUS.repeat(2 + NUM_TOKENS * 4 / CORPUS.len().max(1) + 8);
    let ids = tok.encode(text, false).expect("encodes").get_ids().to_vec();
    (0..NUM_STREAMS)
        .map(|s| {
            let start = (s * 7) % (ids.len() - NUM_TOKENS);
            ids[start..start + NUM_TOKENS].to_vec()
        })
        .collect()
}

fn bench_family(c: &mut Criterion, name: &str, stop: &[&str]) {
    let Some(path) = tokenizer_path(name) else {
        eprintln!("skipping {name}: tokenizer assets not found (set ASYNCLLM_ASSETS)");
        return;
    };
    let tok = Tokenizer::from_file(&path).expect("tokenizer loads");
    let mut det = Detokenizer::new(&tok).expect("supported");
    let streams = streams(&tok);
    // One batch per step: every stream gets its next token.
    let batches: Vec<StepBatch> = (0..NUM_TOKENS)
        .map(|t| {
            let mut b = StepBatch::with_capacity(NUM_STREAMS);
            for (i, s) in streams.iter().enumerate() {
                b.push(i as u64, &s[t..t + 1]);
            }
            b
        })
        .collect();
    let params = RequestParams {
        skip_special_tokens: true,
        spaces_between_special_tokens: true,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };

    let label = if stop.is_empty() { "" } else { " +stop" };
    let mut group = c.benchmark_group("detok");
    group.throughput(Throughput::Elements(NUM_STREAMS as u64));
    group.bench_function(
        format!("{name}{label}: step of 256 streams x 1 token"),
        |b| {
            b.iter_custom(|iters| {
                let mut elapsed = Duration::ZERO;
                let mut t = NUM_TOKENS;
                for _ in 0..iters {
                    if t == NUM_TOKENS {
                        // Restart the streams (untimed) once they are used up.
                        for i in 0..NUM_STREAMS as u64 {
                            det.remove(i);
                            det.add_request(i, &[], params.clone()).expect("adds");
                        }
                        t = 0;
                    }
                    let start = Instant::now();
                    let out = det.step(&batches[t]).expect("steps");
                    elapsed += start.elapsed();
                    std::hint::black_box(out);
                    t += 1;
                }
                elapsed
            })
        },
    );
    group.finish();
}

fn detok(c: &mut Criterion) {
    for name in ["llama-3-8b", "llama-2", "bert-base-uncased"] {
        bench_family(c, name, &[]);
    }
    bench_family(c, "llama-3-8b", &["</answer>", "\n\nUser:"]);
}

criterion_group!(benches, detok);
criterion_main!(benches);
