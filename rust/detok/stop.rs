//! Stop strings over a stream of decided text.
//!
//! The matcher sees each piece of new text once, together with the text it
//! holds back: the longest suffix of everything seen that is a proper prefix of
//! some stop string. Any match that ends in the new text starts inside that
//! held suffix (a longer start would make a longer suffix a stop prefix), so
//! this is the minimal look-back, and it is never more than the longest stop
//! string minus one character.
//!
//! Among matches, the one ending first wins; of those ending at the same
//! place, the longest (earliest start). Text after the winning match is never
//! released; the match itself is released only with
//! `include_stop_str_in_output`.

/// A stop string found in the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopMatch {
    /// Index of the stop string in the request's list.
    pub index: usize,
    /// Position (in bytes of decided text since the request began) just
    /// after the match: the token that produced this byte completed it.
    pub end: usize,
}

/// Stop-string state of one request.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop_str_in_output: bool,
    /// Decided text not released yet (a prefix of some stop string).
    held: String,
    /// Bytes of decided text seen so far (released + held).
    num_seen: usize,
}

impl StopMatcher {
    /// `stops` must be non-empty strings.
    pub fn new(stops: Vec<String>, include_stop_str_in_output: bool) -> Self {
        StopMatcher {
            stops,
            include_stop_str_in_output,
            held: String::new(),
            num_seen: 0,
        }
    }

    /// Bytes of decided text released so far.
    #[inline]
    pub fn num_released(&self) -> usize {
        self.num_seen - self.held.len()
    }

    /// Takes `new` decided text; appends to `out` what can be released.
    ///
    /// Only matches ending after byte `min_end` (absolute, as in
    /// [`StopMatch::end`]) count. With `is_final`, nothing more will come, so
    /// nothing is held back. After a match, the caller must not push again.
    pub fn push(
        &mut self,
        new: &str,
        min_end: usize,
        is_final: bool,
        out: &mut String,
    ) -> Option<StopMatch> {
        let base = self.num_released();
        self.num_seen += new.len();
        self.held.push_str(new);
        let window = self.held.as_str();
        let min_end = min_end.saturating_sub(base);

        let mut best: Option<(usize, usize, usize)> = None; // (end, start, index)
        for (index, stop) in self.stops.iter().enumerate() {
            // The first occurrence that ends after `min_end` starts at or after
            // `from`; occurrences may overlap, so search from there.
            let from = min_end.saturating_add(1).saturating_sub(stop.len());
            if let Some(start) = find_from(window.as_bytes(), stop.as_bytes(), from) {
                let end = start + stop.len();
                let better = match best {
                    None => true,
                    Some((e, s, _)) => end < e || (end == e && start < s),
                };
                if better {
                    best = Some((end, start, index));
                }
            }
        }
        if let Some((end, start, index)) = best {
            let keep = if self.include_stop_str_in_output {
                end
            } else {
                start
            };
            out.push_str(&window[..keep]);
            self.held.clear();
            self.num_seen = base + keep;
            return Some(StopMatch {
                index,
                end: base + end,
            });
        }

        let hold = if is_final {
            0
        } else {
            self.longest_stop_prefix_suffix()
        };
        let release = self.held.len() - hold;
        out.push_str(&self.held[..release]);
        self.held.drain(..release);
        None
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some
    /// stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let window = self.held.as_bytes();
        let Some(&last) = window.last() else {
            return 0;
        };
        let mut best = 0;
        for stop in &self.stops {
            let bytes = stop.as_bytes();
            // Proper prefixes, longest first, that end in the window's last byte.
            let longest = (bytes.len() - 1).min(window.len());
            for len in (best + 1..=longest).rev() {
                if bytes[len - 1] == last && window.ends_with(&bytes[..len]) {
                    // A byte-wise match of UTF-8 ends on a character boundary.
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

/// Start of the first occurrence of `needle` in `hay` at or after `from`.
/// Windows are short (held text plus one step's text), where a plain scan
/// beats setting up a substring searcher.
fn find_from(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let (&first, rest) = needle.split_first()?;
    let last_start = hay.len().checked_sub(needle.len())?;
    (from..=last_start).find(|&i| hay[i] == first && &hay[i + 1..i + needle.len()] == rest)
}
