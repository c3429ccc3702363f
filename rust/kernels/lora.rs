//! LoRA's shrink and expand for every adapted token of a step, added to the base
//! layer's output: `y[t] += (x[t] · A[s]) · B[s]` for the slot `s` of token `t`
//! (`-1`: no adapter, row untouched).
//!
//! Layout (`asyncllm.lora.layers`): `a` is `[slots, k, width]` and `b` is
//! `[slots, width, n]`, row-major, so both products stream rows of the matrix
//! against a few tokens at once (`lora_tile`: register tiles over the vector
//! lanes). A layer that fuses projections (q/k/v, gate/up) has `parts`, their
//! output sizes: `width` is `parts.len()` rank blocks of equal size, and block
//! `p`'s rows of `b` are read only in part `p`'s columns (the rest of `b` is zero
//! by construction, block-diagonal, and is never read: the expand does a third of
//! the walk for q/k/v, half for gate/up).
//!
//! Work items are up to `ITEM_ROWS` tokens of one slot (tokens are grouped by
//! slot first), so each adapter row read from memory serves several tokens; the
//! items run on the kernel team. A token's result does not depend on the tokens
//! beside it: each item's arithmetic is per token, in a fixed order. Zero columns
//! of `h` (a rank below the slot's width pads A and B with zeros) skip their row
//! of B.

use super::elementwise::on_rows;
use super::linear::{Elem, LinearIsa};
use super::linear_simd::{on_isa, Simd, VectorBody};
use super::lora_tile::{expand, shrink};
use super::KernelError;

/// Tokens per work item: a slot's A and B rows are read once per item (and the
/// tiles keep up to 8 tokens' sums in registers, `lora_tile`).
const ITEM_ROWS: usize = 8;

/// The operands' sizes: tokens, input features `k`, slot width (fused
/// projections x max rank) and output features `n`, and the slots held.
#[derive(Clone, Copy, Debug)]
pub struct LoraShape {
    pub tokens: usize,
    pub k: usize,
    pub width: usize,
    pub n: usize,
    pub slots: usize,
}

/// How a layer's slots are laid out: `parts`, the output sizes of the fused
/// projections (`[n]`: one), and `ranks`, the rank each slot's adapter uses in
/// this layer (at most the rank block, `width / parts.len()`; 0: the slot adds
/// nothing here). Columns of a rank block beyond a slot's rank are zero padding
/// and are never read.
#[derive(Clone, Copy, Debug)]
pub struct LoraLayout<'a> {
    pub parts: &'a [usize],
    pub ranks: &'a [usize],
}

/// `y[t] += (x[t] · a[s]) · b[s]` for each token `t` whose slot `s = token_slot[t]`
/// is not -1, on `num_threads` threads of the kernel team, `b` read block-diagonal
/// by `layout.parts`, each slot's A and B only up to its rank. Checks every size
/// and slot first; on error `y` is untouched.
#[allow(clippy::too_many_arguments)]
pub fn lora_add<E: Elem>(
    shape: LoraShape,
    layout: LoraLayout<'_>,
    y: &mut [E],
    x: &[E],
    a: &[E],
    b: &[E],
    token_slot: &[i64],
    num_threads: usize,
) -> Result<(), KernelError> {
    check(
        shape,
        layout,
        [y.len(), x.len(), a.len(), b.len()],
        token_slot,
    )?;
    let isa = LinearIsa::detect()?;
    add_checked(isa, shape, layout, y, x, a, b, token_slot, num_threads)
}

/// `lora_add` in `isa` (a `LinearIsa::detect` or `available` result) for operands
/// that passed `check`.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_checked<E: Elem>(
    isa: LinearIsa,
    shape: LoraShape,
    layout: LoraLayout<'_>,
    y: &mut [E],
    x: &[E],
    a: &[E],
    b: &[E],
    token_slot: &[i64],
    num_threads: usize,
) -> Result<(), KernelError> {
    let parts = layout.parts;
    let LoraShape { k, width, n, .. } = shape;
    // Column bounds of each part, and of the rank block of each row of `b`.
    let mut bounds = vec![0];
    bounds.extend(parts.iter().scan(0, |end, &size| {
        *end += size;
        Some(*end)
    }));
    let rank = width / parts.len();
    // Tokens grouped by slot (stable: in order within a slot).
    let mut order: Vec<usize> = (0..shape.tokens).filter(|&t| token_slot[t] >= 0).collect();
    order.sort_by_key(|&t| token_slot[t]);
    let mut rows: Vec<Option<&mut [E]>> = y.chunks_exact_mut(n).map(Some).collect();
    let mut items: Vec<Item<'_, E>> = Vec::new();
    for group in order.chunk_by(|&p, &q| token_slot[p] == token_slot[q]) {
        let s = token_slot[group[0]] as usize;
        if layout.ranks[s] == 0 {
            continue; // the slot's adapter leaves this layer alone
        }
        for chunk in group.chunks(ITEM_ROWS) {
            let mut y_rows = Vec::with_capacity(chunk.len());
            let mut x_rows = Vec::with_capacity(chunk.len());
            for &t in chunk {
                // Each token is in exactly one chunk, so its row is taken once.
                y_rows.extend(rows[t].take());
                x_rows.push(&x[t * k..(t + 1) * k]);
            }
            items.push(Item {
                isa,
                a: &a[s * k * width..(s + 1) * k * width],
                b: &b[s * width * n..(s + 1) * width * n],
                x: x_rows,
                y: y_rows,
                width,
                rank,
                used: layout.ranks[s],
                bounds: &bounds,
            });
        }
    }
    on_rows(items.into_iter(), num_threads, &|item: Item<'_, E>| {
        on_isa(item.isa, item)
    })
}

