//! Golden frames in `tests/fixtures/wire/`, written by
//! `tests/fixtures/make_wire_fixtures.py` with its own msgpack writer: they
//! decode to the values below, and encoding those values gives the same bytes.

use super::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/wire/{name}.bin",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"))
}

fn assert_fixture(name: &str, expected: Message) {
    let bytes = fixture(name);
    let decoded = decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(decoded, expected, "{name} decodes to something else");
    assert_eq!(
        encode(&expected).unwrap(),
        bytes,
        "{name}: encoder output differs"
    );
}

fn request_a() -> AddRequest {
    AddRequest {
        wire_id: 1,
        prompt_token_ids: vec![1, 15043, 3186, 29991],
        arrival_time: 1_700_000_000.25,
        priority: 0,
        max_tokens: 16,
        min_tokens: 0,
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: None,
        stop_token_ids: vec![],
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: None,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        cache_salt: None,
        structured_outputs: None,
        ..AddRequest::new(0, vec![])
    }
}

fn request_b() -> AddRequest {
    AddRequest {
        wire_id: 4_294_967_296,
        prompt_token_ids: vec![128_000, 9906, 0, 4_294_967_295],
        arrival_time: 0.5,
        priority: -3,
        max_tokens: 300,
        min_tokens: 2,
        temperature: 0.75,
        top_p: 0.5,
        top_k: -1,
        min_p: 0.125,
        seed: Some(18_446_744_073_709_551_615),
        stop_token_ids: vec![2, 128_009],
        ignore_eos: true,
        logprobs: Some(5),
        prompt_logprobs: Some(0),
        repetition_penalty: 1.25,
        frequency_penalty: -0.5,
        presence_penalty: 2.0,
        cache_salt: Some("tenant-β".into()),
        structured_outputs: Some(StructuredSpec {
            kind: "choice".into(),
            spec: r#"["yes","no"]"#.into(),
        }),
        logit_bias: vec![(7, -100.0), (50_256, 2.5)],
        allowed_token_ids: vec![7, 9, 50_256],
        bad_words_token_ids: vec![vec![11], vec![12, 13]],
        pooling: Some("mean".into()),
        lora_int_id: 7,
        lora_name: Some("sql-β".into()),
        lora_path: Some("/adapters/sql".into()),
    }
}

#[test]
fn add_request_single() {
    assert_fixture(
        "add_request_single",
        Message::AddRequests(vec![request_a()]),
    );
}

#[test]
fn add_requests_burst() {
    assert_fixture(
        "add_requests_burst",
        Message::AddRequests(vec![request_a(), request_b()]),
    );
}

#[test]
fn abort() {
    assert_fixture(
        "abort",
        Message::Abort {
            wire_ids: vec![1, 300, 18_446_744_073_709_551_615],
        },
    );
}

#[test]
fn utility_call() {
    assert_fixture(
        "utility_call",
        Message::UtilityCall {
            call_id: 7,
            method: "reset_prefix_cache".into(),
            args: Value::Map(vec![
                ("flag".into(), Value::Bool(true)),
                ("n".into(), Value::Int(-2)),
                ("x".into(), Value::Float(2.5)),
                (
                    "items".into(),
                    Value::List(vec![
                        Value::Nil,
                        Value::Str("é".into()),
                        Value::Bytes(vec![0, 255]),
                    ]),
                ),
            ]),
        },
    );
}

#[test]
fn utility_results() {
    assert_fixture(
        "utility_result_ok",
        Message::UtilityResult {
            call_id: 7,
            result: Ok(Value::List(vec![Value::UInt(1), Value::UInt(70_000)])),
        },
    );
    assert_fixture(
        "utility_result_error",
        Message::UtilityResult {
            call_id: 8,
            result: Err("no such method: frobnicate".into()),
        },
    );
}

#[test]
fn ready_error_shutdown() {
    assert_fixture(
        "ready",
        Message::Ready(Ready {
            max_model_len: 2048,
            num_kv_blocks: 512,
            block_size: 16,
            vocab_size: 32_000,
            eos_token_ids: vec![2],
            hidden_size: 4096,
        }),
    );
    assert_fixture(
        "engine_error",
        Message::EngineError {
            message: "CUDA out of memory".into(),
        },
    );
    assert_fixture("shutdown", Message::Shutdown);
}

#[test]
fn output_batches() {
    assert_fixture(
        "output_batch_empty",
        Message::OutputBatch(OutputBatch {
            outputs: vec![],
            stats: SchedulerStats::default(),
            timestamp: 0.0,
        }),
    );
    assert_fixture(
        "output_batch",
        Message::OutputBatch(OutputBatch {
            outputs: vec![
                RequestOutput {
                    wire_id: 1,
                    new_token_ids: vec![450],
                    num_cached_tokens: Some(32),
                    ..RequestOutput::default()
                },
                RequestOutput {
                    wire_id: 2,
                    new_token_ids: vec![2],
                    finish_reason: Some(FinishReason::Stop),
                    stop_reason: Some(2),
                    ..RequestOutput::default()
                },
                RequestOutput {
                    wire_id: 3,
                    new_token_ids: vec![],
                    finish_reason: Some(FinishReason::Error),
                    error: Some("prompt too long".into()),
                    ..RequestOutput::default()
                },
                RequestOutput {
                    wire_id: 4,
                    new_token_ids: vec![11, 12],
                    finish_reason: Some(FinishReason::Length),
                    logprobs: Some(Logprobs {
                        num_positions: 2,
                        width: 3,
                        token_ids: vec![11, 11, 7, 12, 9, 12],
                        logprobs: vec![-0.5, -0.5, -1.25, -2.0, -0.25, -2.0],
                        ranks: vec![1, 2],
                    }),
                    prompt_logprobs: Some(Logprobs {
                        num_positions: 1,
                        width: 1,
                        token_ids: vec![1],
                        logprobs: vec![-4.0],
                        ranks: vec![10],
                    }),
                    num_cached_tokens: Some(0),
                    ..RequestOutput::default()
                },
                RequestOutput {
                    wire_id: 5,
                    new_token_ids: vec![],
                    finish_reason: Some(FinishReason::Abort),
                    ..RequestOutput::default()
                },
                RequestOutput {
                    wire_id: 6,
                    new_token_ids: vec![],
                    finish_reason: Some(FinishReason::Stop),
                    num_cached_tokens: Some(16),
                    embedding: Some(vec![0.5, -1.25, 3.0]),
                    ..RequestOutput::default()
                },
            ],
            stats: SchedulerStats {
                num_running: 4,
                num_waiting: 1,
                kv_cache_usage: 0.375,
                prefix_cache_queries: 1000,
                prefix_cache_hits: 250,
                num_preemptions: 3,
            },
            timestamp: 1_700_000_001.5,
        }),
    );
}
