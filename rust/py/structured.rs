//! Python binding of constrained decoding (`crate::structured`): a compiler
//! built once per engine from the tokenizer file, grammars compiled with the
//! GIL released, a matcher per request, and the step's two batched calls
//! (`fill_bitmasks`, `advance`) over many matchers with the GIL released.
//!
//! A matcher's state sits behind a mutex that is only taken with the GIL
//! released; a batched call takes each with `try_lock`, so a matcher listed
//! twice, or in use by another thread, is an error rather than a deadlock.
//! `advance_fill` runs the step's advance and fill on the extension's own
//! thread (`mask_job`) and returns at once.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

use super::kernels::{buffer, data_ptr};
use super::mask_job::{MaskJob, SerialWorker};
use crate::structured::compile_pool::CompilePool;
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
    // runs `advance_fill` jobs in order
    worker: SerialWorker,
    // compiles at the lowest priority, so a costly grammar delays only its request
    compile_pool: CompilePool,
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
    // shared with the jobs that advance or fill it (`advance_fill`)
    inner: Arc<Mutex<TrackedMatcher>>,
}

type Shared = Arc<Mutex<TrackedMatcher>>;

/// Every matcher's lock, or why not: plain text, as this runs without the GIL
/// (on the grammar worker too, where building a Python error could wait for it).
fn lock_all(matchers: &[Shared]) -> Result<Vec<MutexGuard<'_, TrackedMatcher>>, String> {
    matchers
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.try_lock()
                .map_err(|_| format!("matcher {i} is in use (listed twice, or by another thread)"))
        })
        .collect()
}

fn matcher_refs(list: &[Bound<'_, GrammarMatcher>]) -> Vec<Shared> {
    // `get` on a frozen pyclass: no borrow flag to take
    list.iter().map(|b| b.get().inner.clone()).collect()
}

/// Advances `draw[i]` by `tokens[i]`, then fills `dest[i]` with the mask of
/// `fill[i]`; the indices of the fills that failed.
fn advance_then_fill(
    draw: &[Shared],
    tokens: &[u32],
    fill: &[Shared],
    mut dest: Vec<&mut [u32]>,
    eos_row: &[u32],
    pool: Option<&ThreadPool>,
) -> Result<Vec<usize>, String> {
    if !draw.is_empty() {
        let mut guards = lock_all(draw)?;
        let mut ms: Vec<&mut TrackedMatcher> = guards.iter_mut().map(|g| &mut **g).collect();
        structured::advance(&mut ms, tokens);
    }
    let mut guards = lock_all(fill)?;
    let mut ms: Vec<&mut TrackedMatcher> = guards.iter_mut().map(|g| &mut **g).collect();
    let failed = structured::fill_masks(&mut ms, &mut dest, eos_row, pool);
    Ok(failed
        .iter()
        .enumerate()
        .filter_map(|(i, &f)| f.then_some(i))
        .collect())
}

/// The rows of `all` (`words` u32 each) listed in `rows`, in that order.
/// `rows` were checked distinct and in range (`check_rows`).
fn row_slices<'a>(all: &'a mut [u32], words: usize, rows: &[usize]) -> Vec<&'a mut [u32]> {
    let mut chunks: Vec<Option<&mut [u32]>> = all.chunks_mut(words).map(Some).collect();
    rows.iter()
        .map(|&r| chunks[r].take().expect("rows are distinct"))
        .collect()
}

/// Threads compiling grammars (each at the lowest priority); more jobs queue.
const COMPILE_THREADS: usize = 2;

/// The most threads `fill_bitmasks` may be asked for.
const MAX_FILL_THREADS: usize = 256;

impl GrammarCompiler {
    /// The pool for a fill on `threads` threads; None for 1 (the calling thread).
    fn fill_pool(&self, threads: usize) -> PyResult<Option<Arc<ThreadPool>>> {
        if !(1..=MAX_FILL_THREADS).contains(&threads) {
            return Err(value_err(format!(
                "threads must be in 1..={MAX_FILL_THREADS}, got {threads}"
            )));
        }
        if threads == 1 {
            return Ok(None);
        }
        self.pool(threads).map(Some)
    }

