//! The output batch on both sides: `encode_output_batch` takes per-request
//! columns, `OutputBatch` is the decoded view. This is the per-step hot path of
//! the wire, so both keep the GIL-held part to extracting or wrapping: the byte
//! work runs detached, and token ids become Python ints only when asked for.

use std::collections::HashMap;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::classes::{finish_reason_str, wire_err, PyLogprobs, PySchedulerStats};
use super::extract;
use crate::protocol::{
    self, FinishReason, LogprobsRef, OutputBatchWriter, RequestOutputRef, WireError,
};

/// The columns of an output batch, owned, so they can cross `py.detach`.
#[derive(Default)]
struct Columns {
    wire_ids: Vec<u64>,
    /// `token_offsets[i]..token_offsets[i + 1]` are request i's ids in `token_ids`.
    token_offsets: Vec<usize>,
    token_ids: Vec<u32>,
    finish_reasons: Option<Vec<Option<FinishReason>>>,
    stop_reasons: Option<Vec<Option<u32>>>,
    errors: Option<Vec<Option<String>>>,
    logprobs: Option<LogprobsColumn>,
    prompt_logprobs: Option<LogprobsColumn>,
    num_cached_tokens: Option<Vec<Option<u32>>>,
    embeddings: Option<EmbeddingColumn>,
}

/// An embeddings column: every vector appended to one flat buffer.
#[derive(Default)]
struct EmbeddingColumn {
    /// Output i's vector is `values[start..end]` for `spans[i] == Some((start, end))`.
    spans: Vec<Option<(usize, usize)>>,
    values: Vec<f32>,
}

impl EmbeddingColumn {
    fn get(&self, i: usize) -> Option<&[f32]> {
        self.spans[i].map(|(start, end)| &self.values[start..end])
    }
}

/// Extracts an optional embeddings column of `n` entries, each None or a
/// sequence of floats (a float32 numpy vector is copied as one buffer).
fn embedding_column(
    obj: Option<&Bound<'_, PyAny>>,
    n: usize,
) -> Result<Option<EmbeddingColumn>, WireError> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let path = || "OutputBatch.embeddings".to_string();
    expect_len(obj, n, &path)?;
    let mut column = EmbeddingColumn::default();
    column.spans.reserve(n);
    extract::for_each(obj, &path, |i, item| {
        if item.is_none() {
            column.spans.push(None);
            return Ok(());
        }
        let start = column.values.len();
        extract::f32s_into(item, &mut column.values, &|| format!("{}[{i}]", path()))?;
        column.spans.push(Some((start, column.values.len())));
        Ok(())
    })?;
    Ok(Some(column))
}

/// A logprobs column: every request's arrays appended to shared flat buffers,
/// so extracting 256 requests' logprobs allocates a handful of times, not 1000.
#[derive(Default)]
struct LogprobsColumn {
    entries: Vec<Option<LogprobsEntry>>,
    token_ids: Vec<u32>,
    logprobs: Vec<f32>,
    ranks: Vec<u32>,
}

#[derive(Clone, Copy)]
struct LogprobsEntry {
    first_cell: usize,
    first_position: usize,
    num_positions: u32,
    width: u32,
}

