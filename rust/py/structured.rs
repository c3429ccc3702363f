//! Python binding of constrained decoding (`crate::structured`): a compiler
//! built once per engine from the tokenizer file, grammars compiled with the
//! GIL released, a matcher per request, and the step's two batched calls
//! (`fill_bitmasks`, `advance`) over many matchers with the GIL released.
//!
//! A matcher's state sits behind a mutex that is only taken with the GIL
//! released; a batched call takes each with `try_lock`, so a matcher listed
//! twice, or in use by another thread, is an error rather than a deadlock.

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

use super::kernels::{buffer, data_ptr};
use crate::structured::{self, Compiler, Status, TrackedMatcher};

fn value_err(e: impl ToString) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Compiles constraints for one tokenizer and model vocabulary; build it once
/// (it walks the whole vocabulary).
#[pyclass(frozen, module = "asyncllm._core")]
pub struct GrammarCompiler {
    inner: Arc<Compiler>,
    eos_row: Arc<Vec<u32>>,
    // the fill's own threads, built on the first call that asks for more than one
    pool: Mutex<Option<Arc<ThreadPool>>>,
}

/// A compiled constraint, shared by every request with the same one.
#[pyclass(frozen, module = "asyncllm._core")]
pub struct Grammar {
    inner: Arc<structured::Grammar>,
    kind: String,
}

/// One request's walk through a grammar.
#[pyclass(frozen, module = "asyncllm._core")]
pub struct GrammarMatcher {
    inner: Mutex<TrackedMatcher>,
}

fn lock_all<'a>(
    matchers: &'a [&'a GrammarMatcher],
) -> PyResult<Vec<MutexGuard<'a, TrackedMatcher>>> {
    matchers
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.inner.try_lock().map_err(|_| {
                PyRuntimeError::new_err(format!(
                    "matcher {i} is in use (listed twice, or by another thread)"
                ))
            })
        })
        .collect()
}

fn matcher_refs<'a>(list: &'a [Bound<'_, GrammarMatcher>]) -> Vec<&'a GrammarMatcher> {
    // `get` on a frozen pyclass: a shared reference, valid while `list` is held
    list.iter().map(|b| b.get()).collect()
}

/// The most threads `fill_bitmasks` may be asked for.
const MAX_FILL_THREADS: usize = 256;

impl GrammarCompiler {
    /// The fill's pool of `threads` threads (rebuilt if asked for another size).
    fn pool(&self, threads: usize) -> PyResult<Arc<ThreadPool>> {
        let mut slot = self
            .pool
            .lock()
            .map_err(|_| PyRuntimeError::new_err("fill pool lock poisoned"))?;
        if let Some(pool) = slot.as_ref().filter(|p| p.current_num_threads() == threads) {
            return Ok(pool.clone());
        }
        let pool = ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("grammar-fill-{i}"))
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start fill threads: {e}")))?;
        let pool = Arc::new(pool);
        *slot = Some(pool.clone());
        Ok(pool)
    }
}

