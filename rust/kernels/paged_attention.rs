//! Decode attention read in place from a paged KV cache (f32 or bf16 K/V with
//! f32 accumulation, CPU; the bf16 parts are in `bf16`).
//!
//! Layout (the model runner's, per layer): the cache is
//! `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 = K, 1 = V);
//! sequence `b` owns the blocks listed in row `b` of `block_tables`
//! `[num_seqs, blocks_per_seq]`, token `t` of it sitting in block
//! `block_tables[b][t / block_size]` at offset `t % block_size`.
//!
//! A work item is one sequence and a range of its KV heads (all of them when the
//! batch alone gives every thread several items, else one): the query heads of a
//! KV head's group are processed together, so each K and V row is read from
//! memory once however large the group. Keys are visited one block at a time
//! with an online softmax (a running max and sum per query head, the output
//! accumulator rescaled when the max grows), so there is a single pass over K
//! and V and no score buffer longer than a block; the next block is prefetched
//! while one is processed. Work items run on a team of the requested size (the
//! Python side passes torch's thread count): torch's own OpenMP team when the
//! process has libgomp loaded, else a rayon pool (see `team`).
//!
//! Decode attention is memory-bound (a handful of flops per byte of K/V), so the
//! code is about reading memory well; the arithmetic only has to vectorise.

use std::marker::PhantomData;
#[cfg(target_os = "linux")]
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

use super::attention_block::{self as block, Rows};
use super::bf16::{self, IsaCap, KvElem};
use super::exp;
use super::linear_simd::{self as simd, Simd};
use super::team::{self, Team};
use super::KernelError;

/// An integer type of block tables and sequence lengths (torch passes int64;
/// int32 tables are accepted too).
pub trait BlockIndex: Copy + Send + Sync {
    fn to_i64(self) -> i64;
}

impl BlockIndex for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        i64::from(self)
    }
}

impl BlockIndex for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
}

/// The sizes of one decode-attention call. Buffers are C-contiguous:
/// q `[num_seqs, num_heads, head_dim]`, out `[num_seqs, num_heads * head_dim]`,
/// kv_cache `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
/// block_tables `[num_seqs, blocks_per_seq]`, seq_lens `[num_seqs]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub blocks_per_seq: usize,
}

impl DecodeShape {
    /// Element counts of (q and out, kv_cache, block_tables), checked for
    /// overflow and for sizes the kernel cannot split into groups.
    fn lengths(&self) -> Result<(usize, usize, usize), KernelError> {
        let s = self;
        if s.num_heads == 0 || s.num_kv_heads == 0 || !s.num_heads.is_multiple_of(s.num_kv_heads) {
            return Err(shape_err(format!(
                "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                s.num_heads, s.num_kv_heads
            )));
        }
        if s.head_dim == 0 || s.block_size == 0 {
            return Err(shape_err("head_dim and block_size must be positive".into()));
        }
        let product = |dims: &[usize]| {
            dims.iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| shape_err(format!("buffer of shape {dims:?} overflows usize")))
        };
        Ok((
            product(&[s.num_seqs, s.num_heads, s.head_dim])?,
            product(&[2, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim])?,
            product(&[s.num_seqs, s.blocks_per_seq])?,
        ))
    }
}

fn shape_err(msg: String) -> KernelError {
    KernelError::Shape(msg)
}

/// The paged KV cache a call reads, as a pointer and a length rather than a
/// slice: the memory usually belongs to another runtime (a torch tensor), and
/// a `&[f32]` over all of it for the whole call would claim more than the
/// kernel needs. Every read goes through `row`, a bounds-checked view of one
/// K or V row that lives only while that row is processed.
#[derive(Clone, Copy)]
pub struct KvCache<'a, E = f32> {
    ptr: *const E,
    len: usize,
    _memory: PhantomData<&'a [E]>,
}

// SAFETY: a `KvCache` only ever reads its memory, and the contract of its
// constructors (a borrowed slice, or `from_raw`'s "valid for reads and not
// written for 'a") holds on every thread alike: sharing it is sharing a
// `&'a [E]`, which is Send and Sync (every `KvElem` is).
unsafe impl<E: KvElem> Send for KvCache<'_, E> {}
// SAFETY: as for Send: shared read-only access to memory nobody writes.
unsafe impl<E: KvElem> Sync for KvCache<'_, E> {}

