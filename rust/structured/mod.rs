//! Constrained decoding: a request's constraint (JSON schema, regex, choice
//! list, Lark grammar, any JSON object) compiled by llguidance into a grammar,
//! a matcher per request walking it token by token, and the two batched
//! operations of a step: the allowed-token bitmask of every constrained row,
//! and the advance of every matcher by its sampled token. Pure Rust: the
//! bindings in `py::structured` release the GIL around all of it.
//!
//! Bitmask layout (as vLLM's and xgrammar's): per row `words` u32, token `t`
//! allowed iff bit `t % 32` of word `t / 32` is set.

mod after_reasoning;
pub mod budget;
pub mod compile_pool;
pub mod literal_runs;
mod schema_refs;
mod vocab;

#[cfg(test)]
mod tests;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use rayon::prelude::*;
use rayon::ThreadPool;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;
use tokenizers::Tokenizer;
use toktrie::{InferenceCapabilities, TokEnv};

use crate::alloc_count;

/// Why a constraint could not be compiled or a matcher could not be used.
#[derive(Debug, Error)]
pub enum StructuredError {
    #[error("cannot build the token trie: {0}")]
    Tokenizer(String),
    #[error("unknown constraint kind {0:?}: expected json, regex, choice, grammar or json_object")]
    Kind(String),
    #[error("invalid {kind}: {msg}")]
    Invalid { kind: &'static str, msg: String },
    #[error("{kind} exceeds the compile budget ({limit}): {msg}")]
    Limit {
        kind: &'static str,
        limit: String,
        msg: String,
    },
}

/// Compiles constraints for one tokenizer; built once per engine.
pub struct Compiler {
    factory: ParserFactory,
    vocab_size: usize,
}

/// A compiled constraint: a matcher at its start, cloned for each request.
pub struct Grammar {
    start: Matcher,
    id: u64,
    size_bytes: u64,
}

/// Tells compiled grammars apart (a matcher's state key starts from it).
static NEXT_GRAMMAR_ID: AtomicU64 = AtomicU64::new(1);

impl Grammar {
    /// A fresh matcher at the start of this grammar. Its parser state is its own;
    /// the lexer's lazily built automaton is shared with every other matcher of
    /// this grammar (llguidance's plain `clone`), so it is built once, not per
    /// request.
    pub fn matcher(&self) -> TrackedMatcher {
        TrackedMatcher::new(self.start.clone(), self.id)
    }

    /// Heap bytes the compile left held (the grammar, its lexer, the start
    /// state); what the grammar cache counts. The lexer's automaton grows a
    /// little more as masks are computed, within `max_lexer_states`.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
}

impl Drop for Grammar {
    fn drop(&mut self) {
        if self.size_bytes > budget::RELEASE_OVER_BYTES {
            // the pages go back when the last matcher of it is gone too; the
            // parts they share are small next to what the grammar held
            alloc_count::release_free_memory();
        }
    }
}

/// What a matcher's state is after an advance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// More tokens may follow.
    Running = 0,
    /// The grammar ended (EOS consumed, or nothing but EOS can follow).
    Complete = 1,
    /// The token was not allowed or the parser failed; see the matcher's error.
    Error = 2,
}

