//! The small `#[pyclass]` values and views of the codec. Each holds the owned
//! Rust message (behind an `Arc` where encoders reuse it), so passing one back
//! to an encoder copies nothing, and token ids become Python ints only when a
//! getter is called.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use super::extract;
use crate::error::Error;
use crate::protocol::{self, FinishReason, WireError};

pub fn wire_err(e: WireError) -> PyErr {
    Error::from(e).into()
}

/// The interned Python name of a finish reason.
pub fn finish_reason_str(py: Python<'_>, r: FinishReason) -> &Bound<'_, PyString> {
    match r {
        FinishReason::Stop => pyo3::intern!(py, "stop"),
        FinishReason::Length => pyo3::intern!(py, "length"),
        FinishReason::Abort => pyo3::intern!(py, "abort"),
        FinishReason::Error => pyo3::intern!(py, "error"),
    }
}

fn u32_list<'py>(py: Python<'py>, values: &[u32]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, values)
}

/// The scheduler's counters after a step.
#[pyclass(
    frozen,
    eq,
    get_all,
    module = "asyncllm._core",
    name = "SchedulerStats"
)]
#[derive(PartialEq)]
pub struct PySchedulerStats {
    pub num_running: u32,
    pub num_waiting: u32,
    pub kv_cache_usage: f32,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
}

impl PySchedulerStats {
    pub fn to_rust(&self) -> protocol::SchedulerStats {
        protocol::SchedulerStats {
            num_running: self.num_running,
            num_waiting: self.num_waiting,
            kv_cache_usage: self.kv_cache_usage,
            prefix_cache_queries: self.prefix_cache_queries,
            prefix_cache_hits: self.prefix_cache_hits,
            num_preemptions: self.num_preemptions,
        }
    }

    pub fn from_rust(s: &protocol::SchedulerStats) -> PySchedulerStats {
        PySchedulerStats {
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            kv_cache_usage: s.kv_cache_usage,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            num_preemptions: s.num_preemptions,
        }
    }
}

#[pymethods]
impl PySchedulerStats {
    #[new]
    #[pyo3(signature = (
        *, num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
        prefix_cache_hits=0, num_preemptions=0
    ))]
    fn new(
        num_running: u32,
        num_waiting: u32,
        kv_cache_usage: f32,
        prefix_cache_queries: u64,
        prefix_cache_hits: u64,
        num_preemptions: u64,
    ) -> Self {
        PySchedulerStats {
            num_running,
            num_waiting,
            kv_cache_usage,
            prefix_cache_queries,
            prefix_cache_hits,
            num_preemptions,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerStats(num_running={}, num_waiting={}, kv_cache_usage={}, \
             prefix_cache_queries={}, prefix_cache_hits={}, num_preemptions={})",
            self.num_running,
            self.num_waiting,
            self.kv_cache_usage,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_preemptions
        )
    }
}

/// The handshake EngineCore sends once it is ready.
#[pyclass(frozen, eq, module = "asyncllm._core", name = "Ready")]
#[derive(PartialEq)]
pub struct PyReady(pub protocol::Ready);

#[pymethods]
impl PyReady {
    #[new]
    #[pyo3(signature = (
        *, max_model_len, num_kv_blocks, block_size, vocab_size, eos_token_ids, hidden_size
    ))]
    fn new(
        max_model_len: u32,
        num_kv_blocks: u32,
        block_size: u32,
        vocab_size: u32,
        eos_token_ids: &Bound<'_, PyAny>,
        hidden_size: u32,
    ) -> PyResult<Self> {
        let eos_token_ids =
            extract::u32s(eos_token_ids, &|| "Ready.eos_token_ids".into()).map_err(wire_err)?;
        Ok(PyReady(protocol::Ready {
            max_model_len,
            num_kv_blocks,
            block_size,
            vocab_size,
            eos_token_ids,
            hidden_size,
        }))
    }
    #[getter]
    fn max_model_len(&self) -> u32 {
        self.0.max_model_len
    }
    #[getter]
    fn num_kv_blocks(&self) -> u32 {
        self.0.num_kv_blocks
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.0.block_size
    }
    #[getter]
    fn vocab_size(&self) -> u32 {
        self.0.vocab_size
    }
    #[getter]
    fn eos_token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        u32_list(py, &self.0.eos_token_ids)
    }
    #[getter]
    fn hidden_size(&self) -> u32 {
        self.0.hidden_size
    }
    fn __repr__(&self) -> String {
        format!("{:?}", self.0)
    }
}

/// Log-probabilities of `num_positions` positions x `width` entries (the
/// sampled or actual token first, then the top-N), row-major and flat.
#[pyclass(frozen, module = "asyncllm._core", name = "Logprobs")]
pub struct PyLogprobs(pub Arc<protocol::Logprobs>);

#[pymethods]
impl PyLogprobs {
    /// `token_ids` and `logprobs` hold `len(ranks) * width` items; the width is
    /// inferred (0 when there are no positions).
    #[new]
    fn new(
        token_ids: &Bound<'_, PyAny>,
        logprobs: &Bound<'_, PyAny>,
        ranks: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        logprobs_from_parts(token_ids, logprobs, ranks, &|| "Logprobs".into())
            .map(|lp| PyLogprobs(Arc::new(lp)))
            .map_err(wire_err)
    }
    #[getter]
    fn num_positions(&self) -> u32 {
        self.0.num_positions
    }
    #[getter]
    fn width(&self) -> u32 {
        self.0.width
    }
    /// Flat, `num_positions * width` ids; a new list on each call.
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        u32_list(py, &self.0.token_ids)
    }
    /// Flat, `num_positions * width` values; a new list on each call.
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.0.logprobs.iter().map(|&v| v as f64))
    }
    #[getter]
    fn ranks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        u32_list(py, &self.0.ranks)
    }
    /// Bit-exact equality of shape and arrays.
    fn __eq__(&self, other: PyRef<'_, Self>) -> bool {
        let (a, b) = (&*self.0, &*other.0);
        a.num_positions == b.num_positions
            && a.width == b.width
            && a.token_ids == b.token_ids
            && a.ranks == b.ranks
            && a.logprobs
                .iter()
                .map(|v| v.to_bits())
                .eq(b.logprobs.iter().map(|v| v.to_bits()))
    }
    fn __repr__(&self) -> String {
        format!(
            "Logprobs(num_positions={}, width={})",
            self.0.num_positions, self.0.width
        )
    }
}

pub fn logprobs_from_parts(
    token_ids: &Bound<'_, PyAny>,
    logprobs: &Bound<'_, PyAny>,
    ranks: &Bound<'_, PyAny>,
    path: &dyn Fn() -> String,
) -> Result<protocol::Logprobs, WireError> {
    let token_ids = extract::u32s(token_ids, &|| format!("{}.token_ids", path()))?;
    let logprobs = extract::f32s(logprobs, &|| format!("{}.logprobs", path()))?;
    let ranks = extract::u32s(ranks, &|| format!("{}.ranks", path()))?;
    let num_positions = u32::try_from(ranks.len())
        .map_err(|_| WireError::encode(path(), "more than 2^32 - 1 positions"))?;
    let width = if ranks.is_empty() {
        0
    } else {
        u32::try_from(token_ids.len() / ranks.len())
            .map_err(|_| WireError::encode(path(), "width above 2^32 - 1"))?
    };
    let lp = protocol::Logprobs {
        num_positions,
        width,
        token_ids,
        logprobs,
        ranks,
    };
    lp.check_shape()
        .map_err(|reason| WireError::encode(path(), reason))?;
    Ok(lp)
}