impl LogprobsColumn {
    /// Appends `None`, a `Logprobs`, or a `(token_ids, logprobs, ranks)` tuple.
    fn push(&mut self, obj: &Bound<'_, PyAny>, path: &dyn Fn() -> String) -> Result<(), WireError> {
        if obj.is_none() {
            self.entries.push(None);
            return Ok(());
        }
        let (first_cell, first_position) = (self.token_ids.len(), self.ranks.len());
        let (num_positions, width) = if let Ok(view) = obj.cast::<PyLogprobs>() {
            let lp = &view.get().0;
            self.token_ids.extend_from_slice(&lp.token_ids);
            self.logprobs.extend_from_slice(&lp.logprobs);
            self.ranks.extend_from_slice(&lp.ranks);
            (lp.num_positions, lp.width)
        } else {
            let expected = "None, a Logprobs or a (token_ids, logprobs, ranks) tuple";
            let parts = obj
                .cast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 3)
                .ok_or_else(|| extract::bad(path, expected, obj))?;
            let item = |i| {
                parts
                    .get_item(i)
                    .map_err(|e| WireError::encode(path(), e.to_string()))
            };
            extract::u32s_into(&item(0)?, &mut self.token_ids, &|| {
                format!("{}.token_ids", path())
            })?;
            extract::f32s_into(&item(1)?, &mut self.logprobs, &|| {
                format!("{}.logprobs", path())
            })?;
            extract::u32s_into(&item(2)?, &mut self.ranks, &|| format!("{}.ranks", path()))?;
            let cells = self.token_ids.len() - first_cell;
            let positions = self.ranks.len() - first_position;
            let too_big = || WireError::encode(path(), "more than 2^32 - 1 positions or width");
            let num_positions = u32::try_from(positions).map_err(|_| too_big())?;
            let width = cells.checked_div(positions).unwrap_or(0);
            (num_positions, u32::try_from(width).map_err(|_| too_big())?)
        };
        let entry = LogprobsEntry {
            first_cell,
            first_position,
            num_positions,
            width,
        };
        let lp = LogprobsRef {
            num_positions,
            width,
            token_ids: &self.token_ids[first_cell..],
            logprobs: &self.logprobs[first_cell.min(self.logprobs.len())..],
            ranks: &self.ranks[first_position..],
        };
        lp.check_shape()
            .map_err(|reason| WireError::encode(path(), reason))?;
        self.entries.push(Some(entry));
        Ok(())
    }

    fn get(&self, i: usize) -> Option<LogprobsRef<'_>> {
        self.entries[i].map(|e| {
            let cells = e.first_cell..e.first_cell + e.num_positions as usize * e.width as usize;
            let positions = e.first_position..e.first_position + e.num_positions as usize;
            LogprobsRef {
                num_positions: e.num_positions,
                width: e.width,
                token_ids: &self.token_ids[cells.clone()],
                logprobs: &self.logprobs[cells],
                ranks: &self.ranks[positions],
            }
        })
    }
}

/// Checks that a column has one entry per wire id.
fn expect_len(
    obj: &Bound<'_, PyAny>,
    n: usize,
    path: &dyn Fn() -> String,
) -> Result<(), WireError> {
    let len = extract::len(obj, path)?;
    if len != n {
        return Err(WireError::encode(
            path(),
            format!("has {len} entries, expected {n} (one per wire id)"),
        ));
    }
    Ok(())
}

/// Extracts an optional logprobs column of `n` entries.
fn logprobs_column(
    obj: Option<&Bound<'_, PyAny>>,
    n: usize,
    name: &'static str,
) -> Result<Option<LogprobsColumn>, WireError> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let path = || format!("OutputBatch.{name}");
    expect_len(obj, n, &path)?;
    let mut column = LogprobsColumn::default();
    column.entries.reserve(n);
    extract::for_each(obj, &path, |i, item| {
        column.push(item, &|| format!("{}[{i}]", path()))
    })?;
    Ok(Some(column))
}

/// Extracts an optional column of `n` items with `read(index, item)`.
fn column<'py, T>(
    obj: Option<&Bound<'py, PyAny>>,
    n: usize,
    name: &'static str,
    mut read: impl FnMut(usize, &Bound<'py, PyAny>) -> Result<T, WireError>,
) -> Result<Option<Vec<T>>, WireError> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let path = || format!("OutputBatch.{name}");
    expect_len(obj, n, &path)?;
    let mut out = Vec::with_capacity(n);
    extract::for_each(obj, &path, |i, item| {
        out.push(read(i, item)?);
        Ok(())
    })?;
    Ok(Some(out))
}

#[allow(clippy::too_many_arguments)]
fn extract_columns(
    wire_ids: &Bound<'_, PyAny>,
    new_token_ids: &Bound<'_, PyAny>,
    finish_reasons: Option<&Bound<'_, PyAny>>,
    stop_reasons: Option<&Bound<'_, PyAny>>,
    errors: Option<&Bound<'_, PyAny>>,
    logprobs: Option<&Bound<'_, PyAny>>,
    prompt_logprobs: Option<&Bound<'_, PyAny>>,
    num_cached_tokens: Option<&Bound<'_, PyAny>>,
    embeddings: Option<&Bound<'_, PyAny>>,
) -> Result<Columns, WireError> {
    let mut c = Columns {
        wire_ids: extract::u64s(wire_ids, &|| "OutputBatch.wire_ids".into())?,
        ..Columns::default()
    };
    let n = c.wire_ids.len();
    let tokens_path = || "OutputBatch.new_token_ids".to_string();
    expect_len(new_token_ids, n, &tokens_path)?;
    c.token_offsets.reserve(n + 1);
    c.token_offsets.push(0);
    c.token_ids.reserve(n);
    extract::nested_u32s_into(
        new_token_ids,
        n,
        &mut c.token_ids,
        &mut c.token_offsets,
        &tokens_path,
    )?;
    c.finish_reasons = column(finish_reasons, n, "finish_reasons", |i, item| {
        extract::opt(item, |r| {
            extract::finish_reason(r, || format!("OutputBatch.finish_reasons[{i}]"))
        })
    })?;
    c.stop_reasons = column(stop_reasons, n, "stop_reasons", |i, item| {
        extract::opt(item, |r| {
            extract::u32_(r, || format!("OutputBatch.stop_reasons[{i}]"))
        })
    })?;
    c.errors = column(errors, n, "errors", |i, item| {
        extract::opt(item, |e| {
            extract::str_(e, || format!("OutputBatch.errors[{i}]"))
        })
    })?;
    c.logprobs = logprobs_column(logprobs, n, "logprobs")?;
    c.prompt_logprobs = logprobs_column(prompt_logprobs, n, "prompt_logprobs")?;
    c.num_cached_tokens = column(num_cached_tokens, n, "num_cached_tokens", |i, item| {
        extract::opt(item, |r| {
            extract::u32_(r, || format!("OutputBatch.num_cached_tokens[{i}]"))
        })
    })?;
    c.embeddings = embedding_column(embeddings, n)?;
    Ok(c)
}

