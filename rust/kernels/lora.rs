//! LoRA's shrink and expand for every adapted token of a step, added to the base
//! layer's output: `y[t] += (x[t] · A[s]) · B[s]` for the slot `s` of token `t`
//! (`-1`: no adapter, row untouched).
//!
//! Layout (`asyncllm.lora.layers`): `a` is `[slots, k, width]` and `b` is
//! `[slots, width, n]`, row-major, so both products stream rows of the matrix
//! against one vector per token (`axpy` over `width` or `n`, the vector lanes).
//! A layer that fuses projections (q/k/v, gate/up) has `parts`, their output
//! sizes: `width` is `parts.len()` rank blocks of equal size, and block `p`'s
//! rows of `b` are read only in part `p`'s columns (the rest of `b` is zero by
//! construction, block-diagonal, and is never read: the expand does a third of
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
use super::KernelError;

/// Tokens per work item: a slot's A and B rows are read once per item.
const ITEM_ROWS: usize = 4;

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
    check(shape, y, x, a, b, token_slot)?;
    check_layout(shape, layout)?;
    let parts = layout.parts;
    let isa = LinearIsa::detect()?;
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

fn check<E: Elem>(
    s: LoraShape,
    y: &[E],
    x: &[E],
    a: &[E],
    b: &[E],
    token_slot: &[i64],
) -> Result<(), KernelError> {
    let sizes_ok = y.len() == s.tokens * s.n
        && x.len() == s.tokens * s.k
        && a.len() == s.slots * s.k * s.width
        && b.len() == s.slots * s.width * s.n
        && token_slot.len() == s.tokens
        && s.n > 0
        && s.k > 0
        && s.width > 0;
    if !sizes_ok {
        return Err(KernelError::Shape(format!(
            "lora_add needs y [t, n], x [t, k], a [slots, k, width], b [slots, width, n] and \
             one slot per token for {s:?}; got y {}, x {}, a {}, b {}, token_slot {} elements",
            y.len(),
            x.len(),
            a.len(),
            b.len(),
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
    Ok(())
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
    fn run<S: Simd>(self) {
        let (width, rows) = (self.width, self.x.len());
        let n = self.b.len() / width.max(1);
        let (rank, used) = (self.rank, self.used);
        // the columns read: the whole width, or the first `used` of each rank block
        let blocks: Vec<(usize, usize)> = if used == rank {
            vec![(0, width)]
        } else {
            (0..width / rank)
                .map(|p| (p * rank, p * rank + used))
                .collect()
        };
        // shrink: h[r] = x[r] · A, one row of A per input feature
        let mut h = vec![0f32; rows * width];
        for (i, a_row) in self.a.chunks_exact(width).enumerate() {
            for (r, x) in self.x.iter().enumerate() {
                let h_row = &mut h[r * width..(r + 1) * width];
                for &(lo, hi) in &blocks {
                    axpy::<S, E>(&mut h_row[lo..hi], x[i].to_f32(), &a_row[lo..hi]);
                }
            }
        }
        // expand: d[r] = h[r] · B, each row of B over its part's columns only,
        // skipping the zero-padded ranks and the parts an adapter leaves alone
        let mut d = vec![0f32; rows * n];
        for (j, b_row) in self.b.chunks_exact(n).enumerate() {
            if j % rank >= used || (0..rows).all(|r| h[r * width + j] == 0.0) {
                continue;
            }
            let (lo, hi) = (self.bounds[j / self.rank], self.bounds[j / self.rank + 1]);
            for r in 0..rows {
                let out = &mut d[r * n + lo..r * n + hi];
                axpy::<S, E>(out, h[r * width + j], &b_row[lo..hi]);
            }
        }
        for (y, d) in self.y.into_iter().zip(d.chunks_exact(n)) {
            for (y, d) in y.iter_mut().zip(d) {
                *y = E::from_f32(y.to_f32() + d);
            }
        }
    }
}

/// `acc += alpha * w`, in vectors of `S::LANES` and a scalar tail.
#[inline(always)]
fn axpy<S: Simd, E: Elem>(acc: &mut [f32], alpha: f32, w: &[E]) {
    let lanes = S::LANES;
    let whole = acc.len() / lanes * lanes;
    // SAFETY: every vector op touches `lanes` elements at offsets `c < whole`,
    // within both `acc` and `w` (`w.len() == acc.len()` by the callers' row
    // slicing); `on_isa` runs this in code compiled for `S`'s ISA on a CPU that has it.
    unsafe {
        let va = S::splat(alpha);
        for c in (0..whole).step_by(lanes) {
            let p = acc.as_mut_ptr().add(c);
            S::store(p, S::fma(va, S::load_w(w.as_ptr().add(c)), S::load(p)));
        }
    }
    for (o, v) in acc[whole..].iter_mut().zip(&w[whole..]) {
        *o = S::scalar_fma(alpha, v.to_f32(), *o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator: values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Three fused parts of 7, 6 and 8 outputs, rank 4 each.
    const PARTS: [usize; 3] = [7, 6, 8];

    /// Whether `b`'s element at rank row `j`, column `o` is in its part's block.
    fn in_block(j: usize, o: usize) -> bool {
        let p = j / 4;
        let lo: usize = PARTS[..p].iter().sum();
        (lo..lo + PARTS[p]).contains(&o)
    }

    #[test]
    fn mixed_slots_match_the_per_token_products() {
        let shape = LoraShape {
            tokens: 11,
            k: 19,
            width: 12,
            n: 21,
            slots: 3,
        };
        let x = values(shape.tokens * shape.k, 1);
        let a = values(shape.slots * shape.k * shape.width, 2);
        // b block-diagonal, as laid out; NaN off the blocks, which are never read
        let mut b = values(shape.slots * shape.width * shape.n, 3);
        for (i, v) in b.iter_mut().enumerate() {
            if !in_block(i / shape.n % shape.width, i % shape.n) {
                *v = f32::NAN;
            }
        }
        let y0 = values(shape.tokens * shape.n, 4);
        let slots = [2, -1, 0, 2, 1, 1, -1, 0, 2, 2, 0];
        let full = LoraLayout {
            parts: &PARTS,
            ranks: &[4, 4, 4],
        };
        for threads in [1, 3] {
            let mut y = y0.clone();
            lora_add(shape, full, &mut y, &x, &a, &b, &slots, threads).unwrap();
            for (t, &s) in slots.iter().enumerate() {
                for o in 0..shape.n {
                    let mut want = y0[t * shape.n + o] as f64;
                    if s >= 0 {
                        let s = s as usize;
                        for j in (0..shape.width).filter(|&j| in_block(j, o)) {
                            let h: f64 = (0..shape.k)
                                .map(|i| {
                                    x[t * shape.k + i] as f64
                                        * a[(s * shape.k + i) * shape.width + j] as f64
                                })
                                .sum();
                            want += h * b[(s * shape.width + j) * shape.n + o] as f64;
                        }
                    }
                    let got = y[t * shape.n + o] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "token {t} out {o}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn padded_ranks_are_never_read() {
        // slots of rank 2, 4 and 0 in blocks of 4: every A and B value past a
        // slot's rank is NaN, so reading one would show in the output
        let shape = LoraShape {
            tokens: 6,
            k: 9,
            width: 12,
            n: 21,
            slots: 3,
        };
        let ranks = [2usize, 4, 0];
        let x = values(shape.tokens * shape.k, 5);
        let mut a = values(shape.slots * shape.k * shape.width, 6);
        for (i, v) in a.iter_mut().enumerate() {
            let (s, j) = (i / (shape.k * shape.width), i % shape.width);
            if j % 4 >= ranks[s] {
                *v = f32::NAN;
            }
        }
        let mut b = values(shape.slots * shape.width * shape.n, 7);
        for (i, v) in b.iter_mut().enumerate() {
            let (s, j) = (i / (shape.width * shape.n), i / shape.n % shape.width);
            if j % 4 >= ranks[s] || !in_block(j, i % shape.n) {
                *v = f32::NAN;
            }
        }
        let y0 = values(shape.tokens * shape.n, 8);
        let slots = [0, 1, 2, 0, -1, 1];
        let mut y = y0.clone();
        let layout = LoraLayout {
            parts: &PARTS,
            ranks: &ranks,
        };
        lora_add(shape, layout, &mut y, &x, &a, &b, &slots, 2).unwrap();
        for (t, &s) in slots.iter().enumerate() {
            for o in 0..shape.n {
                let mut want = y0[t * shape.n + o] as f64;
                if s >= 0 {
                    let s = s as usize;
                    let cols = (0..shape.width).filter(|&j| j % 4 < ranks[s] && in_block(j, o));
                    for j in cols {
                        let h: f64 = (0..shape.k)
                            .map(|i| {
                                x[t * shape.k + i] as f64
                                    * a[(s * shape.k + i) * shape.width + j] as f64
                            })
                            .sum();
                        want += h * b[(s * shape.width + j) * shape.n + o] as f64;
                    }
                }
                let got = y[t * shape.n + o] as f64;
                assert!(
                    (got - want).abs() < 1e-4,
                    "token {t} out {o}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_bad_slot_is_refused_before_writing() {
        let shape = LoraShape {
            tokens: 2,
            k: 3,
            width: 2,
            n: 4,
            slots: 1,
        };
        let mut y = vec![1.0f32; 8];
        let (x, a, b) = (vec![1.0f32; 6], vec![1.0f32; 6], vec![1.0f32; 8]);
        let one = |parts| LoraLayout { parts, ranks: &[2] };
        let err = lora_add(shape, one(&[4]), &mut y, &x, &a, &b, &[0, 1], 1).unwrap_err();
        assert!(
            err.to_string().contains("token 1 has slot 1, not in -1..1"),
            "{err}"
        );
        let err = lora_add(shape, one(&[1, 2]), &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
        assert!(
            err.to_string().contains("parts [1, 2] must split n=4"),
            "{err}"
        );
        let err = lora_add(shape, one(&[2, 1, 1]), &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
        assert!(err.to_string().contains("equal rank blocks"), "{err}");
        let high = LoraLayout {
            parts: &[4],
            ranks: &[3],
        };
        let err = lora_add(shape, high, &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
        assert!(err.to_string().contains("a rank of at most 2"), "{err}");
        assert!(y.iter().all(|&v| v == 1.0));
    }
}
