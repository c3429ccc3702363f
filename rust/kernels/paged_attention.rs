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

use super::attention_block::{self as block, Rows};
use super::attention_job::{shape_err, Job, Scratch};
pub use super::attention_job::{BlockIndex, DecodeShape, KvCache};
use super::attention_runs as runs;
use super::bf16::{self, IsaCap, KvElem};
use super::exp;
use super::linear_simd::{self as simd, Simd};
use super::team;
use super::KernelError;

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
    if window == 0 {
        if let Some(pieces) = runs::pieces(&job, num_threads) {
            return runs::attend_pieces(&job, &pieces, isa, num_threads, out);
        }
    }
    let heads = job.heads_per_item;
    let chunk = heads * job.group * shape.head_dim;
    team::run_queue(
        out.chunks_exact_mut(chunk).enumerate(),
        num_threads,
        || Scratch::new(heads * job.group, shape.block_size),
        &|(item, out), scratch| isa.attend(&job, Work::Item(item), out, scratch),
    )
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
    pub(super) fn attend<T: BlockIndex, E: KvElem>(
        self,
        job: &Job<'_, T, E>,
        work: Work<'_, T>,
        out: &mut [f32],
        s: &mut Scratch,
    ) {
        match self {
            // SAFETY: the portable variant uses no instruction a CPU may lack.
            Isa::Portable => unsafe { attend::<simd::Portable, false, T, E>(job, work, out, s) },
            // SAFETY: each variant is only constructed where the CPU has its
            // features (`detect`, or tests that check the same).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { attend_avx2_fma(job, work, out, s) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { attend_avx512(job, work, out, s) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => unsafe { attend_avx512_bf16(job, work, out, s) },
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
    work: Work<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX2 and FMA, the features `simd::Avx2` uses.
    unsafe { attend::<simd::Avx2, false, T, E>(job, work, out, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn attend_avx512<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    work: Work<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX-512F, the feature `simd::Avx512` uses.
    unsafe { attend::<simd::Avx512, false, T, E>(job, work, out, s) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f,avx512bf16")]
fn attend_avx512_bf16<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    work: Work<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // SAFETY: compiled with AVX-512F and AVX512-BF16 (`simd::Avx512`, `vdpbf16ps`).
    unsafe { attend::<simd::Avx512, true, T, E>(job, work, out, s) }
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
    work: Work<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    // the common head sizes compiled for their size (registers, straight-line
    // dot products: `attention_block`), any other by the general loops
    let d = job.shape.head_dim;
    // SAFETY: the caller's ISA is `S`'s (and AVX512-BF16 with DPBF16).
    unsafe {
        match d.is_multiple_of(S::LANES).then_some(d / S::LANES) {
            Some(2) => attend_dv::<S, DPBF16, T, E, 2>(job, work, out, s),
            Some(4) => attend_dv::<S, DPBF16, T, E, 4>(job, work, out, s),
            Some(8) => attend_dv::<S, DPBF16, T, E, 8>(job, work, out, s),
            _ => attend_dv::<S, DPBF16, T, E, 0>(job, work, out, s),
        }
    }
}

/// `attend` with head_dim `DV * LANES` when `DV` > 0 (any when 0).
///
/// # Safety
/// As `attend`.
#[inline(always)]
unsafe fn attend_dv<S: Simd, const DPBF16: bool, T: BlockIndex, E: KvElem, const DV: usize>(
    job: &Job<'_, T, E>,
    work: Work<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let item = match work {
        // SAFETY: as this function's.
        Work::Rows(rows) => {
            return unsafe { attend_rows::<S, DPBF16, T, E, DV>(job, rows, out, s) }
        }
        Work::Item(item) => item,
    };
    let sh = &job.shape;
    let (d, group, heads) = (sh.head_dim, job.group, job.heads_per_item);
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
    let table = &job.block_tables[seq * sh.blocks_per_seq..][..len.div_ceil(sh.block_size)];
    let rows = Queries {
        q,
        q_bits,
        table,
        lens: &[len],
        first_head,
        heads,
    };
    // SAFETY: as this function's.
    unsafe { attend_rows::<S, DPBF16, T, E, DV>(job, &rows, out, s) }
}

/// A work item: the KV heads `item` stands for (`attend`), or a run's rows.
#[derive(Clone, Copy)]
pub(super) enum Work<'a, T> {
    Item(usize),
    Rows(&'a Queries<'a, T>),
}

/// What one work item attends with: the query heads of `heads` KV heads from
/// `first_head` on, of one row or of a run of rows that read the same keys
/// (`attention_runs`), with `table` the longest row's block table.
pub(super) struct Queries<'a, T> {
    /// `[heads][rows][group][head_dim]`.
    pub(super) q: &'a [f32],
    /// q in bf16 with DPBF16 (else empty), as `q`.
    pub(super) q_bits: &'a [u16],
    pub(super) table: &'a [T],
    /// Each row's keys (`seq_len`), one more a row (a run), the last the longest.
    pub(super) lens: &'a [usize],
    pub(super) first_head: usize,
    pub(super) heads: usize,
}

/// The rows of `rows` attending: `out` is `[heads][rows][group][head_dim]`.
/// Blocks are the outer loop; in a block, each KV head's scores for all its
/// query heads, the online-softmax update, then each KV head's values
/// (`attention_block`). The next block's rows are prefetched as this one's
/// are read. A row shorter than the longest counts only its own keys: the
/// scores past its end are zeros, which add nothing to its values, so each row
/// gets the bits it gets alone.
///
/// # Safety
/// As `attend`.
#[inline(always)]
pub(super) unsafe fn attend_rows<
    S: Simd,
    const DPBF16: bool,
    T: BlockIndex,
    E: KvElem,
    const DV: usize,
>(
    job: &Job<'_, T, E>,
    rows: &Queries<'_, T>,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let sh = &job.shape;
    let (d, bs, heads, first_head) = (sh.head_dim, sh.block_size, rows.heads, rows.first_head);
    let (q, q_bits, table, lens) = (rows.q, rows.q_bits, rows.table, rows.lens);
    // query heads per KV head: each row's group
    let group = job.group;
    let per_kv = lens.len() * group;
    let len = lens[lens.len() - 1];
    let ts = job.token_stride;
    out.fill(0.0);
    s.max[..heads * per_kv].fill(f32::NEG_INFINITY);
    s.sum[..heads * per_kv].fill(0.0);
    // In range: `Job::new` checked every block id this call reads.
    let base_of = |block: &T| block.to_i64() as usize * job.block_stride + first_head * d;
    // One KV head's rows of a block (`Rows::new` checks they are in the cache).
    fn rows_of<'a, E: KvElem>(
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
    let group_len = per_kv * d;
    let row = heads * d;
    for (j, block) in table.iter().enumerate().skip(first / bs) {
        let n = bs.min(len - j * bs);
        let t0 = if j == first / bs { first % bs } else { 0 };
        let base = base_of(block);
        let next = table
            .get(j + 1)
            .map(|next| (base_of(next), bs.min(len - (j + 1) * bs)));
        for h in 0..heads {
            // The next block's rows, all of the item's heads of a token at once, in
            // the first head's pass: in address order, which the hardware follows
            // (a head's row at a time, strided, measured ~12 % slower in bf16).
            let next_keys = next
                .filter(|_| h == 0)
                .map(|(nb, m)| rows_of(job.k, nb, ts, row, m));
            let qb = if DPBF16 {
                &q_bits[h * group_len..][..group_len]
            } else {
                q_bits
            };
            // SAFETY: the caller's ISA is `S`'s (and AVX512-BF16 with DPBF16).
            unsafe {
                block::scores::<S, DPBF16, E, DV>(
                    &q[h * group_len..][..group_len],
                    qb,
                    rows_of(job.k, base + h * d, ts, d, n),
                    next_keys,
                    t0,
                    job.scale,
                    &mut s.scores[h * per_kv * bs..],
                    bs,
                )
            };
        }
        for (qh, out) in out.chunks_exact_mut(d).enumerate() {
            // this query's row's keys in the block end at `end`
            let end = n.min(lens[qh % per_kv / group].saturating_sub(j * bs));
            let scores = &mut s.scores[qh * bs..qh * bs + n];
            if end <= t0 {
                scores[t0..].fill(0.0);
                continue;
            }
            let row = &mut scores[t0..end];
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
            scores[end..].fill(0.0);
        }
        for h in 0..heads {
            let next_values = next
                .filter(|_| h == 0)
                .map(|(nb, m)| rows_of(job.v, nb, ts, row, m));
            // SAFETY: as for the scores.
            unsafe {
                block::values::<S, E, DV>(
                    &s.scores[h * per_kv * bs..],
                    bs,
                    rows_of(job.v, base + h * d, ts, d, n),
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
