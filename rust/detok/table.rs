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

use std::collections::HashMap;

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
struct Span {
    start: u32,
    len: u32,
}

/// What one token contributes, before joining.
#[derive(Clone, Copy, Debug)]
pub enum Piece<'a> {
    /// Text (valid UTF-8) or, under [`Utf8Join::Lossy`], raw bytes.
    Bytes(&'a [u8]),
    /// A byte-fallback token (`<0xXX>`), only under [`Utf8Join::ByteRuns`].
    Byte(u8),
}

const PRESENT: u8 = 1;
const SPECIAL: u8 = 2;
const ADDED: u8 = 4;
/// The piece is a byte-fallback byte, in `data[0]`.
const BYTE: u8 = 8;
/// The piece is longer than `INLINE` and lives in the arena (`data` holds
/// its span).
const LONG: u8 = 16;

const INLINE: usize = 14;

/// One token id's hot entry: 16 bytes, holding its usual piece (at any
/// position but the first of a decode) inline when short, so that a step
/// touches one cache line per token.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(16))]
pub struct Entry {
    flags: u8,
    len: u8,
    data: [u8; INLINE],
}

impl Entry {
    const MISSING: Entry = Entry {
        flags: 0,
        len: 0,
        data: [0; INLINE],
    };

    /// Whether the id names a token at all (`decode` drops ids that don't).
    #[inline]
    pub fn is_present(&self) -> bool {
        self.flags & PRESENT != 0
    }
    /// Whether `skip_special_tokens` removes it.
    #[inline]
    pub fn is_special(&self) -> bool {
        self.flags & SPECIAL != 0
    }
    /// Whether it is an added token (a segment break without
    /// `spaces_between_special_tokens`).
    #[inline]
    pub fn is_added(&self) -> bool {
        self.flags & ADDED != 0
    }
}

/// What is only needed at the first token of a decode or for added tokens.
#[derive(Clone, Copy, Debug, Default)]
struct ColdEntry {
    /// The piece when the token is the first of a decode; `None` if as usual.
    first: Option<(Span, bool)>,
    /// The token's own string (an added token's content).
    raw: Span,
}

/// The decode table of one tokenizer; immutable and shared by all requests.
#[derive(Debug)]
pub struct DecodeTable {
    pub join: Utf8Join,
    /// `Strip` after `Fuse`: remove up to `n` leading `char`s of a decode.
    pub strip: Option<(char, usize)>,
    entries: Vec<Entry>,
    cold: Vec<ColdEntry>,
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
fn byte_level_chars() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = HashMap::with_capacity(256);
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
            cold: vec![ColdEntry::default(); num_ids],
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
            let mut entry = Entry::MISSING;
            entry.flags = PRESENT;
            if vocab.is_special_token(&token) {
                entry.flags |= SPECIAL;
            }
            if added.contains_key(&id) {
                entry.flags |= ADDED;
            }
            match table.piece_bytes(&rest, &chars) {
                Err(byte) => {
                    entry.flags |= BYTE;
                    entry.data[0] = byte;
                }
                Ok(bytes) if bytes.len() <= INLINE => {
                    entry.len = bytes.len() as u8;
                    entry.data[..bytes.len()].copy_from_slice(&bytes);
                }
                Ok(bytes) => {
                    let span = table.push(&bytes);
                    entry.flags |= LONG;
                    entry.data[..4].copy_from_slice(&span.start.to_le_bytes());
                    entry.data[4..8].copy_from_slice(&span.len.to_le_bytes());
                }
            }
            table.entries[id as usize] = entry;
            let first = if first == rest {
                None
            } else {
                Some(match table.piece_bytes(&first, &chars) {
                    Err(byte) => (table.push(&[byte]), true),
                    Ok(bytes) => (table.push(&bytes), false),
                })
            };
            let raw = table.push(token.as_bytes());
            table.cold[id as usize] = ColdEntry { first, raw };
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

    /// The bytes of a piece, or `Err(byte)` for a byte-fallback token.
    fn piece_bytes(&self, text: &str, chars: &HashMap<char, u8>) -> Result<Vec<u8>, u8> {
        match self.join {
            Utf8Join::Text => Ok(text.as_bytes().to_vec()),
            Utf8Join::ByteRuns => match fallback_byte(text) {
                Some(b) => Err(b),
                None => Ok(text.as_bytes().to_vec()),
            },
            // `ByteLevel` maps each char back to its byte, or keeps the token's
            // own UTF-8 if any char is outside the map (e.g. added tokens).
            Utf8Join::Lossy => {
                let mapped: Option<Vec<u8>> =
                    text.chars().map(|c| chars.get(&c).copied()).collect();
                Ok(mapped.unwrap_or_else(|| text.as_bytes().to_vec()))
            }
        }
    }

    /// The entry of `id`; ids beyond the vocabulary are absent, as in `decode`.
    #[inline]
    pub fn entry(&self, id: u32) -> &Entry {
        self.entries.get(id as usize).unwrap_or(&Entry::MISSING)
    }

    /// The piece of a present token at any position but the first.
    #[inline]
    pub fn rest<'a>(&'a self, entry: &'a Entry) -> Piece<'a> {
        if entry.flags & BYTE != 0 {
            Piece::Byte(entry.data[0])
        } else if entry.flags & LONG == 0 {
            Piece::Bytes(&entry.data[..entry.len as usize])
        } else {
            let word = |i: usize| {
                u32::from_le_bytes([
                    entry.data[i],
                    entry.data[i + 1],
                    entry.data[i + 2],
                    entry.data[i + 3],
                ])
            };
            self.span(Span {
                start: word(0),
                len: word(4),
            })
        }
    }

    /// The piece of a present token `id` at the first position of a decode.
    pub fn first<'a>(&'a self, id: u32, entry: &'a Entry) -> Piece<'a> {
        match self.cold[id as usize].first {
            None => self.rest(entry),
            Some((span, true)) => Piece::Byte(self.bytes(span)[0]),
            Some((span, false)) => self.span(span),
        }
    }

    /// The token's own string (an added token's content).
    pub fn raw(&self, id: u32) -> &str {
        // Raw strings were pushed from `&str`.
        std::str::from_utf8(self.bytes(self.cold[id as usize].raw)).unwrap_or_default()
    }

    fn span(&self, span: Span) -> Piece<'_> {
        Piece::Bytes(self.bytes(span))
    }

    fn bytes(&self, span: Span) -> &[u8] {
        &self.arena[span.start as usize..(span.start + span.len) as usize]
    }

    /// Number of ids with an entry (vocabulary plus added tokens).
    pub fn num_ids(&self) -> usize {
        self.entries.len()
    }
}