fn encode_columns(
    buf: Vec<u8>,
    c: &Columns,
    stats: &protocol::SchedulerStats,
    timestamp: f64,
) -> Result<Vec<u8>, WireError> {
    let mut w = OutputBatchWriter::new_in(buf, c.wire_ids.len(), c.token_ids.len())?;
    for (i, &wire_id) in c.wire_ids.iter().enumerate() {
        w.push(&RequestOutputRef {
            wire_id,
            new_token_ids: &c.token_ids[c.token_offsets[i]..c.token_offsets[i + 1]],
            finish_reason: c.finish_reasons.as_ref().and_then(|v| v[i]),
            stop_reason: c.stop_reasons.as_ref().and_then(|v| v[i]),
            error: c.errors.as_ref().and_then(|v| v[i].as_deref()),
            logprobs: c.logprobs.as_ref().and_then(|col| col.get(i)),
            prompt_logprobs: c.prompt_logprobs.as_ref().and_then(|col| col.get(i)),
            num_cached_tokens: c.num_cached_tokens.as_ref().and_then(|v| v[i]),
            embedding: c.embeddings.as_ref().and_then(|col| col.get(i)),
        })?;
    }
    w.finish(stats, timestamp)
}

/// Encodes one engine step's outputs from per-request columns (see the stub).
#[pyfunction]
#[pyo3(signature = (
    wire_ids, new_token_ids, stats, timestamp, *, finish_reasons=None, stop_reasons=None,
    errors=None, logprobs=None, prompt_logprobs=None, num_cached_tokens=None, embeddings=None
))]
#[allow(clippy::too_many_arguments)]
pub fn encode_output_batch<'py>(
    py: Python<'py>,
    wire_ids: &Bound<'py, PyAny>,
    new_token_ids: &Bound<'py, PyAny>,
    stats: &Bound<'py, PySchedulerStats>,
    timestamp: f64,
    finish_reasons: Option<&Bound<'py, PyAny>>,
    stop_reasons: Option<&Bound<'py, PyAny>>,
    errors: Option<&Bound<'py, PyAny>>,
    logprobs: Option<&Bound<'py, PyAny>>,
    prompt_logprobs: Option<&Bound<'py, PyAny>>,
    num_cached_tokens: Option<&Bound<'py, PyAny>>,
    embeddings: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyBytes>> {
    let columns = extract_columns(
        wire_ids,
        new_token_ids,
        finish_reasons,
        stop_reasons,
        errors,
        logprobs,
        prompt_logprobs,
        num_cached_tokens,
        embeddings,
    )
    .map_err(wire_err)?;
    let stats = stats.get().to_rust();
    let buf = super::scratch::take();
    let frame = py
        .detach(|| encode_columns(buf, &columns, &stats, timestamp))
        .map_err(wire_err)?;
    let bytes = PyBytes::new(py, &frame);
    super::scratch::give_back(frame);
    Ok(bytes)
}

/// A decoded output batch. Columns are built on access; nothing per token
/// exists in Python until `new_token_ids(i)` or `all_new_token_ids()` is called.
#[pyclass(frozen, module = "asyncllm._core", name = "OutputBatch")]
pub struct PyOutputBatch {
    batch: protocol::OutputBatchColumns,
    /// Each output's logprobs, moved out of `batch` into `Arc`s so that a
    /// `Logprobs` view shares them instead of copying; empty when none has any.
    logprobs: Vec<Option<Arc<protocol::Logprobs>>>,
    prompt_logprobs: Vec<Option<Arc<protocol::Logprobs>>>,
}

