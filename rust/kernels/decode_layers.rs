//! A whole decode step of a Llama-family model's decoder layers in one call: for
//! each layer RMSNorm, the fused q/k/v projection, rotary embedding, the K/V write
//! into the paged cache, decode attention, the output projection and residual,
//! RMSNorm, the fused gate/up projection, SiLU × up, the down projection and
//! residual — for a step of a few decode rows (one token per sequence).
//!
//! Why one call: at batch 1 the torch path runs ~20 small ops per layer between
//! the matrix-vector products, and each weight read streams megabytes through the
//! caches, evicting the interpreter's and the dispatcher's code and data: measured
//! on a Xeon VM, an `x + x` of 512 floats took 1.7 µs in a loop and 80 µs right
//! after a 16 MB read. In one call the work between the products is a few
//! microseconds of arithmetic on vectors that stay in L1.
//!
//! The torch path's numbers, rounding where it rounds: every intermediate the
//! torch path holds as a tensor of the model's dtype is rounded to that dtype here
//! too (bf16: round to nearest even, as torch), and elementwise ops compute in f32
//! as torch's CPU kernels do; only `exp` and `sqrt` are Rust's, which may differ
//! from torch's vectorised ones in the last bit (a bf16 value then differs by one
//! unit in the last place now and then). Products run on `linear` (one reduction
//! order for any row count) and attention on `paged_attention`, so a row gives
//! the same bits alone and in a batch.
//!
//! With LoRA, a projection may carry its adapter slots (`Adapters`) and the step
//! each row's slot (`DecodeStep::lora_slots`): their products are added to the
//! projection's output by the kernel `LoRALinear` runs on the torch path.

use super::decode_proj::{project, Proj, ProjLora};
use super::decode_rows::{AddNormRow, NarrowRow, NormRow, RopeRow, SiluRow, Simd};
use super::linear::{Elem, LinearIsa, LinearShape};
use super::paged_attention::{paged_decode_attention, DecodeShape, KvCache};
use super::team_region;
use super::KernelError;

/// The model's sizes and constants, the same for every layer.
#[derive(Clone, Copy, Debug)]
pub struct DecodeDims {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    /// RMSNorm's epsilon.
    pub eps: f32,
    /// Attention's score scale (head_dim^-0.5 for Llama).
    pub scale: f32,
}

impl DecodeDims {
    fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn qkv_size(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }
}

/// One layer's weights, projections in `nn.Linear`'s `[out, in]` layout (float or
/// GGUF blocks); gate and up stacked (`[2 * intermediate, hidden]`), q, k and v
/// stacked.
pub struct LayerWeights<'a, E> {
    pub input_norm: &'a [E],
    pub qkv: Proj<'a, E>,
    pub qkv_bias: Option<&'a [f32]>,
    pub o: Proj<'a, E>,
    pub post_norm: &'a [E],
    pub gate_up: Proj<'a, E>,
    pub down: Proj<'a, E>,
    pub adapters: Adapters<'a, E>,
}

/// A layer's adapter slots, per projection (None: that projection has none).
pub struct Adapters<'a, E> {
    pub qkv: Option<ProjLora<'a, E>>,
    pub o: Option<ProjLora<'a, E>>,
    pub gate_up: Option<ProjLora<'a, E>>,
    pub down: Option<ProjLora<'a, E>>,
}

impl<E> Adapters<'_, E> {
    /// No adapters on any projection.
    pub fn none() -> Self {
        Adapters {
            qkv: None,
            o: None,
            gate_up: None,
            down: None,
        }
    }
}

/// A layer's paged KV cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
/// written at the step's slots and then read by attention.
pub struct CacheMut<C> {
    ptr: *mut C,
    len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

// SAFETY: a `CacheMut` is the exclusive handle `from_raw`'s contract describes;
// moving it to another thread moves that exclusivity with it.
unsafe impl<C: Send> Send for CacheMut<C> {}

impl<C: Elem> CacheMut<C> {
    /// # Safety
    /// `ptr` is non-null, aligned for `C` and valid for reads and writes of `len`
    /// elements for as long as the value is used, and nothing else reads or
    /// writes that memory meanwhile.
    pub unsafe fn from_raw(ptr: *mut C, len: usize, num_blocks: usize, block_size: usize) -> Self {
        CacheMut {
            ptr,
            len,
            num_blocks,
            block_size,
        }
    }

