//! Python binding of the fused decode step (`crate::kernels::decode_layers`): a
//! `_DecodePlan` holds the buffers of every layer's weights and KV cache (made
//! once, when the model loads), and `run` takes a step's few small arrays.
//! Weights and caches are float32, or bfloat16 passed as int16 bits; a
//! projection may instead be GGUF blocks, a list of `(qtype, uint8 rows)` parts.
//! With LoRA a layer also holds its projections' adapter slots and their ranks
//! (`asyncllm.lora.layers.LoRALinear`'s buffers, written in place by slot writes
//! between steps), read by the steps `run` gives `lora_slots`.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::decode_bufs::{Buf, LoraBuf, ProjBuf};
use super::kernels::data_ptr;
use crate::error::Error;
use crate::kernels::{
    decode_layers, Adapters, CacheMut, DecodeDims, DecodeStep, Elem, LayerWeights,
};

struct Layer {
    input_norm: Buf,
    qkv: ProjBuf,
    qkv_bias: Option<PyBuffer<f32>>,
    o: ProjBuf,
    post_norm: Buf,
    gate_up: ProjBuf,
    down: ProjBuf,
    cache: Buf,
    /// qkv's, o's, gate_up's and down's adapters (each None: none).
    adapters: [Option<LoraBuf>; 4],
}

/// Every layer's weights and KV cache for `run`, held for the model's lifetime.
///
/// The promise the GIL cannot keep once `run` releases it, kept by the one
/// caller (`asyncllm.models.fused_decode`): the runner's thread is the only one
/// that runs the model, so while `run` works nothing else writes the weights
/// (which nothing writes after loading at all), the caches or the adapter slots
/// and ranks (written by that same thread between steps).
#[pyclass(name = "_DecodePlan", module = "asyncllm._core", frozen)]
pub struct DecodePlan {
    dims: DecodeDims,
    bf16: bool,
    cache_bf16: bool,
    layers: Vec<Layer>,
}