impl PyOutputBatch {
    /// Wraps a decoded batch (call it without the GIL: it moves every output's
    /// logprobs).
    pub fn new(mut batch: protocol::OutputBatchColumns) -> PyOutputBatch {
        fn share(
            column: &mut Vec<Option<protocol::Logprobs>>,
        ) -> Vec<Option<Arc<protocol::Logprobs>>> {
            if column.iter().all(Option::is_none) {
                return Vec::new();
            }
            column.drain(..).map(|lp| lp.map(Arc::new)).collect()
        }
        let logprobs = share(&mut batch.logprobs);
        let prompt_logprobs = share(&mut batch.prompt_logprobs);
        PyOutputBatch {
            batch,
            logprobs,
            prompt_logprobs,
        }
    }

    fn index(&self, i: isize) -> PyResult<usize> {
        let n = self.batch.len() as isize;
        let j = if i < 0 { i + n } else { i };
        if j < 0 || j >= n {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "output index {i} out of range for a batch of {n}"
            )));
        }
        Ok(j as usize)
    }
}

#[pymethods]
impl PyOutputBatch {
    fn __len__(&self) -> usize {
        self.batch.len()
    }

    #[getter]
    fn wire_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.batch.wire_ids)
    }

    /// The new token ids of output `i`.
    fn new_token_ids<'py>(&self, py: Python<'py>, i: isize) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.batch.new_token_ids(self.index(i)?))
    }

    /// The new token ids of every output, one list each.
    fn all_new_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let lists = (0..self.batch.len())
            .map(|i| PyList::new(py, self.batch.new_token_ids(i)))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, lists)
    }

    #[getter]
    fn num_new_tokens(&self) -> Vec<usize> {
        (0..self.batch.len())
            .map(|i| self.batch.new_token_ids(i).len())
            .collect()
    }

    #[getter]
    fn finish_reasons<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.batch
                .finish_reasons
                .iter()
                .map(|r| r.map(|r| finish_reason_str(py, r).clone())),
        )
    }

    #[getter]
    fn stop_reasons(&self) -> Vec<Option<u32>> {
        self.batch.stop_reasons.clone()
    }

    #[getter]
    fn errors(&self) -> Vec<Option<String>> {
        self.batch.errors.clone()
    }

    /// Output index -> prompt tokens served from the prefix cache, for the
    /// outputs that carry it (each request's first); empty in most steps.
    #[getter]
    fn num_cached_tokens(&self) -> HashMap<usize, u32> {
        let counts = self.batch.num_cached_tokens.iter().enumerate();
        counts.filter_map(|(i, n)| n.map(|n| (i, n))).collect()
    }

    /// Output index -> the pooled vector of each embedding request's (final)
    /// output; empty in steps without one.
    #[getter]
    fn embeddings(&self) -> HashMap<usize, Vec<f32>> {
        let vectors = self.batch.embeddings.iter().enumerate();
        vectors
            .filter_map(|(i, v)| v.clone().map(|v| (i, v)))
            .collect()
    }

    /// Indices of the outputs whose request finished in this step.
    #[getter]
    fn finished_indices(&self) -> Vec<usize> {
        let reasons = self.batch.finish_reasons.iter().enumerate();
        reasons
            .filter(|(_, r)| r.is_some())
            .map(|(i, _)| i)
            .collect()
    }

    fn logprobs(&self, i: isize) -> PyResult<Option<PyLogprobs>> {
        let i = self.index(i)?;
        let lp = self.logprobs.get(i).and_then(Option::as_ref);
        Ok(lp.map(|lp| PyLogprobs(lp.clone())))
    }

    fn prompt_logprobs(&self, i: isize) -> PyResult<Option<PyLogprobs>> {
        let i = self.index(i)?;
        let lp = self.prompt_logprobs.get(i).and_then(Option::as_ref);
        Ok(lp.map(|lp| PyLogprobs(lp.clone())))
    }

    #[getter]
    fn stats(&self) -> PySchedulerStats {
        PySchedulerStats::from_rust(&self.batch.stats)
    }

    #[getter]
    fn timestamp(&self) -> f64 {
        self.batch.timestamp
    }

    fn __repr__(&self) -> String {
        format!(
            "OutputBatch(len={}, timestamp={})",
            self.batch.len(),
            self.batch.timestamp
        )
    }
}
