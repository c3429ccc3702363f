//! Python binding of the batched detokenizer (`crate::detok`): extract owned
//! inputs with the GIL held, run the detokenizer inside `py.detach` (GIL
//! released), wrap the results. The state sits behind a mutex that is only
//! taken with the GIL released, so a long step never blocks other Python
//! threads, and concurrent calls from several threads serialize safely.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Mutex, MutexGuard};

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use crate::detok::{DetokError, Detokenizer, RequestParams, StepBatch, StepOutputs};
use crate::error::Error;

fn detok_err(err: DetokError) -> PyErr {
    Error::from(err).into()
}

/// Appends the ints of one Python sequence of token ids to `out`.
fn extend_ids(obj: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
    if let Ok(list) = obj.cast::<PyList>() {
        out.reserve(list.len());
        for item in list.iter() {
            out.push(item.extract::<u32>()?);
        }
    } else {
        for item in obj.try_iter()? {
            out.push(item?.extract::<u32>()?);
        }
    }
    Ok(())
}

/// Appends one request's new tokens: an int (one token) or a sequence of ints.
fn extend_step_ids(obj: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
    if obj.is_instance_of::<PyInt>() {
        out.push(obj.extract::<u32>()?);
        Ok(())
    } else {
        extend_ids(obj, out)
    }
}

/// One token per request from a buffer of 32- or 64-bit integers (an
/// `array.array`, a NumPy array, ...): no Python int per token. `None` if
/// `obj` isn't such a buffer.
fn buffer_ids(py: Python<'_>, obj: &Bound<'_, PyAny>) -> Option<PyResult<Vec<u32>>> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return None;
    }
    fn narrow<T: Copy + TryInto<u32>>(v: Vec<T>) -> PyResult<Vec<u32>> {
        v.into_iter()
            .map(|x| {
                x.try_into().map_err(|_| {
                    pyo3::exceptions::PyOverflowError::new_err("token id out of range")
                })
            })
            .collect()
    }
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return Some(buf.to_vec(py));
    }
    if let Ok(buf) = PyBuffer::<i32>::get(obj) {
        return Some(buf.to_vec(py).and_then(narrow));
    }
    if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        return Some(buf.to_vec(py).and_then(narrow));
    }
    if let Ok(buf) = PyBuffer::<u64>::get(obj) {
        return Some(buf.to_vec(py).and_then(narrow));
    }
    None
}

/// Per request an int (one token) or a sequence of ints.
fn extract_nested(obj: &Bound<'_, PyAny>, batch: &mut StepBatch) -> PyResult<()> {
    match obj.cast::<PyList>() {
        Ok(list) => {
            for item in list.iter() {
                extend_step_ids(&item, &mut batch.token_ids)?;
                batch.offsets.push(batch.token_ids.len());
            }
        }
        Err(_) => {
            for item in obj.try_iter()? {
                extend_step_ids(&item?, &mut batch.token_ids)?;
                batch.offsets.push(batch.token_ids.len());
            }
        }
    }
    Ok(())
}

fn extract_request_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    match obj.cast::<PyList>() {
        Ok(list) => list.iter().map(|item| item.extract::<u64>()).collect(),
        Err(_) => obj.extract(),
    }
}

/// Per position of `ids`: whether its id is in `finished` (ids of the batch).
fn finished_flags(ids: &[u64], finished: &[u64]) -> Result<Vec<bool>, DetokError> {
    let mut flags = vec![false; ids.len()];
    let position: Box<dyn Fn(u64) -> Option<usize>> = if finished.len() <= 8 {
        Box::new(|id| ids.iter().position(|&x| x == id))
    } else {
        let map: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, &x)| (x, i)).collect();
        Box::new(move |id| map.get(&id).copied())
    };
    for &id in finished {
        flags[position(id).ok_or(DetokError::FinishedNotInBatch(id))?] = true;
    }
    Ok(flags)
}

/// FxHash: step texts are short, and this is far cheaper than SipHash.
#[derive(Default)]
struct FxHasher(u64);

