//! Every class of malformed input is rejected with an error that names what
//! was wrong and where.

use super::super::add_request::ADD_REQUEST_FIELDS;
use super::super::writer::Writer;
use super::*;

type Field = Box<dyn Fn(&mut Writer)>;

fn frame(message_type: MessageType, body: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer::from_vec(Vec::with_capacity(64));
    w.raw(&[message_type as u8, WIRE_VERSION]);
    body(&mut w);
    w.into_bytes()
}

/// The fields of a valid AddRequest with prompt [1, 2, 3], in wire order
/// (ADD_REQUEST_FIELDS of them; `the_helper_builds_a_valid_frame` checks).
fn add_request_fields() -> Vec<Field> {
    vec![
        Box::new(|w| w.uint(9)),
        Box::new(|w| w.u32s(&[1, 2, 3], "").unwrap()),
        Box::new(|w| w.f64(0.5)),
        Box::new(|w| w.int(0)),
        Box::new(|w| w.uint(16)),
        Box::new(|w| w.uint(0)),
        Box::new(|w| w.f32(1.0)),
        Box::new(|w| w.f32(1.0)),
        Box::new(|w| w.int(-1)),
        Box::new(|w| w.f32(0.0)),
        Box::new(|w| w.nil()),
        Box::new(|w| w.u32s(&[], "").unwrap()),
        Box::new(|w| w.bool(false)),
        Box::new(|w| w.nil()),
        Box::new(|w| w.nil()),
        Box::new(|w| w.f32(1.0)),
        Box::new(|w| w.f32(0.0)),
        Box::new(|w| w.f32(0.0)),
        Box::new(|w| w.nil()),
        Box::new(|w| w.nil()),
        Box::new(|w| w.nil()),
        Box::new(|w| w.u32s(&[], "").unwrap()),
        Box::new(|w| w.nil()),
        Box::new(|w| w.nil()),
        // lora_int_id, lora_name, lora_path: the base model
        Box::new(|w| w.uint(0)),
        Box::new(|w| w.nil()),
        Box::new(|w| w.nil()),
    ]
}

fn add_requests_frame(fields: &[Field]) -> Vec<u8> {
    frame(MessageType::AddRequests, |w| {
        w.array_len(1, "").unwrap();
        w.array_len(fields.len(), "").unwrap();
        for f in fields {
            f(w);
        }
    })
}

/// A valid AddRequests frame with field `index` replaced.
fn with_field(index: usize, replacement: Field) -> Vec<u8> {
    let mut fields = add_request_fields();
    fields[index] = replacement;
    add_requests_frame(&fields)
}

fn err(frame: &[u8]) -> String {
    decode(frame).expect_err("must be rejected").to_string()
}

#[test]
fn the_helper_builds_a_valid_frame() {
    let Message::AddRequests(r) = decode(&add_requests_frame(&add_request_fields())).unwrap()
    else {
        panic!("wrong type");
    };
    assert_eq!(r[0].prompt_token_ids, [1, 2, 3]);
    assert_eq!(r[0].top_k, -1);
}

#[test]
fn header_problems() {
    assert_eq!(
        err(b""),
        "truncated frame: frame header (message type, wire version) needs 2 bytes, 0 left"
    );
    assert_eq!(
        err(&[0x01]),
        "truncated frame: frame header (message type, wire version) needs 2 bytes, 1 left"
    );
    assert_eq!(
        err(&[0x7e, WIRE_VERSION, 0x90]),
        "unknown message type 0x7e"
    );
    assert_eq!(
        err(&[0x04, WIRE_VERSION + 1, 0x90]),
        format!(
            "wrong wire version: frame has {}, this build speaks {WIRE_VERSION}",
            WIRE_VERSION + 1
        )
    );
}

#[test]
fn oversized_frames_are_rejected_before_reading() {
    let frame = encode_abort(&[1; 100]).unwrap();
    let e = decode_with_limit(&frame, 50).unwrap_err();
    assert_eq!(
        e,
        WireError::TooLarge {
            size: frame.len(),
            max: 50
        }
    );
    assert!(decode_with_limit(&frame, frame.len()).is_ok());
}

