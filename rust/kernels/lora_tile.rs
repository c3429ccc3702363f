//! The register tiles of LoRA's shrink and expand (`lora`): up to `ROWS` tokens of
//! one slot at a time, their partial sums kept in vector registers.
//!
//! shrink: `h[r][cols] = Σ_i x[r][i] · a[i][cols]` — each row of A (a few vectors:
//! the slot's rank blocks) is loaded once per input feature and serves every token
//! of the tile, where a token at a time would load and store `h` for each product.
//! expand: `d[r][cols] = Σ_j h[r][j] · b[j][cols]` over a few vectors of output
//! columns at a time, then `y += d`. Both sum in the one order the per-token loops
//! did (input feature by feature, then rank row by rank row, each a fused
//! multiply-add from zero), so a token's result is the same bits whatever the
//! tokens beside it, and the same as before the tiles.

use std::array;

use super::linear::Elem;
use super::linear_simd::Simd;

/// Vector columns per tile: with 8 rows, 24 accumulators and 3 loaded vectors fit
/// AVX-512's 32 registers.
const COLS: usize = 3;

/// The most tokens of a tile for `S`: 8 where vectors are 16 lanes (32
/// registers), 4 where they are 8 (AVX2: 16 registers).
#[inline(always)]
fn max_rows<S: Simd>() -> usize {
    if S::LANES >= 16 {
        8
    } else {
        4
    }
}

/// Calls `$f::<S, E, R, C>($args)` for runtime `rows` in {1, 2, 4, 8} and `cols` in
/// {1, 2, 3}: each pair its own monomorphic tile, accumulators in registers.
macro_rules! tile {
    ($f:ident, $rows:expr, $cols:expr, $($arg:expr),*) => {
        match ($rows, $cols) {
            (8, 3) => $f::<S, E, 8, 3>($($arg),*),
            (8, 2) => $f::<S, E, 8, 2>($($arg),*),
            (8, _) => $f::<S, E, 8, 1>($($arg),*),
            (4, 3) => $f::<S, E, 4, 3>($($arg),*),
            (4, 2) => $f::<S, E, 4, 2>($($arg),*),
            (4, _) => $f::<S, E, 4, 1>($($arg),*),
            (2, 3) => $f::<S, E, 2, 3>($($arg),*),
            (2, 2) => $f::<S, E, 2, 2>($($arg),*),
            (2, _) => $f::<S, E, 2, 1>($($arg),*),
            (_, 3) => $f::<S, E, 1, 3>($($arg),*),
            (_, 2) => $f::<S, E, 1, 2>($($arg),*),
            (_, _) => $f::<S, E, 1, 1>($($arg),*),
        }
    };
}

/// The tile heights covering `rows` tokens: the largest of 8, 4, 2, 1 that fit.
fn row_tiles<S: Simd>(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    let top = max_rows::<S>();
    let mut start = 0;
    std::iter::from_fn(move || {
        let left = rows - start;
        let r = [8, 4, 2, 1].into_iter().find(|&r| r <= left && r <= top)?;
        start += r;
        Some((start - r, r))
    })
}

/// `h[r * width + j] = Σ_i x[r][i] · a[i * width + j]` for every column `j` in
/// `blocks` (column ranges of `a`; the rest of `h` is left as it is), each sum a
/// chain of fused multiply-adds from zero, `i` ascending.
#[inline(always)]
pub(super) fn shrink<S: Simd, E: Elem>(
    x: &[&[E]],
    a: &[E],
    width: usize,
    blocks: &[(usize, usize)],
    h: &mut [f32],
) {
    let k = a.len() / width;
    let lanes = S::LANES;
    assert!(x.iter().all(|row| row.len() == k) && h.len() >= x.len() * width);
    let mut vectors = Vec::new(); // the first column of each whole vector of columns
    let mut tails = Vec::new(); // the columns left over, one at a time
    for &(lo, hi) in blocks {
        assert!(lo <= hi && hi <= width);
        let whole = lo + (hi - lo) / lanes * lanes;
        vectors.extend((lo..whole).step_by(lanes));
        tails.extend(whole..hi);
    }
    for (r0, rows) in row_tiles::<S>(x.len()) {
        let xs = &x[r0..r0 + rows];
        let hs = &mut h[r0 * width..(r0 + rows) * width];
        for offs in vectors.chunks(COLS) {
            // SAFETY: `a` holds k rows of `width`, every offset + lanes <= width
            // (whole vectors within a block within the row); `xs` has `rows` rows of
            // `k` and `hs` `rows` rows of `width` (asserted above); `on_isa` runs
            // this compiled for `S`'s ISA on a CPU that has it.
            unsafe { tile!(shrink_tile, rows, offs.len(), xs, a, width, offs, hs) }
        }
        for &j in &tails {
            for (r, x) in xs.iter().enumerate() {
                let col = a.iter().skip(j).step_by(width);
                let sum = x.iter().zip(col).fold(0.0, |acc, (x, a)| {
                    S::scalar_fma(x.to_f32(), a.to_f32(), acc)
                });
                hs[r * width + j] = sum;
            }
        }
    }
}