impl Hasher for FxHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write_u128(&mut self, n: u128) {
        self.write_u64(n as u64);
        self.write_u64((n >> 64) as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
}

/// Python strings of recent step texts. Most texts are one token's text, so a
/// lookup (hash + incref) usually replaces building a new `str`, the largest
/// cost of wrapping a step. Keys are texts of up to 16 bytes packed into an
/// integer, so lookups neither allocate nor call `memcmp`. Only used with the
/// GIL held.
struct StrCache {
    map: HashMap<(u128, u8), Py<PyString>, BuildHasherDefault<FxHasher>>,
}

impl StrCache {
    const MAX_ENTRIES: usize = 1 << 16;

    fn get<'py>(&mut self, py: Python<'py>, text: &str) -> Bound<'py, PyString> {
        if text.len() > 16 {
            return PyString::new(py, text);
        }
        let mut packed = [0u8; 16];
        packed[..text.len()].copy_from_slice(text.as_bytes());
        let key = (u128::from_le_bytes(packed), text.len() as u8);
        if let Some(s) = self.map.get(&key) {
            return s.bind(py).clone();
        }
        if self.map.len() >= Self::MAX_ENTRIES {
            self.map.clear();
        }
        let s = PyString::new(py, text);
        self.map.insert(key, s.clone().unbind());
        s
    }
}

/// What one `Detokenizer.step` released, per request in the order given.
/// `texts` is built with the output; the other properties build a new list
/// when read.
#[pyclass(module = "asyncllm._core", name = "DetokenizerOutput", frozen)]
pub struct PyDetokenizerOutput {
    outputs: StepOutputs,
    texts: Py<PyList>,
}

#[pymethods]
impl PyDetokenizerOutput {
    /// The newly released text of each request (the same list at each read).
    #[getter]
    fn texts<'py>(&self, py: Python<'py>) -> Bound<'py, PyList> {
        self.texts.bind(py).clone()
    }

    /// `(position in the batch, stop string index, num_kept)` of each request
    /// whose stop string matched in this step.
    #[getter]
    fn stops(&self) -> Vec<(usize, usize, usize)> {
        self.outputs
            .items
            .iter()
            .enumerate()
            .filter_map(|(i, item)| item.stop_index.map(|s| (i, s, item.num_kept)))
            .collect()
    }

    /// How many of each request's new tokens belong to its output.
    #[getter]
    fn num_kept(&self) -> Vec<usize> {
        self.outputs
            .items
            .iter()
            .map(|item| item.num_kept)
            .collect()
    }

    /// Output tokens of each request whose text has been released in full.
    #[getter]
    fn num_tokens_released(&self) -> Vec<usize> {
        self.outputs
            .items
            .iter()
            .map(|item| item.num_tokens_released)
            .collect()
    }

    fn __len__(&self) -> usize {
        self.outputs.items.len()
    }

    /// `(text, stop_index, num_kept, num_tokens_released)` of request `i`.
    fn __getitem__<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyTuple>> {
        let n = self.outputs.items.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if !(0..n).contains(&j) {
            return Err(pyo3::exceptions::PyIndexError::new_err(
                "DetokenizerOutput index out of range",
            ));
        }
        let item = self.outputs.items[j as usize];
        (
            self.outputs.text_of(j as usize),
            item.stop_index,
            item.num_kept,
            item.num_tokens_released,
        )
            .into_pyobject(py)
    }
}

/// Batched incremental detokenizer with stop strings for one tokenizer.
#[pyclass(module = "asyncllm._core", name = "Detokenizer", frozen)]
pub struct PyDetokenizer {
    inner: Mutex<Detokenizer>,
    /// Taken only with the GIL held (never across `detach`).
    strings: Mutex<StrCache>,
}

impl PyDetokenizer {
    /// Call only with the GIL released.
    fn lock(&self) -> Result<MutexGuard<'_, Detokenizer>, DetokError> {
        self.inner.lock().map_err(|_| DetokError::Poisoned)
    }

    fn wrap(inner: Detokenizer) -> Self {
        PyDetokenizer {
            inner: Mutex::new(inner),
            strings: Mutex::new(StrCache {
                map: HashMap::default(),
            }),
        }
    }

    fn wrap_texts<'py>(
        &self,
        py: Python<'py>,
        outputs: &StepOutputs,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut cache = self
            .strings
            .lock()
            .map_err(|_| detok_err(DetokError::Poisoned))?;
        let n = outputs.items.len();
        PyList::new(py, (0..n).map(|i| cache.get(py, outputs.text_of(i))))
    }

    fn step_batch(&self, py: Python<'_>, batch: &StepBatch) -> PyResult<StepOutputs> {
        py.detach(|| self.lock()?.step(batch)).map_err(detok_err)
    }
}

