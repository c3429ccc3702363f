//! The token trie llguidance walks: every token id's bytes, taken from the
//! detokenizer's decode table (`crate::detok::DecodeTable`), so a grammar sees
//! exactly the bytes the engine's own text is made of.

use std::sync::Arc;

use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormSequence};
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use super::StructuredError;
use crate::detok::{DecodeTable, Piece};

/// A tokenizer and its trie: what llguidance needs to turn bytes into tokens.
struct Env {
    tokenizer: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy over the trie where the tokenizer's own encoding fails to give
    /// tokens of the trie (as llguidance's HF adapter does).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// The bytes of every token id below `vocab_size` (the width of the model's
/// logits, which may exceed the tokenizer's vocabulary: the ids past it are
/// unnamed special tokens no grammar allows). Special tokens are marked as
/// toktrie wants (0xFF then their text), so a grammar's text never matches them.
pub fn token_bytes(
    tokenizer: &Tokenizer,
    vocab_size: usize,
) -> Result<Vec<Vec<u8>>, StructuredError> {
    let table =
        DecodeTable::new(tokenizer).map_err(|e| StructuredError::Tokenizer(e.to_string()))?;
    if table.num_ids() > vocab_size {
        return Err(StructuredError::Tokenizer(format!(
            "the tokenizer has {} ids but the model's vocabulary only {vocab_size}",
            table.num_ids()
        )));
    }
    let special = |text: &str| {
        let mut bytes = Vec::with_capacity(text.len() + 1);
        bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
        bytes.extend_from_slice(text.as_bytes());
        bytes
    };
    let mut words = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size as u32 {
        let entry = table.entry(id);
        let bytes = if (id as usize) >= table.num_ids() || !entry.is_present() {
            special(&format!("<[{id}]>"))
        } else if entry.is_special() {
            special(table.raw(id))
        } else {
            match table.rest(entry) {
                Piece::Bytes(b) => b.to_vec(),
                Piece::Byte(b) => vec![b],
            }
        };
        words.push(bytes);
    }
    Ok(words)
}

/// `tokenizer` as llguidance needs it to tokenize bytes (forced text of a
/// grammar): without the normalizer or Metaspace step that prepends a space to
/// every encoded text (SentencePiece-style tokenizers), so "[" encodes as "["
/// and not as " [" (llguidance's own HF adapter makes the same changes).
fn without_prepended_space(mut tokenizer: Tokenizer) -> Result<Tokenizer, StructuredError> {
    fn normalizer(n: NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(seq) => {
                let kept: Vec<_> = seq
                    .as_ref()
                    .iter()
                    .filter_map(|n| normalizer(n.clone()))
                    .collect();
                (!kept.is_empty()).then(|| NormalizerWrapper::Sequence(NormSequence::new(kept)))
            }
            other => Some(other),
        }
    }
    fn pre_tokenizer(p: PreTokenizerWrapper) -> PreTokenizerWrapper {
        match p {
            PreTokenizerWrapper::Metaspace(mut ms) => {
                ms.prepend_scheme = PrependScheme::Never;
                PreTokenizerWrapper::Metaspace(ms)
            }
            PreTokenizerWrapper::Sequence(seq) => PreTokenizerWrapper::Sequence(PreSequence::new(
                seq.as_ref()
                    .iter()
                    .map(|p| pre_tokenizer(p.clone()))
                    .collect(),
            )),
            other => other,
        }
    }
    if let Some(n) = tokenizer.get_normalizer().cloned() {
        tokenizer
            .with_normalizer(normalizer(n))
            .map_err(|e| StructuredError::Tokenizer(e.to_string()))?;
    }
    if let Some(p) = tokenizer.get_pre_tokenizer().cloned() {
        tokenizer.with_pre_tokenizer(Some(pre_tokenizer(p)));
    }
    Ok(tokenizer)
}

/// The llguidance environment of `tokenizer` with `eos` as its end tokens.
pub fn tok_env(
    tokenizer: Tokenizer,
    eos: &[u32],
    vocab_size: usize,
) -> Result<TokEnv, StructuredError> {
    let Some(&first_eos) = eos.first() else {
        return Err(StructuredError::Tokenizer(
            "constrained decoding needs at least one EOS token id".into(),
        ));
    };
    if let Some(bad) = eos.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(StructuredError::Tokenizer(format!(
            "EOS token id {bad} is outside the vocabulary of {vocab_size}"
        )));
    }
    let words = token_bytes(&tokenizer, vocab_size)?;
    let info = TokRxInfo::new(vocab_size as u32, first_eos);
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    let tokenizer = without_prepended_space(tokenizer)?;
    Ok(Arc::new(Env { tokenizer, trie }))
}