#[pymethods]
impl GrammarCompiler {
    /// From `tokenizer.json` at `tokenizer_path`; `eos_token_ids` end a
    /// generation (allowed where a grammar may end); `vocab_size` is the width
    /// of the model's logits.
    #[new]
    fn new(
        py: Python<'_>,
        tokenizer_path: &str,
        eos_token_ids: Vec<u32>,
        vocab_size: usize,
    ) -> PyResult<Self> {
        let path = tokenizer_path.to_string();
        let inner = py
            .detach(move || Compiler::from_file(&path, &eos_token_ids, vocab_size))
            .map_err(value_err)?;
        let eos_row = Arc::new(inner.eos_row());
        Ok(GrammarCompiler {
            inner: Arc::new(inner),
            eos_row,
            pool: Mutex::new(None),
        })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// int32 words per bitmask row: ceil(vocab_size / 32).
    #[getter]
    fn words(&self) -> usize {
        self.inner.words()
    }

    /// Compiles (kind, spec) (`StructuredOutputsParams.kind` and `.spec()`),
    /// with the GIL released. Raises ValueError naming the problem.
    fn compile(&self, py: Python<'_>, kind: &str, spec: &str) -> PyResult<Grammar> {
        let compiler = self.inner.clone();
        let (k, s) = (kind.to_string(), spec.to_string());
        let inner = py
            .detach(move || compiler.compile(&k, &s))
            .map_err(value_err)?;
        Ok(Grammar {
            inner: Arc::new(inner),
            kind: kind.to_string(),
        })
    }

    /// Writes the allowed tokens of `matchers[i]` into row `rows[i]` of `out`
    /// (a writable C-contiguous int32 buffer `[N, words]`), all with the GIL
    /// released. Matchers in the same state (same grammar, same tokens) share
    /// one computed mask. With `threads` > 1 the distinct masks are computed
    /// on a pool of that many threads where there are many; with 1 (the
    /// default) serially on the calling thread, which costs least where the
    /// forward pass keeps every core busy. Returns the indices of the matchers
    /// in error (their rows allow EOS only).
    ///
    /// The caller keeps `out` to itself during the call (the runner's own
    /// array): nothing else may read or write it while the GIL is released.
    #[pyo3(signature = (matchers, out, rows, threads = 1))]
    fn fill_bitmasks(
        &self,
        py: Python<'_>,
        matchers: Vec<Bound<'_, GrammarMatcher>>,
        out: &Bound<'_, PyAny>,
        rows: Vec<usize>,
        threads: usize,
    ) -> PyResult<Vec<usize>> {
        if !(1..=MAX_FILL_THREADS).contains(&threads) {
            return Err(value_err(format!(
                "threads must be in 1..={MAX_FILL_THREADS}, got {threads}"
            )));
        }
        let pool = if threads > 1 {
            Some(self.pool(threads)?)
        } else {
            None
        };
        let words = self.inner.words();
        let buf = buffer::<i32>(out, "out", "int32", 2)?;
        if buf.readonly() {
            return Err(value_err("out must be writable"));
        }
        let shape = buf.shape().to_vec();
        if shape[1] != words {
            return Err(value_err(format!(
                "out has {} words per row; this vocabulary needs {words}",
                shape[1]
            )));
        }
        if rows.len() != matchers.len() {
            return Err(value_err(format!(
                "{} matchers but {} rows",
                matchers.len(),
                rows.len()
            )));
        }
        let mut seen = vec![false; shape[0]];
        for &r in &rows {
            if r >= shape[0] || std::mem::replace(&mut seen[r], true) {
                return Err(value_err(format!(
                    "row {r} is out of range or listed twice (out has {} rows)",
                    shape[0]
                )));
            }
        }
        let refs = matcher_refs(&matchers);
        let ptr = data_ptr(&buf) as usize;
        let len = shape[0] * words;
        let eos_row = self.eos_row.clone();
        py.detach(move || {
            // SAFETY: `buf` (held by this frame until after `detach` returns) keeps
            // the exporter's memory alive and in place; it is C-contiguous int32
            // of `len` elements (checked above), writable, and u32 has i32's size
            // and alignment. The caller's contract: no other thread touches `out`
            // during the call. Rows are distinct (checked), so the row slices
            // below never alias.
            let all: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u32, len) };
            let mut chunks: Vec<Option<&mut [u32]>> = all.chunks_mut(words).map(Some).collect();
            let mut dest: Vec<&mut [u32]> = rows
                .iter()
                .map(|&r| chunks[r].take().expect("rows are distinct"))
                .collect();
            let mut guards = lock_all(&refs)?;
            let mut ms: Vec<&mut TrackedMatcher> = guards.iter_mut().map(|g| &mut **g).collect();
            let failed = structured::fill_masks(&mut ms, &mut dest, &eos_row, pool.as_deref());
            Ok(failed
                .iter()
                .enumerate()
                .filter_map(|(i, &f)| f.then_some(i))
                .collect())
        })
    }

    /// Advances `matchers[i]` by `tokens[i]` with the GIL released. Returns
    /// per matcher 0 (running), 1 (complete: the grammar ended) or 2 (error).
    fn advance(
        &self,
        py: Python<'_>,
        matchers: Vec<Bound<'_, GrammarMatcher>>,
        tokens: Vec<u32>,
    ) -> PyResult<Vec<u8>> {
        if tokens.len() != matchers.len() {
            return Err(value_err(format!(
                "{} matchers but {} tokens",
                matchers.len(),
                tokens.len()
            )));
        }
        let refs = matcher_refs(&matchers);
        py.detach(move || {
            let mut guards = lock_all(&refs)?;
            let mut ms: Vec<&mut TrackedMatcher> = guards.iter_mut().map(|g| &mut **g).collect();
            Ok(structured::advance(&mut ms, &tokens)
                .into_iter()
                .map(|s| s as u8)
                .collect())
        })
    }
}

#[pymethods]
impl Grammar {
    /// A fresh matcher at the start of this grammar.
    fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            inner: Mutex::new(self.inner.matcher()),
        }
    }

    /// The constraint's kind, as compiled.
    #[getter]
    fn kind(&self) -> &str {
        &self.kind
    }
}

impl GrammarMatcher {
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut TrackedMatcher) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut m = self
                .inner
                .try_lock()
                .map_err(|_| PyRuntimeError::new_err("matcher is in use by another thread"))?;
            Ok(f(&mut m))
        })
    }
}

#[pymethods]
impl GrammarMatcher {
    /// Consumes `tokens` in order (a resumed request's outputs so far); stops
    /// at the end of the grammar. Returns the status, as `advance`.
    fn consume(&self, py: Python<'_>, tokens: Vec<u32>) -> PyResult<u8> {
        self.with(py, move |m| structured::consume(m, &tokens) as u8)
    }

    /// Undoes the last `num_tokens` consumed tokens (rejected speculation).
    fn rollback(&self, py: Python<'_>, num_tokens: usize) -> PyResult<()> {
        self.with(py, move |m| m.rollback(num_tokens))?
            .map_err(value_err)
    }

    /// 0 running, 1 complete, 2 error.
    #[getter]
    fn status(&self, py: Python<'_>) -> PyResult<u8> {
        self.with(py, |m| structured::status(m) as u8)
    }

    /// Why the matcher failed, or None.
    #[getter]
    fn error(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.with(py, |m| m.matcher().get_error())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GrammarCompiler>()?;
    m.add_class::<Grammar>()?;
    m.add_class::<GrammarMatcher>()?;
    m.add("GRAMMAR_RUNNING", Status::Running as u8)?;
    m.add("GRAMMAR_COMPLETE", Status::Complete as u8)?;
    m.add("GRAMMAR_ERROR", Status::Error as u8)?;
    Ok(())
}
