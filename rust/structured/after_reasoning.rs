//! A constraint on a reasoning model's answer only: the reasoning (`<think>…
//! </think>`) stays free text, then the answer must match the request's own
//! constraint (JSON schema, regex, choice, grammar or any JSON object), as
//! vLLM applies structured output after the reasoning parser's end tag.
//!
//! Built as two grammars, so the request's constraint compiles exactly as it
//! would alone (its own lexer, its own errors): a Lark grammar for the
//! reasoning and the whitespace after it, ending in the named sub-grammar
//! `@answer`, which is the request's constraint. The reasoning is one lazy
//! lexeme that ends at the first close tag (`suffix=`: the tag stays in the
//! text, where the server's reasoning parser reads it).
//!
//! The spec is JSON: `{"open": "<think>" | null, "close": "</think>", "kind":
//! ..., "spec": ...}`. `open: null` is a model whose output starts in
//! reasoning (DeepSeek-R1: its template opens the tag); with an open tag the
//! reasoning block is optional and begins the output (Qwen3) — the same rules
//! as the server's parsers.

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use serde_json::Value;

use super::StructuredError;

/// The longest tag accepted (the tags are the parser's, not a client's; the
/// bound only keeps a malformed spec from building a large grammar).
const MAX_TAG_BYTES: usize = 64;

/// The most whitespace between the reasoning and the answer (models write a
/// newline or two): unbounded, a weak model could spend every token on it.
const MAX_WS: usize = 8;

/// The parsed spec: the tags, and the answer's own kind and spec.
pub struct Spec {
    pub open: Option<String>,
    pub close: String,
    pub kind: String,
    pub spec: String,
}

fn invalid(msg: impl Into<String>) -> StructuredError {
    StructuredError::Invalid {
        kind: "answer after reasoning",
        msg: msg.into(),
    }
}

/// A tag as a Lark string literal: printable ASCII without `"` or `\`, so it
/// needs no escaping (every reasoning model's tags are such).
fn tag(value: Option<&Value>, name: &str) -> Result<Option<String>, StructuredError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s))
            if !s.is_empty()
                && s.len() <= MAX_TAG_BYTES
                && s.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\') =>
        {
            Ok(Some(s.clone()))
        }
        Some(other) => Err(invalid(format!(
            "{name} must be printable ASCII without quotes or backslashes, at most \
             {MAX_TAG_BYTES} bytes; got {other}"
        ))),
    }
}

impl Spec {
    pub fn parse(spec: &str) -> Result<Self, StructuredError> {
        let v: Value =
            serde_json::from_str(spec).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
        let text = |name: &str| match v.get(name) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(invalid(format!("{name} must be a string"))),
        };
        let kind = text("kind")?;
        if kind == "after_reasoning" {
            return Err(invalid(
                "the answer's kind cannot itself be after_reasoning",
            ));
        }
        Ok(Spec {
            open: tag(v.get("open"), "open")?,
            close: tag(v.get("close"), "close")?.ok_or_else(|| invalid("close is required"))?,
            kind,
            spec: text("spec")?,
        })
    }

    /// The Lark grammar of the reasoning, ending in `@answer`.
    fn lark(&self) -> String {
        let reasoning = match &self.open {
            // the output starts inside the block: reasoning, close tag, answer
            None => "start: reasoning WS? @answer".to_string(),
            // an optional block at the start (whitespace before it allowed)
            Some(open) => format!("start: (WS? \"{open}\" reasoning WS?)? @answer"),
        };
        format!(
            "{reasoning}\nreasoning[suffix=\"{close}\"]: /(?s:.*)/\nWS: /[ \\t\\r\\n]{{1,{MAX_WS}}}/\n",
            close = self.close
        )
    }

    /// `answer` (the request's constraint, compiled alone as one grammar)
    /// behind the reasoning.
    pub fn wrap(&self, mut answer: TopLevelGrammar) -> Result<TopLevelGrammar, StructuredError> {
        if answer.grammars.len() != 1 {
            return Err(invalid("the answer's constraint must be a single grammar"));
        }
        let mut inner = answer.grammars.remove(0);
        inner.name = Some("answer".to_string());
        Ok(TopLevelGrammar {
            grammars: vec![GrammarWithLexer::from_lark(self.lark()), inner],
            max_tokens: answer.max_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked() {
        let ok = Spec::parse(r#"{"open":null,"close":"</think>","kind":"regex","spec":"a"}"#);
        assert!(ok.is_ok());
        for bad in [
            r#"{"close":"</th\"ink>","kind":"regex","spec":"a"}"#,
            r#"{"open":"","close":"</think>","kind":"regex","spec":"a"}"#,
            r#"{"kind":"regex","spec":"a"}"#,
            r#"{"close":"</think>","kind":"after_reasoning","spec":"a"}"#,
            r#"{"close":"</think>","spec":"a"}"#,
        ] {
            assert!(Spec::parse(bad).is_err(), "{bad}");
        }
    }
}