#[pymethods]
impl DecodePlan {
    /// `layers`: per layer (input_norm, qkv, qkv_bias or None, o, post_norm,
    /// gate_up, down, kv_cache[, adapters]), weights in the model's dtype — or,
    /// for a projection, a list of GGUF parts `(qtype, uint8 rows)` — the bias
    /// float32, the cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`;
    /// `adapters`, with LoRA: for qkv, o, gate_up and down, None or `(a, b,
    /// parts, ranks)` (`_lora_add`'s a, b and parts in the model's dtype, ranks an
    /// int64 array of each slot's rank, read at every step).
    #[new]
    #[allow(clippy::too_many_arguments)] // the model's sizes, all distinct
    fn new(
        layers: Vec<Bound<'_, PyTuple>>,
        hidden: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        intermediate: usize,
        eps: f32,
        scale: f32,
    ) -> PyResult<Self> {
        let dims = DecodeDims {
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate,
            eps,
            scale,
        };
        let layers = layers.iter().map(layer).collect::<PyResult<Vec<_>>>()?;
        let Some(first) = layers.first() else {
            return Err(PyValueError::new_err("layers must not be empty"));
        };
        let (bf16, cache_bf16) = (first.input_norm.is_bf16(), first.cache.is_bf16());
        for (i, l) in layers.iter().enumerate() {
            let projections = [&l.qkv, &l.o, &l.gate_up, &l.down];
            let floats = projections.iter().filter_map(|p| p.float_is_bf16());
            let norms = [l.input_norm.is_bf16(), l.post_norm.is_bf16()];
            let adapters = l.adapters.iter().flatten();
            let adapters = adapters.flat_map(|ad| [ad.a.is_bf16(), ad.b.is_bf16()]);
            if norms
                .into_iter()
                .chain(floats)
                .chain(adapters)
                .any(|b| b != bf16)
                || l.cache.is_bf16() != cache_bf16
            {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: the weights must share one dtype, and the caches one"
                )));
            }
            let cs = l.cache.shape();
            if cs.len() != 5 || cs[0] != 2 || cs[3] != num_kv_heads || cs[4] != head_dim {
                return Err(PyValueError::new_err(format!(
                    "layer {i}: kv_cache must be [2, blocks, block_size, {num_kv_heads}, \
                     {head_dim}], got {cs:?}"
                )));
            }
        }
        Ok(DecodePlan {
            dims,
            bf16,
            cache_bf16,
            layers,
        })
    }

    /// Runs every layer over `hidden` `[m, hidden]` (updated in place) for `m`
    /// decode rows: `cos_sin` `[m, 2, head_dim / 2]` in the model's dtype, `slots`
    /// `[m]`, `block_tables` `[m, n]` and `seq_lens` `[m]` int64; with LoRA,
    /// `lora_slots` `[m]` int64, each row's adapter slot (-1: none; None: no row
    /// has one). Raises `ValueError`, writing nothing, on any shape or range
    /// problem.
    #[allow(clippy::too_many_arguments)] // the step's operands, all distinct
    #[pyo3(signature = (hidden, cos_sin, slots, block_tables, seq_lens, num_threads, lora_slots=None))]
    fn run(
        &self,
        py: Python<'_>,
        hidden: &Bound<'_, PyAny>,
        cos_sin: &Bound<'_, PyAny>,
        slots: PyBuffer<i64>,
        block_tables: PyBuffer<i64>,
        seq_lens: PyBuffer<i64>,
        num_threads: usize,
        lora_slots: Option<PyBuffer<i64>>,
    ) -> PyResult<()> {
        let (hidden, cos_sin) = (Buf::get(hidden, "hidden")?, Buf::get(cos_sin, "cos_sin")?);
        if hidden.is_bf16() != self.bf16 || cos_sin.is_bf16() != self.bf16 {
            return Err(PyValueError::new_err(
                "hidden and cos_sin must have the model's dtype",
            ));
        }
        if matches!(&hidden, Buf::F32(b) if b.readonly())
            || matches!(&hidden, Buf::Bf16(b) if b.readonly())
        {
            return Err(PyValueError::new_err("hidden must be writable"));
        }
        let h = hidden.bytes();
        for l in &self.layers {
            let c = l.cache.bytes();
            if c.0 < h.1 && h.0 < c.1 {
                return Err(PyValueError::new_err("hidden must not overlap a kv_cache"));
            }
        }
        let lora_slots = lora_slots.map(|b| b.to_vec(py)).transpose()?;
        // each layer's adapters' ranks as they are now (slot writes change them)
        let mut ranks = Vec::new();
        if lora_slots.is_some() {
            for l in &self.layers {
                for ad in &l.adapters {
                    ranks.push(ad.as_ref().map(|ad| ad.ranks(py)).transpose()?);
                }
            }
        }
        let ints = Ints {
            slots: slots.to_vec(py)?,
            tables: block_tables.to_vec(py)?,
            lens: seq_lens.to_vec(py)?,
            lora_slots,
            ranks,
        };
        match (self.bf16, self.cache_bf16) {
            (false, false) => self.call::<f32, f32>(py, &hidden, &cos_sin, &ints, num_threads),
            (false, true) => self.call::<f32, u16>(py, &hidden, &cos_sin, &ints, num_threads),
            (true, false) => self.call::<u16, f32>(py, &hidden, &cos_sin, &ints, num_threads),
            (true, true) => self.call::<u16, u16>(py, &hidden, &cos_sin, &ints, num_threads),
        }
    }
}

/// A step's integer operands, copied out of their buffers; `ranks`: with
/// `lora_slots`, each layer's four projections' slot ranks in turn (None: no
/// adapters there).
struct Ints {
    slots: Vec<i64>,
    tables: Vec<i64>,
    lens: Vec<i64>,
    lora_slots: Option<Vec<i64>>,
    ranks: Vec<Option<Vec<usize>>>,
}