impl Compiler {
    /// The compiler for `tokenizer` whose model has `vocab_size` logits, `eos`
    /// being the tokens that end a generation (allowed where a grammar ends).
    pub fn new(
        tokenizer: Tokenizer,
        eos: &[u32],
        vocab_size: usize,
    ) -> Result<Self, StructuredError> {
        let env: TokEnv = vocab::tok_env(tokenizer, eos, vocab_size)?;
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| StructuredError::Tokenizer(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = budget::limits();
        Ok(Compiler {
            factory,
            vocab_size,
        })
    }

    /// From a `tokenizer.json` file.
    pub fn from_file(path: &str, eos: &[u32], vocab_size: usize) -> Result<Self, StructuredError> {
        let tokenizer = Tokenizer::from_file(path)
            .map_err(|e| StructuredError::Tokenizer(format!("{path}: {e}")))?;
        Self::new(tokenizer, eos, vocab_size)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The bitmask row allowing only the EOS tokens.
    pub fn eos_row(&self) -> Vec<u32> {
        let trie = self.factory.tok_env().tok_trie();
        let mut row = vec![0u32; self.words()];
        for &t in trie.eos_tokens() {
            row[t as usize / 32] |= 1 << (t % 32);
        }
        row
    }

    /// u32 words per bitmask row.
    pub fn words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// Compiles one constraint. `kind` and `spec` are `StructuredOutputsParams`'s
    /// `kind` and `spec()`: a JSON schema as text, a regex, a JSON list of
    /// strings, a Lark grammar, or "" for any JSON object. The heap it holds is
    /// measured on the calling thread (run it on a thread of its own, as
    /// `compile_pool` does, for a figure that only counts it).
    pub fn compile(&self, kind: &str, spec: &str) -> Result<Grammar, StructuredError> {
        let (built, usage) = alloc_count::measure(|| self.build(kind, spec));
        let (kind, start) = match built {
            Ok(built) => built,
            Err(e) => {
                if usage.peak > budget::RELEASE_OVER_BYTES {
                    // a large compile refused: what it built goes back now (a kept
                    // grammar's scratch is reused by the next compile instead, and
                    // trimming locks every arena the step loop allocates from)
                    alloc_count::release_free_memory();
                }
                return Err(e);
            }
        };
        if usage.net > budget::MAX_GRAMMAR_BYTES {
            drop(start);
            alloc_count::release_free_memory();
            return Err(StructuredError::Limit {
                kind,
                limit: format!("max_grammar_bytes={}", budget::MAX_GRAMMAR_BYTES),
                msg: format!("the compiled grammar holds {} bytes", usage.net),
            });
        }
        Ok(Grammar {
            start,
            id: NEXT_GRAMMAR_ID.fetch_add(1, Ordering::Relaxed),
            size_bytes: usage.net,
        })
    }

    /// The matcher at the start of (kind, spec), and the kind's name for errors.
    fn build(&self, kind: &str, spec: &str) -> Result<(&'static str, Matcher), StructuredError> {
        let (kind, top) = top_level(kind, spec)?;
        let invalid = |msg: String| match budget::exceeded_limit(&msg) {
            Some(limit) => StructuredError::Limit { kind, limit, msg },
            None => StructuredError::Invalid { kind, msg },
        };
        // Building the parser compiles the grammar and its lexer; a bad schema,
        // regex or grammar, or one past the limits, fails here.
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| invalid(e.to_string()))?;
        let mut start = Matcher::new(Ok(parser));
        // The first mask, computed here rather than in a step: it builds the
        // lexer's first states (shared with every matcher of this grammar), so
        // their time is spent on the compile thread and their bytes counted in
        // the grammar's size.
        let first = start.compute_mask_or_eos();
        if let Some(e) = start.get_error() {
            return Err(invalid(e));
        }
        if let Err(e) = first {
            return Err(invalid(e.to_string()));
        }
        Ok((kind, start))
    }
}

/// The grammar of one constraint, and the kind's name for errors.
fn top_level(kind: &str, spec: &str) -> Result<(&'static str, TopLevelGrammar), StructuredError> {
    Ok(match kind {
        "json" => ("JSON schema", json_schema(checked_schema(spec)?)),
        "json_object" => (
            "JSON object",
            json_schema(serde_json::json!({"type": "object"})),
        ),
        "regex" => (
            "regex",
            TopLevelGrammar::from_regex(check_literals("regex", spec)?),
        ),
        "choice" => ("choice", choice(spec)?),
        "grammar" => ("grammar", TopLevelGrammar::from_lark(spec.to_string())),
        "after_reasoning" => {
            let reasoned = after_reasoning::Spec::parse(spec)?;
            let (kind, answer) = top_level(&reasoned.kind, &reasoned.spec)?;
            (kind, reasoned.wrap(answer)?)
        }
        other => return Err(StructuredError::Kind(other.to_string())),
    })
}

fn parse_json(kind: &'static str, spec: &str) -> Result<Value, StructuredError> {
    serde_json::from_str(spec).map_err(|e| StructuredError::Invalid {
        kind,
        msg: format!("not valid JSON: {e}"),
    })
}

/// The JSON schema in `spec`, refused if it is not JSON or if its `$ref`s form
/// a cycle that consumes nothing (it would describe no JSON at all).
fn checked_schema(spec: &str) -> Result<Value, StructuredError> {
    let schema = parse_json("JSON schema", spec)?;
    check_schema_literals(&schema)?;
    if let Some(cycle) = schema_refs::ref_cycle(&schema) {
        return Err(StructuredError::Invalid {
            kind: "JSON schema",
            msg: format!("$ref cycle that matches no JSON: {cycle}"),
        });
    }
    Ok(schema)
}

/// `pattern`, refused if it spells out a literal longer than
/// `literal_runs::MAX_LITERAL_BYTES` once its repetitions are expanded.
fn check_literals<'a>(kind: &'static str, pattern: &'a str) -> Result<&'a str, StructuredError> {
    let longest = literal_runs::longest_literal(pattern).unwrap_or(0);
    if longest > literal_runs::MAX_LITERAL_BYTES {
        return Err(StructuredError::Limit {
            kind,
            limit: format!("max_literal_bytes={}", literal_runs::MAX_LITERAL_BYTES),
            msg: format!(
                "it spells out a literal of {longest} bytes once repetitions are expanded"
            ),
        });
    }
    Ok(pattern)
}

/// Every `pattern` of a JSON schema within `check_literals`'s bound, and every
/// string `const` or `enum` value too (each becomes a literal of the lexer).
fn check_schema_literals(schema: &Value) -> Result<(), StructuredError> {
    let mut stack = vec![schema];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(p)) = map.get("pattern") {
                    check_literals("JSON schema", p)?;
                }
                let consts = map.get("const").into_iter();
                let enums = map
                    .get("enum")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten();
                for c in consts.chain(enums) {
                    if let Value::String(text) = c {
                        check_literals("JSON schema", &regex_syntax::escape(text))?;
                    }
                }
                stack.extend(map.values());
            }
            Value::Array(items) => stack.extend(items.iter()),
            _ => {}
        }
    }
    Ok(())
}

