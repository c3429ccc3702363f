//! The per-token decode table: what each token id contributes to the text of a
//! `Tokenizer::decode`, precomputed once so that streaming never calls the
//! decoder chain.
//!
//! Every supported decoder is a per-token map (which may treat the first token
//! of a decode differently), followed by a join of the pieces under one of three
//! UTF-8 regimes, and optionally a strip of leading characters of the joined
//! string:
//!
//! | `tokenizer.json` decoder                         | pieces      | join            |
//! |--------------------------------------------------|-------------|-----------------|
//! | `ByteLevel` (GPT-2, Llama-3, Qwen2, Phi, NeoX)     | raw bytes   | `Lossy`         |
//! | `Replace* ByteFallback Fuse Strip` (Llama-2, Mistral) | text / byte | `ByteRuns` |
//! | `WordPiece` (BERT), `Metaspace` (T5), none          | text        | `Text`          |
//!
//! The per-token part is computed by the `tokenizers` crate's own decoders
//! (`decode_chain` on one token, as the first and as a later token), so it
//! matches the Python package exactly. Decoders whose output is not such a
//! composition (`BPEDecoder`, `CTC`, a `Strip` of trailing characters, ...) are
//! rejected with [`DetokError::Unsupported`] rather than decoded approximately.

use tokenizers::decoders::DecoderWrapper;
use tokenizers::{Decoder, Tokenizer};

use super::DetokError;

/// How the pieces of a decode are joined into text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Utf8Join {
    /// Pieces are valid text; concatenate.
    Text,
    /// Pieces are text or single bytes (`<0xXX>` tokens). A maximal run of
    /// bytes becomes its UTF-8 text if valid as a whole, else one U+FFFD per
    /// byte (the `ByteFallback` decoder).
    ByteRuns,
    /// Pieces are raw bytes; the concatenation is decoded like
    /// `String::from_utf8_lossy` (the `ByteLevel` decoder).
    Lossy,
}

/// A byte range in [`DecodeTable::arena`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Span {
    start: u32,
    len: u32,
}

/// What one token contributes, before joining.
#[derive(Clone, Copy, Debug)]
pub enum Piece {
    /// Text (valid UTF-8) or, under [`Utf8Join::Lossy`], raw bytes.
    Bytes(Span),
    /// A byte-fallback token (`<0xXX>`), only under [`Utf8Join::ByteRuns`].
    Byte(u8),
}

const PRESENT: u8 = 1;
const SPECIAL: u8 = 2;
const ADDED: u8 = 4;

/// One token id's entry.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// The piece when this token is the first of a decode.
    pub first: Piece,
    /// The piece at any later position.
    pub rest: Piece,
    /// The token's own string (an added token's content).
    pub raw: Span,
    flags: u8,
}

impl Entry {
    const MISSING: Entry = Entry {
        first: Piece::Bytes(Span { start: 0, len: 0 }),
        rest: Piece::Bytes(Span { start: 0, len: 0 }),
        raw: Span { start: 0, len: 0 },
        flags: 0,
    };

    /// Whether the id names a token at all (`decode` drops ids that don't).
    pub fn is_present(&self) -> bool {
        self.flags & PRESENT != 0
    }
    /// Whether `skip_special_tokens` removes it.
    pub fn is_special(&self) -> bool {
        self.flags & SPECIAL != 0
    }
    /// Whether it is an added token (a segment break without
    /// `spaces_between_special_tokens`).
    pub fn is_added(&self) -> bool {
        self.flags & ADDED != 0
    }
}

/// The decode table of one tokenizer; immutable and shared by all requests.
#[derive(Debug)]
pub struct DecodeTable {
    pub join: Utf8Join,
    /// `Strip` after `Fuse`: remove up to `n` leading `char`s of a decode.
    pub strip: Option<(char, usize)>,
    entries: Vec<Entry>,
    arena: Vec<u8>,
}

/// The decoder chain, split into the parts the table models.
struct Plan {
    per_token: Vec<DecoderWrapper>,
    join: Utf8Join,
    strip: Option<(char, usize)>,
    no_decoder: bool,
}

fn unsupported(what: &str) -> DetokError {
    DetokError::Unsupported(what.to_string())
}

fn flatten(decoder: &DecoderWrapper, out: &mut Vec<DecoderWrapper>) {
    match decoder {
        DecoderWrapper::Sequence(seq) => seq.get_decoders().iter().for_each(|d| flatten(d, out)),
        other => out.push(other.clone()),
    }
}

fn plan(decoder: Option<&DecoderWrapper>) -> Result<Plan, DetokError> {
    let mut plan = Plan {
        per_token: Vec::new(),
        join: Utf8Join::Text,
        strip: None,
        no_decoder: decoder.is_none(),
    };
    let mut chain = Vec::new();
    if let Some(d) = decoder {
        flatten(d, &mut chain);
    }
    // Phases: per-token maps, then ByteFallback / ByteLevel, then Fuse, then Strip.
    let mut fused = false;
    let mut bytes_joined = false;
    for d in chain {
        match d {
            DecoderWrapper::Fuse(_) => fused = true,
            DecoderWrapper::Strip(s) if fused && plan.strip.is_none() => {
                if s.stop != 0 {
                    return Err(unsupported("Strip of trailing characters"));
                }
                plan.strip = Some((s.content, s.start));
            }
            _ if fused || bytes_joined && plan.join == Utf8Join::Lossy => {
                return Err(unsupported("a decoder after Fuse or ByteLevel"));
            }
            DecoderWrapper::ByteFallback(_) if !bytes_joined => {
                bytes_joined = true;
                plan.join = Utf8Join::ByteRuns;
            }
            DecoderWrapper::ByteLevel(_) if !bytes_joined => {
                bytes_joined = true;
                plan.join = Utf8Join::Lossy;
            }
            _ if bytes_joined => return Err(unsupported("a decoder after ByteFallback")),
            d @ (DecoderWrapper::Replace(_)
            | DecoderWrapper::Metaspace(_)
            | DecoderWrapper::WordPiece(_)
            | DecoderWrapper::Strip(_)) => plan.per_token.push(d),
            DecoderWrapper::BPE(_) => return Err(unsupported("BPEDecoder")),
            DecoderWrapper::CTC(_) => return Err(unsupported("CTC")),
            _ => return Err(unsupported("this decoder sequence")),
        }
    }
    Ok(plan)
}