    /// Stores `k` and `v` (one token's `[num_kv_heads * head_dim]`) at `slot`.
    fn write(&mut self, slot: usize, k: &[f32], v: &[f32]) {
        let row = k.len();
        let half = self.len / 2;
        assert!(
            v.len() == row && (slot + 1) * row <= half,
            "slot {slot} outside the cache"
        );
        for (which, src) in [(0, k), (half, v)] {
            let start = which + slot * row;
            // SAFETY: start + row <= len (asserted: (slot + 1) * row <= half and
            // which <= half), within the memory `from_raw` made ours alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), row) };
            for (d, s) in dst.iter_mut().zip(src) {
                *d = C::from_f32(*s);
            }
        }
    }

    fn reader(&self) -> KvCache<'_, C> {
        // SAFETY: `from_raw`'s contract; the returned view borrows `self`, so no
        // `write` runs while it lives.
        unsafe { KvCache::from_raw(self.ptr.cast_const(), self.len) }
    }
}

/// The step: `m` decode rows, one per sequence.
pub struct DecodeStep<'a, E> {
    /// `[m, 2, head_dim / 2]`: cos then sin of each row's position (the rows of
    /// the model's `cos_sin_cache`).
    pub cos_sin: &'a [E],
    /// `[m]`: the cache slot of each row's new token.
    pub slots: &'a [i64],
    /// `[m, blocks_per_seq]`.
    pub block_tables: &'a [i64],
    /// `[m]`: keys each row attends to, its new token included.
    pub seq_lens: &'a [i64],
    /// `[m]`: each row's adapter slot (-1: none), or None: no row has one (the
    /// layers' `adapters` are then not read).
    pub lora_slots: Option<&'a [i64]>,
}