impl<'a, E: KvElem> KvCache<'a, E> {
    /// A cache held in Rust memory (tests, benchmarks).
    pub fn new(cache: &'a [E]) -> Self {
        KvCache {
            ptr: cache.as_ptr(),
            len: cache.len(),
            _memory: PhantomData,
        }
    }

    /// A cache of `len` elements at `ptr`, e.g. a Python buffer.
    ///
    /// # Safety
    /// `ptr` is non-null, aligned for `E` and valid for reads of `len` elements
    /// for all of `'a`, and nothing writes that memory during `'a`.
    pub unsafe fn from_raw(ptr: *const E, len: usize) -> Self {
        KvCache {
            ptr,
            len,
            _memory: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The K half and the V half.
    fn halves(self) -> (KvCache<'a, E>, KvCache<'a, E>) {
        let half = self.len / 2;
        let v = KvCache {
            // `wrapping_add` because an empty cache may have a dangling pointer;
            // `row` never reads past `len`, so the pointer is only read in bounds.
            ptr: self.ptr.wrapping_add(half),
            len: self.len - half,
            _memory: PhantomData,
        };
        (KvCache { len: half, ..self }, v)
    }

    /// `len` elements from `start`. Panics when out of bounds, so memory safety
    /// never rests on the callers' index arithmetic.
    #[inline(always)]
    fn row(&self, start: usize, len: usize) -> &'a [E] {
        assert!(
            start <= self.len && len <= self.len - start,
            "KV row {start}+{len} outside a cache of {} elements",
            self.len
        );
        // SAFETY: the range was just checked to lie within the `len` elements
        // the constructor's contract makes valid for reads and unwritten for
        // 'a (`new`: a borrowed slice; `from_raw`: its caller's promise).
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), len) }
    }
}

/// Writes `out[b, h*D..(h+1)*D] = softmax(scale * q[b,h] · K_b^T) V_b` for every
/// sequence `b` and query head `h`, where `K_b`, `V_b` are the first
/// `seq_lens[b]` tokens of the sequence read through its block table and query
/// head `h` reads KV head `h / (num_heads / num_kv_heads)`.
///
/// Every argument is checked before anything is written: buffer lengths against
/// `shape`, `1 <= seq_lens[b] <= blocks_per_seq * block_size`, and every block
/// id the call reads in `0..num_blocks` (entries past a sequence's last block
/// are never read and may hold anything). `num_threads` (at least 1) is the
/// number of threads that share the work (see `team` for which threads).
/// K/V are f32 or bf16 (`u16` bits, see `bf16`); q and out are f32.
#[allow(clippy::too_many_arguments)] // the kernel's operands, all distinct
pub fn paged_decode_attention<T: BlockIndex, L: BlockIndex, E: KvElem>(
    shape: &DecodeShape,
    q: &[f32],
    kv_cache: KvCache<'_, E>,
    block_tables: &[T],
    seq_lens: &[L],
    scale: f32,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    paged_decode_attention_windowed(
        shape,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        0,
        num_threads,
        out,
    )
}

/// `paged_decode_attention` over each sequence's last `window` tokens only
/// (positions `seq_lens[b] - window .. seq_lens[b]`, or all when `window` is 0
/// or at least `seq_lens[b]`): sliding-window layers. The blocks before the
/// window are not read.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_windowed<T: BlockIndex, L: BlockIndex, E: KvElem>(
    shape: &DecodeShape,
    q: &[f32],
    kv_cache: KvCache<'_, E>,
    block_tables: &[T],
    seq_lens: &[L],
    scale: f32,
    window: usize,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    run(
        shape,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        num_threads,
        out,
        Isa::detect::<E>()?,
        window,
    )
}