    /// `out` as a writable int32 `[N, words]` buffer, after checking that `rows`
    /// are `n` distinct rows of it.
    fn target(&self, out: &Bound<'_, PyAny>, rows: &[usize], n: usize) -> PyResult<PyBuffer<i32>> {
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
        if rows.len() != n {
            return Err(value_err(format!("{n} matchers but {} rows", rows.len())));
        }
        let mut seen = vec![false; shape[0]];
        for &r in rows {
            if r >= shape[0] || std::mem::replace(&mut seen[r], true) {
                return Err(value_err(format!(
                    "row {r} is out of range or listed twice (out has {} rows)",
                    shape[0]
                )));
            }
        }
        Ok(buf)
    }

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
        // Walking the vocabulary costs ~0.1-0.2 s of CPU on the first constrained
        // request: at the compile threads' low priority too, not the caller's.
        let builder = CompilePool::new("grammar-init", 1);
        let inner = py
            .detach(|| {
                builder.run(None, move || {
                    Compiler::from_file(&path, &eos_token_ids, vocab_size)
                })
            })
            .map_err(value_err)?
            .map_err(value_err)?;
        let eos_row = Arc::new(inner.eos_row());
        Ok(GrammarCompiler {
            inner: Arc::new(inner),
            eos_row,
            pool: Mutex::new(None),
            worker: SerialWorker::new("grammar-masks"),
            compile_pool: CompilePool::new("grammar-compile", COMPILE_THREADS),
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

    /// Compiles (kind, spec) (`StructuredOutputsParams.kind` and `.spec()`) on
    /// the compiler's own threads, which run at the lowest scheduling priority,
    /// waiting with the GIL released at most `timeout_s` seconds (None: until
    /// it is done). Raises ValueError naming the problem, or the limit the
    /// grammar went past (the deadline included).
    #[pyo3(signature = (kind, spec, timeout_s=None))]
    fn compile(
        &self,
        py: Python<'_>,
        kind: &str,
        spec: &str,
        timeout_s: Option<f64>,
    ) -> PyResult<Grammar> {
        let deadline = match timeout_s {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => return Err(value_err(format!("timeout_s must be > 0, got {t}"))),
        };
        let compiler = self.inner.clone();
        let (k, s) = (kind.to_string(), spec.to_string());
        let inner = py
            .detach(|| {
                self.compile_pool
                    .run(deadline, move || compiler.compile(&k, &s))
            })
            .map_err(value_err)?
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
        let pool = self.fill_pool(threads)?;
        let target = self.target(out, &rows, matchers.len())?;
        let refs = matcher_refs(&matchers);
        let (ptr, len, words) = (
            data_ptr(&target) as usize,
            target.item_count(),
            self.inner.words(),
        );
        let eos_row = self.eos_row.clone();
        py.detach(move || {
            // SAFETY: `target` (held by this frame until after `detach` returns)
            // keeps the exporter's memory alive and in place; it is C-contiguous
            // int32 of `len` elements, writable (`target` checked both), and u32
            // has i32's size and alignment. The caller's contract: no other thread
            // touches `out` during the call. Rows are distinct (checked), so the
            // row slices never alias.
            let all: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u32, len) };
            let dest = row_slices(all, words, &rows);
            advance_then_fill(&[], &[], &refs, dest, &eos_row, pool.as_deref())
        })
        .map_err(PyRuntimeError::new_err)
    }

    /// Queues, on the extension's own thread, the advance of `advance[i]` by
    /// `tokens[i]` and then the fill of `fill[i]`'s mask into row `rows[i]` of
    /// `out` (as `fill_bitmasks`), and returns at once: the runner hands over a
    /// draw and goes on while the next masks are computed. Jobs run in the order
    /// they were queued. `MaskJob.wait()` gives the failed fills' indices.
    ///
    /// The caller leaves `out`'s rows `rows` alone until the job is waited for.
    #[pyo3(signature = (advance, tokens, fill, out, rows, threads = 1))]
    #[allow(clippy::too_many_arguments)]
    fn advance_fill(
        &self,
        advance: Vec<Bound<'_, GrammarMatcher>>,
        tokens: Vec<u32>,
        fill: Vec<Bound<'_, GrammarMatcher>>,
        out: &Bound<'_, PyAny>,
        rows: Vec<usize>,
        threads: usize,
    ) -> PyResult<MaskJob> {
        if tokens.len() != advance.len() {
            return Err(value_err(format!(
                "{} matchers to advance but {} tokens",
                advance.len(),
                tokens.len()
            )));
        }
        let pool = self.fill_pool(threads)?;
        let target = self.target(out, &rows, fill.len())?;
        let (draw, refs) = (matcher_refs(&advance), matcher_refs(&fill));
        let (ptr, len, words) = (
            data_ptr(&target) as usize,
            target.item_count(),
            self.inner.words(),
        );
        let eos_row = self.eos_row.clone();
        let result = self.worker.submit(move || {
            // SAFETY: the `MaskJob` returned below holds `target` until this job
            // has ended (dropping an unfinished job waits for it), so the
            // exporter's memory stays alive and in place throughout; it is
            // C-contiguous int32 of `len` elements, writable (checked), and u32
            // has i32's size and alignment. The caller's contract: nothing else
            // touches rows `rows` of `out` until the job is waited for. Rows are
            // distinct (checked), so the row slices never alias.
            let all: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u32, len) };
            let dest = row_slices(all, words, &rows);
            advance_then_fill(&draw, &tokens, &refs, dest, &eos_row, pool.as_deref())
        })?;
        Ok(MaskJob::new(result, target))
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
            Ok::<Vec<u8>, String>(
                structured::advance(&mut ms, &tokens)
                    .into_iter()
                    .map(|s| s as u8)
                    .collect(),
            )
        })
        .map_err(PyRuntimeError::new_err)
    }
}

#[pymethods]
impl Grammar {
    /// A fresh matcher at the start of this grammar.
    fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher {
            inner: Arc::new(Mutex::new(self.inner.matcher())),
        }
    }

    /// The constraint's kind, as compiled.
    #[getter]
    fn kind(&self) -> &str {
        &self.kind
    }

    /// Heap bytes the compiled grammar holds (measured when it was compiled).
    #[getter]
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
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
    m.add_class::<MaskJob>()?;
    m.add("GRAMMAR_RUNNING", Status::Running as u8)?;
    m.add("GRAMMAR_COMPLETE", Status::Complete as u8)?;
    m.add("GRAMMAR_ERROR", Status::Error as u8)?;
    Ok(())
}
