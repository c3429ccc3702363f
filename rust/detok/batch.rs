//! The batched detokenizer: every request's incremental decoder and stop
//! matcher, advanced by one call per engine step. This is the one loop over a
//! step's outputs on the front-end side (`Detokenizer::step`).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use tokenizers::Tokenizer;

use super::stop::StopMatcher;
use super::stream::{DecodeOptions, IncrementalDecoder};
use super::table::DecodeTable;
use super::DetokError;

/// How one request is detokenized.
#[derive(Clone, Debug, Default)]
pub struct RequestParams {
    pub skip_special_tokens: bool,
    pub spaces_between_special_tokens: bool,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// Stop strings are only matched in text of the `min_tokens`-th output
    /// token onwards (a match ending in earlier text doesn't count).
    pub min_tokens: usize,
}

/// One engine step's new tokens, as parallel arrays (built without per-request
/// allocations): request `i` got `token_ids[offsets[i]..offsets[i + 1]]`.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    pub request_ids: Vec<u64>,
    pub offsets: Vec<usize>,
    pub token_ids: Vec<u32>,
    /// Per request: it finished for another reason (EOS, length, abort) with
    /// this step, so release everything held back and drop its state.
    /// Empty means none finished.
    pub finished: Vec<bool>,
}

impl StepBatch {
    /// An empty batch with room for `n` requests.
    pub fn with_capacity(n: usize) -> Self {
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0);
        StepBatch {
            request_ids: Vec::with_capacity(n),
            offsets,
            token_ids: Vec::with_capacity(n),
            finished: Vec::new(),
        }
    }

    /// Appends one request's new tokens.
    pub fn push(&mut self, request_id: u64, token_ids: &[u32]) {
        self.request_ids.push(request_id);
        self.token_ids.extend_from_slice(token_ids);
        self.offsets.push(self.token_ids.len());
    }

    pub fn len(&self) -> usize {
        self.request_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.request_ids.is_empty()
    }
}

/// What one step released for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepItem {
    /// The new text is `StepOutputs::text[previous item's text_end..text_end]`.
    pub text_end: usize,
    /// The stop string (index into the request's list) matched in this step.
    pub stop_index: Option<usize>,
    /// How many of this step's new tokens to keep: all of them, or after a stop
    /// match those up to the one that completed it. 0 once stopped.
    pub num_kept: usize,
    /// Output tokens (kept ones, counted from the first) whose text has been
    /// released in full so far; equals all kept tokens once the request
    /// stopped or finished.
    pub num_tokens_released: usize,
}

/// The result of a step: texts packed into one string.
#[derive(Clone, Debug, Default)]
pub struct StepOutputs {
    pub text: String,
    pub items: Vec<StepItem>,
}

impl StepOutputs {
    /// The new text of item `i`.
    pub fn text_of(&self, i: usize) -> &str {
        let start = if i == 0 {
            0
        } else {
            self.items[i - 1].text_end
        };
        &self.text[start..self.items[i].text_end]
    }
}

/// Request ids are small integers chosen by the front end: a multiplicative
/// hash is enough, and much cheaper than SipHash in the per-step loop.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

struct Request {
    decoder: IncrementalDecoder,
    stop: Option<StopMatcher>,
    min_tokens: usize,
    /// Output tokens accepted so far.
    num_tokens: usize,
    /// Bytes of text decided so far (before stop-string hold-back).
    num_decided: usize,
    /// Matches must end after this byte (`usize::MAX`: not yet allowed).
    min_end: usize,
    num_tokens_released: usize,
    /// (tokens, decided bytes) at points where the decoder held nothing back,
    /// not yet covered by released text.
    marks: VecDeque<(usize, usize)>,
    stopped: bool,
    /// The step that last touched it (catches duplicate ids in one batch).
    last_step: u64,
}

