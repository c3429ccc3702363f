//! Python bindings of the proposers (`crate::spec::ngram`, `crate::spec::suffix`):
//! inputs copied with the GIL held, the indexes updated and the proposals made
//! with it released. Both take a step's rows in the same columns (`StepColumns`).

use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::kernels::buffer;
use crate::spec::budget::{caps, Acceptance, StepCost};
use crate::spec::ngram::NgramProposer;
use crate::spec::suffix::{SuffixConfig, SuffixProposer};

fn err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// A copy of a 1-D int64 buffer as `usize`s, or a `ValueError` naming it.
fn sizes(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<usize>> {
    let buf = buffer::<i64>(obj, name, "int64", 1)?;
    buf.to_vec(py)?
        .into_iter()
        .map(|v| {
            usize::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("{name} holds {v}, must be >= 0")))
        })
        .collect()
}

/// A copy of a 1-D int32 buffer of token ids.
fn token_ids(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let buf = buffer::<i32>(obj, name, "int32", 1)?;
    Ok(buf.to_vec(py)?.into_iter().map(|t| t as u32).collect())
}

/// One step's columns, copied: row i's new tokens are
/// `tokens[offsets[i]..offsets[i + 1]]`.
struct StepColumns {
    rows: Vec<usize>,
    offsets: Vec<usize>,
    tokens: Vec<u32>,
    drafted: Vec<usize>,
    accepted: Vec<usize>,
    max_drafts: Vec<usize>,
}

impl StepColumns {
    fn extract(py: Python<'_>, cols: [&Bound<'_, PyAny>; 6]) -> PyResult<Self> {
        let [rows, offsets, tokens, drafted, accepted, max_drafts] = cols;
        let c = StepColumns {
            rows: sizes(py, rows, "rows")?,
            offsets: sizes(py, offsets, "new_offsets")?,
            tokens: token_ids(py, tokens, "new_tokens")?,
            drafted: sizes(py, drafted, "drafted")?,
            accepted: sizes(py, accepted, "accepted")?,
            max_drafts: sizes(py, max_drafts, "max_drafts")?,
        };
        let m = c.rows.len();
        if c.offsets.len() != m + 1
            || c.drafted.len() != m
            || c.accepted.len() != m
            || c.max_drafts.len() != m
            || c.offsets.windows(2).any(|w| w[0] > w[1])
            || c.offsets[m] > c.tokens.len()
        {
            return Err(PyValueError::new_err(format!(
                "step: new_offsets must be [{}] non-decreasing within new_tokens ({} tokens), \
                 drafted, accepted and max_drafts [{m}]",
                m + 1,
                c.tokens.len()
            )));
        }
        Ok(c)
    }

    /// Call `step(row, new tokens, drafted, accepted, max_drafts, out)` for
    /// every row; returns each row's proposal length and the proposals.
    fn run(
        &self,
        mut step: impl FnMut(usize, &[u32], usize, usize, usize, &mut Vec<u32>) -> PyResult<usize>,
    ) -> PyResult<(Vec<u32>, Vec<u32>)> {
        let m = self.rows.len();
        let mut counts = Vec::with_capacity(m);
        let mut out = Vec::new();
        for i in 0..m {
            let new = &self.tokens[self.offsets[i]..self.offsets[i + 1]];
            let n = step(
                self.rows[i],
                new,
                self.drafted[i],
                self.accepted[i],
                self.max_drafts[i],
                &mut out,
            )?;
            counts.push(n as u32);
        }
        Ok((counts, out))
    }
}

/// Prompt-lookup proposals for the rows of the runner's input batch.
#[pyclass(module = "asyncllm._core", name = "NgramProposer", frozen)]
pub struct PyNgramProposer {
    inner: Mutex<NgramProposer>,
}

impl PyNgramProposer {
    fn lock(&self) -> PyResult<MutexGuard<'_, NgramProposer>> {
        self.inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("NgramProposer: a previous call panicked"))
    }
}

#[pymethods]
impl PyNgramProposer {
    #[new]
    fn new(num_rows: usize, prompt_lookup_min: usize, prompt_lookup_max: usize) -> PyResult<Self> {
        let inner =
            NgramProposer::new(num_rows, prompt_lookup_min, prompt_lookup_max).map_err(err)?;
        Ok(PyNgramProposer {
            inner: Mutex::new(inner),
        })
    }

    /// Start `row` with its tokens so far (`tokens`, int32); indexes them with
    /// the GIL released.
    fn add(&self, py: Python<'_>, row: usize, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let toks = token_ids(py, tokens, "tokens")?;
        py.detach(|| self.lock()?.add(row, &toks).map_err(err))
    }

    /// Forget `row`.
    fn remove(&self, py: Python<'_>, row: usize) -> PyResult<()> {
        py.detach(|| {
            self.lock()?.remove(row);
            Ok(())
        })
    }

    /// One step for rows `rows` (int64 `[m]`): row i's new tokens are
    /// `new_tokens[new_offsets[i]:new_offsets[i + 1]]` (int32; offsets int64
    /// `[m + 1]`), of its last drafts `drafted[i]` were proposed and
    /// `accepted[i]` accepted, and it may get up to `max_drafts[i]` (int64 each)
    /// proposed tokens. Returns each row's number of proposed tokens and the
    /// tokens, concatenated.
    #[allow(clippy::too_many_arguments)] // the step's columns, all distinct
    fn step(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        new_offsets: &Bound<'_, PyAny>,
        new_tokens: &Bound<'_, PyAny>,
        drafted: &Bound<'_, PyAny>,
        accepted: &Bound<'_, PyAny>,
        max_drafts: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<u32>, Vec<u32>)> {
        let cols = StepColumns::extract(
            py,
            [rows, new_offsets, new_tokens, drafted, accepted, max_drafts],
        )?;
        py.detach(|| {
            let mut proposer = self.lock()?;
            cols.run(|row, new, d, a, k, out| proposer.step(row, new, d, a, k, out).map_err(err))
        })
    }
}

