//! The elementwise work between a layer's matmuls, row by row: RMSNorm and the
//! residual add with the next norm (SiLU × up is `silu_mul`'s) — f32 or bf16
//! (bits), computed in f32 and rounded where the torch path rounds
//! (`asyncllm.models.layers`).
//!
//! Why: on the CPU the torch path runs a bf16 RMSNorm as seven ops (widen, square,
//! mean, rsqrt, multiply, narrow, multiply by the weight), each a pass over memory
//! and a dispatch; here it is one pass, rows shared out over the kernel team. The
//! fused decode step (`decode_layers`) runs the same row functions, so both paths
//! give the same bits. A row's result never depends on the rows beside it.

use super::linear::Elem;
use super::team;
use super::KernelError;

/// Rows per work item: enough that a handful of items per thread balance the
/// team, few enough that a small step does not pay for threads it cannot use.
pub(super) const ITEM_ROWS: usize = 16;

/// `x` rounded to the element type and back: what storing it in a tensor of the
/// model's dtype does (nothing for f32).
#[inline(always)]
pub(super) fn round<E: Elem>(x: f32) -> f32 {
    E::from_f32(x).to_f32()
}

/// RMSNorm of one row into `out`, as `asyncllm.models.layers.rms_norm`: in f32,
/// the normalised row rounded to the dtype before the weight multiplies.
#[inline(always)]
pub(super) fn rms_norm_row<E: Elem>(row: &[E], weight: &[E], eps: f32, out: &mut [E]) {
    let h = weight.len();
    // 16 partial sums, then a fixed tree and the tail: one order for every row,
    // and a loop the compiler vectorises (a single running sum it cannot reorder)
    let mut acc = [0.0f32; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v.to_f32() * v.to_f32();
        }
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    let sum = tail.iter().fold(acc[0], |s, v| s + v.to_f32() * v.to_f32());
    let inv = 1.0 / (sum / h as f32 + eps).sqrt();
    for ((d, v), w) in out.iter_mut().zip(row).zip(weight) {
        *d = E::from_f32(round::<E>(v.to_f32() * inv) * w.to_f32());
    }
}

#[inline(always)]
pub(super) fn widen<E: Elem>(src: &[E], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

#[inline(always)]
pub(super) fn narrow<E: Elem>(src: &[f32], dst: &mut [E]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(*s);
    }
}

/// `x += y`, rounded to the dtype.
#[inline(always)]
pub(super) fn add_in_place<E: Elem>(x: &mut [E], y: &[E]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a = E::from_f32(a.to_f32() + b.to_f32());
    }
}

/// `out = rms_norm(x) * weight` for every row of `x` (rows of `weight.len()`).
pub fn rms_norm<E: Elem>(
    x: &[E],
    weight: &[E],
    eps: f32,
    out: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    let h = weight.len();
    check(h, x.len(), out.len(), x.len(), "rms_norm: x and out")?;
    let items = out.chunks_mut(ITEM_ROWS * h).zip(x.chunks(ITEM_ROWS * h));
    on_rows(items, num_threads, &|(out, x): (&mut [E], &[E])| {
        for (dst, row) in out.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
            rms_norm_row(row, weight, eps, dst);
        }
    })
}

/// `residual += x` (rounded), then `out = rms_norm(residual) * weight`: a block's
/// output joining the residual stream and the next norm reading it, in one pass.
pub fn add_rms_norm<E: Elem>(
    x: &[E],
    residual: &mut [E],
    weight: &[E],
    eps: f32,
    out: &mut [E],
    num_threads: usize,
) -> Result<(), KernelError> {
    let h = weight.len();
    check(
        h,
        x.len(),
        out.len(),
        residual.len(),
        "add_rms_norm: x, residual and out",
    )?;
    let rows = ITEM_ROWS * h;
    let items = out
        .chunks_mut(rows)
        .zip(residual.chunks_mut(rows))
        .zip(x.chunks(rows));
    on_rows(items, num_threads, &|((out, res), x): (
        (&mut [E], &mut [E]),
        &[E],
    )| {
        add_in_place(res, x);
        for (dst, row) in out.chunks_exact_mut(h).zip(res.chunks_exact(h)) {
            rms_norm_row(row, weight, eps, dst);
        }
    })
}

fn check(width: usize, a: usize, b: usize, c: usize, what: &str) -> Result<(), KernelError> {
    if width == 0 || !a.is_multiple_of(width) || a != b || a != c {
        return Err(KernelError::Shape(format!(
            "{what} must hold whole rows of {width} alike; got {a}, {b}, {c} elements"
        )));
    }
    Ok(())
}

/// Runs `body` on every item, on `num_threads` threads of the kernel team (one
/// thread below two items: a small step pays for no wake-up).
pub(super) fn on_rows<I, F>(items: I, num_threads: usize, body: &F) -> Result<(), KernelError>
where
    I: Iterator + Send,
    I::Item: Send,
    F: Fn(I::Item) + Sync,
{
    team::run_queue(items, num_threads, || (), &|item, _: &mut ()| body(item))
}