/// Batched incremental detokenizer with stop strings, for one tokenizer.
pub struct Detokenizer {
    table: DecodeTable,
    /// Request id -> index in `slots`: one hash lookup per request per step.
    index: IdMap<usize>,
    slots: Vec<Option<Request>>,
    free_slots: Vec<usize>,
    num_steps: u64,
    // Buffers reused across steps.
    step_slots: Vec<usize>,
    scratch: String,
    ends: Vec<usize>,
}

impl Detokenizer {
    /// Loads `tokenizer.json` from a path.
    pub fn from_file(path: &str) -> Result<Self, DetokError> {
        let tokenizer =
            Tokenizer::from_file(path).map_err(|e| DetokError::Load(format!("{path}: {e}")))?;
        Self::new(&tokenizer)
    }

    /// Loads a `tokenizer.json` given as a string.
    pub fn from_json(json: &str) -> Result<Self, DetokError> {
        let tokenizer =
            Tokenizer::from_bytes(json.as_bytes()).map_err(|e| DetokError::Load(e.to_string()))?;
        Self::new(&tokenizer)
    }

    pub fn new(tokenizer: &Tokenizer) -> Result<Self, DetokError> {
        Ok(Detokenizer {
            table: DecodeTable::new(tokenizer)?,
            index: IdMap::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            num_steps: 0,
            step_slots: Vec::new(),
            scratch: String::new(),
            ends: Vec::new(),
        })
    }

    pub fn num_requests(&self) -> usize {
        self.index.len()
    }

    pub fn contains(&self, request_id: u64) -> bool {
        self.index.contains_key(&request_id)
    }

    /// Adds a request whose prompt is `prompt_token_ids`: its state is seeded
    /// from the prompt so that output text continues it (see `detok/mod.rs`).
    pub fn add_request(
        &mut self,
        request_id: u64,
        prompt_token_ids: &[u32],
        params: RequestParams,
    ) -> Result<(), DetokError> {
        if self.index.contains_key(&request_id) {
            return Err(DetokError::DuplicateRequest(request_id));
        }
        if params.stop.iter().any(String::is_empty) {
            return Err(DetokError::EmptyStopString(request_id));
        }
        let opts = DecodeOptions {
            skip_special_tokens: params.skip_special_tokens,
            spaces_between_special_tokens: params.spaces_between_special_tokens,
        };
        let decoder = IncrementalDecoder::after_prompt(&self.table, opts, prompt_token_ids);
        let stop = (!params.stop.is_empty())
            .then(|| StopMatcher::new(params.stop, params.include_stop_str_in_output));
        let request = Request {
            decoder,
            stop,
            min_tokens: params.min_tokens,
            num_tokens: 0,
            num_decided: 0,
            min_end: if params.min_tokens <= 1 {
                0
            } else {
                usize::MAX
            },
            num_tokens_released: 0,
            marks: VecDeque::new(),
            stopped: false,
            last_step: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot] = Some(request);
                slot
            }
            None => {
                self.slots.push(Some(request));
                self.slots.len() - 1
            }
        };
        self.index.insert(request_id, slot);
        Ok(())
    }

    /// Drops a request's state; false if there was none.
    pub fn remove(&mut self, request_id: u64) -> bool {
        match self.index.remove(&request_id) {
            Some(slot) => {
                self.slots[slot] = None;
                self.free_slots.push(slot);
                true
            }
            None => false,
        }
    }

    /// Advances every request in `batch` by its new tokens and returns, in the
    /// same order, what each released. Fails without changing any state if an
    /// id is unknown or repeated, or the arrays disagree in length.
    pub fn step(&mut self, batch: &StepBatch) -> Result<StepOutputs, DetokError> {
        let n = batch.request_ids.len();
        if batch.offsets.len() != n + 1
            || (!batch.finished.is_empty() && batch.finished.len() != n)
            || batch.offsets.last() != Some(&batch.token_ids.len())
        {
            return Err(DetokError::BatchShape);
        }
        self.num_steps += 1;
        self.step_slots.clear();
        for &id in &batch.request_ids {
            let slot = *self.index.get(&id).ok_or(DetokError::UnknownRequest(id))?;
            let Some(req) = self.slots[slot].as_mut() else {
                return Err(DetokError::UnknownRequest(id));
            };
            if req.last_step == self.num_steps {
                return Err(DetokError::RepeatedRequest(id));
            }
            req.last_step = self.num_steps;
            self.step_slots.push(slot);
        }

        let mut outputs = StepOutputs {
            text: String::with_capacity(n * 8),
            items: Vec::with_capacity(n),
        };
        for (i, &slot) in self.step_slots.iter().enumerate() {
            let tokens = &batch.token_ids[batch.offsets[i]..batch.offsets[i + 1]];
            let finished = batch.finished.get(i).copied().unwrap_or(false);
            let Some(req) = self.slots[slot].as_mut() else {
                continue; // checked above
            };
            let item = advance(
                req,
                &self.table,
                tokens,
                finished,
                &mut outputs.text,
                &mut self.scratch,
                &mut self.ends,
            );
            outputs.items.push(item);
            if finished {
                self.index.remove(&batch.request_ids[i]);
                self.slots[slot] = None;
                self.free_slots.push(slot);
            }
        }
        Ok(outputs)
    }
}