/// SuffixDecoding proposals for the rows of the runner's input batch.
#[pyclass(module = "asyncllm._core", name = "SuffixProposer", frozen)]
pub struct PySuffixProposer {
    inner: Mutex<SuffixProposer>,
}

impl PySuffixProposer {
    fn lock(&self) -> PyResult<MutexGuard<'_, SuffixProposer>> {
        self.inner
            .lock()
            .map_err(|_| PyRuntimeError::new_err("SuffixProposer: a previous call panicked"))
    }
}

#[pymethods]
impl PySuffixProposer {
    #[new]
    fn new(
        num_rows: usize,
        max_tree_depth: usize,
        max_cached_requests: usize,
        max_cached_tokens: usize,
        max_spec_factor: f32,
        min_token_prob: f32,
    ) -> PyResult<Self> {
        let config = SuffixConfig {
            max_tree_depth,
            max_cached_requests,
            max_cached_tokens,
            max_spec_factor,
            min_token_prob,
        };
        let inner = SuffixProposer::new(num_rows, config).map_err(err)?;
        Ok(PySuffixProposer {
            inner: Mutex::new(inner),
        })
    }

    /// Start `row` for request `key` with its tokens so far (`tokens`, int32),
    /// the first `num_prompt` its prompt; builds its tries with the GIL released.
    fn add(
        &self,
        py: Python<'_>,
        row: usize,
        key: u64,
        tokens: &Bound<'_, PyAny>,
        num_prompt: usize,
    ) -> PyResult<()> {
        let toks = token_ids(py, tokens, "tokens")?;
        py.detach(|| self.lock()?.add(row, key, &toks, num_prompt).map_err(err))
    }

    /// `row`'s request left: its output stays shared until evicted.
    fn remove(&self, py: Python<'_>, row: usize) -> PyResult<()> {
        py.detach(|| {
            self.lock()?.remove(row);
            Ok(())
        })
    }

    /// As `NgramProposer.step`.
    #[allow(clippy::too_many_arguments)] // the step's columns, all distinct
    fn step(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, PyAny>,
        new_offsets: &Bound<'_, PyAny>,
        new_tokens: &Bound<'_, PyAny>,
        drafted: &Bound<'_, PyAny>,
        accepted: &Bound<'_, PyAny>,
        max_drafts: &Bound<'_, PyAny>,
    ) -> PyResult<(Vec<u32>, Vec<u32>)> {
        let cols = StepColumns::extract(
            py,
            [rows, new_offsets, new_tokens, drafted, accepted, max_drafts],
        )?;
        py.detach(|| {
            let mut proposer = self.lock()?;
            cols.run(|row, new, d, a, k, out| proposer.step(row, new, d, a, k, out).map_err(err))
        })
    }

    /// (requests kept after they left, tokens) in the shared trie.
    fn cache_size(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        py.detach(|| {
            let p = self.lock()?;
            Ok((p.num_cached_requests(), p.num_global_tokens()))
        })
    }
}

/// Each proposing request's draft cap (`crate::spec::budget::caps`):
/// `accepted` and `reached` are the decayed counts of every batch row (float64
/// `[rows, k]`), `proposing` the rows of the requests asking (int64 `[n]`), the
/// step's cost `t0 + t1 * rows` for `num_rows` requests. ValueError on a shape
/// or a row out of range.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the budget's state and the step's cost
fn _draft_caps(
    py: Python<'_>,
    accepted: &Bound<'_, PyAny>,
    reached: &Bound<'_, PyAny>,
    proposing: &Bound<'_, PyAny>,
    overall: f64,
    prior_weight: f64,
    t0: f64,
    t1: f64,
    num_rows: usize,
    slack: f64,
) -> PyResult<Vec<usize>> {
    let took = buffer::<f64>(accepted, "accepted", "float64", 2)?;
    let got = buffer::<f64>(reached, "reached", "float64", 2)?;
    let (rows, k) = (took.shape()[0], took.shape()[1]);
    if got.shape() != took.shape() {
        return Err(err(format!(
            "_draft_caps: reached has shape {:?}, accepted {:?}",
            got.shape(),
            took.shape()
        )));
    }
    let which = sizes(py, proposing, "proposing")?;
    if let Some(&bad) = which.iter().find(|&&r| r >= rows) {
        return Err(err(format!(
            "_draft_caps: proposing holds row {bad}, beyond the {rows} rows"
        )));
    }
    if k == 0 {
        return Ok(vec![0; which.len()]);
    }
    let (took, got) = (took.to_vec(py)?, got.to_vec(py)?);
    let gather = |all: &[f64]| -> Vec<f64> {
        which
            .iter()
            .flat_map(|&r| all[r * k..(r + 1) * k].iter().copied())
            .collect()
    };
    let (took, got) = (gather(&took), gather(&got));
    let acc = Acceptance {
        accepted: &took,
        reached: &got,
        k,
        overall,
        prior_weight,
    };
    let cost = StepCost {
        t0,
        t1,
        num_rows,
        slack,
    };
    Ok(caps(&acc, &cost))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNgramProposer>()?;
    m.add_class::<PySuffixProposer>()?;
    m.add_function(wrap_pyfunction!(_draft_caps, m)?)
}
