//! One request's incremental decoder: token ids in, text out, such that the
//! concatenation of everything it emits equals the reference decode (see the
//! crate-level convention in `detok/mod.rs`), and nothing emitted is ever
//! retracted.
//!
//! Text is held back only while it is undecided: under `Lossy` an incomplete
//! UTF-8 sequence at the end, under `ByteRuns` the whole current run of byte
//! tokens (a run decodes to one U+FFFD per byte if *any* part of it is invalid,
//! so even its valid prefix is undecided until the run ends). `Text` pieces are
//! final at once. The cost per token is proportional to its piece's length.

use super::table::{DecodeTable, Piece, Utf8Join};

/// Options of one request that change the decode.
#[derive(Clone, Copy, Debug)]
pub struct DecodeOptions {
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
}

/// Incremental decoding state of one request.
#[derive(Clone, Debug)]
pub struct IncrementalDecoder {
    opts: DecodeOptions,
    /// The next kept token is the first of the current decode (segment).
    first: bool,
    /// Leading `strip` characters still to remove from the current segment.
    strip_left: usize,
    /// Undecided bytes: an incomplete UTF-8 tail (`Lossy`) or the current
    /// byte-token run (`ByteRuns`).
    pending: Vec<u8>,
    /// What the prompt's undecided tail decoded to in `decode(prompt)`; text
    /// that repeats it is the prompt's, not the output's.
    shadow: String,
    /// The table's `Strip`: character and count per segment.
    strip: Option<(char, usize)>,
}

impl IncrementalDecoder {
    /// A decoder at the start of a decode (no prompt).
    pub fn new(table: &DecodeTable, opts: DecodeOptions) -> Self {
        IncrementalDecoder {
            opts,
            first: true,
            strip_left: table.strip.map_or(0, |(_, n)| n),
            pending: Vec::new(),
            shadow: String::new(),
            strip: table.strip,
        }
    }

    /// A decoder positioned after `prompt`, emitting none of the prompt's text:
    /// the first output token then decodes with the spacing it has after the
    /// prompt, and a character the prompt left incomplete is emitted once the
    /// output completes it. O(prompt length), once per request.
    pub fn after_prompt(table: &DecodeTable, opts: DecodeOptions, prompt: &[u32]) -> Self {
        let mut dec = IncrementalDecoder::new(table, opts);
        let mut scratch = String::new();
        for &id in prompt {
            dec.push(table, id, &mut scratch);
            scratch.clear();
        }
        // `decode(prompt)` ends with what the undecided tail gives at the end.
        let mut shadow = String::new();
        dec.clone().finish(table, &mut shadow);
        dec.shadow = shadow;
        dec
    }

    /// Whether no text is held back, i.e. all tokens pushed so far have had
    /// their text emitted.
    #[inline]
    pub fn is_settled(&self) -> bool {
        self.pending.is_empty()
    }

    /// Feeds one token id; appends the text it decides to `out`.
    #[inline]
    pub fn push(&mut self, table: &DecodeTable, id: u32, out: &mut String) {
        let entry = table.entry(id);
        if !entry.is_present() || (self.opts.skip_special_tokens && entry.is_special()) {
            return;
        }
        if !self.opts.spaces_between_special_tokens && entry.is_added() {
            // Added tokens stand alone: decode(run) + content + decode(run) ...
            self.end_segment(table, out);
            self.emit(table.raw(id), out);
            self.first = true;
            self.strip_left = self.strip.map_or(0, |(_, n)| n);
            return;
        }
        let piece = if self.first {
            self.first = false;
            table.first(id, entry)
        } else {
            table.rest(entry)
        };
        match (table.join, piece) {
            (Utf8Join::ByteRuns, Piece::Byte(b)) => self.pending.push(b),
            (Utf8Join::Lossy, Piece::Bytes(bytes)) => match std::str::from_utf8(bytes) {
                Ok(text) if self.pending.is_empty() => self.emit(text, out),
                _ => {
                    self.pending.extend_from_slice(bytes);
                    self.drain_lossy(out);
                }
            },
            (_, Piece::Bytes(bytes)) => {
                self.flush_run(out);
                // Text pieces were stored from `&str`.
                self.emit(std::str::from_utf8(bytes).unwrap_or_default(), out);
            }
            (_, Piece::Byte(_)) => unreachable!("byte pieces exist only under ByteRuns"),
        }
    }

    /// Ends the decode: appends the held-back text as the full decode ends it.
    pub fn finish(&mut self, table: &DecodeTable, out: &mut String) {
        self.end_segment(table, out);
    }

    fn end_segment(&mut self, table: &DecodeTable, out: &mut String) {
        match table.join {
            Utf8Join::ByteRuns => self.flush_run(out),
            Utf8Join::Lossy if !self.pending.is_empty() => {
                let bytes = std::mem::take(&mut self.pending);
                self.emit(&String::from_utf8_lossy(&bytes), out);
            }
            _ => {}
        }
    }

    /// `ByteFallback`: a finished run is its text if valid, else U+FFFD per byte.
    fn flush_run(&mut self, out: &mut String) {
        if self.pending.is_empty() {
            return;
        }
        let run = std::mem::take(&mut self.pending);
        match String::from_utf8(run) {
            Ok(text) => self.emit(&text, out),
            Err(err) => {
                let text = "\u{FFFD}".repeat(err.as_bytes().len());
                self.emit(&text, out);
            }
        }
    }

    /// `from_utf8_lossy`, incrementally: emits everything but an incomplete
    /// sequence at the end, which more bytes may complete.
    fn drain_lossy(&mut self, out: &mut String) {
        // Taken out (no allocation) so `emit` can borrow `self`; put back after.
        let mut bytes = std::mem::take(&mut self.pending);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&bytes[start..]) {
                Ok(valid) => {
                    self.emit(valid, out);
                    start = bytes.len();
                    break;
                }
                Err(err) => {
                    let valid = &bytes[start..start + err.valid_up_to()];
                    self.emit(std::str::from_utf8(valid).unwrap_or_default(), out);
                    start += err.valid_up_to();
                    match err.error_len() {
                        Some(n) => {
                            self.emit("\u{FFFD}", out);
                            start += n;
                        }
                        None => break,
                    }
                }
            }
        }
        bytes.drain(..start);
        self.pending = bytes;
    }

    /// Appends decided text after the `Strip` decoder and the prompt shadow.
    #[inline]
    fn emit(&mut self, mut text: &str, out: &mut String) {
        if self.strip_left > 0 && !text.is_empty() {
            if let Some((c, _)) = self.strip {
                while self.strip_left > 0 && text.starts_with(c) {
                    text = &text[c.len_utf8()..];
                    self.strip_left -= 1;
                }
            }
            if !text.is_empty() {
                self.strip_left = 0;
            }
        }
        if !self.shadow.is_empty() && !text.is_empty() {
            let common = common_prefix(&self.shadow, text);
            if common == text.len() {
                self.shadow.drain(..common);
                return;
            }
            self.shadow.clear();
            text = &text[common..];
        }
        out.push_str(text);
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a
/// character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    let mut n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    while !b.is_char_boundary(n) {
        n -= 1;
    }
    n
}
