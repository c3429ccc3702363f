//! The fused decode step's work between its kernels (norms, rotary, the residual
//! adds, conversions, SiLU × up), row by row on the kernel team and compiled for
//! the CPU's vectors.
//!
//! Why rows on the team: on the calling thread alone this work left the others
//! waiting — with the integer kernel's activation rounding, a quarter of a 9-row
//! SmolLM2 verification step. A row's result never depends on its neighbours or
//! on which thread takes it, so the bits are those of the serial loop.
//!
//! Why `Simd::call` takes functions, not closures: a closure is compiled on its
//! own for the baseline (SSE2), even inside a `target_feature` function; an
//! `#[inline(always)]` function called from a `target_feature` copy is compiled
//! into that copy.

use super::bf16::IsaCap;
use super::elementwise::{add_in_place, narrow, on_rows, rms_norm_row, round, widen};
use super::linear::{Elem, LinearIsa};
use super::silu_mul::silu_mul_rows;
use super::KernelError;

/// The vector instructions the step's own work is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Simd {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// The widest this CPU has within `ASYNCLLM_KERNEL_ISA`'s cap (tests force
    /// each).
    pub(super) fn detect() -> Result<Simd, KernelError> {
        let cap = super::bf16::isa_cap()?;
        #[cfg(target_arch = "x86_64")]
        if matches!(cap, IsaCap::Auto | IsaCap::Avx512 | IsaCap::Avx512Vnni)
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Ok(Simd::Avx512);
        }
        #[cfg(target_arch = "x86_64")]
        if cap != IsaCap::Portable
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Ok(Simd::Avx2);
        }
        let _ = cap;
        Ok(Simd::Portable)
    }

    /// `job.run()` in this ISA's copy.
    #[inline(always)]
    fn call<J: RowJob>(self, job: J) {
        match self {
            // SAFETY: `detect` returns a variant only where the CPU has every
            // feature its copy is compiled for.
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { call_avx512(job) },
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { call_avx2(job) },
            Simd::Portable => job.run(),
        }
    }

    /// `job(item).run()` for every item, shared out over `num_threads` threads of
    /// the team (the calling thread alone below two items); `job` only gathers
    /// the row's operands.
    #[inline(always)]
    pub(super) fn rows<I, J, F>(
        self,
        items: I,
        num_threads: usize,
        job: F,
    ) -> Result<(), KernelError>
    where
        I: Iterator + Send,
        I::Item: Send,
        J: RowJob,
        F: Fn(I::Item) -> J + Sync,
    {
        on_rows(items, num_threads, &|item| self.call(job(item)))
    }
}

/// One row's work, compiled into the copy of the ISA that calls it: each `run`
/// is `#[inline(always)]` (a closure or a function called through `Fn` may be
/// left out of line, compiled for the baseline).
pub(super) trait RowJob {
    fn run(self);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
fn call_avx512<J: RowJob>(job: J) {
    job.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn call_avx2<J: RowJob>(job: J) {
    job.run()
}

/// `out = rms_norm(x) * weight` of one row.
pub(super) struct NormRow<'a, E> {
    pub weight: &'a [E],
    pub eps: f32,
    pub x: &'a [E],
    pub out: &'a mut [E],
}

impl<E: Elem> RowJob for NormRow<'_, E> {
    #[inline(always)]
    fn run(self) {
        rms_norm_row(self.x, self.weight, self.eps, self.out);
    }
}

/// `x += y` (rounded), then `out = rms_norm(x) * weight` where there is a
/// weight: a block's output joining the residual stream and the next norm
/// reading it.
pub(super) struct AddNormRow<'a, E> {
    pub norm: Option<(&'a [E], f32)>,
    pub x: &'a mut [E],
    pub y: &'a [E],
    pub out: &'a mut [E],
}

impl<E: Elem> RowJob for AddNormRow<'_, E> {
    #[inline(always)]
    fn run(self) {
        add_in_place(self.x, self.y);
        if let Some((weight, eps)) = self.norm {
            rms_norm_row(self.x, weight, eps, self.out);
        }
    }
}

/// f32 to the model's dtype.
pub(super) struct NarrowRow<'a, E> {
    pub src: &'a [f32],
    pub dst: &'a mut [E],
}

impl<E: Elem> RowJob for NarrowRow<'_, E> {
    #[inline(always)]
    fn run(self) {
        narrow(self.src, self.dst);
    }
}

/// `silu(gate) * up` of one row of the fused gate/up output.
pub(super) struct SiluRow<'a, E> {
    pub isa: LinearIsa,
    pub gate_up: &'a [E],
    pub out: &'a mut [E],
}

impl<E: Elem> RowJob for SiluRow<'_, E> {
    #[inline(always)]
    fn run(self) {
        silu_mul_rows(self.isa, self.gate_up, self.out.len(), self.out);
    }
}

/// One row's rotary embedding (`qkv`: q, k and v heads; `cos_sin`: the row's
/// cos then sin), the rotated q heads widened into `q32` and k, v into `kv32`.
pub(super) struct RopeRow<'a, E> {
    pub head_dim: usize,
    pub qkv: &'a mut [E],
    pub cos_sin: &'a [E],
    pub q32: &'a mut [f32],
    pub kv32: &'a mut [f32],
}

impl<E: Elem> RowJob for RopeRow<'_, E> {
    #[inline(always)]
    fn run(self) {
        let (cos, sin) = self.cos_sin.split_at(self.head_dim / 2);
        let (qs, kvs) = (self.q32.len(), self.kv32.len() / 2);
        rotate(&mut self.qkv[..qs + kvs], self.head_dim, cos, sin, self.q32);
        widen(&self.qkv[qs..], self.kv32);
    }
}

/// Rotates q and k heads (`row`: `[heads, head_dim]`, q heads then k heads) in
/// place by rotate-half (`apply_rotary`), each product and sum rounded as the
/// torch ops round; the rotated q heads also go to `q32` in f32.
///
/// Zipped slices of one length, not indexing: `cos[i]` with `cos` of unknown
/// length kept a bounds check in the loop, which left it scalar (a SmolLM2
/// prompt's profile: 4.5 % of the samples, more than attention's half).
#[inline(always)]
fn rotate<E: Elem>(row: &mut [E], head_dim: usize, cos: &[E], sin: &[E], q32: &mut [f32]) {
    let half = head_dim / 2;
    let (cos, sin) = (&cos[..half], &sin[..half]);
    for head in row.chunks_exact_mut(head_dim) {
        let (x1, x2) = head.split_at_mut(half);
        for (((x1, x2), c), s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
            let (a, b) = (x1.to_f32(), x2.to_f32());
            let (c, s) = (c.to_f32(), s.to_f32());
            let lo = round::<E>(a * c) - round::<E>(b * s);
            let hi = round::<E>(b * c) + round::<E>(a * s);
            *x1 = E::from_f32(lo);
            *x2 = E::from_f32(hi);
        }
    }
    widen(&row[..q32.len()], q32);
}