/// Runs every layer over `hidden` (`[m, hidden]`, updated in place) for the rows
/// of `step`, on `num_threads` threads. Every size, slot and block id is checked
/// before anything is written.
pub fn decode_layers<E: Elem, C: Elem>(
    dims: &DecodeDims,
    layers: &mut [(LayerWeights<'_, E>, CacheMut<C>)],
    step: &DecodeStep<'_, E>,
    hidden: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    // The work between the kernels (norms, rotary, conversions, SiLU, residual
    // adds) is shared out by rows (`decode_rows`) and its serial rest compiled
    // for the CPU's vectors rather than the baseline's SSE2 (the same IEEE
    // operations in the same order: the same bits). ASYNCLLM_KERNEL_ISA caps it
    // as it caps the kernels (tests force each copy). One team serves the whole
    // step: its 150 kernel calls fork in the region (`team_region`) rather than
    // starting a team each.
    let simd = Simd::detect()?;
    team_region::region(num_threads, || match simd {
        // SAFETY: `detect` returns a variant only where the CPU has every
        // feature its copy is compiled for.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { layers_avx512(simd, dims, layers, step, hidden, num_threads) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { layers_avx2(simd, dims, layers, step, hidden, num_threads) },
        Simd::Portable => layers_body(simd, dims, layers, step, hidden, num_threads),
    })?
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn layers_avx512<E: Elem, C: Elem>(
    simd: Simd,
    dims: &DecodeDims,
    layers: &mut [(LayerWeights<'_, E>, CacheMut<C>)],
    step: &DecodeStep<'_, E>,
    hidden: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    layers_body(simd, dims, layers, step, hidden, num_threads)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn layers_avx2<E: Elem, C: Elem>(
    simd: Simd,
    dims: &DecodeDims,
    layers: &mut [(LayerWeights<'_, E>, CacheMut<C>)],
    step: &DecodeStep<'_, E>,
    hidden: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    layers_body(simd, dims, layers, step, hidden, num_threads)
}

/// `decode_layers`' work, inlined into each ISA's copy.
#[inline(always)]
fn layers_body<E: Elem, C: Elem>(
    simd: Simd,
    dims: &DecodeDims,
    layers: &mut [(LayerWeights<'_, E>, CacheMut<C>)],
    step: &DecodeStep<'_, E>,
    hidden: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    let m = check(dims, layers, step, hidden.len())?;
    let d = *dims;
    let (h, qs, kvs, inter) = (d.hidden, d.q_size(), d.kv_size(), d.intermediate);
    let mut s = Scratch::new(&d, m);
    let isa = LinearIsa::detect()?;
    let blocks_per_seq = step.block_tables.len() / m;
    let threads = num_threads;
    let norms: Vec<&[E]> = layers.iter().map(|(w, _)| w.input_norm).collect();
    if let Some(&norm) = norms.first() {
        let items = hidden.chunks(h).zip(s.normed.chunks_mut(h));
        simd.rows(items, threads, |(x, out)| NormRow {
            weight: norm,
            eps: d.eps,
            x,
            out,
        })?;
    }
    for (i, (w, cache)) in layers.iter_mut().enumerate() {
        let shape = LinearShape {
            m,
            k: h,
            n: d.qkv_size(),
        };
        project(&w.qkv, shape, &s.normed, w.qkv_bias, threads, &mut s.qkv)?;
        let ad = (step.lora_slots, isa, threads);
        adapt(&w.adapters.qkv, ad, shape, &s.normed, &mut s.qkv)?;
        let items = s
            .qkv
            .chunks_mut(d.qkv_size())
            .zip(step.cos_sin.chunks(d.head_dim))
            .zip(s.q32.chunks_mut(qs).zip(s.kv32.chunks_mut(2 * kvs)));
        simd.rows(items, threads, |((qkv, cos_sin), (q32, kv32))| RopeRow {
            head_dim: d.head_dim,
            qkv,
            cos_sin,
            q32,
            kv32,
        })?;
        for (r, kv32) in s.kv32.chunks_exact(2 * kvs).enumerate() {
            let (k32, v32) = kv32.split_at(kvs);
            cache.write(step.slots[r] as usize, k32, v32);
        }
        let shape = DecodeShape {
            num_seqs: m,
            num_heads: d.num_heads,
            num_kv_heads: d.num_kv_heads,
            head_dim: d.head_dim,
            num_blocks: cache.num_blocks,
            block_size: cache.block_size,
            blocks_per_seq,
        };
        let kv = cache.reader();
        paged_decode_attention(
            &shape,
            &s.q32,
            kv,
            step.block_tables,
            step.seq_lens,
            d.scale,
            threads,
            &mut s.att32,
        )?;
        let items = s.att32.chunks(qs).zip(s.att.chunks_mut(qs));
        simd.rows(items, threads, |(src, dst)| NarrowRow { src, dst })?;
        let shape = LinearShape { m, k: qs, n: h };
        project(&w.o, shape, &s.att, None, threads, &mut s.out)?;
        adapt(&w.adapters.o, ad, shape, &s.att, &mut s.out)?;
        let items = hidden
            .chunks_mut(h)
            .zip(s.out.chunks(h))
            .zip(s.normed.chunks_mut(h));
        let norm = Some((w.post_norm, d.eps));
        simd.rows(items, threads, |((x, y), out)| AddNormRow {
            norm,
            x,
            y,
            out,
        })?;
        let shape = LinearShape {
            m,
            k: h,
            n: 2 * inter,
        };
        project(&w.gate_up, shape, &s.normed, None, threads, &mut s.gate_up)?;
        adapt(&w.adapters.gate_up, ad, shape, &s.normed, &mut s.gate_up)?;
        let items = s.gate_up.chunks(2 * inter).zip(s.act.chunks_mut(inter));
        simd.rows(items, threads, |(gate_up, out)| SiluRow {
            isa,
            gate_up,
            out,
        })?;
        let shape = LinearShape { m, k: inter, n: h };
        project(&w.down, shape, &s.act, None, threads, &mut s.out)?;
        adapt(&w.adapters.down, ad, shape, &s.act, &mut s.out)?;
        // the residual add, and the next layer's input norm where there is one
        let norm = norms.get(i + 1).map(|&next| (next, d.eps));
        let items = hidden
            .chunks_mut(h)
            .zip(s.out.chunks(h))
            .zip(s.normed.chunks_mut(h));
        simd.rows(items, threads, |((x, y), out)| AddNormRow {
            norm,
            x,
            y,
            out,
        })?;
    }
    Ok(())
}

/// Adds a projection's adapters' products (`lora`) to its output `out`, when it has
/// adapters and the step has `lora_slots`; checked with the step (`check`).
fn adapt<E: Elem>(
    lora: &Option<ProjLora<'_, E>>,
    (lora_slots, isa, num_threads): (Option<&[i64]>, LinearIsa, usize),
    shape: LinearShape,
    x: &[E],
    out: &mut [E],
) -> Result<(), KernelError> {
    match (lora, lora_slots) {
        (Some(lora), Some(slots)) => lora.add(isa, shape, x, slots, num_threads, out),
        _ => Ok(()),
    }
}

/// The step's buffers, allocated once per call and reused by every layer.
struct Scratch<E> {
    normed: Vec<E>,
    qkv: Vec<E>,
    q32: Vec<f32>,
    /// each row's k then v, widened for the cache
    kv32: Vec<f32>,
    att32: Vec<f32>,
    att: Vec<E>,
    out: Vec<E>,
    gate_up: Vec<E>,
    act: Vec<E>,
}

impl<E: Elem> Scratch<E> {
    fn new(d: &DecodeDims, m: usize) -> Self {
        let zero = E::from_f32(0.0);
        Scratch {
            normed: vec![zero; m * d.hidden],
            qkv: vec![zero; m * d.qkv_size()],
            q32: vec![0.0; m * d.q_size()],
            kv32: vec![0.0; m * 2 * d.kv_size()],
            att32: vec![0.0; m * d.q_size()],
            att: vec![zero; m * d.q_size()],
            out: vec![zero; m * d.hidden],
            gate_up: vec![zero; m * 2 * d.intermediate],
            act: vec![zero; m * d.intermediate],
        }
    }
}

/// The step's row count, after checking every operand against `dims`: weight
/// sizes, the step's arrays, slots within each cache and, for every row, its
/// seq_len within its block table and the block ids it reads within the cache
/// (so no check inside the loop can fail after a cache was written).
fn check<E: Elem, C: Elem>(
    dims: &DecodeDims,
    layers: &[(LayerWeights<'_, E>, CacheMut<C>)],
    step: &DecodeStep<'_, E>,
    hidden_len: usize,
) -> Result<usize, KernelError> {
    let d = dims;
    let bad = |what: String| Err(KernelError::Shape(format!("decode_layers: {what}")));
    if d.hidden == 0 || d.head_dim == 0 || !d.head_dim.is_multiple_of(2) || d.num_kv_heads == 0 {
        return bad(format!("bad dims {d:?}"));
    }
    if !hidden_len.is_multiple_of(d.hidden) || hidden_len == 0 {
        return bad(format!(
            "hidden has {hidden_len} elements, not rows of {}",
            d.hidden
        ));
    }
    let m = hidden_len / d.hidden;
    let half = d.head_dim / 2;
    if step.cos_sin.len() != m * 2 * half {
        return bad(format!("cos_sin must be [{m}, 2, {half}]"));
    }
    if step.slots.len() != m || step.seq_lens.len() != m || step.block_tables.is_empty() {
        return bad(format!(
            "slots and seq_lens must have {m} rows, block_tables some"
        ));
    }
    if !step.block_tables.len().is_multiple_of(m) {
        return bad(format!("block_tables must have {m} rows"));
    }
    let per_seq = step.block_tables.len() / m;
    let (h, inter) = (d.hidden, d.intermediate);
    for (i, (w, cache)) in layers.iter().enumerate() {
        let norms = [
            ("input_norm", w.input_norm.len()),
            ("post_norm", w.post_norm.len()),
        ];
        for (name, got) in norms {
            if got != h {
                return bad(format!(
                    "layer {i}: {name} has {got} elements, expected {h}"
                ));
            }
        }
        let projections = [
            ("qkv", &w.qkv, d.qkv_size(), h),
            ("o", &w.o, h, d.q_size()),
            ("gate_up", &w.gate_up, 2 * inter, h),
            ("down", &w.down, h, inter),
        ];
        for (name, p, n, k) in projections {
            if let Some(why) = p.mismatch(n, k) {
                return bad(format!("layer {i}: {name} {why}"));
            }
        }
        let a = &w.adapters;
        let adapted = [
            ("qkv", &a.qkv, d.qkv_size(), h),
            ("o", &a.o, h, d.q_size()),
            ("gate_up", &a.gate_up, 2 * inter, h),
            ("down", &a.down, h, inter),
        ];
        for (name, lora, n, k) in adapted {
            if let (Some(lora), Some(slots)) = (lora, step.lora_slots) {
                if let Err(e) = lora.check(LinearShape { m, k, n }, slots) {
                    return bad(format!("layer {i}: {name}'s adapters: {e}"));
                }
            }
        }
        let cells_len = 2 * cache.num_blocks * cache.block_size * d.kv_size();
        if cache.len != cells_len || cache.block_size == 0 {
            return bad(format!(
                "layer {i}: kv cache has {} elements, expected {cells_len}",
                cache.len
            ));
        }
        if w.qkv_bias.is_some_and(|b| b.len() != d.qkv_size()) {
            return bad(format!(
                "layer {i}: qkv_bias must have {} elements",
                d.qkv_size()
            ));
        }
        let cells = (cache.num_blocks * cache.block_size) as i64;
        for r in 0..m {
            let (slot, len) = (step.slots[r], step.seq_lens[r]);
            let table = &step.block_tables[r * per_seq..(r + 1) * per_seq];
            let blocks = (len.max(0) as usize).div_ceil(cache.block_size);
            if !(0..cells).contains(&slot) || len < 1 || blocks > per_seq {
                return bad(format!(
                    "row {r}: slot {slot} or seq_len {len} out of range"
                ));
            }
            if let Some(id) = table[..blocks]
                .iter()
                .find(|&&b| !(0..cache.num_blocks as i64).contains(&b))
            {
                return bad(format!(
                    "row {r}: block id {id} not in 0..{}",
                    cache.num_blocks
                ));
            }
        }
    }
    Ok(m)
}