#[test]
fn every_truncation_of_every_message_is_rejected() {
    let mut rng = Rng::new(11);
    for _ in 0..300 {
        let bytes = encode(&random_message(&mut rng)).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
    }
}

#[test]
fn truncated_token_array_names_the_field() {
    let bytes = encode_add_requests([&AddRequest::new(5, vec![7; 1024])]).unwrap();
    // Header (2), outer array (1), request array (3), wire id (1), bin16 header (3) + 40
    // bytes (more than one per field left, so the request's header check passes).
    const { assert!(ADD_REQUEST_FIELDS < 40) };
    assert_eq!(
        err(&bytes[..2 + 1 + 3 + 1 + 3 + 40]),
        "truncated frame: AddRequests[0].prompt_token_ids needs 4096 bytes, 40 left"
    );
    // Fewer bytes than the request's fields could take fails at its header.
    assert_eq!(
        err(&bytes[..2 + 1 + 3 + 10]),
        format!("truncated frame: AddRequests[0] needs {ADD_REQUEST_FIELDS} bytes, 10 left")
    );
}

#[test]
fn wrong_field_types() {
    assert_eq!(
        err(&with_field(6, Box::new(|w| w.f64(1.0)))),
        "malformed frame: AddRequests[0].temperature: expected float32, found float64 (0xcb)"
    );
    assert_eq!(
        err(&with_field(1, Box::new(|w| w.str("hi", "").unwrap()))),
        "malformed frame: AddRequests[0].prompt_token_ids: expected bin, found str (0xa2)"
    );
    assert_eq!(
        err(&with_field(12, Box::new(|w| w.uint(1)))),
        "malformed frame: AddRequests[0].ignore_eos: expected bool, found int (0x01)"
    );
    assert_eq!(
        err(&with_field(0, Box::new(|w| w.nil()))),
        "malformed frame: AddRequests[0].wire_id: expected int, found nil (0xc0)"
    );
    assert_eq!(
        err(&with_field(10, Box::new(|w| w.f32(1.0)))),
        "malformed frame: AddRequests[0].seed: expected int, found float32 (0xca)"
    );
    assert_eq!(
        err(&with_field(18, Box::new(|w| w.uint(1)))),
        "malformed frame: AddRequests[0].cache_salt: expected str, found int (0x01)"
    );
}

#[test]
fn structured_specs_are_checked() {
    let with = |kind: &str, spec: String| {
        let kind = kind.to_string();
        with_field(
            19,
            Box::new(move |w| {
                w.array_len(2, "").unwrap();
                w.str(&kind, "").unwrap();
                w.str(&spec, "").unwrap();
            }),
        )
    };
    assert_eq!(
        err(&with("xml", "{}".into())),
        "malformed frame: AddRequests[0].structured_outputs: kind \"xml\" is not one of \
         json, regex, choice, grammar, json_object, after_reasoning"
    );
    assert_eq!(
        err(&with("regex", "a".repeat(MAX_STRUCTURED_SPEC_BYTES + 1))),
        format!(
            "malformed frame: AddRequests[0].structured_outputs: spec of {} bytes is over the limit \
             of {MAX_STRUCTURED_SPEC_BYTES}",
            MAX_STRUCTURED_SPEC_BYTES + 1
        )
    );
    assert!(decode(&with("regex", "a+".into())).is_ok());
    let mut r = AddRequest::new(1, vec![1]);
    r.structured_outputs = Some(StructuredSpec {
        kind: "json".into(),
        spec: "x".repeat(MAX_STRUCTURED_SPEC_BYTES + 1),
    });
    assert!(encode_add_requests([&r]).is_err());
}

#[test]
fn ints_out_of_range() {
    assert_eq!(
        err(&with_field(3, Box::new(|w| w.int(1 << 40)))),
        "malformed frame: AddRequests[0].priority: int 1099511627776 out of range -2^31..2^31"
    );
    assert_eq!(
        err(&with_field(0, Box::new(|w| w.int(-1)))),
        "malformed frame: AddRequests[0].wire_id: int -1 out of range 0..2^64"
    );
    assert_eq!(
        err(&with_field(4, Box::new(|w| w.uint(1 << 32)))),
        "malformed frame: AddRequests[0].max_tokens: int 4294967296 out of range 0..2^32"
    );
}

