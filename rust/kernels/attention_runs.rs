//! Decode attention for runs of rows that read the same keys: speculative
//! decoding's verification tokens (and batch-invariant mode's prompt tokens)
//! reach `paged_attention` as rows of their own, each a decode one token longer
//! than the row before it, through the same block table. A work item here takes
//! a piece of such a run and one KV head: every K and V row of the block is
//! read once for all the piece's query heads (a virtual group of rows × group),
//! where row by row each query read it again. A shorter row counts only its own
//! keys (`attend_rows`), so every row gets the bits it gets alone.

use super::attention_job::{BlockIndex, Job, Scratch};
use super::bf16::KvElem;
use super::paged_attention::{Isa, Queries, Work};
use super::team;
use super::KernelError;

/// The most rows of a piece: its queries' scores and outputs stay in a few
/// kilobytes of scratch.
const PIECE_ROWS: usize = 8;

/// The pieces `(first row, rows)` of the call's rows, each row in one piece and
/// the rows of a piece a run; None when no run has two rows (the row-by-row
/// path then runs). Runs are cut into pieces of at most `PIECE_ROWS`, and into
/// more when the call would otherwise give a thread fewer than two items (a
/// lone request's verification: one run, a few KV heads).
pub(super) fn pieces<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    num_threads: usize,
) -> Option<Vec<(usize, usize)>> {
    let sh = &job.shape;
    let (n, bps, bs) = (sh.num_seqs, sh.blocks_per_seq, sh.block_size);
    let lens = &job.seq_lens;
    let table = |b: usize| &job.block_tables[b * bps..(b + 1) * bps];
    // row b + 1 continues row b's run: one key more, the same blocks for the keys
    // they share
    let continues = |b: usize| {
        let shared = lens[b].div_ceil(bs);
        lens[b + 1] == lens[b] + 1
            && table(b)[..shared]
                .iter()
                .zip(&table(b + 1)[..shared])
                .all(|(x, y)| x.to_i64() == y.to_i64())
    };
    let mut runs = Vec::new();
    let mut start = 0;
    for b in 0..n {
        if b + 1 == n || !continues(b) {
            runs.push((start, b + 1 - start));
            start = b + 1;
        }
    }
    if runs.iter().all(|&(_, len)| len < 2) {
        return None;
    }
    let want = (2 * num_threads).div_ceil(sh.num_kv_heads.max(1));
    let per_run = want.div_ceil(runs.len());
    let mut pieces = Vec::new();
    for (first, len) in runs {
        let count = len.div_ceil(PIECE_ROWS).max(per_run).min(len);
        // `count` pieces of as even a size as they go
        let mut at = first;
        for i in 0..count {
            let size = len * (i + 1) / count - len * i / count;
            pieces.push((at, size));
            at += size;
        }
    }
    Some(pieces)
}

/// `paged_attention`'s output for the rows of `pieces` (every row in one):
/// items (piece, KV head), each gathering its queries (`[row][group]` of the
/// head), attending (`attend_rows`) into its own output run, and the outputs
/// put back in `out`'s `[row][head]` order once every item is done.
pub(super) fn attend_pieces<T: BlockIndex, E: KvElem>(
    job: &Job<'_, T, E>,
    pieces: &[(usize, usize)],
    isa: Isa,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let sh = &job.shape;
    let (d, group, kv_heads) = (sh.head_dim, job.group, sh.num_kv_heads);
    // each item's output, `rows * group * d` elements, in item order (pieces in
    // row order, each piece's KV heads in turn): `out`'s length holds them all
    let mut tmp = vec![0.0f32; out.len()];
    let mut chunks = Vec::with_capacity(pieces.len() * kv_heads);
    let mut rest = tmp.as_mut_slice();
    for &(first, rows) in pieces {
        for h in 0..kv_heads {
            let (chunk, tail) = rest.split_at_mut(rows * group * d);
            chunks.push((first, rows, h, chunk));
            rest = tail;
        }
    }
    let max_rows = pieces.iter().map(|&(_, rows)| rows).max().unwrap_or(1);
    team::run_queue(
        chunks.into_iter(),
        num_threads,
        || PieceScratch::new(job, max_rows),
        &|(first, rows, h, chunk): (usize, usize, usize, &mut [f32]), ps: &mut PieceScratch| {
            ps.attend(job, isa, (first, rows, h), chunk)
        },
    )?;
    // back to [row][query head]
    let mut at = 0;
    for &(first, rows) in pieces {
        for h in 0..kv_heads {
            for i in 0..rows {
                let src = &tmp[at + i * group * d..][..group * d];
                out[((first + i) * sh.num_heads + h * group) * d..][..group * d]
                    .copy_from_slice(src);
            }
            at += rows * group * d;
        }
    }
    Ok(())
}

/// A thread's buffers for pieces: the gathered queries and `attend_rows`'s.
struct PieceScratch {
    q: Vec<f32>,
    q_bits: Vec<u16>,
    lens: Vec<usize>,
    scratch: Scratch,
}

impl PieceScratch {
    fn new<T, E: KvElem>(job: &Job<'_, T, E>, max_rows: usize) -> Self {
        let per = max_rows * job.group;
        PieceScratch {
            q: Vec::with_capacity(per * job.shape.head_dim),
            q_bits: Vec::with_capacity(per * job.shape.head_dim),
            lens: Vec::with_capacity(max_rows),
            scratch: Scratch::new(per, job.shape.block_size),
        }
    }

    /// Rows `first..first + rows` of KV head `h` into `out` (`[row][group][d]`).
    fn attend<T: BlockIndex, E: KvElem>(
        &mut self,
        job: &Job<'_, T, E>,
        isa: Isa,
        (first, rows, h): (usize, usize, usize),
        out: &mut [f32],
    ) {
        let sh = &job.shape;
        let (d, group) = (sh.head_dim, job.group);
        let heads = first..first + rows;
        self.q.clear();
        self.q_bits.clear();
        for b in heads.clone() {
            let at = (b * sh.num_heads + h * group) * d;
            self.q.extend_from_slice(&job.q[at..][..group * d]);
            if !job.q_bits.is_empty() {
                self.q_bits
                    .extend_from_slice(&job.q_bits[at..][..group * d]);
            }
        }
        self.lens.clear();
        self.lens.extend_from_slice(&job.seq_lens[heads]);
        let last = first + rows - 1;
        let len = job.seq_lens[last];
        let table = &job.block_tables[last * sh.blocks_per_seq..][..len.div_ceil(sh.block_size)];
        let queries = Queries {
            q: &self.q,
            q_bits: &self.q_bits,
            table,
            lens: &self.lens,
            first_head: h,
            heads: 1,
        };
        isa.attend(job, Work::Rows(&queries), out, &mut self.scratch);
    }
}
