//! A projection of the fused decode step (`decode_layers`): float weights in the
//! checkpoint's layout, or GGUF blocks read as they are (the models of
//! `asyncllm.models.gguf`, whose layers keep their weights quantized).
//!
//! The GGUF arm computes what `GGUFLinear`'s `int` kernel computes on the torch
//! path, rounding where it rounds: `x` widened to f32, each part's product by the
//! integer kernel (`gguf_linear_int`; float parts by `gguf_linear`) in f32, the
//! result rounded to the model's dtype, then the bias added and rounded again
//! (`out + bias` on a tensor of that dtype). Parts stack along the output, as
//! `torch.cat` stacks them. The integer kernel does the widening as it quantizes
//! each row and the rounding as it stores each output, on the team's threads
//! (`gguf_int::run_into`): those passes over a 102-token prompt's rows had run on
//! the calling thread while the others waited (with the copies, ~9 % of its
//! profile's samples; ~3 % of its time, measured).
//!
//! A projection may carry adapters (`ProjLora`): their products are added to its
//! output by `lora_add`, as `LoRALinear` adds them to its base layer's output on
//! the torch path (the same kernel, so the same bits).

use super::elementwise::widen;
use super::gguf::GgufType;
use super::gguf_int::{gguf_linear_int_into, OutRows};
use super::gguf_linear::gguf_linear;
use super::linear::{linear, Elem, LinearIsa, LinearShape};
use super::lora::{add_checked, check as check_lora, LoraLayout, LoraShape};
use super::KernelError;

/// One run of output rows of a GGUF weight, all of one block type.
pub struct GgufPart<'a> {
    pub t: GgufType,
    /// Whole rows of `t.row_bytes(k)` bytes each.
    pub blocks: &'a [u8],
    /// Whether `blocks` are in the panel layout (`gguf_panels`).
    pub panels: bool,
}

/// A projection's weight, `[out, in]`.
pub enum Proj<'a, E> {
    Float(&'a [E]),
    Gguf(Vec<GgufPart<'a>>),
}

impl<E> Proj<'_, E> {
    /// Why this weight cannot be `[n, k]`, or None when it is.
    pub(super) fn mismatch(&self, n: usize, k: usize) -> Option<String> {
        match self {
            Proj::Float(w) if w.len() != n * k => {
                Some(format!("has {} elements, expected {}", w.len(), n * k))
            }
            Proj::Float(_) => None,
            Proj::Gguf(parts) => {
                let mut rows = 0;
                for p in parts {
                    let rb = match p.t.row_bytes(k) {
                        Ok(rb) => rb,
                        Err(e) => return Some(e.to_string()),
                    };
                    if !p.blocks.len().is_multiple_of(rb) {
                        return Some(format!("{:?} blocks are not whole rows of {k}", p.t));
                    }
                    rows += p.blocks.len() / rb;
                }
                (rows != n).then(|| format!("has {rows} rows of blocks, expected {n}"))
            }
        }
    }
}

/// A projection's adapters in `lora_add`'s layout: its slots' A `[slots, k,
/// width]` and B `[slots, width, n]`, the output sizes of the projections fused
/// in it (`parts`) and each slot's rank in it (`ranks`, one per slot).
pub struct ProjLora<'a, E> {
    pub a: &'a [E],
    pub b: &'a [E],
    pub width: usize,
    pub parts: &'a [usize],
    pub ranks: &'a [usize],
}

impl<E: Elem> ProjLora<'_, E> {
    fn operands(&self, shape: LinearShape) -> (LoraShape, LoraLayout<'_>) {
        let LinearShape { m, k, n } = shape;
        let slots = self.ranks.len();
        let lora = LoraShape {
            tokens: m,
            k,
            width: self.width,
            n,
            slots,
        };
        let layout = LoraLayout {
            parts: self.parts,
            ranks: self.ranks,
        };
        (lora, layout)
    }

    /// Whether these adapters fit a projection of `shape` and the step's
    /// `token_slot` (an error naming what does not).
    pub(super) fn check(&self, shape: LinearShape, token_slot: &[i64]) -> Result<(), KernelError> {
        let (lora, layout) = self.operands(shape);
        let (m, k, n) = (shape.m, shape.k, shape.n);
        check_lora(
            lora,
            layout,
            [m * n, m * k, self.a.len(), self.b.len()],
            token_slot,
        )
    }

    /// `out[t] += (x[t] · A[s]) · B[s]` for each row `t` whose slot `s =
    /// token_slot[t]` is not -1, after `check` passed for `shape`.
    pub(super) fn add(
        &self,
        isa: LinearIsa,
        shape: LinearShape,
        x: &[E],
        token_slot: &[i64],
        num_threads: usize,
        out: &mut [E],
    ) -> Result<(), KernelError> {
        let (lora, layout) = self.operands(shape);
        add_checked(
            isa,
            lora,
            layout,
            out,
            x,
            self.a,
            self.b,
            token_slot,
            num_threads,
        )
    }
}

/// `out[m, n] = x[m, k] · Wᵀ (+ bias)` on `num_threads` threads.
#[inline(always)]
pub(super) fn project<E: Elem>(
    w: &Proj<'_, E>,
    shape: LinearShape,
    x: &[E],
    bias: Option<&[f32]>,
    num_threads: usize,
    out: &mut [E],
) -> Result<(), KernelError> {
    let parts = match w {
        Proj::Float(w) => return linear(shape, x, w, bias, num_threads, out),
        Proj::Gguf(parts) => parts,
    };
    let LinearShape { m, k, n } = shape;
    let float = |t: GgufType| matches!(t, GgufType::F32 | GgufType::F16 | GgufType::Bf16);
    // float parts run in f32; block parts read `x` and write `out` as they are
    let x32 = if parts.iter().any(|p| float(p.t)) {
        let mut x32 = vec![0.0f32; m * k];
        widen(x, &mut x32);
        x32
    } else {
        Vec::new()
    };
    let mut first = 0;
    for p in parts {
        let rows = p.blocks.len() / p.t.row_bytes(k)?;
        if float(p.t) {
            let mut y = vec![0.0f32; m * rows];
            gguf_linear(p.t, m, k, &x32, p.blocks, p.panels, num_threads, &mut y)?;
            for (dst, src) in out.chunks_exact_mut(n).zip(y.chunks_exact(rows)) {
                for (d, s) in dst[first..first + rows].iter_mut().zip(src) {
                    *d = E::from_f32(*s);
                }
            }
        } else {
            let to = OutRows {
                out: &mut *out,
                stride: n,
                first,
            };
            gguf_linear_int_into(p.t, m, k, x, p.blocks, p.panels, num_threads, to)?;
        }
        first += rows;
    }
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(n) {
            for (v, b) in row.iter_mut().zip(b) {
                *v = E::from_f32(v.to_f32() + b);
            }
        }
    }
    Ok(())
}