/// Checks `lora_add`'s operands, given the lengths of y, x, a and b: every size,
/// part, rank and slot.
pub(super) fn check(
    s: LoraShape,
    layout: LoraLayout<'_>,
    [y, x, a, b]: [usize; 4],
    token_slot: &[i64],
) -> Result<(), KernelError> {
    let sizes_ok = y == s.tokens * s.n
        && x == s.tokens * s.k
        && a == s.slots * s.k * s.width
        && b == s.slots * s.width * s.n
        && token_slot.len() == s.tokens
        && s.n > 0
        && s.k > 0
        && s.width > 0;
    if !sizes_ok {
        return Err(KernelError::Shape(format!(
            "lora_add needs y [t, n], x [t, k], a [slots, k, width], b [slots, width, n] and \
             one slot per token for {s:?}; got y {y}, x {x}, a {a}, b {b}, token_slot {} \
             elements",
            token_slot.len()
        )));
    }
    if let Some((t, &slot)) = token_slot
        .iter()
        .enumerate()
        .find(|&(_, &v)| v < -1 || v >= s.slots as i64)
    {
        return Err(KernelError::Shape(format!(
            "lora_add: token {t} has slot {slot}, not in -1..{}",
            s.slots
        )));
    }
    check_layout(s, layout)
}

fn check_layout(s: LoraShape, layout: LoraLayout<'_>) -> Result<(), KernelError> {
    let parts = layout.parts;
    if parts.is_empty()
        || !s.width.is_multiple_of(parts.len())
        || parts.iter().sum::<usize>() != s.n
    {
        return Err(KernelError::Shape(format!(
            "lora_add: parts {parts:?} must split n={} outputs, and width={} into equal \
             rank blocks",
            s.n, s.width
        )));
    }
    let rank = s.width / parts.len();
    if layout.ranks.len() != s.slots || layout.ranks.iter().any(|&r| r > rank) {
        return Err(KernelError::Shape(format!(
            "lora_add: ranks {:?} must give each of {} slots a rank of at most {rank}",
            layout.ranks, s.slots
        )));
    }
    Ok(())
}

/// Up to `ITEM_ROWS` tokens of one slot, with that slot's matrices.
struct Item<'a, E> {
    isa: LinearIsa,
    a: &'a [E],
    b: &'a [E],
    x: Vec<&'a [E]>,
    y: Vec<&'a mut [E]>,
    width: usize,
    /// Rows of `b` per part, and the parts' column bounds (`parts.len() + 1`).
    rank: usize,
    /// The slot's rank: the leading columns of each rank block that are read.
    used: usize,
    bounds: &'a [usize],
}

impl<E: Elem> VectorBody for Item<'_, E> {
    #[inline(always)]
    fn run<S: Simd>(mut self) {
        let (width, rank, used) = (self.width, self.rank, self.used);
        let n = self.b.len() / width.max(1);
        // the columns read: the first `used` of each rank block
        let blocks: Vec<(usize, usize)> = (0..width / rank)
            .map(|p| (p * rank, p * rank + used))
            .collect();
        let mut h = vec![0f32; self.x.len() * width];
        shrink::<S, E>(&self.x, self.a, width, &blocks, &mut h);
        // expand, each part's rank rows over its own columns only, skipping the
        // rows every token's h leaves at zero (the parts an adapter leaves alone)
        let rows = self.x.len();
        for (p, &(lo, hi)) in blocks.iter().enumerate() {
            let live: Vec<usize> = (lo..hi)
                .filter(|&j| (0..rows).any(|r| h[r * width + j] != 0.0))
                .collect();
            if !live.is_empty() {
                let cols = (self.bounds[p], self.bounds[p + 1]);
                expand::<S, E>(&h, width, self.b, n, &live, cols, &mut self.y);
            }
        }
    }
}
