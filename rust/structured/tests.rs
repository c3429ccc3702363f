//! Constrained decoding against the shipped asyncllm-tiny tokenizer (always
//! present) and, where the assets are, real tokenizers of other families.

use std::path::PathBuf;

use super::*;

fn tiny() -> Compiler {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("python/asyncllm/default_model/asyncllm-tiny/tokenizer.json");
    let tok = Tokenizer::from_file(&path).expect("tokenizer loads");
    let eos = tok.token_to_id("<|eos|>").expect("eos token");
    Compiler::new(tok, &[eos], 8192).expect("compiler")
}

fn allowed(row: &[u32], t: u32) -> bool {
    row[t as usize / 32] >> (t % 32) & 1 == 1
}

/// Walks `m` greedily by the lowest allowed token (deterministic), returning the
/// text it spelt and whether the grammar completed within `max` tokens.
fn walk(c: &Compiler, m: &mut TrackedMatcher, max: usize) -> (String, bool) {
    let words = c.words();
    let eos = c.eos_row();
    let trie = c.factory.tok_env().tok_trie().clone();
    let mut row = vec![0u32; words];
    let mut out = Vec::new();
    for _ in 0..max {
        let failed = fill_masks(&mut [&mut *m], &mut [&mut row[..]], &eos, None);
        assert_eq!(failed, vec![false]);
        // prefer a non-EOS token so the walk explores the grammar
        let eos_tokens = trie.eos_tokens().to_vec();
        let pick = (0..c.vocab_size() as u32)
            .filter(|&t| allowed(&row, t))
            .find(|t| !eos_tokens.contains(t))
            .or_else(|| eos_tokens.first().copied().filter(|&t| allowed(&row, t)))
            .expect("some token allowed");
        let st = advance(&mut [&mut *m], &[pick])[0];
        if !eos_tokens.contains(&pick) {
            out.extend_from_slice(trie.token(pick));
        }
        assert_ne!(st, Status::Error);
        if st == Status::Complete {
            return (String::from_utf8_lossy(&out).into_owned(), true);
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), false)
}

#[test]
fn choice_spells_one_choice_then_only_eos() {
    let c = tiny();
    let g = c.compile("choice", r#"["yes","no"]"#).unwrap();
    let mut m = g.matcher();
    let (text, done) = walk(&c, &mut m, 20);
    assert!(done);
    assert!(text == "yes" || text == "no", "{text:?}");
}

#[test]
fn regex_output_full_matches() {
    let c = tiny();
    let g = c.compile("regex", "[0-9]{3}-[a-c]{2}").unwrap();
    let (text, done) = walk(&c, &mut g.matcher(), 20);
    assert!(done);
    let b = text.as_bytes();
    assert_eq!(b.len(), 6, "{text:?}");
    assert!(
        b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
        "{text:?}"
    );
}

#[test]
fn json_schema_is_compact_and_parses() {
    let c = tiny();
    let schema = r#"{"type":"object","properties":{"a":{"type":"integer","minimum":0,"maximum":9},
        "b":{"enum":["x","y"]}},"required":["a","b"],"additionalProperties":false}"#;
    let g = c.compile("json", schema).unwrap();
    let (text, done) = walk(&c, &mut g.matcher(), 40);
    assert!(done, "{text:?}");
    let v: Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(v["a"].as_i64().unwrap() <= 9);
    assert!(!text.contains(' '), "compact: {text:?}");
}

#[test]
fn lark_grammar_and_eos_only_where_it_can_end() {
    let c = tiny();
    let g = c.compile("grammar", "start: \"ab\" \"c\"?").unwrap();
    let mut m = g.matcher();
    let words = c.words();
    let eos = c.eos_row();
    let eos_id = c.factory.tok_env().tok_trie().eos_token();
    let mut row = vec![0u32; words];
    fill_masks(&mut [&mut m], &mut [&mut row[..]], &eos, None);
    assert!(!allowed(&row, eos_id), "EOS before the grammar can end");
    let ab = c.factory.tok_env().tokenize("ab");
    assert_eq!(consume(&mut m, &ab), Status::Running);
    fill_masks(&mut [&mut m], &mut [&mut row[..]], &eos, None);
    assert!(allowed(&row, eos_id), "EOS where the grammar can end");
    assert_eq!(advance(&mut [&mut m], &[eos_id]), vec![Status::Complete]);
}