/// `paged_decode_attention` with the instruction set chosen by the caller
/// (tests run every variant the machine supports).
#[allow(clippy::too_many_arguments)]
pub(super) fn run<T: BlockIndex, L: BlockIndex, E: KvElem>(
    shape: &DecodeShape,
    q: &[f32],
    kv_cache: KvCache<'_, E>,
    block_tables: &[T],
    seq_lens: &[L],
    scale: f32,
    num_threads: usize,
    out: &mut [f32],
    isa: Isa,
    window: usize,
) -> Result<(), KernelError> {
    if num_threads == 0 {
        return Err(shape_err("num_threads must be at least 1".into()));
    }
    let mut job = Job::new(
        shape,
        q,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        out.len(),
        num_threads,
    )?;
    job.window = window;
    let heads = job.heads_per_item;
    let chunk = heads * job.group * shape.head_dim;
    let num_items = shape.num_seqs * shape.num_kv_heads / heads;
    if num_threads == 1 || num_items <= 1 {
        let mut scratch = Scratch::new(heads * job.group, shape.block_size);
        for (item, out) in out.chunks_exact_mut(chunk).enumerate() {
            isa.attend(&job, item, out, &mut scratch);
        }
        return Ok(());
    }
    let new_scratch = || Scratch::new(heads * job.group, shape.block_size);
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => {
            // Items are handed out one at a time as threads ask, like rayon's
            // work stealing: a thread the OS descheduled holds up no one.
            let items = Mutex::new(out.chunks_exact_mut(chunk).enumerate());
            team::run_on_omp(parallel, num_threads, &|| {
                let mut scratch = new_scratch();
                loop {
                    // Only `next` runs under the lock and it cannot panic; were the
                    // lock poisoned anyway, the iterator in it would still be valid.
                    let next = items.lock().unwrap_or_else(PoisonError::into_inner).next();
                    let Some((item, out)) = next else { break };
                    isa.attend(&job, item, out, &mut scratch);
                }
            })?;
        }
        Team::Rayon => team::pool(num_threads)?.install(|| {
            out.par_chunks_exact_mut(chunk)
                .enumerate()
                .for_each_init(new_scratch, |scratch, (item, out)| {
                    isa.attend(&job, item, out, scratch)
                })
        }),
    }
    Ok(())
}

/// KV heads per work item: all of a sequence's (its K/V rows are then read in
/// address order, which the hardware prefetchers follow) while that still leaves
/// several items per thread to balance; else one.
fn heads_per_item(shape: &DecodeShape, num_threads: usize) -> usize {
    if shape.num_seqs >= 8 * num_threads {
        shape.num_kv_heads
    } else {
        1
    }
}

/// The validated operands of one call, shared by every work item.
struct Job<'a, T, E> {
    shape: DecodeShape,
    group: usize,
    q: &'a [f32],
    /// q rounded to bf16, for `vdpbf16ps` (empty unless the cache is bf16).
    q_bits: Vec<u16>,
    k: KvCache<'a, E>,
    v: KvCache<'a, E>,
    block_tables: &'a [T],
    seq_lens: Vec<usize>,
    scale: f32,
    /// Elements between consecutive tokens of a block (num_kv_heads * head_dim).
    token_stride: usize,
    /// Elements between consecutive blocks (block_size * token_stride).
    block_stride: usize,
    /// KV heads per work item (a divisor of num_kv_heads).
    heads_per_item: usize,
    /// Tokens attended to at the end of each sequence (0: all).
    window: usize,
}

impl<'a, T: BlockIndex, E: KvElem> Job<'a, T, E> {
    #[allow(clippy::too_many_arguments)] // the kernel's operands, all distinct
    fn new<L: BlockIndex>(
        shape: &DecodeShape,
        q: &'a [f32],
        kv_cache: KvCache<'a, E>,
        block_tables: &'a [T],
        seq_lens: &[L],
        scale: f32,
        out_len: usize,
        num_threads: usize,
    ) -> Result<Self, KernelError> {
        let (q_len, cache_len, table_len) = shape.lengths()?;
        for (name, got, want) in [
            ("q", q.len(), q_len),
            ("out", out_len, q_len),
            ("kv_cache", kv_cache.len(), cache_len),
            ("block_tables", block_tables.len(), table_len),
            ("seq_lens", seq_lens.len(), shape.num_seqs),
        ] {
            if got != want {
                return Err(shape_err(format!(
                    "{name} has {got} elements, expected {want} for {shape:?}"
                )));
            }
        }
        let bs = shape.block_size;
        let capacity = shape.blocks_per_seq.saturating_mul(bs);
        let mut lens = Vec::with_capacity(shape.num_seqs);
        for (seq, len) in seq_lens.iter().enumerate() {
            let len = len.to_i64();
            let err = || KernelError::SeqLen {
                seq,
                len,
                max: capacity,
                blocks: shape.blocks_per_seq,
                block_size: bs,
            };
            let len = usize::try_from(len).map_err(|_| err())?;
            if len == 0 || len > capacity {
                return Err(err());
            }
            let row = &block_tables[seq * shape.blocks_per_seq..][..len.div_ceil(bs)];
            for (pos, id) in row.iter().enumerate() {
                let id = id.to_i64();
                if !(0..shape.num_blocks as i64).contains(&id) {
                    let num_blocks = shape.num_blocks;
                    return Err(KernelError::BlockId {
                        seq,
                        pos,
                        id,
                        num_blocks,
                    });
                }
            }
            lens.push(len);
        }
        let (k, v) = kv_cache.halves();
        let token_stride = shape.num_kv_heads * shape.head_dim;
        Ok(Job {
            shape: *shape,
            group: shape.num_heads / shape.num_kv_heads,
            q,
            q_bits: if E::IS_BF16 {
                q.iter().map(|&x| bf16::f32_to_bf16(x)).collect()
            } else {
                Vec::new()
            },
            k,
            v,
            block_tables,
            seq_lens: lens,
            scale,
            token_stride,
            block_stride: bs * token_stride,
            heads_per_item: heads_per_item(shape, num_threads),
            window: 0,
        })
    }
}