#[pymethods]
impl PyDetokenizer {
    /// Loads the `tokenizer.json` at `path`.
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let path = path.to_string_lossy().into_owned();
        let inner = py
            .detach(|| Detokenizer::from_file(&path))
            .map_err(detok_err)?;
        Ok(PyDetokenizer::wrap(inner))
    }

    /// Builds a detokenizer from the text of a `tokenizer.json`.
    #[staticmethod]
    fn from_json(py: Python<'_>, json: String) -> PyResult<Self> {
        let inner = py
            .detach(|| Detokenizer::from_json(&json))
            .map_err(detok_err)?;
        Ok(PyDetokenizer::wrap(inner))
    }

    #[pyo3(signature = (
        request_id,
        prompt_token_ids,
        *,
        skip_special_tokens = true,
        spaces_between_special_tokens = true,
        stop = None,
        include_stop_str_in_output = false,
        min_tokens = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        request_id: u64,
        prompt_token_ids: &Bound<'_, PyAny>,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
        stop: Option<Vec<String>>,
        include_stop_str_in_output: bool,
        min_tokens: usize,
    ) -> PyResult<()> {
        let mut prompt = Vec::new();
        extend_ids(prompt_token_ids, &mut prompt)?;
        let params = RequestParams {
            skip_special_tokens,
            spaces_between_special_tokens,
            stop: stop.unwrap_or_default(),
            include_stop_str_in_output,
            min_tokens,
        };
        py.detach(|| self.lock()?.add_request(request_id, &prompt, params))
            .map_err(detok_err)
    }

    /// Drops a request's state; False if it had none.
    fn remove(&self, py: Python<'_>, request_id: u64) -> PyResult<bool> {
        py.detach(|| Ok(self.lock()?.remove(request_id)))
            .map_err(detok_err)
    }

    #[pyo3(signature = (request_ids, new_token_ids, finished = None))]
    fn step(
        &self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        new_token_ids: &Bound<'_, PyAny>,
        finished: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyDetokenizerOutput> {
        let ids = extract_request_ids(request_ids)?;
        let mut batch = StepBatch::with_capacity(ids.len());
        if let Some(tokens) = buffer_ids(py, new_token_ids) {
            batch.token_ids = tokens?;
            batch.offsets.extend(1..=batch.token_ids.len());
        } else {
            extract_nested(new_token_ids, &mut batch)?;
        }
        if let Some(finished) = finished {
            let finished: Vec<u64> = finished.extract()?;
            if !finished.is_empty() {
                batch.finished = finished_flags(&ids, &finished).map_err(detok_err)?;
            }
        }
        batch.request_ids = ids;
        let outputs = self.step_batch(py, &batch)?;
        let texts = self.wrap_texts(py, &outputs)?.unbind();
        Ok(PyDetokenizerOutput { outputs, texts })
    }

    /// Finishes one request (EOS, length, abort): releases its held-back text
    /// and drops its state. Returns `(text, stop_index)`.
    fn finish(&self, py: Python<'_>, request_id: u64) -> PyResult<(String, Option<usize>)> {
        let mut batch = StepBatch::with_capacity(1);
        batch.push(request_id, &[]);
        batch.finished = vec![true];
        let mut outputs = self.step_batch(py, &batch)?;
        let stop_index = outputs.items[0].stop_index;
        Ok((std::mem::take(&mut outputs.text), stop_index))
    }

    /// Number of requests with state.
    #[getter]
    fn num_requests(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| Ok(self.lock()?.num_requests()))
            .map_err(detok_err)
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.num_requests(py)
    }

    fn __contains__(&self, py: Python<'_>, request_id: u64) -> PyResult<bool> {
        py.detach(|| Ok(self.lock()?.contains(request_id)))
            .map_err(detok_err)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDetokenizer>()?;
    m.add_class::<PyDetokenizerOutput>()
}