#[test]
fn disallowed_token_is_an_error_and_masks_eos_only() {
    let c = tiny();
    let g = c.compile("regex", "a+").unwrap();
    let mut m = g.matcher();
    let z = c.factory.tok_env().tokenize("z")[0];
    assert_eq!(advance(&mut [&mut m], &[z]), vec![Status::Error]);
    let words = c.words();
    let mut row = vec![0u32; words];
    let failed = fill_masks(&mut [&mut m], &mut [&mut row[..]], &c.eos_row(), None);
    assert_eq!(failed, vec![true]);
    assert_eq!(row, c.eos_row());
}

#[test]
fn bad_inputs_name_the_problem() {
    let c = tiny();
    let msg = |k: &str, s: &str| c.compile(k, s).err().expect("must fail").to_string();
    assert!(msg("regex", "(unclosed").starts_with("invalid regex"));
    assert!(msg("json", "{not json").contains("not valid JSON"));
    assert!(msg("json", r#"{"type":"nonsense"}"#).starts_with("invalid JSON schema"));
    assert!(msg("grammar", "start: undefined_rule").starts_with("invalid grammar"));
    assert!(msg("choice", "[]").starts_with("invalid choice"));
    assert!(msg("xml", "").contains("unknown constraint kind"));
}

#[test]
fn many_rows_in_parallel_match_one_by_one() {
    let c = tiny();
    let g = c
        .compile(
            "json",
            r#"{"type":"array","items":{"type":"integer"},"maxItems":3}"#,
        )
        .unwrap();
    let words = c.words();
    let eos = c.eos_row();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let env = c.factory.tok_env().clone();
    // rows at three places: the start, after "[1," and after "[12,3" (the
    // last two spelt by different tokens per row, so twins and strangers mix)
    let prefixes = ["", "[1,", "[12,3"];
    for with_pool in [None, Some(&pool)] {
        let mut ms: Vec<TrackedMatcher> = (0..24).map(|_| g.matcher()).collect();
        for (i, m) in ms.iter_mut().enumerate() {
            let text = prefixes[i % 3];
            if i % 2 == 0 {
                consume(m, &env.tokenize(text));
            } else {
                // byte by byte: the same text in other tokens
                for ch in text.chars() {
                    consume(m, &env.tokenize(&ch.to_string()));
                }
            }
        }
        let mut batch = vec![0u32; 24 * words];
        let mut refs: Vec<&mut TrackedMatcher> = ms.iter_mut().collect();
        let mut rows: Vec<&mut [u32]> = batch.chunks_mut(words).collect();
        fill_masks(&mut refs, &mut rows, &eos, with_pool);
        for (i, m) in ms.iter_mut().enumerate() {
            let mut row = vec![0u32; words];
            fill_masks(&mut [m], &mut [&mut row[..]], &eos, None);
            assert_eq!(&batch[i * words..(i + 1) * words], &row[..], "row {i}");
        }
    }
}

#[test]
fn twins_share_a_mask_and_part_when_their_tokens_do() {
    let c = tiny();
    let g = c.compile("regex", "(ab|cd)+").unwrap();
    let h = c.compile("regex", "(ab|cd)+").unwrap();
    let env = c.factory.tok_env().clone();
    let (a, cc) = (env.tokenize("a")[0], env.tokenize("c")[0]);
    let mut x = g.matcher();
    let mut y = g.matcher();
    assert!(x.same_state(&y), "two fresh matchers of one grammar");
    assert!(
        !x.same_state(&h.matcher()),
        "another grammar, even if equal"
    );
    advance(&mut [&mut x, &mut y], &[a, a]);
    assert!(x.same_state(&y));
    let (words, eos) = (c.words(), c.eos_row());
    let mut batch = vec![0u32; 2 * words];
    let mut rows: Vec<&mut [u32]> = batch.chunks_mut(words).collect();
    fill_masks(&mut [&mut x, &mut y], &mut rows, &eos, None);
    assert_eq!(batch[..words], batch[words..], "twins, one mask");
    let mut z = g.matcher();
    advance(&mut [&mut z], &[cc]);
    assert!(!x.same_state(&z));
    // rollback restores the state key: after undoing "c", z is fresh again
    z.rollback(1).unwrap();
    assert!(z.same_state(&g.matcher()));
    assert!(z.rollback(1).is_err(), "nothing left to undo");
}

#[test]
fn real_tokenizers_build_and_constrain() {
    let dir = std::env::var_os("ASYNCLLM_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/assets"))
        .join("tokenizers");
    for (name, eos) in [("qwen2.5", "<|endoftext|>"), ("llama-2", "</s>")] {
        let path = dir.join(name).join("tokenizer.json");
        if !path.is_file() {
            eprintln!("skipping {name}: no assets at {}", path.display());
            continue;
        }
        let tok = Tokenizer::from_file(&path).unwrap();
        let eos = tok.token_to_id(eos).unwrap();
        let vocab = tok.get_vocab_size(true);
        let c = Compiler::new(tok, &[eos], vocab.div_ceil(64) * 64).unwrap();
        let g = c.compile("choice", r#"["alpha beta","gamma"]"#).unwrap();
        let (text, done) = walk(&c, &mut g.matcher(), 30);
        assert!(
            done && (text == "alpha beta" || text == "gamma"),
            "{name}: {text:?}"
        );
    }
}

/// The status after consuming `text` from the start of `g`, and whether EOS is
/// then allowed.
fn after_text(c: &Compiler, g: &Grammar, text: &str) -> (Status, bool) {
    let mut m = g.matcher();
    let ids = c.factory.tok_env().tokenize(text);
    let st = consume(&mut m, &ids);
    let mut row = vec![0u32; c.words()];
    fill_masks(&mut [&mut m], &mut [&mut row[..]], &c.eos_row(), None);
    let eos_id = c.factory.tok_env().tok_trie().eos_token();
    (st, allowed(&row, eos_id))
}

#[test]
fn answer_after_reasoning_is_constrained_and_the_reasoning_is_not() {
    let c = tiny();
    let spec = |open: &str| {
        format!(
            r#"{{"open":{open},"close":"</think>","kind":"json","spec":"{{\"enum\":[\"yes\",\"no\"]}}"}}"#
        )
    };
    // DeepSeek-R1: the output starts in reasoning, free text up to the tag
    let g = c.compile("after_reasoning", &spec("null")).unwrap();
    let (st, eos) = after_text(&c, &g, "a {not json} \"yes\"");
    assert_eq!(st, Status::Running);
    assert!(!eos, "EOS inside the reasoning");
    // a complete answer: nothing but EOS can follow
    assert_eq!(
        after_text(&c, &g, "hmm, {x}</think>\n\n\"no\""),
        (Status::Complete, true)
    );
    let (st, _) = after_text(&c, &g, "hmm</think> maybe");
    assert_eq!(st, Status::Error, "the answer must match the schema");
    let spaced = format!("hmm</think>{}\"no\"", " ".repeat(9));
    assert_eq!(
        after_text(&c, &g, &spaced).0,
        Status::Error,
        "whitespace is bounded"
    );
    // Qwen3: an optional block first; without it the answer starts at once
    let g = c.compile("after_reasoning", &spec("\"<think>\"")).unwrap();
    assert_eq!(after_text(&c, &g, "\"yes\""), (Status::Complete, true));
    let thought = "<think>so: no</think>\"no\"";
    assert_eq!(after_text(&c, &g, thought), (Status::Complete, true));
    assert_eq!(after_text(&c, &g, "so: no").0, Status::Error);
    // the answer's own errors are named as its kind
    let err = c
        .compile(
            "after_reasoning",
            r#"{"open":null,"close":"</think>","kind":"json","spec":"{]"}"#,
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("JSON schema"), "{err}");
}