/// Per-thread buffers of a work item: a block's scores for each query head, and the
/// running max and sum of each of the item's query heads.
struct Scratch {
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Scratch {
    fn new(query_heads: usize, block_size: usize) -> Self {
        Scratch {
            scores: vec![0.0; query_heads * block_size],
            max: vec![0.0; query_heads],
            sum: vec![0.0; query_heads],
        }
    }
}

/// The instruction sets the kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    /// AVX-512F: 16 lanes (a bf16 cache widened as it is read).
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX-512F, and `vdpbf16ps` for the q·k dot products of a bf16 cache.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
}

impl Isa {
    /// The best variant this CPU runs for a cache of `E`, within the cap of
    /// `ASYNCLLM_KERNEL_ISA` (the detection is cached by std).
    pub(super) fn detect<E: KvElem>() -> Result<Isa, KernelError> {
        let cap = bf16::isa_cap()?;
        #[cfg(target_arch = "x86_64")]
        if cap != IsaCap::Portable
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
        {
            if cap != IsaCap::Avx2 && is_x86_feature_detected!("avx512f") {
                if E::IS_BF16 && cap == IsaCap::Auto && is_x86_feature_detected!("avx512bf16") {
                    return Ok(Isa::Avx512Bf16);
                }
                return Ok(Isa::Avx512);
            }
            return Ok(Isa::Avx2Fma);
        }
        let _ = cap;
        Ok(Isa::Portable)
    }

    /// The variant's name, as `_core._kernel_isa` reports it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    #[inline]
    fn attend<T: BlockIndex, E: KvElem>(
        self,
        job: &Job<'_, T, E>,
        item: usize,
        out: &mut [f32],
        s: &mut Scratch,
    ) {
        match self {
            // SAFETY: the portable variant uses no instruction a CPU may lack.
            Isa::Portable => unsafe { attend::<simd::Portable, false, T, E>(job, item, out, s) },
            // SAFETY: each variant is only constructed where the CPU has its
            // features (`detect`, or tests that check the same).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { attend_avx2_fma(job, item, out, s) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { attend_avx512(job, item, out, s) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => unsafe { attend_avx512_bf16(job, item, out, s) },
        }
    }
}

