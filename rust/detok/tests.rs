//! Detokenizer tests against the real tokenizers in `shared/assets` (skipped
//! when absent). The reference is the `tokenizers` crate's own `decode`, the
//! same code the Python package runs.

use std::path::PathBuf;

use tokenizers::Tokenizer;

use super::*;

const FAMILIES: &[&str] = &[
    "gpt2",
    "llama-2",
    "mistral-v0.1",
    "llama-3-8b",
    "qwen2.5",
    "bert-base-uncased",
    "phi-2",
    "gpt-neox-20b",
    "t5-small",
];

const TEXTS: &[&str] = &[
    "Hello world! How are you doing today?",
    "日本語のテキストと中文字符，还有한국어.",
    "Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷, skin 👋🏽 and ❤️‍🔥!",
    "مرحبا بالعالم، كيف حالك؟",
    "def f(x):\n\tif x  >   1:\n\t\treturn    x ** 2  # comment\n",
    "Ça coûte 5 € — naïve café, Straße, Ελληνικά, русский.",
    "don't stop . ?! it's ' quoted ' , you're we've I'm",
];

fn assets() -> Option<PathBuf> {
    let dir = std::env::var_os("ASYNCLLM_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/assets"));
    let dir = dir.join("tokenizers");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("skipping: tokenizer assets not found at {}", dir.display());
        None
    }
}

fn load(name: &str) -> Option<(Tokenizer, Detokenizer)> {
    let path = assets()?.join(name).join("tokenizer.json");
    let tok = Tokenizer::from_file(&path).expect("tokenizer loads");
    let det = Detokenizer::new(&tok).expect("detokenizer supports it");
    Some((tok, det))
}

/// A small deterministic PRNG (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `D` of `detok/mod.rs`.
fn decode(tok: &Tokenizer, ids: &[u32], skip: bool, spaces: bool) -> String {
    if spaces {
        return tok.decode(ids, skip).unwrap();
    }
    let added = tok.get_added_tokens_decoder();
    let vocab = tok.get_added_vocabulary();
    let (mut text, mut run) = (String::new(), Vec::new());
    for &id in ids {
        let Some(token) = tok.id_to_token(id) else {
            continue;
        };
        if skip && vocab.is_special_token(&token) {
            continue;
        }
        if added.contains_key(&id) {
            text += &tok.decode(&std::mem::take(&mut run), skip).unwrap();
            text += &token;
        } else {
            run.push(id);
        }
    }
    text + &tok.decode(&run, skip).unwrap()
}