#[test]
fn wrong_array_lengths() {
    let mut fields = add_request_fields();
    fields.pop();
    assert_eq!(
        err(&add_requests_frame(&fields)),
        format!(
            "malformed frame: AddRequests[0]: expected an array of {ADD_REQUEST_FIELDS} fields, \
             found {}",
            ADD_REQUEST_FIELDS - 1
        )
    );
    assert_eq!(
        err(&frame(MessageType::Shutdown, |w| w
            .array_len(1, "")
            .unwrap())),
        "truncated frame: Shutdown needs 1 byte, 0 left"
    );
    assert_eq!(
        err(&frame(MessageType::Shutdown, |w| {
            w.array_len(1, "").unwrap();
            w.nil();
        })),
        "malformed frame: Shutdown: expected an array of 0 fields, found 1"
    );
    assert_eq!(
        err(&frame(MessageType::Abort, |w| w.uint(3))),
        "malformed frame: Abort: expected array, found int (0x03)"
    );
}

#[test]
fn token_bytes_not_a_multiple_of_four() {
    assert_eq!(
        err(&with_field(
            1,
            Box::new(|w| w.bin(&[1, 2, 3, 4, 5], "").unwrap())
        )),
        "malformed frame: AddRequests[0].prompt_token_ids: array of 4-byte items has 5 bytes, \
         not a multiple of 4"
    );
}

#[test]
fn absurd_declared_lengths_fail_before_allocating() {
    // An array of 2^32 - 1 requests in a 7-byte body.
    let f = frame(MessageType::AddRequests, |w| {
        w.raw(&[0xdd, 0xff, 0xff, 0xff, 0xff])
    });
    assert_eq!(
        err(&f),
        "truncated frame: AddRequests needs 4294967295 bytes, 0 left"
    );
    let f = with_field(1, Box::new(|w| w.raw(&[0xc6, 0xff, 0xff, 0xff, 0xf0])));
    assert!(err(&f)
        .starts_with("truncated frame: AddRequests[0].prompt_token_ids needs 4294967280 bytes"));
    let f = frame(MessageType::UtilityCall, |w| {
        w.array_len(3, "").unwrap();
        w.uint(1);
        w.str("m", "").unwrap();
        w.raw(&[0xdf, 0xff, 0xff, 0xff, 0xff]);
    });
    assert_eq!(
        err(&f),
        "truncated frame: UtilityCall.args needs 8589934590 bytes, 0 left"
    );
}

#[test]
fn trailing_bytes() {
    let mut f = encode_shutdown();
    f.push(0xc0);
    assert_eq!(
        err(&f),
        "malformed frame: 1 trailing bytes after the Shutdown body"
    );
}

#[test]
fn invalid_utf8() {
    let f = frame(MessageType::EngineError, |w| {
        w.array_len(1, "").unwrap();
        w.raw(&[0xa2, 0xff, 0xfe]);
    });
    assert!(err(&f).starts_with("malformed frame: EngineError.message: str is not valid UTF-8"));
}

fn output_batch_frame(output_fields: impl Fn(&mut Writer)) -> Vec<u8> {
    frame(MessageType::OutputBatch, |w| {
        w.array_len(3, "").unwrap();
        w.array_len(1, "").unwrap();
        output_fields(w);
        w.array_len(6, "").unwrap();
        w.uint(1);
        w.uint(0);
        w.f32(0.5);
        w.uint(0);
        w.uint(0);
        w.uint(0);
        w.f64(1.0);
    })
}