/// GPT-2's byte <-> printable character map, inverted (char -> byte).
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut n = 0;
    for b in 0u32..256 {
        let c = if printable.contains(&b) {
            b
        } else {
            n += 1;
            255 + n
        };
        map.insert(char::from_u32(c).expect("valid scalar"), b as u8);
    }
    map
}

/// `ByteFallback`'s own test for a byte token.
fn fallback_byte(token: &str) -> Option<u8> {
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        u8::from_str_radix(&token[3..5], 16).ok()
    } else {
        None
    }
}

impl DecodeTable {
    /// Builds the table for `tokenizer`, or says why its decoder isn't supported.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, DetokError> {
        let plan = plan(tokenizer.get_decoder())?;
        let per_token = DecoderWrapper::Sequence(tokenizers::decoders::sequence::Sequence::new(
            plan.per_token.clone(),
        ));
        let added = tokenizer.get_added_tokens_decoder();
        let num_ids = added
            .keys()
            .map(|&id| id as usize + 1)
            .chain([tokenizer.get_vocab_size(true)])
            .max()
            .unwrap_or(0);
        let chars = byte_level_chars();
        let mut table = DecodeTable {
            join: plan.join,
            strip: plan.strip.filter(|&(_, n)| n > 0),
            entries: vec![Entry::MISSING; num_ids],
            arena: Vec::new(),
        };
        let vocab = tokenizer.get_added_vocabulary();
        for id in 0..num_ids as u32 {
            let Some(token) = tokenizer.id_to_token(id) else {
                continue;
            };
            let (first, rest) = if plan.no_decoder {
                (token.clone(), format!(" {token}"))
            } else if plan.per_token.is_empty() {
                (token.clone(), token.clone())
            } else {
                let decode = |tokens: Vec<String>| {
                    per_token
                        .decode_chain(tokens)
                        .map_err(|e| DetokError::Load(e.to_string()))
                };
                let first = decode(vec![token.clone()])?.swap_remove(0);
                let rest = decode(vec![String::new(), token.clone()])?.swap_remove(1);
                (first, rest)
            };
            let first_piece = table.piece(&first, &chars);
            let rest_piece = if rest == first {
                first_piece
            } else {
                table.piece(&rest, &chars)
            };
            let raw = table.push(token.as_bytes());
            let mut flags = PRESENT;
            if vocab.is_special_token(&token) {
                flags |= SPECIAL;
            }
            if added.contains_key(&id) {
                flags |= ADDED;
            }
            table.entries[id as usize] = Entry {
                first: first_piece,
                rest: rest_piece,
                raw,
                flags,
            };
        }
        Ok(table)
    }

    fn push(&mut self, bytes: &[u8]) -> Span {
        let span = Span {
            start: self.arena.len() as u32,
            len: bytes.len() as u32,
        };
        self.arena.extend_from_slice(bytes);
        span
    }

    fn piece(&mut self, text: &str, chars: &std::collections::HashMap<char, u8>) -> Piece {
        match self.join {
            Utf8Join::Text => Piece::Bytes(self.push(text.as_bytes())),
            Utf8Join::ByteRuns => match fallback_byte(text) {
                Some(b) => Piece::Byte(b),
                None => Piece::Bytes(self.push(text.as_bytes())),
            },
            // `ByteLevel` maps each char back to its byte, or keeps the token's
            // own UTF-8 if any char is outside the map (e.g. added tokens).
            Utf8Join::Lossy => {
                let mapped: Option<Vec<u8>> =
                    text.chars().map(|c| chars.get(&c).copied()).collect();
                let bytes = mapped.unwrap_or_else(|| text.as_bytes().to_vec());
                Piece::Bytes(self.push(&bytes))
            }
        }
    }

    /// The entry of `id`; ids beyond the vocabulary are absent, as in `decode`.
    #[inline]
    pub fn entry(&self, id: u32) -> &Entry {
        self.entries.get(id as usize).unwrap_or(&Entry::MISSING)
    }

    /// The bytes of a span.
    #[inline]
    pub fn bytes(&self, span: Span) -> &[u8] {
        &self.arena[span.start as usize..(span.start + span.len) as usize]
    }

    /// The text of a span (only for text pieces and raw token strings).
    #[inline]
    pub fn text(&self, span: Span) -> &str {
        // Text pieces and raw strings were pushed from `&str`.
        std::str::from_utf8(self.bytes(span)).unwrap_or_default()
    }

    /// Number of ids with an entry (vocabulary plus added tokens).
    pub fn num_ids(&self) -> usize {
        self.entries.len()
    }
}