/// One shrink tile: `R` tokens × `C` vectors of columns at `offs`.
///
/// # Safety
/// `x` has `R` rows of `k = a.len() / width` elements, `h` `R` rows of `width`,
/// every `offs[c] + S::LANES <= width`, and the CPU has `S`'s ISA.
#[inline(always)]
unsafe fn shrink_tile<S: Simd, E: Elem, const R: usize, const C: usize>(
    x: &[&[E]],
    a: &[E],
    width: usize,
    offs: &[usize],
    h: &mut [f32],
) {
    let k = a.len() / width;
    let offs: [usize; C] = array::from_fn(|c| offs[c]);
    let xp: [*const E; R] = array::from_fn(|r| x[r].as_ptr());
    // SAFETY: the caller's bounds: row i of `a` at i * width, each vector within
    // it; x[r][i] for i < k; h's row r at r * width.
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        for i in 0..k {
            let row = a.as_ptr().add(i * width);
            let w: [S::V; C] = array::from_fn(|c| S::load_w(row.add(offs[c])));
            for (acc, x) in acc.iter_mut().zip(&xp) {
                let xv = S::splat((*x.add(i)).to_f32());
                for (acc, w) in acc.iter_mut().zip(&w) {
                    *acc = S::fma(xv, *w, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (acc, off) in acc.iter().zip(&offs) {
                S::store(h.as_mut_ptr().add(r * width + off), *acc);
            }
        }
    }
}

/// `y[r][lo..hi] = E(y[r][lo..hi] + Σ_{j in js} h[r * width + j] · b[j * n + lo..hi])`
/// for each token `r` of `y`, each sum a chain of fused multiply-adds from zero, `j`
/// in the order of `js`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn expand<S: Simd, E: Elem>(
    h: &[f32],
    width: usize,
    b: &[E],
    n: usize,
    js: &[usize],
    (lo, hi): (usize, usize),
    y: &mut [&mut [E]],
) {
    let lanes = S::LANES;
    assert!(lo <= hi && hi <= n && h.len() >= y.len() * width);
    assert!(js.iter().all(|&j| j < width && (j + 1) * n <= b.len()));
    assert!(y.iter().all(|row| row.len() == n));
    let whole = lo + (hi - lo) / lanes * lanes;
    let vectors: Vec<usize> = (lo..whole).step_by(lanes).collect();
    for (r0, rows) in row_tiles::<S>(y.len()) {
        let hs = &h[r0 * width..(r0 + rows) * width];
        let ys = &mut y[r0..r0 + rows];
        for offs in vectors.chunks(COLS) {
            // SAFETY: every j in `js` is a row of `b` and a column of `hs`, every
            // offset + lanes <= n (whole vectors below `hi`), `ys` has `rows` rows of
            // `n` (asserted above); `on_isa` runs this compiled for `S`'s ISA.
            unsafe { tile!(expand_tile, rows, offs.len(), hs, width, b, n, js, offs, ys) }
        }
        for o in whole..hi {
            for (r, y) in ys.iter_mut().enumerate() {
                let d = js.iter().fold(0.0, |acc, &j| {
                    S::scalar_fma(hs[r * width + j], b[j * n + o].to_f32(), acc)
                });
                y[o] = E::from_f32(y[o].to_f32() + d);
            }
        }
    }
}

/// One expand tile: `R` tokens × `C` vectors of output columns at `offs`.
///
/// # Safety
/// `h` has `R` rows of `width`, `y` `R` rows of `n`; every `j` in `js` is below
/// `width` with row `j` of `b` (`n` wide) inside `b`; every `offs[c] + S::LANES <=
/// n`; the CPU has `S`'s ISA.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn expand_tile<S: Simd, E: Elem, const R: usize, const C: usize>(
    h: &[f32],
    width: usize,
    b: &[E],
    n: usize,
    js: &[usize],
    offs: &[usize],
    y: &mut [&mut [E]],
) {
    let offs: [usize; C] = array::from_fn(|c| offs[c]);
    // SAFETY: the caller's bounds, as stated above.
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        for &j in js {
            let row = b.as_ptr().add(j * n);
            let w: [S::V; C] = array::from_fn(|c| S::load_w(row.add(offs[c])));
            for (r, acc) in acc.iter_mut().enumerate() {
                let hv = S::splat(*h.get_unchecked(r * width + j));
                for (acc, w) in acc.iter_mut().zip(&w) {
                    *acc = S::fma(hv, *w, *acc);
                }
            }
        }
        let mut spill = [0f32; 16]; // S::LANES is at most 16
        for (acc, y) in acc.iter().zip(y.iter_mut()) {
            for (acc, off) in acc.iter().zip(&offs) {
                let p = y.as_mut_ptr().add(*off);
                if E::IS_BF16 {
                    // y + d in f32, rounded to bf16 one element at a time
                    S::store(spill.as_mut_ptr(), *acc);
                    for (l, d) in spill.iter().take(S::LANES).enumerate() {
                        *p.add(l) = E::from_f32((*p.add(l)).to_f32() + d);
                    }
                } else {
                    // E is f32 here: the same add, a vector at a time
                    let p = p.cast::<f32>();
                    S::store(p, S::add(S::load(p), *acc));
                }
            }
        }
    }
}