/// The reference: `D(P + O)` past its common prefix with `D(P)`.
fn reference(tok: &Tokenizer, prompt: &[u32], out: &[u32], skip: bool, spaces: bool) -> String {
    let all: Vec<u32> = prompt.iter().chain(out).copied().collect();
    let (full, pre) = (
        decode(tok, &all, skip, spaces),
        decode(tok, prompt, skip, spaces),
    );
    let mut n = full
        .bytes()
        .zip(pre.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    while !full.is_char_boundary(n) {
        n -= 1;
    }
    full[n..].to_string()
}

fn params(skip: bool, spaces: bool) -> RequestParams {
    RequestParams {
        skip_special_tokens: skip,
        spaces_between_special_tokens: spaces,
        ..Default::default()
    }
}

/// Streams `out` in chunks (sizes from `rng`, 1 if none) and returns the
/// released texts and the last step item.
fn stream(
    det: &mut Detokenizer,
    prompt: &[u32],
    out: &[u32],
    p: RequestParams,
    rng: Option<&mut Rng>,
) -> (Vec<String>, StepItem) {
    det.add_request(7, prompt, p).unwrap();
    let mut texts = Vec::new();
    let mut pos = 0;
    let mut rng = rng;
    loop {
        let size = rng.as_mut().map_or(1, |r| 1 + r.below(5));
        let end = (pos + size).min(out.len());
        let mut batch = StepBatch::with_capacity(1);
        batch.push(7, &out[pos..end]);
        let last = end == out.len();
        batch.finished = vec![last];
        let res = det.step(&batch).unwrap();
        texts.push(res.text_of(0).to_string());
        pos = end;
        if last || res.items[0].stop_index.is_some() {
            det.remove(7);
            return (texts, res.items[0]);
        }
    }
}

fn encode(tok: &Tokenizer, text: &str) -> Vec<u32> {
    tok.encode(text, false).unwrap().get_ids().to_vec()
}

#[test]
fn incremental_equals_full_decode_for_every_family() {
    for name in FAMILIES {
        let Some((tok, mut det)) = load(name) else {
            return;
        };
        let mut rng = Rng(0x9E3779B97F4A7C15 ^ name.len() as u64);
        let vocab = tok.get_vocab_size(true);
        let mut cases: Vec<(Vec<u32>, Vec<u32>)> = Vec::new();
        for text in TEXTS {
            let ids = encode(&tok, text);
            cases.push((Vec::new(), ids.clone()));
            let cut = ids.len() / 3;
            cases.push((ids[..cut].to_vec(), ids[cut..].to_vec()));
        }
        for _ in 0..40 {
            let n = 1 + rng.below(40);
            let ids: Vec<u32> = (0..n).map(|_| rng.below(vocab + 3) as u32).collect();
            let cut = rng.below(n);
            cases.push((ids[..cut].to_vec(), ids[cut..].to_vec()));
        }
        for (prompt, out) in &cases {
            for (skip, spaces) in [(true, true), (false, true), (true, false), (false, false)] {
                let want = reference(&tok, prompt, out, skip, spaces);
                let (texts, item) =
                    stream(&mut det, prompt, out, params(skip, spaces), Some(&mut rng));
                assert_eq!(
                    texts.concat(),
                    want,
                    "{name} skip={skip} spaces={spaces} prompt={prompt:?} out={out:?}"
                );
                assert_eq!(item.num_tokens_released, out.len());
            }
        }
    }
}

#[test]
fn split_utf8_is_held_until_complete() {
    let Some((tok, mut det)) = load("gpt2") else {
        return;
    };
    let ids = encode(&tok, "😀");
    assert!(ids.len() > 1, "emoji spans several byte-level tokens");
    let (texts, _) = stream(&mut det, &[], &ids, params(true, true), None);
    assert!(texts[..texts.len() - 1].iter().all(String::is_empty));
    assert_eq!(texts.last().unwrap(), "😀");

    // Unfinished at the end: released as the full decode renders it.
    let (texts, _) = stream(&mut det, &[], &ids[..1], params(true, true), None);
    assert_eq!(texts.concat(), tok.decode(&ids[..1], true).unwrap());
}

#[test]
fn byte_fallback_run_is_held_until_it_ends() {
    let Some((tok, mut det)) = load("llama-2") else {
        return;
    };
    // "中" as byte tokens, then an invalid byte: the whole run is U+FFFD x4.
    let byte = |b: u8| tok.token_to_id(&format!("<0x{b:02X}>")).unwrap();
    let ids = [byte(0xE4), byte(0xB8), byte(0xAD), byte(0x80)];
    let (texts, _) = stream(&mut det, &[], &ids, params(true, true), None);
    assert_eq!(texts.concat(), "\u{FFFD}".repeat(4));
    assert_eq!(texts.concat(), tok.decode(&ids, true).unwrap());
    let (texts, _) = stream(&mut det, &[], &ids[..3], params(true, true), None);
    assert_eq!(texts.concat(), "中");
}

#[test]
fn prompt_seeding_keeps_sentencepiece_spacing() {
    let Some((tok, mut det)) = load("llama-2") else {
        return;
    };
    let prompt = tok.encode("Hello", true).unwrap().get_ids().to_vec();
    let world = tok.token_to_id("▁world").unwrap();
    let (texts, _) = stream(&mut det, &prompt, &[world], params(true, true), None);
    assert_eq!(texts.concat(), " world");
    // Without a prompt the first token's space goes, as in decode().
    let (texts, _) = stream(&mut det, &[], &[world], params(true, true), None);
    assert_eq!(texts.concat(), "world");
}

#[test]
fn prompt_ending_in_partial_utf8_emits_the_completed_char_once() {
    for name in ["gpt2", "llama-2", "qwen2.5"] {
        let Some((tok, mut det)) = load(name) else {
            return;
        };
        let ids = encode(&tok, "ab 😀 cd");
        for cut in 1..ids.len() {
            let (prompt, out) = (&ids[..cut], &ids[cut..]);
            let (texts, _) = stream(&mut det, prompt, out, params(true, true), None);
            assert_eq!(
                texts.concat(),
                reference(&tok, prompt, out, true, true),
                "{name} {cut}"
            );
            let pre = tok.decode(prompt, true).unwrap();
            if pre.ends_with('\u{FFFD}') {
                assert!(texts.concat().starts_with('😀'), "{name}: {texts:?}");
            }
        }
    }
}

#[test]
fn special_tokens_both_ways() {
    let Some((tok, mut det)) = load("llama-3-8b") else {
        return;
    };
    let eot = tok.token_to_id("<|eot_id|>").unwrap();
    let mut ids = encode(&tok, "Hi");
    ids.push(eot);
    ids.extend(encode(&tok, " there"));
    let (texts, _) = stream(&mut det, &[], &ids, params(false, true), None);
    assert_eq!(texts.concat(), "Hi<|eot_id|> there");
    let (texts, _) = stream(&mut det, &[], &ids, params(true, true), None);
    assert_eq!(texts.concat(), "Hi there");

    let Some((tok, mut det)) = load("bert-base-uncased") else {
        return;
    };
    let ids = tok.encode("hello world", true).unwrap().get_ids().to_vec();
    let (texts, _) = stream(&mut det, &[], &ids, params(false, true), None);
    assert_eq!(texts.concat(), "[CLS] hello world [SEP]");
    let (texts, _) = stream(&mut det, &[], &ids, params(false, false), None);
    assert_eq!(texts.concat(), "[CLS]hello world[SEP]");
}

fn stop_params(stop: &[&str], include: bool, min_tokens: usize) -> RequestParams {
    RequestParams {
        skip_special_tokens: true,
        spaces_between_special_tokens: true,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        include_stop_str_in_output: include,
        min_tokens,
    }
}

/// gpt2 ids of `words`, one token per word (checked).
fn words(tok: &Tokenizer, words: &[&str]) -> Vec<u32> {
    words
        .iter()
        .map(|w| {
            let ids = encode(tok, w);
            assert_eq!(ids.len(), 1, "{w:?} is one token");
            ids[0]
        })
        .collect()
}

#[test]
fn stop_string_hold_back_and_release() {
    let Some((tok, mut det)) = load("gpt2") else {
        return;
    };
    let ids = words(&tok, &["Hello", " wor", "ry", " world", "!"]);
    det.add_request(1, &[], stop_params(&[" world!"], false, 0))
        .unwrap();
    let mut released = Vec::new();
    for &id in &ids {
        let mut b = StepBatch::with_capacity(1);
        b.push(1, &[id]);
        let r = det.step(&b).unwrap();
        released.push((r.text_of(0).to_string(), r.items[0]));
    }
    // " wor" may start the stop: held; "ry" rules it out: released together.
    assert_eq!(released[0].0, "Hello");
    assert_eq!(released[1].0, "");
    assert_eq!(released[1].1.num_tokens_released, 1);
    assert_eq!(released[2].0, " worry");
    assert_eq!(released[2].1.num_tokens_released, 3);
    assert_eq!(released[3].0, "");
    assert_eq!(released[4].0, "");
    assert_eq!(released[4].1.stop_index, Some(0));
    assert_eq!(released[4].1.num_kept, 1);
}

#[test]
fn stop_string_earliest_match_include_and_token_count() {
    let Some((tok, mut det)) = load("gpt2") else {
        return;
    };
    let ids = words(&tok, &["The", " cat", " sat", " on", " the", " mat"]);
    // "at" ends at byte 7 (in " cat"), before " sat on" or " the mat" end.
    for (include, want) in [(false, "The c"), (true, "The cat")] {
        let p = stop_params(&[" the mat", " sat on", "at"], include, 0);
        let (texts, item) = stream(&mut det, &[], &ids, p, None);
        assert_eq!(item.stop_index, Some(2));
        assert_eq!(item.num_kept, 1, "the completing token is in its own step");
        assert_eq!(texts.concat(), want);
    }
    // All in one step: tokens after the completing one are dropped.
    det.add_request(2, &[], stop_params(&[" sat"], true, 0))
        .unwrap();
    let mut b = StepBatch::with_capacity(1);
    b.push(2, &ids);
    let r = det.step(&b).unwrap();
    assert_eq!(r.text_of(0), "The cat sat");
    assert_eq!(r.items[0].num_kept, 3);
    assert_eq!(r.items[0].stop_index, Some(0));
    // Later tokens for a stopped request are ignored.
    let r = det.step(&b).unwrap();
    assert_eq!((r.text_of(0), r.items[0].num_kept), ("", 0));
    // Same end: the longer stop string wins.
    let (texts, item) = stream(
        &mut det,
        &[],
        &ids,
        stop_params(&["at", " cat"], false, 0),
        None,
    );
    assert_eq!((texts.concat().as_str(), item.stop_index), ("The", Some(1)));
}

#[test]
fn stop_strings_respect_min_tokens() {
    let Some((tok, mut det)) = load("gpt2") else {
        return;
    };
    let ids = words(&tok, &["The", " cat", " sat", " on", " the", " mat"]);
    // " cat" is token 2: with min_tokens 3 it can't stop there; " the" (token
    // 5) can. A match spanning into allowed text counts ("sat" ends in token 3).
    let p = stop_params(&[" cat", " the"], false, 3);
    let (texts, item) = stream(&mut det, &[], &ids, p, None);
    assert_eq!(
        (texts.concat().as_str(), item.stop_index),
        ("The cat sat on", Some(1))
    );
    // Before the min_tokens-th token nothing matches, not even at the start.
    let p = stop_params(&["The"], false, 3);
    let (texts, item) = stream(&mut det, &[], &ids, p, None);
    assert_eq!(
        (texts.concat().as_str(), item.stop_index),
        ("The cat sat on the mat", None)
    );
    let p = stop_params(&["cat sat"], false, 3);
    let (texts, _) = stream(&mut det, &[], &ids, p, None);
    assert_eq!(texts.concat(), "The ");
}

#[test]
fn stop_match_in_text_released_at_finish() {
    let Some((tok, mut det)) = load("gpt2") else {
        return;
    };
    // An unfinished character renders as U+FFFD only at the finish.
    let mut ids = encode(&tok, "ok ");
    ids.push(encode(&tok, "😀")[0]);
    let (texts, item) = stream(
        &mut det,
        &[],
        &ids,
        stop_params(&["\u{FFFD}"], false, 0),
        None,
    );
    assert_eq!(texts.concat(), "ok ");
    assert_eq!(item.stop_index, Some(0));
}

#[test]
fn errors_are_reported_without_side_effects() {
    let Some((_, mut det)) = load("gpt2") else {
        return;
    };
    det.add_request(1, &[], params(true, true)).unwrap();
    assert!(matches!(
        det.add_request(1, &[], params(true, true)),
        Err(DetokError::DuplicateRequest(1))
    ));
    assert!(matches!(
        det.add_request(2, &[], stop_params(&[""], false, 0)),
        Err(DetokError::EmptyStopString(2))
    ));
    let mut b = StepBatch::with_capacity(2);
    b.push(1, &[15496]);
    b.push(3, &[995]);
    assert!(matches!(det.step(&b), Err(DetokError::UnknownRequest(3))));
    let mut b = StepBatch::with_capacity(2);
    b.push(1, &[15496]);
    b.push(1, &[995]);
    assert!(matches!(det.step(&b), Err(DetokError::RepeatedRequest(1))));
    let mut b = StepBatch::with_capacity(1);
    b.push(1, &[15496]);
    assert_eq!(det.step(&b).unwrap().text, "Hello");
}