/// A JSON-schema grammar, compact (no free whitespace between tokens) unless the
/// schema's own `x-guidance` options say otherwise: free whitespace lets a model
/// pad forever, and compact JSON is what a client parses anyway.
fn json_schema(mut schema: Value) -> TopLevelGrammar {
    if let Value::Object(map) = &mut schema {
        map.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    TopLevelGrammar::from_json_schema(schema)
}

/// Exactly one of the strings: an alternation of escaped literals.
fn choice(spec: &str) -> Result<TopLevelGrammar, StructuredError> {
    let invalid = |msg: String| StructuredError::Invalid {
        kind: "choice",
        msg,
    };
    let choices: Vec<String> = serde_json::from_str(spec)
        .map_err(|e| invalid(format!("not a JSON list of strings: {e}")))?;
    if choices.is_empty() || choices.iter().any(String::is_empty) {
        return Err(invalid("needs at least one choice, none empty".into()));
    }
    let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
    let pattern = format!("(?:{})", alternatives.join("|"));
    Ok(TopLevelGrammar::from_regex(check_literals(
        "choice", &pattern,
    )?))
}

/// Unique rows at least this many are filled in parallel (given a pool);
/// fewer cost less on one thread.
const PARALLEL_ROWS: usize = 8;

/// Fills `rows[i]` (one bitmask row each, `eos_row.len()` words) with the
/// tokens `matchers[i]` allows next: EOS only where the grammar has ended, and
/// EOS only too where the matcher failed (so the request ends; its status says
/// why). Returns per row whether the matcher is in error. `eos_row` is
/// `Compiler::eos_row`.
///
/// A matcher's state is a function of its grammar and the tokens it consumed,
/// so rows with the same (grammar, tokens) (the `n > 1` children of a request,
/// rows at the start of the same schema, rows a forced prefix brought to the
/// same place) have the same mask: it is computed once and copied.
/// The distinct masks are computed on `pool` where one is given and there are
/// many, else serially on the calling thread (where the forward pass already
/// keeps every core busy, more threads only steal its cores).
pub fn fill_masks(
    matchers: &mut [&mut TrackedMatcher],
    rows: &mut [&mut [u32]],
    eos_row: &[u32],
    pool: Option<&ThreadPool>,
) -> Vec<bool> {
    assert_eq!(matchers.len(), rows.len(), "one bitmask row per matcher");
    let words = eos_row.len();
    // same_as[i]: the first row j <= i with row i's state
    let mut first: HashMap<u64, Vec<usize>> = HashMap::with_capacity(matchers.len());
    let mut same_as: Vec<usize> = Vec::with_capacity(matchers.len());
    for (i, m) in matchers.iter().enumerate() {
        let candidates = first.entry(m.key).or_default();
        let found = candidates
            .iter()
            .copied()
            .find(|&j| matchers[j].same_state(m));
        same_as.push(found.unwrap_or_else(|| {
            candidates.push(i);
            i
        }));
    }
    let fill = |(m, row): (&mut &mut TrackedMatcher, &mut &mut [u32])| -> bool {
        assert_eq!(row.len(), words, "bitmask row width");
        match m.m.compute_mask_or_eos() {
            Ok(mask) => {
                let src = mask.as_slice();
                let n = src.len().min(words);
                row[..n].copy_from_slice(&src[..n]);
                row[n..].fill(0);
                false
            }
            Err(_) => {
                row.copy_from_slice(eos_row);
                true
            }
        }
    };
    // the distinct states, computed; then every other row copies its twin's mask
    let mut unique: Vec<(&mut &mut TrackedMatcher, &mut &mut [u32])> = matchers
        .iter_mut()
        .zip(rows.iter_mut())
        .enumerate()
        .filter(|(i, _)| same_as[*i] == *i)
        .map(|(_, pair)| pair)
        .collect();
    let failed_unique: Vec<bool> = match pool {
        Some(pool) if unique.len() >= PARALLEL_ROWS => {
            pool.install(|| unique.par_iter_mut().map(|(m, r)| fill((m, r))).collect())
        }
        _ => unique.iter_mut().map(|(m, r)| fill((m, r))).collect(),
    };
    let mut failed = vec![false; matchers.len()];
    let mut k = 0;
    for i in 0..matchers.len() {
        let j = same_as[i];
        if j == i {
            failed[i] = failed_unique[k];
            k += 1;
        } else {
            failed[i] = failed[j];
            let (head, tail) = rows.split_at_mut(i);
            tail[0].copy_from_slice(head[j]);
        }
    }
    failed
}

/// A request's matcher with what identifies its state: its grammar and the
/// tokens it consumed (kept, with their running hash, so twins are found
/// exactly, not by hash alone).
pub struct TrackedMatcher {
    m: Matcher,
    grammar: u64,
    key: u64,
    tokens: Vec<u32>,
}

impl TrackedMatcher {
    fn new(m: Matcher, grammar: u64) -> Self {
        TrackedMatcher {
            m,
            grammar,
            key: mix(grammar),
            tokens: Vec::new(),
        }
    }

    fn same_state(&self, other: &TrackedMatcher) -> bool {
        self.key == other.key
            && self.grammar == other.grammar
            && self.m.is_error() == other.m.is_error()
            && self.tokens == other.tokens
    }

    fn push(&mut self, t: u32) {
        self.tokens.push(t);
        self.key = mix(self.key ^ u64::from(t));
    }

    /// The llguidance matcher (its error text, its captures).
    pub fn matcher(&self) -> &Matcher {
        &self.m
    }

    /// Undoes the last `num_tokens` consumed tokens (rejected speculation).
    pub fn rollback(&mut self, num_tokens: usize) -> Result<(), String> {
        if num_tokens > self.tokens.len() {
            return Err(format!(
                "cannot roll back {num_tokens} tokens: {} consumed",
                self.tokens.len()
            ));
        }
        self.m.rollback(num_tokens).map_err(|e| e.to_string())?;
        self.tokens.truncate(self.tokens.len() - num_tokens);
        self.key = self
            .tokens
            .iter()
            .fold(mix(self.grammar), |k, &t| mix(k ^ u64::from(t)));
        Ok(())
    }
}

/// splitmix64's finaliser: a cheap, well-mixed step of the running hash.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Advances `matchers[i]` by `tokens[i]`.
pub fn advance(matchers: &mut [&mut TrackedMatcher], tokens: &[u32]) -> Vec<Status> {
    assert_eq!(matchers.len(), tokens.len(), "one token per matcher");
    matchers
        .iter_mut()
        .zip(tokens)
        .map(|(m, &t)| consume(m, &[t]))
        .collect()
}

/// Consumes `tokens` (e.g. a resumed request's outputs so far).
pub fn consume(m: &mut TrackedMatcher, tokens: &[u32]) -> Status {
    if m.m.is_error() {
        return Status::Error;
    }
    for &t in tokens {
        if m.m.is_stopped() {
            break; // the EOS after the end of the grammar, or anything past it
        }
        m.push(t);
        if m.m.consume_token(t).is_err() {
            return Status::Error;
        }
    }
    status(m)
}

pub fn status(m: &TrackedMatcher) -> Status {
    if m.m.is_error() {
        Status::Error
    } else if m.m.is_stopped() {
        Status::Complete
    } else {
        Status::Running
    }
}
