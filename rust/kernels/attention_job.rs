//! The operands of one decode-attention call (`paged_attention`): its sizes, the
//! paged cache as a bounds-checked view, and the validated `Job` every work item
//! reads — every check made before anything is written.

use std::marker::PhantomData;

use super::bf16::{self, KvElem};
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

pub(super) fn shape_err(msg: String) -> KernelError {
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
    pub(super) fn halves(self) -> (KvCache<'a, E>, KvCache<'a, E>) {
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
    pub(super) fn row(&self, start: usize, len: usize) -> &'a [E] {
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

/// KV heads per work item: all of a sequence's (its K/V rows are then read in
/// address order, which the hardware prefetchers follow) while that still leaves
/// several items per thread to balance; else one.
pub(super) fn heads_per_item(shape: &DecodeShape, num_threads: usize) -> usize {
    if shape.num_seqs >= 8 * num_threads {
        shape.num_kv_heads
    } else {
        1
    }
}

/// The validated operands of one call, shared by every work item.
pub(super) struct Job<'a, T, E> {
    pub(super) shape: DecodeShape,
    pub(super) group: usize,
    pub(super) q: &'a [f32],
    /// q rounded to bf16, for `vdpbf16ps` (empty unless the cache is bf16).
    pub(super) q_bits: Vec<u16>,
    pub(super) k: KvCache<'a, E>,
    pub(super) v: KvCache<'a, E>,
    pub(super) block_tables: &'a [T],
    pub(super) seq_lens: Vec<usize>,
    pub(super) scale: f32,
    /// Elements between consecutive tokens of a block (num_kv_heads * head_dim).
    pub(super) token_stride: usize,
    /// Elements between consecutive blocks (block_size * token_stride).
    pub(super) block_stride: usize,
    /// KV heads per work item (a divisor of num_kv_heads).
    pub(super) heads_per_item: usize,
    /// Tokens attended to at the end of each sequence (0: all).
    pub(super) window: usize,
}

impl<'a, T: BlockIndex, E: KvElem> Job<'a, T, E> {
    #[allow(clippy::too_many_arguments)] // the kernel's operands, all distinct
    pub(super) fn new<L: BlockIndex>(
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
pub(super) struct Scratch {
    pub(super) scores: Vec<f32>,
    pub(super) max: Vec<f32>,
    pub(super) sum: Vec<f32>,
}

impl Scratch {
    pub(super) fn new(query_heads: usize, block_size: usize) -> Self {
        Scratch {
            scores: vec![0.0; query_heads * block_size],
            max: vec![0.0; query_heads],
            sum: vec![0.0; query_heads],
        }
    }
}