#[test]
fn output_batch_problems() {
    let unknown_reason = output_batch_frame(|w| {
        w.array_len(9, "").unwrap();
        w.uint(1);
        w.u32s(&[5], "").unwrap();
        w.uint(9);
        w.nil();
        w.nil();
        w.nil();
        w.nil();
        w.nil();
        w.nil();
    });
    assert_eq!(
        err(&unknown_reason),
        "malformed frame: OutputBatch.outputs[0].finish_reason: unknown finish reason 9"
    );
    let bad_shape = output_batch_frame(|w| {
        w.array_len(9, "").unwrap();
        w.uint(1);
        w.u32s(&[5], "").unwrap();
        w.nil();
        w.nil();
        w.nil();
        w.array_len(5, "").unwrap();
        w.uint(2);
        w.uint(3);
        w.u32s(&[0; 6], "").unwrap();
        w.f32s(&[0.0; 6], "").unwrap();
        w.u32s(&[0; 1], "").unwrap();
        w.nil();
        w.nil();
        w.nil();
    });
    assert_eq!(
        err(&bad_shape),
        "malformed frame: OutputBatch.outputs[0].logprobs: 2 positions need 2 ranks, got 1"
    );
    let ragged_embedding = output_batch_frame(|w| {
        w.array_len(9, "").unwrap();
        w.uint(1);
        w.u32s(&[], "").unwrap();
        w.uint(0);
        for _ in 0..5 {
            w.nil();
        }
        w.bin(&[0; 6], "").unwrap();
    });
    assert_eq!(
        err(&ragged_embedding),
        "malformed frame: OutputBatch.outputs[0].embedding: array of 4-byte items has 6 bytes, \
         not a multiple of 4"
    );
    let bad_stats = frame(MessageType::OutputBatch, |w| {
        w.array_len(3, "").unwrap();
        w.array_len(0, "").unwrap();
        w.array_len(6, "").unwrap();
        w.uint(1);
        w.uint(0);
        w.f64(0.5);
    });
    assert_eq!(
        err(&bad_stats),
        "malformed frame: OutputBatch.stats.kv_cache_usage: expected float32, found float64 (0xcb)"
    );
}

#[test]
fn utility_problems() {
    let not_ok_value = frame(MessageType::UtilityResult, |w| {
        w.array_len(3, "").unwrap();
        w.uint(1);
        w.bool(false);
        w.uint(3);
    });
    assert_eq!(
        err(&not_ok_value),
        "malformed frame: UtilityResult.error: expected str, found int (0x03)"
    );
    let int_key = frame(MessageType::UtilityCall, |w| {
        w.array_len(3, "").unwrap();
        w.uint(1);
        w.str("m", "").unwrap();
        w.map_len(1, "").unwrap();
        w.uint(1);
        w.uint(2);
    });
    assert_eq!(
        err(&int_key),
        "malformed frame: UtilityCall.args: map keys must be str"
    );
    let ext = frame(MessageType::UtilityCall, |w| {
        w.array_len(3, "").unwrap();
        w.uint(1);
        w.str("m", "").unwrap();
        w.raw(&[0xd4, 0x01, 0x00]);
    });
    assert_eq!(
        err(&ext),
        "malformed frame: UtilityCall.args: unsupported msgpack type ext (0xd4)"
    );
    let deep = frame(MessageType::UtilityCall, |w| {
        w.array_len(3, "").unwrap();
        w.uint(1);
        w.str("m", "").unwrap();
        w.raw(&[0x91; 100_000]);
        w.nil();
    });
    assert!(err(&deep).contains("nest deeper than 64 levels"));
}

#[test]
fn malformed_list_fields() {
    // logit_bias: ids and biases of different lengths
    let uneven = with_field(
        20,
        Box::new(|w| {
            w.array_len(2, "").unwrap();
            w.u32s(&[1, 2], "").unwrap();
            w.f32s(&[0.5], "").unwrap();
        }),
    );
    assert_eq!(
        err(&uneven),
        "malformed frame: AddRequests[0].logit_bias: 2 token ids but 1 biases"
    );
    // bad_words_token_ids: a list that is not a bin of u32
    let bad_word = with_field(
        22,
        Box::new(|w| {
            w.array_len(2, "").unwrap();
            w.u32s(&[1], "").unwrap();
            w.bin(&[1, 2, 3], "").unwrap();
        }),
    );
    assert!(err(&bad_word).starts_with("malformed frame: AddRequests[0].bad_words_token_ids[1]:"));
    // both decode when well formed
    let ok = with_field(
        22,
        Box::new(|w| {
            w.array_len(1, "").unwrap();
            w.u32s(&[4, 5], "").unwrap();
        }),
    );
    let Message::AddRequests(r) = decode(&ok).unwrap() else {
        panic!("not AddRequests")
    };
    assert_eq!(r[0].bad_words_token_ids, vec![vec![4, 5]]);
}
