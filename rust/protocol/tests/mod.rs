//! Tests of the wire protocol: round trips, malformed input, a never-panics
//! property test, and the golden fixtures shared with the Python tests.

mod fixtures;
mod fuzz;
mod malformed;
mod roundtrip;

use super::*;

/// A small seeded PRNG (SplitMix64), so failures reproduce without extra crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    pub fn u32(&mut self) -> u32 {
        self.next_u64() as u32
    }

    /// Ints that hit every msgpack width boundary often.
    pub fn edgy_u64(&mut self) -> u64 {
        const EDGES: [u64; 10] = [
            0,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u32::MAX as u64,
            u64::MAX,
        ];
        if self.chance(3) {
            EDGES[self.below(EDGES.len() as u64) as usize]
        } else {
            self.next_u64() >> self.below(64)
        }
    }

    /// Any bit pattern sometimes (NaN payloads, infinities, subnormals).
    pub fn f32(&mut self) -> f32 {
        match self.below(4) {
            0 => f32::from_bits(self.u32()),
            1 => [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN][self.below(5) as usize],
            _ => (self.below(1 << 20) as f32) / 1024.0,
        }
    }

    pub fn f64(&mut self) -> f64 {
        match self.below(4) {
            0 => f64::from_bits(self.next_u64()),
            1 => [0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN][self.below(5) as usize],
            _ => self.next_u64() as f64 / 7.0,
        }
    }

    pub fn u32s(&mut self, max_len: u64) -> Vec<u32> {
        let n = self.below(max_len + 1);
        (0..n).map(|_| self.u32() >> self.below(32)).collect()
    }

    pub fn string(&mut self, max_len: u64) -> String {
        const PIECES: [&str; 6] = ["a", "Z", " ", "é", "日本", "👩‍👩‍👧"];
        let n = self.below(max_len + 1);
        (0..n).map(|_| PIECES[self.below(6) as usize]).collect()
    }

    pub fn opt<T>(&mut self, f: impl FnOnce(&mut Rng) -> T) -> Option<T> {
        if self.chance(2) {
            None
        } else {
            Some(f(self))
        }
    }
}

pub fn random_add_request(rng: &mut Rng) -> AddRequest {
    AddRequest {
        wire_id: rng.edgy_u64(),
        prompt_token_ids: rng.u32s(300),
        arrival_time: rng.f64(),
        priority: rng.next_u64() as i32 >> rng.below(32),
        max_tokens: rng.edgy_u64() as u32,
        min_tokens: rng.edgy_u64() as u32,
        temperature: rng.f32(),
        top_p: rng.f32(),
        top_k: [0, -1, 1, 50, i32::MAX, i32::MIN][rng.below(6) as usize],
        min_p: rng.f32(),
        seed: rng.opt(|r| r.edgy_u64()),
        stop_token_ids: rng.u32s(4),
        ignore_eos: rng.chance(2),
        logprobs: rng.opt(|r| r.edgy_u64() as u32),
        prompt_logprobs: rng.opt(|r| r.below(21) as u32),
        repetition_penalty: rng.f32(),
        frequency_penalty: rng.f32(),
        presence_penalty: rng.f32(),
        cache_salt: rng.opt(|r| r.string(20)),
        structured_outputs: rng.opt(|r| StructuredSpec {
            kind: STRUCTURED_KINDS[r.below(STRUCTURED_KINDS.len() as u64) as usize].to_string(),
            spec: r.string(40),
        }),
        logit_bias: rng.u32s(3).into_iter().map(|t| (t, rng.f32())).collect(),
        allowed_token_ids: rng.u32s(4),
        bad_words_token_ids: (0..rng.below(3)).map(|_| rng.u32s(3)).collect(),
        pooling: rng.opt(|r| ["last", "mean"][r.below(2) as usize].to_string()),
        lora_int_id: rng.edgy_u64() as u32,
        lora_name: rng.opt(|r| r.string(20)),
        lora_path: rng.opt(|r| r.string(40)),
    }
}

pub fn random_logprobs(rng: &mut Rng) -> Logprobs {
    let num_positions = rng.below(5) as u32;
    let width = rng.below(7) as u32;
    let cells = (num_positions * width) as usize;
    Logprobs {
        num_positions,
        width,
        token_ids: (0..cells).map(|_| rng.u32()).collect(),
        logprobs: (0..cells).map(|_| rng.f32()).collect(),
        ranks: (0..num_positions).map(|_| rng.u32()).collect(),
    }
}

pub fn random_output_batch(rng: &mut Rng) -> OutputBatch {
    let n = rng.below(40);
    OutputBatch {
        outputs: (0..n)
            .map(|_| RequestOutput {
                wire_id: rng.edgy_u64(),
                new_token_ids: rng.u32s(6),
                finish_reason: rng.opt(|r| FinishReason::ALL[r.below(4) as usize]),
                stop_reason: rng.opt(|r| r.u32()),
                error: rng.opt(|r| r.string(40)),
                logprobs: rng.opt(random_logprobs),
                prompt_logprobs: rng.opt(random_logprobs),
                num_cached_tokens: rng.opt(|r| r.edgy_u64() as u32),
                embedding: rng.opt(|r| (0..r.below(9)).map(|_| r.f32()).collect()),
            })
            .collect(),
        stats: SchedulerStats {
            num_running: rng.edgy_u64() as u32,
            num_waiting: rng.edgy_u64() as u32,
            kv_cache_usage: rng.f32(),
            prefix_cache_queries: rng.edgy_u64(),
            prefix_cache_hits: rng.edgy_u64(),
            num_preemptions: rng.edgy_u64(),
        },
        timestamp: rng.f64(),
    }
}

pub fn random_value(rng: &mut Rng, depth: usize) -> Value {
    let kinds = if depth >= 4 { 7 } else { 9 };
    match rng.below(kinds) {
        0 => Value::Nil,
        1 => Value::Bool(rng.chance(2)),
        2 => Value::UInt(rng.edgy_u64()),
        3 => Value::Int(-((rng.edgy_u64() >> 1) as i64) - 1),
        4 => Value::Float(rng.f64()),
        5 => Value::Str(rng.string(50)),
        6 => Value::Bytes((0..rng.below(40)).map(|_| rng.u32() as u8).collect()),
        7 => Value::List(
            (0..rng.below(20))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => Value::Map(
            (0..rng.below(20))
                .map(|_| (rng.string(8), random_value(rng, depth + 1)))
                .collect(),
        ),
    }
}

pub fn random_message(rng: &mut Rng) -> Message {
    match rng.below(8) {
        0 => Message::AddRequests((0..rng.below(5)).map(|_| random_add_request(rng)).collect()),
        1 => Message::Abort {
            wire_ids: (0..rng.below(30)).map(|_| rng.edgy_u64()).collect(),
        },
        2 => Message::UtilityCall {
            call_id: rng.edgy_u64(),
            method: rng.string(20),
            args: random_value(rng, 0),
        },
        3 => Message::UtilityResult {
            call_id: rng.edgy_u64(),
            result: if rng.chance(2) {
                Ok(random_value(rng, 0))
            } else {
                Err(rng.string(60))
            },
        },
        4 => Message::Ready(Ready {
            max_model_len: rng.u32(),
            num_kv_blocks: rng.u32(),
            block_size: rng.u32(),
            vocab_size: rng.u32(),
            eos_token_ids: rng.u32s(3),
            hidden_size: rng.u32(),
        }),
        5 => Message::EngineError {
            message: rng.string(100),
        },
        6 => Message::Shutdown,
        _ => Message::OutputBatch(random_output_batch(rng)),
    }
}
