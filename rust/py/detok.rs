//! Python binding of the batched detokenizer (`crate::detok`): extract owned
//! inputs with the GIL held, run the detokenizer inside `py.detach` (GIL
//! released), wrap the results. The state sits behind a mutex that is only
//! taken with the GIL released, so a long step never blocks other Python
//! threads, and concurrent calls from several threads serialize safely.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

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

fn wrap_outputs<'py>(py: Python<'py>, outputs: &StepOutputs) -> PyResult<Bound<'py, PyList>> {
    let mut items = Vec::with_capacity(outputs.items.len());
    for (i, item) in outputs.items.iter().enumerate() {
        let tuple = (
            PyString::new(py, outputs.text_of(i)),
            item.stop_index,
            item.num_kept,
            item.num_tokens_released,
        );
        items.push(tuple.into_pyobject(py)?);
    }
    PyList::new(py, items)
}

/// Batched incremental detokenizer with stop strings for one tokenizer.
#[pyclass(module = "asyncllm._core", name = "Detokenizer", frozen)]
pub struct PyDetokenizer {
    inner: Mutex<Detokenizer>,
}

impl PyDetokenizer {
    /// Call only with the GIL released.
    fn lock(&self) -> Result<MutexGuard<'_, Detokenizer>, DetokError> {
        self.inner.lock().map_err(|_| DetokError::Poisoned)
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
        Ok(PyDetokenizer {
            inner: Mutex::new(inner),
        })
    }

    /// Builds a detokenizer from the text of a `tokenizer.json`.
    #[staticmethod]
    fn from_json(py: Python<'_>, json: String) -> PyResult<Self> {
        let inner = py
            .detach(|| Detokenizer::from_json(&json))
            .map_err(detok_err)?;
        Ok(PyDetokenizer {
            inner: Mutex::new(inner),
        })
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
    fn step<'py>(
        &self,
        py: Python<'py>,
        request_ids: &Bound<'py, PyAny>,
        new_token_ids: &Bound<'py, PyAny>,
        finished: Option<Vec<bool>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let ids: Vec<u64> = request_ids.extract()?;
        let mut batch = StepBatch::with_capacity(ids.len());
        for item in new_token_ids.try_iter()? {
            extend_ids(&item?, &mut batch.token_ids)?;
            batch.offsets.push(batch.token_ids.len());
        }
        batch.request_ids = ids;
        batch.finished = finished.unwrap_or_default();
        let outputs = self.step_batch(py, &batch)?;
        wrap_outputs(py, &outputs)
    }

    /// Finishes one request (EOS, length, abort): releases its held-back text
    /// and drops its state.
    fn finish<'py>(&self, py: Python<'py>, request_id: u64) -> PyResult<Bound<'py, PyTuple>> {
        let mut batch = StepBatch::with_capacity(1);
        batch.push(request_id, &[]);
        batch.finished = vec![true];
        let outputs = self.step_batch(py, &batch)?;
        let item = outputs.items[0];
        (
            outputs.text.as_str(),
            item.stop_index,
            item.num_kept,
            item.num_tokens_released,
        )
            .into_pyobject(py)
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
    m.add_class::<PyDetokenizer>()
}
