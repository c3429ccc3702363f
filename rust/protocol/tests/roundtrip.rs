//! Every message survives encode -> decode exactly, floats bit for bit.

use super::*;

/// Decoding gives back the message and re-encoding gives back the bytes. The
/// byte check is bit-exact for floats (NaN payloads included); the structural
/// check runs when the message has no NaN (`m == m` is false otherwise).
fn assert_round_trip(message: &Message) {
    let bytes = encode(message).expect("encodes");
    let decoded = decode(&bytes).unwrap_or_else(|e| panic!("{e} for {message:?}"));
    assert_eq!(
        encode(&decoded).unwrap(),
        bytes,
        "re-encode differs: {message:?}"
    );
    #[allow(clippy::eq_op)]
    if message == message {
        assert_eq!(&decoded, message);
    }
}

#[test]
fn random_messages_round_trip() {
    let mut rng = Rng::new(0x5eed);
    for _ in 0..3000 {
        assert_round_trip(&random_message(&mut rng));
    }
}

#[test]
fn edge_cases_round_trip() {
    let mut max = AddRequest::new(u64::MAX, vec![0, u32::MAX, 1 << 31]);
    max.priority = i32::MIN;
    max.top_k = -1;
    max.seed = Some(u64::MAX);
    max.logprobs = Some(0);
    max.prompt_logprobs = Some(u32::MAX);
    max.max_tokens = u32::MAX;
    max.arrival_time = f64::MAX;
    max.cache_salt = Some("é".repeat(256));
    max.structured_outputs = Some(StructuredSpec {
        kind: "json".into(),
        spec: "é".repeat(MAX_STRUCTURED_SPEC_BYTES / 2),
    });
    let mut empty_salt = AddRequest::new(1, vec![1]);
    empty_salt.cache_salt = Some(String::new());
    let messages = [
        Message::AddRequests(vec![]),
        Message::AddRequests(vec![AddRequest::new(0, vec![])]),
        Message::AddRequests(vec![max.clone(), AddRequest::new(7, vec![1; 70_000])]),
        Message::AddRequests(vec![empty_salt]),
        Message::Abort { wire_ids: vec![] },
        Message::Abort {
            wire_ids: vec![0, u64::MAX, 1 << 32],
        },
        Message::UtilityCall {
            call_id: 0,
            method: String::new(),
            args: Value::Nil,
        },
        Message::UtilityResult {
            call_id: u64::MAX,
            result: Err(String::new()),
        },
        Message::UtilityResult {
            call_id: 1,
            result: Ok(Value::Map(vec![
                ("".into(), Value::List(vec![])),
                ("neg".into(), Value::Int(i64::MIN)),
                ("big".into(), Value::UInt(u64::MAX)),
                ("s".into(), Value::Str("x".repeat(70_000))),
            ])),
        },
        Message::Ready(Ready::default()),
        Message::EngineError {
            message: "💥".into(),
        },
        Message::Shutdown,
        Message::OutputBatch(OutputBatch::default()),
        Message::OutputBatch(OutputBatch {
            outputs: vec![RequestOutput {
                wire_id: u64::MAX,
                new_token_ids: vec![],
                finish_reason: Some(FinishReason::Error),
                stop_reason: Some(u32::MAX),
                error: Some(String::new()),
                logprobs: Some(Logprobs {
                    num_positions: 0,
                    width: 6,
                    token_ids: vec![],
                    logprobs: vec![],
                    ranks: vec![],
                }),
                prompt_logprobs: Some(Logprobs {
                    num_positions: 2,
                    width: 1,
                    token_ids: vec![5, 6],
                    logprobs: vec![-0.0, f32::NEG_INFINITY],
                    ranks: vec![1, u32::MAX],
                }),
                num_cached_tokens: Some(u32::MAX),
                embedding: Some(vec![-0.0, f32::MAX, f32::MIN_POSITIVE]),
            }],
            stats: SchedulerStats {
                num_running: u32::MAX,
                num_waiting: 0,
                kv_cache_usage: 1.0,
                prefix_cache_queries: u64::MAX,
                prefix_cache_hits: 0,
                num_preemptions: 1,
            },
            timestamp: f64::INFINITY,
        }),
    ];
    for m in &messages {
        assert_round_trip(m);
    }
}

