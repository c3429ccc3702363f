//! Rotary position embedding (rotate-half, as `asyncllm.models.layers.
//! apply_rotary`) of the q and k heads at the front of each row of the fused
//! q/k/v projection's output, into a new `[T, heads, head_dim]` buffer: f32 or
//! bf16 (bits), each product and sum rounded to the dtype where torch's ops
//! round.
//!
//! Why: torch runs it as six elementwise ops and a concatenation, each a pass
//! over memory and a dispatch, on a strided view; this is one pass, compiled per
//! ISA so it vectorises. A row's result never depends on its neighbours.

use super::elementwise::{on_rows, round, ITEM_ROWS};
use super::linear::{Elem, LinearIsa};
use super::linear_simd::{on_isa, Simd, VectorBody};
use super::KernelError;

/// The sizes of one call: `x` holds rows of `row_len` whose first
/// `heads * head_dim` elements are the heads to rotate; `cos` and `sin` hold
/// `head_dim / 2` values per row.
#[derive(Clone, Copy, Debug)]
pub struct RotaryShape {
    pub row_len: usize,
    pub heads: usize,
    pub head_dim: usize,
}

/// `out[t, h] = rotate_half(x[t, h], cos[t], sin[t])` for every row `t` and head
/// `h < heads`, on `num_threads` threads of the kernel team.
pub fn rotary<E: Elem>(
    shape: RotaryShape,
    x: &[E],
    cos: &[E],
    sin: &[E],
    out: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    let RotaryShape {
        row_len,
        heads,
        head_dim,
    } = shape;
    let half = head_dim / 2;
    let width = heads * head_dim;
    let rows = cos.len().checked_div(half).unwrap_or(0);
    if half == 0
        || !head_dim.is_multiple_of(2)
        || width > row_len
        || sin.len() != cos.len()
        || !cos.len().is_multiple_of(half)
        || x.len() != rows * row_len
        || out.len() != rows * width
    {
        return Err(KernelError::Shape(format!(
            "rotary: {shape:?} does not fit x ({}), cos ({}), sin ({}) and out ({}) elements",
            x.len(),
            cos.len(),
            sin.len(),
            out.len()
        )));
    }
    let isa = LinearIsa::detect()?;
    let items = out
        .chunks_mut(ITEM_ROWS * width)
        .zip(x.chunks(ITEM_ROWS * row_len))
        .zip(
            cos.chunks(ITEM_ROWS * half)
                .zip(sin.chunks(ITEM_ROWS * half)),
        );
    on_rows(items, num_threads, &|((out, x), (cos, sin))| {
        on_isa(
            isa,
            Rows {
                s: shape,
                x,
                cos,
                sin,
                out,
            },
        )
    })
}

/// The rows of one item. `S` only selects the variant the loop is compiled in
/// (products and sums are separate roundings, never fused, as torch's are).
struct Rows<'a, E> {
    s: RotaryShape,
    x: &'a [E],
    cos: &'a [E],
    sin: &'a [E],
    out: &'a mut [E],
}

impl<E: Elem> VectorBody for Rows<'_, E> {
    #[inline(always)]
    fn run<S: Simd>(self) {
        let Rows {
            s,
            x,
            cos,
            sin,
            out,
        } = self;
        let (d, half) = (s.head_dim, s.head_dim / 2);
        let rows = x
            .chunks_exact(s.row_len)
            .zip(out.chunks_exact_mut(s.heads * d))
            .zip(cos.chunks_exact(half).zip(sin.chunks_exact(half)));
        for ((x, out), (cos, sin)) in rows {
            for (head, dst) in x[..s.heads * d]
                .chunks_exact(d)
                .zip(out.chunks_exact_mut(d))
            {
                let (x1, x2) = head.split_at(half);
                let (lo, hi) = dst.split_at_mut(half);
                // Zipped, not indexed: no bounds checks in the way of vectorising.
                let pairs = x1.iter().zip(x2).zip(cos.iter().zip(sin));
                for ((lo, hi), ((a, b), (c, sn))) in lo.iter_mut().zip(hi.iter_mut()).zip(pairs) {
                    let (a, b, c, sn) = (a.to_f32(), b.to_f32(), c.to_f32(), sn.to_f32());
                    *lo = E::from_f32(round::<E>(a * c) - round::<E>(b * sn));
                    *hi = E::from_f32(round::<E>(b * c) + round::<E>(a * sn));
                }
            }
        }
    }
}