/// One request's share of a step.
fn advance(
    req: &mut Request,
    table: &DecodeTable,
    tokens: &[u32],
    finished: bool,
    out: &mut String,
    scratch: &mut String,
    ends: &mut Vec<usize>,
) -> StepItem {
    if req.stopped {
        return StepItem {
            text_end: out.len(),
            stop_index: None,
            num_kept: 0,
            num_tokens_released: req.num_tokens_released,
        };
    }
    let Some(stop) = req.stop.as_mut() else {
        // No stop strings: decided text is released as it is decided.
        for &id in tokens {
            req.decoder.push(table, id, out);
            req.num_tokens += 1;
            if req.decoder.is_settled() {
                req.num_tokens_released = req.num_tokens;
            }
        }
        if finished {
            req.decoder.finish(table, out);
            req.num_tokens_released = req.num_tokens;
        }
        return StepItem {
            text_end: out.len(),
            stop_index: None,
            num_kept: tokens.len(),
            num_tokens_released: req.num_tokens_released,
        };
    };

    scratch.clear();
    ends.clear();
    let num_before = req.num_tokens;
    let decided_before = req.num_decided;
    for &id in tokens {
        req.decoder.push(table, id, scratch);
        req.num_tokens += 1;
        let decided = decided_before + scratch.len();
        ends.push(decided);
        if req.num_tokens + 1 == req.min_tokens {
            req.min_end = decided;
        }
        if req.decoder.is_settled() {
            req.marks.push_back((req.num_tokens, decided));
        }
    }
    if finished {
        req.decoder.finish(table, scratch);
    }
    req.num_decided = decided_before + scratch.len();

    let matched = stop.push(scratch, req.min_end, finished, out);
    let num_kept = match matched {
        Some(m) => {
            // The token that produced the match's last byte completed it; text
            // released only at `finish` belongs to the last token.
            let completing = ends
                .iter()
                .position(|&e| e >= m.end)
                .unwrap_or(tokens.len().max(1) - 1);
            let num_kept = (completing + 1).min(tokens.len());
            req.num_tokens = num_before + num_kept;
            req.num_tokens_released = req.num_tokens;
            req.stopped = true;
            req.marks.clear();
            num_kept
        }
        None => {
            let released = stop.num_released();
            while let Some(&(num_tokens, decided)) = req.marks.front() {
                if decided > released {
                    break;
                }
                req.num_tokens_released = num_tokens;
                req.marks.pop_front();
            }
            if finished {
                req.num_tokens_released = req.num_tokens;
            }
            tokens.len()
        }
    };
    StepItem {
        text_end: out.len(),
        stop_index: matched.map(|m| m.index),
        num_kept,
        num_tokens_released: req.num_tokens_released,
    }
}
