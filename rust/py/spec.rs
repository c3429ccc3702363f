//! Python binding of the n-gram proposer (`crate::spec::ngram`): inputs copied
//! with the GIL held, the index updated and the proposals made with it released.

use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::kernels::buffer;
use crate::spec::ngram::{NgramError, NgramProposer};

fn err(e: NgramError) -> PyErr {
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
        let rows = sizes(py, rows, "rows")?;
        let offsets = sizes(py, new_offsets, "new_offsets")?;
        let toks = token_ids(py, new_tokens, "new_tokens")?;
        let drafted = sizes(py, drafted, "drafted")?;
        let accepted = sizes(py, accepted, "accepted")?;
        let max_drafts = sizes(py, max_drafts, "max_drafts")?;
        let m = rows.len();
        if offsets.len() != m + 1
            || drafted.len() != m
            || accepted.len() != m
            || max_drafts.len() != m
            || offsets.windows(2).any(|w| w[0] > w[1])
            || offsets[m] > toks.len()
        {
            return Err(PyValueError::new_err(format!(
                "step: new_offsets must be [{}] non-decreasing within new_tokens ({} tokens), \
                 drafted, accepted and max_drafts [{m}]",
                m + 1,
                toks.len()
            )));
        }
        py.detach(|| {
            let mut proposer = self.lock()?;
            let mut counts = Vec::with_capacity(m);
            let mut out = Vec::new();
            for i in 0..m {
                let new = &toks[offsets[i]..offsets[i + 1]];
                let n = proposer
                    .step(
                        rows[i],
                        new,
                        drafted[i],
                        accepted[i],
                        max_drafts[i],
                        &mut out,
                    )
                    .map_err(err)?;
                counts.push(n as u32);
            }
            Ok((counts, out))
        })
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNgramProposer>()
}