impl DecodePlan {
    fn call<E: Elem, C: Elem>(
        &self,
        py: Python<'_>,
        hidden: &Buf,
        cos_sin: &Buf,
        ints: &Ints,
        num_threads: usize,
    ) -> PyResult<()> {
        // SAFETY (the weight, adapter and cos_sin slices): `E` and `C` match the
        // buffers' variants (`run` dispatched on the dtypes `new` and `run`
        // checked); the weights and adapters are written by no one while the
        // model runs (the contract on `DecodePlan`), cos_sin is the caller's fresh
        // tensor.
        let mut layers: Vec<(LayerWeights<'_, E>, CacheMut<C>)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let cs = l.cache.shape();
            // SAFETY: the cache buffer is C-contiguous, aligned and non-null
            // (`Buf::get`, `data_ptr`), valid for reads and writes of `len`
            // elements while the plan holds its export; only this call touches
            // it meanwhile (the contract on `DecodePlan`), and `hidden`, the
            // one other buffer written, was checked not to overlap it.
            let cache =
                unsafe { CacheMut::from_raw(l.cache.ptr_mut(), l.cache.len(), cs[1], cs[2]) };
            let weights = unsafe {
                LayerWeights {
                    input_norm: l.input_norm.slice(),
                    qkv: l.qkv.proj(),
                    qkv_bias: l.qkv_bias.as_ref().map(|b| {
                        std::slice::from_raw_parts(data_ptr(b).cast_const(), b.item_count())
                    }),
                    o: l.o.proj(),
                    post_norm: l.post_norm.slice(),
                    gate_up: l.gate_up.proj(),
                    down: l.down.proj(),
                    adapters: adapters(l, ints.ranks.get(4 * i..4 * i + 4)),
                }
            };
            layers.push((weights, cache));
        }
        let step = unsafe {
            DecodeStep {
                cos_sin: cos_sin.slice(),
                slots: &ints.slots,
                block_tables: &ints.tables,
                seq_lens: &ints.lens,
                lora_slots: ints.lora_slots.as_deref(),
            }
        };
        // SAFETY: `hidden` is C-contiguous, aligned, non-null, writable (checked
        // in `run`) and valid for its elements while the export is held (this
        // call); it overlaps no cache (checked) and no weight (a fresh tensor of
        // the caller's, shared with no other thread).
        let out = unsafe { std::slice::from_raw_parts_mut(hidden.ptr_mut::<E>(), hidden.len()) };
        py.detach(|| decode_layers(&self.dims, &mut layers, &step, out, num_threads))
            .map_err(|e| Error::from(e).into())
    }
}

/// A layer's adapters for one step, with `ranks` (its four projections' slot
/// ranks, None: a step without `lora_slots`, whose adapters are not read).
///
/// # Safety
/// As `Buf::slice`: `E` matches the adapter buffers' variant, and nothing writes
/// them while the adapters live.
unsafe fn adapters<'a, E>(
    l: &'a Layer,
    ranks: Option<&'a [Option<Vec<usize>>]>,
) -> Adapters<'a, E> {
    let Some(ranks) = ranks else {
        return Adapters::none();
    };
    // SAFETY (each `lora`): the caller's (above).
    let get = |i: usize| match (&l.adapters[i], &ranks[i]) {
        (Some(ad), Some(r)) => Some(unsafe { ad.lora(r) }),
        _ => None,
    };
    Adapters {
        qkv: get(0),
        o: get(1),
        gate_up: get(2),
        down: get(3),
    }
}

fn layer(t: &Bound<'_, PyTuple>) -> PyResult<Layer> {
    if t.len() != 8 && t.len() != 9 {
        return Err(PyValueError::new_err(
            "a layer is (input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, kv_cache[, \
             adapters])",
        ));
    }
    let item = |i: usize, name: &str| Buf::get(&t.get_item(i)?, name);
    let proj = |i: usize, name: &str| ProjBuf::get(&t.get_item(i)?, name);
    let bias = t.get_item(2)?;
    Ok(Layer {
        input_norm: item(0, "input_norm")?,
        qkv: proj(1, "qkv")?,
        qkv_bias: if bias.is_none() {
            None
        } else {
            Some(typed_f32(&bias)?)
        },
        o: proj(3, "o")?,
        post_norm: item(4, "post_norm")?,
        gate_up: proj(5, "gate_up")?,
        down: proj(6, "down")?,
        cache: item(7, "kv_cache")?,
        adapters: if t.len() == 9 {
            adapter_bufs(&t.get_item(8)?)?
        } else {
            [None, None, None, None]
        },
    })
}

/// A layer's `adapters` item: None for each of qkv, o, gate_up and down, or
/// `(a, b, parts, ranks)`.
fn adapter_bufs(obj: &Bound<'_, PyAny>) -> PyResult<[Option<LoraBuf>; 4]> {
    let items: Vec<Bound<'_, PyAny>> = obj.extract()?;
    let [qkv, o, gate_up, down] = <[_; 4]>::try_from(items).map_err(|_| {
        PyValueError::new_err("adapters are four items: qkv's, o's, gate_up's and down's")
    })?;
    Ok([
        LoraBuf::get(&qkv, "qkv adapters")?,
        LoraBuf::get(&o, "o adapters")?,
        LoraBuf::get(&gate_up, "gate_up adapters")?,
        LoraBuf::get(&down, "down adapters")?,
    ])
}

fn typed_f32(obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<f32>> {
    let buf = PyBuffer::<f32>::get(obj)
        .map_err(|_| PyValueError::new_err("qkv_bias must be a float32 buffer"))?;
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("qkv_bias must be C-contiguous"));
    }
    Ok(buf)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DecodePlan>()
}
