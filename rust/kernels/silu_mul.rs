//! `silu(gate) * up` of an MLP's fused gate/up output, row by row (gate first,
//! then up, in each row), f32 or bf16 (bits): computed in f32 and rounded to
//! the dtype where torch's `F.silu(gate) * up` rounds (after the SiLU, after
//! the product).
//!
//! Why here: torch runs it as two ops and a temporary, each a pass over memory
//! and a dispatch; this is one pass, with the branch-free `exp` of `exp` so the
//! loop vectorises in each ISA variant (a scalar libm `exp` made it 2x slower
//! than torch's). The fused decode step runs the same row function, so both
//! paths give the same bits; a row's result never depends on its neighbours.

use super::elementwise::{on_rows, round, ITEM_ROWS};
use super::exp;
use super::linear::{Elem, LinearIsa};
use super::linear_simd::{on_isa, Simd, VectorBody};
use super::KernelError;

/// `out[r] = silu(gate_up[r][..inter]) * gate_up[r][inter..]` for every row `r`
/// (rows of `inter` in `out`), on `num_threads` threads of the kernel team.
pub fn silu_mul<E: Elem>(
    gate_up: &[E],
    out: &mut [E],
    inter: usize,
    num_threads: usize,
) -> Result<(), KernelError> {
    if inter == 0 || !out.len().is_multiple_of(inter) || gate_up.len() != 2 * out.len() {
        return Err(KernelError::Shape(format!(
            "silu_mul: gate_up ({} elements) must hold the gate and up halves of out's \
             rows of {inter} ({} elements)",
            gate_up.len(),
            out.len()
        )));
    }
    let isa = LinearIsa::detect()?;
    let items = out
        .chunks_mut(ITEM_ROWS * inter)
        .zip(gate_up.chunks(ITEM_ROWS * 2 * inter));
    on_rows(items, num_threads, &|(out, gate_up): (&mut [E], &[E])| {
        silu_mul_rows(isa, gate_up, inter, out)
    })
}

/// `silu_mul` of whole rows on the calling thread, in the variant of `isa`.
pub(super) fn silu_mul_rows<E: Elem>(isa: LinearIsa, gate_up: &[E], inter: usize, out: &mut [E]) {
    on_isa(
        isa,
        Rows {
            gate_up,
            inter,
            out,
        },
    )
}

struct Rows<'a, E> {
    gate_up: &'a [E],
    inter: usize,
    out: &'a mut [E],
}

impl<E: Elem> VectorBody for Rows<'_, E> {
    #[inline(always)]
    fn run<S: Simd>(self) {
        let inter = self.inter;
        for (row, dst) in self
            .gate_up
            .chunks_exact(2 * inter)
            .zip(self.out.chunks_exact_mut(inter))
        {
            let (gate, up) = row.split_at(inter);
            for ((d, g), u) in dst.iter_mut().zip(gate).zip(up) {
                let silu = round::<E>(exp::silu::<S>(g.to_f32()));
                *d = E::from_f32(silu * u.to_f32());
            }
        }
    }
}