#[test]
fn nan_and_infinities_round_trip_bit_exact() {
    let quiet_payload = f32::from_bits(0x7fc0_1234);
    let signalling = f32::from_bits(0xff80_0001);
    let mut r = AddRequest::new(1, vec![]);
    r.temperature = quiet_payload;
    r.top_p = signalling;
    r.min_p = f32::INFINITY;
    r.arrival_time = f64::from_bits(0x7ff8_dead_beef_0001);
    let bytes = encode_add_requests([&r]).unwrap();
    let Message::AddRequests(back) = decode(&bytes).unwrap() else {
        panic!("wrong message type");
    };
    assert_eq!(back[0].temperature.to_bits(), 0x7fc0_1234);
    assert_eq!(back[0].top_p.to_bits(), 0xff80_0001);
    assert_eq!(back[0].min_p, f32::INFINITY);
    assert_eq!(back[0].arrival_time.to_bits(), 0x7ff8_dead_beef_0001);

    let batch = OutputBatch {
        outputs: vec![RequestOutput {
            logprobs: Some(Logprobs {
                num_positions: 1,
                width: 2,
                token_ids: vec![1, 2],
                logprobs: vec![quiet_payload, f32::NEG_INFINITY],
                ranks: vec![1],
            }),
            ..RequestOutput::default()
        }],
        timestamp: f64::NAN,
        ..OutputBatch::default()
    };
    let Message::OutputBatch(back) = decode(&encode_output_batch(&batch).unwrap()).unwrap() else {
        panic!("wrong message type");
    };
    let lp = back.outputs[0].logprobs.as_ref().unwrap();
    assert_eq!(lp.logprobs[0].to_bits(), 0x7fc0_1234);
    assert_eq!(lp.logprobs[1], f32::NEG_INFINITY);
    assert_eq!(back.timestamp.to_bits(), f64::NAN.to_bits());
}

#[test]
fn integers_use_the_smallest_encoding() {
    let sizes: Vec<usize> = [
        0u64,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u32::MAX as u64,
        u64::MAX,
    ]
    .iter()
    .map(|&id| encode_abort(&[id]).unwrap().len() - 4)
    .collect();
    assert_eq!(sizes, [1, 1, 2, 2, 3, 3, 5, 5, 9]);
}

#[test]
fn output_batch_writer_matches_owned_encoder_and_checks_count() {
    let mut rng = Rng::new(3);
    let batch = random_output_batch(&mut rng);
    let mut w = OutputBatchWriter::new(batch.outputs.len(), 0).unwrap();
    for o in &batch.outputs {
        w.push(&RequestOutputRef {
            wire_id: o.wire_id,
            new_token_ids: &o.new_token_ids,
            finish_reason: o.finish_reason,
            stop_reason: o.stop_reason,
            error: o.error.as_deref(),
            logprobs: o.logprobs.as_ref().map(|lp| lp.as_ref()),
            prompt_logprobs: o.prompt_logprobs.as_ref().map(|lp| lp.as_ref()),
            num_cached_tokens: o.num_cached_tokens,
            embedding: o.embedding.as_deref(),
        })
        .unwrap();
    }
    let bytes = w.finish(&batch.stats, batch.timestamp).unwrap();
    assert_eq!(bytes, encode_output_batch(&batch).unwrap());

    let short = OutputBatchWriter::new(2, 0).unwrap();
    let err = short.finish(&SchedulerStats::default(), 0.0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot encode OutputBatch.outputs: declared 2 outputs, got 0"
    );
    let mut over = OutputBatchWriter::new(0, 0).unwrap();
    assert!(over.push(&RequestOutputRef::default()).is_err());
}

#[test]
fn logprobs_with_a_wrong_shape_are_not_encoded() {
    let batch = OutputBatch {
        outputs: vec![RequestOutput {
            logprobs: Some(Logprobs {
                num_positions: 2,
                width: 3,
                token_ids: vec![0; 6],
                logprobs: vec![0.0; 5],
                ranks: vec![0; 2],
            }),
            ..RequestOutput::default()
        }],
        ..OutputBatch::default()
    };
    let err = encode_output_batch(&batch).unwrap_err().to_string();
    assert!(
        err.starts_with("cannot encode OutputBatch.outputs[0].logprobs: 2 positions x width 3"),
        "{err}"
    );
}

#[test]
fn values_nested_too_deep_are_not_encoded() {
    let mut v = Value::Nil;
    for _ in 0..=MAX_VALUE_DEPTH {
        v = Value::List(vec![v]);
    }
    let err = encode_utility_call(1, "m", &v).unwrap_err().to_string();
    assert!(err.contains("nest deeper than 64"), "{err}");
}

#[test]
fn output_batches_decode_into_columns() {
    let mut rng = Rng::new(21);
    for _ in 0..500 {
        let batch = random_output_batch(&mut rng);
        let frame = encode_output_batch(&batch).unwrap();
        let columns = decode_output_batch(&frame, DEFAULT_MAX_FRAME_SIZE).unwrap();
        for i in 0..columns.len() {
            assert_eq!(columns.new_token_ids(i), batch.outputs[i].new_token_ids);
        }
        // Same bytes back through the owned form (bit-exact, NaNs included).
        assert_eq!(
            encode_output_batch(&columns.clone().into_batch()).unwrap(),
            frame
        );
        #[allow(clippy::eq_op)]
        if batch == batch {
            assert_eq!(columns, OutputBatchColumns::from(batch));
        }
    }
    let err = decode_output_batch(&encode_shutdown(), DEFAULT_MAX_FRAME_SIZE).unwrap_err();
    assert_eq!(
        err.to_string(),
        "malformed frame: frame header: expected an OutputBatch frame, found Shutdown"
    );
    let mut frame = encode_output_batch(&OutputBatch::default()).unwrap();
    frame.push(0);
    assert!(decode_output_batch(&frame, DEFAULT_MAX_FRAME_SIZE).is_err());
}