/// The name of the variant a call with a cache of `E` runs here (for tests
/// and benchmarks that must know which path they measured).
pub fn kernel_isa<E: KvElem>() -> Result<&'static str, KernelError> {
    Ok(Isa::detect::<E>()?.name())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2_fma<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    item: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX2 and FMA, the features `simd::Avx2` uses.
    unsafe { attend::<simd::Avx2, false, T, E>(job, item, out, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn attend_avx512<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    item: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX-512F, the feature `simd::Avx512` uses.
    unsafe { attend::<simd::Avx512, false, T, E>(job, item, out, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bf16")]
fn attend_avx512_bf16<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    item: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX-512F and AVX512-BF16 (`simd::Avx512`, `vdpbf16ps`).
    unsafe { attend::<simd::Avx512, true, T, E>(job, item, out, s) }
}

/// One work item: the KV heads `heads_per_item * i .. heads_per_item * (i + 1)`
/// of one sequence and their query heads; `out` is those query heads' outputs.
/// Blocks are the outer loop; in a block, each KV head's scores for all its
/// query heads, the online-softmax update, then each KV head's values
/// (`attention_block`). The next block's rows are prefetched as this one's
/// are read.
///
/// # Safety
/// Call only from code compiled for `S`'s instruction set (and AVX512-BF16 when
/// `DPBF16`), on a CPU that has it.
#[inline(always)]
unsafe fn attend<S: Simd, const DPBF16: bool, T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    item: usize,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let sh = &job.shape;
    let (d, group, bs, heads) = (sh.head_dim, job.group, sh.block_size, job.heads_per_item);
    let items_per_seq = sh.num_kv_heads / heads;
    let (seq, first_head) = (item / items_per_seq, item % items_per_seq * heads);
    let len = job.seq_lens[seq];
    let q_start = (seq * sh.num_heads + first_head * group) * d;
    let q = &job.q[q_start..][..heads * group * d];
    let q_bits: &[u16] = if DPBF16 {
        &job.q_bits[q_start..][..heads * group * d]
    } else {
        &[]
    };
    let table = &job.block_tables[seq * sh.blocks_per_seq..][..len.div_ceil(bs)];
    let ts = job.token_stride;
    out.fill(0.0);
    s.max.fill(f32::NEG_INFINITY);
    s.sum.fill(0.0);
    // In range: `Job::new` checked every block id this call reads.
    let base_of = |block: &T| block.to_i64() as usize * job.block_stride + first_head * d;
    // One KV head's rows of a block (`Rows::new` checks they are in the cache).
    fn rows<'a, E: KvElem>(
        cache: KvCache<'a, E>,
        start: usize,
        ts: usize,
        d: usize,
        n: usize,
    ) -> Rows<'a, E> {
        Rows::new(cache.row(start, (n - 1) * ts + d), ts, d, n)
    }
    // Sliding window: the first position read; blocks before it are skipped.
    let first = if job.window > 0 {
        len.saturating_sub(job.window)
    } else {
        0
    };
    let group_len = group * d;
    for (j, block) in table.iter().enumerate().skip(first / bs) {
        let n = bs.min(len - j * bs);
        let t0 = if j == first / bs { first % bs } else { 0 };
        let base = base_of(block);
        let next = table
            .get(j + 1)
            .map(|next| (base_of(next), bs.min(len - (j + 1) * bs)));
        for h in 0..heads {
            let next_keys = next.map(|(nb, m)| rows(job.k, nb + h * d, ts, d, m));
            let qb = if DPBF16 {
                &q_bits[h * group_len..][..group_len]
            } else {
                q_bits
            };
            // SAFETY: the caller's ISA is `S`'s (and AVX512-BF16 with DPBF16).
            unsafe {
                block::scores::<S, DPBF16, E>(
                    &q[h * group_len..][..group_len],
                    qb,
                    rows(job.k, base + h * d, ts, d, n),
                    next_keys,
                    t0,
                    job.scale,
                    &mut s.scores[h * group * bs..],
                    bs,
                )
            };
        }
        for (qh, out) in out.chunks_exact_mut(d).enumerate() {
            let row = &mut s.scores[qh * bs + t0..qh * bs + n];
            let block_max = exp::max_of(row);
            if block_max > s.max[qh] {
                if s.max[qh] != f32::NEG_INFINITY {
                    let c = exp::exp_nonpositive::<S>(s.max[qh] - block_max);
                    s.sum[qh] *= c;
                    scale_in_place(out, c);
                }
                s.max[qh] = block_max;
            }
            s.sum[qh] += exp::exp_shifted_sum::<S>(row, s.max[qh]);
        }
        for h in 0..heads {
            let next_values = next.map(|(nb, m)| rows(job.v, nb + h * d, ts, d, m));
            // SAFETY: as for the scores.
            unsafe {
                block::values::<S, E>(
                    &s.scores[h * group * bs..],
                    bs,
                    rows(job.v, base + h * d, ts, d, n),
                    next_values,
                    t0,
                    &mut out[h * group_len..][..group_len],
                )
            };
        }
    }
    for (out, sum) in out.chunks_exact_mut(d).zip(&s.sum) {
        scale_in_place(out, 1.0 / sum);
    }
}

#[inline(always)]
fn scale_in_place(out: &mut [f32], c: f32) {
    for o in out {
        *o *= c;
    }
}

#[cfg(test)]
pub(super) fn exp_for_tests(x: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    let fused = exp::exp_nonpositive::<simd::Avx2>(x);
    #[cfg(not(target_arch = "x86_64"))]
    let fused = exp::exp_nonpositive::<simd::Portable>(x);
    (exp::exp_nonpositive::<simd::Portable>(x), fused)
}
