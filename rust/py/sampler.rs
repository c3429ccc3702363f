//! Python binding of the CPU sampler (`crate::sampler`). The small per-row
//! inputs are copied and validated with the GIL held; the logits are read in
//! place through a raw-pointer view (as `py::kernels` reads the KV cache); the
//! GIL is released for the kernel, which writes the caller's output buffers.

use pyo3::buffer::{Element, PyBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::kernels::{buffer, byte_range, data_ptr};
use crate::error::Error;
use crate::sampler::{self, Batch, Bias, Masks, Outputs, RowParams, TokenLists};

/// Columns of `params_f` and `params_i` (python/asyncllm/worker/input_batch.py).
const NUM_F: usize = 6;
const NUM_I: usize = 6;

fn err(msg: String) -> PyErr {
    PyValueError::new_err(msg)
}

/// A copy of a 1-D int64 buffer converted to `U`, or a `ValueError` naming the
/// argument and the bad value.
fn ints<U: TryFrom<i64>>(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<U>> {
    let buf = buffer::<i64>(obj, name, "int64", 1)?;
    buf.to_vec(py)?
        .into_iter()
        .map(|v| U::try_from(v).map_err(|_| err(format!("{name} holds {v}, out of range"))))
        .collect()
}

fn writable<T: Element>(
    obj: &Bound<'_, PyAny>,
    name: &str,
    dtype: &str,
    ndim: usize,
) -> PyResult<PyBuffer<T>> {
    let buf = buffer::<T>(obj, name, dtype, ndim)?;
    if buf.readonly() {
        return Err(err(format!("{name} must be writable")));
    }
    Ok(buf)
}

/// The rows' parameters from `params_f` `[n, 6]` f32 (temperature, top_p,
/// min_p, repetition, frequency, presence) and `params_i` `[n, 6]` i64 (greedy,
/// top_k, num_logprobs, seed bits, stream bits, output position).
fn row_params(f: &[f32], i: &[i64]) -> PyResult<Vec<RowParams>> {
    f.chunks_exact(NUM_F)
        .zip(i.chunks_exact(NUM_I))
        .enumerate()
        .map(|(r, (f, i))| {
            let num_logprobs = i32::try_from(i[2])
                .ok()
                .filter(|&n| n >= -1)
                .ok_or_else(|| err(format!("row {r}: num_logprobs {} is not in -1..2^31", i[2])))?;
            if i[1] < 0 || i[5] < 0 {
                return Err(err(format!(
                    "row {r}: top_k {} and position {} must be >= 0",
                    i[1], i[5]
                )));
            }
            Ok(RowParams {
                greedy: i[0] != 0,
                temperature: f[0],
                top_k: u32::try_from(i[1]).unwrap_or(u32::MAX), // >= vocab: off
                top_p: f[1],
                min_p: f[2],
                repetition: f[3],
                frequency: f[4],
                presence: f[5],
                seed: i[3] as u64, // the bits of a uint64
                stream: i[4] as u64,
                position: i[5] as u64,
                num_logprobs,
            })
        })
        .collect()
}

/// Samples every row of `logits` `[n, vocab]` f32 (see `crate::sampler` for the
/// semantics). Per-row parameters: `params_f`/`params_i` (`row_params`); token
/// lists in CSR form (int64): `seen_offsets` `[n + 1]`, `seen_tokens` and
/// `seen_counts` (occurrences among the outputs), `banned_offsets` `[n + 1]` and
/// `banned_tokens`. Writes `sampled` `[n]` and `ranks` `[n]` (int64) and
/// `logprob_ids` `[n, w]` int64 / `logprob_values` `[n, w]` f32 (w = 0, or at
/// least 1 + every row's num_logprobs). Constrained rows (structured output):
/// `bitmask` `[m, words]` int32 and `bitmask_rows` `[m]` int64, distinct rows:
/// row `bitmask_rows[i]` samples as if every token that row `i` of the
/// bitmask does not allow had logit -inf, logprobs and ranks included (the
/// mask is applied as the kernel reads the row: no separate pass). Logit bias
/// (`logit_bias`): `bias_offsets` `[n + 1]` and `bias_tokens` (int64, each
/// row's sorted and distinct) with `bias_values` (float32) parallel to the
/// tokens, added to those logits before the penalties; None: no row has any. Returns the
/// rows whose logits had no finite maximum. Raises `ValueError`, writing
/// nothing, on a bad argument.
///
/// Private to the package (`_sample`): its one caller,
/// `asyncllm.worker.sampler_kernel.sample_cpu`, keeps the promise the GIL can
/// no longer keep once it is released: no other thread writes `logits` or
/// touches the outputs meanwhile, nor writes `bitmask` (the runner's own
/// array, filled before this call). Everything else is copied first.
#[pyfunction(name = "_sample")]
#[pyo3(signature = (
    logits, params_f, params_i, seen_offsets, seen_tokens, seen_counts, banned_offsets,
    banned_tokens, sampled, ranks, logprob_ids, logprob_values, num_threads,
    bitmask = None, bitmask_rows = None, bias_offsets = None, bias_tokens = None,
    bias_values = None,
))]
#[allow(clippy::too_many_arguments)] // the kernel's operands, all distinct
fn sample(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    params_f: &Bound<'_, PyAny>,
    params_i: &Bound<'_, PyAny>,
    seen_offsets: &Bound<'_, PyAny>,
    seen_tokens: &Bound<'_, PyAny>,
    seen_counts: &Bound<'_, PyAny>,
    banned_offsets: &Bound<'_, PyAny>,
    banned_tokens: &Bound<'_, PyAny>,
    sampled: &Bound<'_, PyAny>,
    ranks: &Bound<'_, PyAny>,
    logprob_ids: &Bound<'_, PyAny>,
    logprob_values: &Bound<'_, PyAny>,
    num_threads: usize,
    bitmask: Option<&Bound<'_, PyAny>>,
    bitmask_rows: Option<&Bound<'_, PyAny>>,
    bias_offsets: Option<&Bound<'_, PyAny>>,
    bias_tokens: Option<&Bound<'_, PyAny>>,
    bias_values: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<usize>> {
    let logits = buffer::<f32>(logits, "logits", "float32", 2)?;
    let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
    let pf = buffer::<f32>(params_f, "params_f", "float32", 2)?;
    let pi = buffer::<i64>(params_i, "params_i", "int64", 2)?;
    if pf.shape() != [n, NUM_F] || pi.shape() != [n, NUM_I] {
        return Err(err(format!(
            "params_f and params_i must be [{n}, 6] for logits {:?}, got {:?} and {:?}",
            logits.shape(),
            pf.shape(),
            pi.shape()
        )));
    }
    let rows = row_params(&pf.to_vec(py)?, &pi.to_vec(py)?)?;
    let seen_offsets: Vec<usize> = ints(py, seen_offsets, "seen_offsets")?;
    let seen_tokens: Vec<u32> = ints(py, seen_tokens, "seen_tokens")?;
    let seen_counts: Vec<u32> = ints(py, seen_counts, "seen_counts")?;
    let banned_offsets: Vec<usize> = ints(py, banned_offsets, "banned_offsets")?;
    let banned_tokens: Vec<u32> = ints(py, banned_tokens, "banned_tokens")?;
    let (bias_offsets, bias_tokens, bias_values): (Vec<usize>, Vec<u32>, Vec<f32>) =
        match (bias_offsets, bias_tokens, bias_values) {
            (None, None, None) => (Vec::new(), Vec::new(), Vec::new()),
            (Some(o), Some(t), Some(v)) => (
                ints(py, o, "bias_offsets")?,
                ints(py, t, "bias_tokens")?,
                buffer::<f32>(v, "bias_values", "float32", 1)?.to_vec(py)?,
            ),
            _ => {
                return Err(err(
                    "bias_offsets, bias_tokens and bias_values must be given together".into(),
                ))
            }
        };
    let sampled = writable::<i64>(sampled, "sampled", "int64", 1)?;
    let ranks = writable::<i64>(ranks, "ranks", "int64", 1)?;
    let ids = writable::<i64>(logprob_ids, "logprob_ids", "int64", 2)?;
    let values = writable::<f32>(logprob_values, "logprob_values", "float32", 2)?;
    let width = ids.shape()[1];
    if sampled.shape() != [n]
        || ranks.shape() != [n]
        || ids.shape() != [n, width]
        || values.shape() != [n, width]
    {
        return Err(err(format!(
            "outputs must be sampled [{n}], ranks [{n}], logprob_ids and logprob_values [{n}, w]; got {:?}, {:?}, {:?}, {:?}",
            sampled.shape(),
            ranks.shape(),
            ids.shape(),
            values.shape()
        )));
    }
    let bits = match bitmask {
        Some(b) => Some(buffer::<i32>(b, "bitmask", "int32", 2)?),
        None => None,
    };
    let of_row = match (&bits, bitmask_rows) {
        (None, None) => Vec::new(),
        (Some(bits), Some(rows)) => mask_of_row(py, bits, rows, n)?,
        _ => return Err(err("bitmask and bitmask_rows must be given together".into())),
    };
    let mut ranges = vec![
        byte_range(&logits),
        byte_range(&sampled),
        byte_range(&ranks),
        byte_range(&ids),
        byte_range(&values),
    ];
    ranges.extend(bits.as_ref().map(byte_range));
    for (a, ra) in ranges.iter().enumerate() {
        for rb in &ranges[a + 1..] {
            if ra.0 < ra.1 && rb.0 < rb.1 && ra.0 < rb.1 && rb.0 < ra.1 {
                return Err(err(
                    "logits, bitmask and the four outputs must not overlap".into()
                ));
            }
        }
    }
    // SAFETY: `logits` is a C-contiguous (checked by `buffer`) f32 buffer whose
    // pointer pyo3 checked to be aligned (non-null: `data_ptr`), valid for reads
    // of its `item_count` elements while the `PyBuffer` is held: until this
    // function returns, which outlives every use of the slice. No one writes it
    // meanwhile: the exporter cannot resize a buffer with an export outstanding,
    // the outputs (the only memory written here) were checked not to overlap it,
    // and the sole caller (see above) computed it on the thread blocked in this
    // call and shares it with no other.
    let logits_view = unsafe { std::slice::from_raw_parts(data_ptr(&logits), logits.item_count()) };
    // SAFETY (the four outputs): each is C-contiguous, aligned (pyo3 checked),
    // writable (checked) and valid for its `item_count` elements while its
    // `PyBuffer` is held, i.e. for all of this function; they overlap neither
    // each other nor `logits` (checked above) and the rest are copies. They are
    // exclusively ours for the call: the sole caller passes tensors it has just
    // allocated and shares with no other thread.
    let out = unsafe {
        Outputs {
            sampled: std::slice::from_raw_parts_mut(data_ptr(&sampled), sampled.item_count()),
            ranks: std::slice::from_raw_parts_mut(data_ptr(&ranks), ranks.item_count()),
            logprob_ids: std::slice::from_raw_parts_mut(data_ptr(&ids), ids.item_count()),
            logprob_values: std::slice::from_raw_parts_mut(data_ptr(&values), values.item_count()),
            width,
        }
    };
    let masks = match &bits {
        // SAFETY: a C-contiguous (checked by `buffer`) int32 buffer, aligned
        // (pyo3 checked) and valid for `item_count` reads while the `PyBuffer`
        // is held (all of this function); u32 has i32's size and alignment. Only
        // read: the sole caller fills it before this call and writes it again
        // only after it returns (the next step's fill), and it overlaps none of
        // the outputs (checked above).
        Some(b) => Masks {
            bits: unsafe {
                std::slice::from_raw_parts(data_ptr(b).cast::<u32>().cast_const(), b.item_count())
            },
            words: b.shape()[1],
            of_row: &of_row,
        },
        None => Masks::NONE,
    };
    let batch = Batch {
        logits: logits_view,
        vocab,
        rows: &rows,
        seen: TokenLists {
            offsets: &seen_offsets,
            tokens: &seen_tokens,
        },
        seen_counts: &seen_counts,
        banned: TokenLists {
            offsets: &banned_offsets,
            tokens: &banned_tokens,
        },
        masks,
        bias: Bias {
            offsets: &bias_offsets,
            tokens: &bias_tokens,
            values: &bias_values,
        },
    };
    py.detach(|| sampler::sample(&batch, out, num_threads))
        .map_err(|e| Error::from(e).into())
}

/// The mask index of each of the `n` logits rows (`Masks::of_row`) from
/// `bitmask_rows`; a `ValueError` for a row out of range or listed twice, or a
/// bitmask with fewer rows than `bitmask_rows` or 0 words.
fn mask_of_row(
    py: Python<'_>,
    bits: &PyBuffer<i32>,
    rows: &Bound<'_, PyAny>,
    n: usize,
) -> PyResult<Vec<usize>> {
    let rows: Vec<usize> = ints(py, rows, "bitmask_rows")?;
    let (m, words) = (bits.shape()[0], bits.shape()[1]);
    if rows.len() > m || words == 0 {
        return Err(err(format!(
            "bitmask [{m}, {words}] has too few rows or words for {} bitmask_rows",
            rows.len()
        )));
    }
    let mut of_row = vec![Masks::UNCONSTRAINED; n];
    for (i, &r) in rows.iter().enumerate() {
        if r >= n || of_row[r] != Masks::UNCONSTRAINED {
            return Err(err(format!(
                "bitmask_rows: row {r} is out of range or listed twice ({n} rows)"
            )));
        }
        of_row[r] = i;
    }
    Ok(of_row)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(sample, m)?)
}
