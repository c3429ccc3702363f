//! The element types of the decode kernel's KV cache: f32, and bf16 stored as
//! its bit pattern (`u16`: the upper half of an f32). bf16 rows are widened to
//! f32 as they are read (a 16-bit shift, which vectorises on any ISA), or, on
//! CPUs with AVX512-BF16, the q·k dot products run on `vdpbf16ps` directly
//! (bf16 pairs multiplied and accumulated in f32). Accumulation is f32 always.
//!
//! `ASYNCLLM_KERNEL_ISA` caps the instruction set the kernel picks, read once:
//! `portable` (no SIMD intrinsics, what a CPU without AVX2 runs), `avx2`
//! (AVX2 + FMA, no AVX-512), `avxvnni` (as `avx2`, and AVX-VNNI for the GGUF
//! integer kernel), `avx512` (AVX-512F, not its BF16 extension), `avx512vnni`
//! (as `avx512`, and AVX512-VNNI for the GGUF integer kernel), or `auto` / unset
//! (the best the CPU has); so CI covers every variant on one machine.

use std::sync::OnceLock;

use super::KernelError;

/// An element of the KV cache the kernel reads: f32, or bf16 bits (`u16`) —
/// the linear kernels' element types.
pub use super::linear::Elem as KvElem;

/// bf16 bits to f32: exact (bf16 is f32 with the low 16 mantissa bits dropped).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (as torch does); NaN stays NaN.
/// Branch-free (both results, then a select), so loops over it vectorise.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// The most the kernel may use, from `ASYNCLLM_KERNEL_ISA` (read once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IsaCap {
    Portable,
    Avx2,
    /// AVX-512 (F) for the kernels that have such a variant, but not its BF16
    /// extension: the attention kernel runs its AVX2 variant.
    Avx512,
    /// AVX-VNNI (256-bit integer dot products) for the GGUF integer kernel; the
    /// other kernels run as under `Avx2`.
    AvxVnni,
    /// AVX512-VNNI for the GGUF integer kernel; the other kernels run as under
    /// `Avx512`.
    Avx512Vnni,
    Auto,
}

pub(super) fn isa_cap() -> Result<IsaCap, KernelError> {
    static CAP: OnceLock<Result<IsaCap, String>> = OnceLock::new();
    CAP.get_or_init(|| match std::env::var("ASYNCLLM_KERNEL_ISA").as_deref() {
        Ok("portable") => Ok(IsaCap::Portable),
        Ok("avx2") => Ok(IsaCap::Avx2),
        Ok("avx512") => Ok(IsaCap::Avx512),
        Ok("avxvnni") => Ok(IsaCap::AvxVnni),
        Ok("avx512vnni") => Ok(IsaCap::Avx512Vnni),
        Ok("auto") | Ok("") | Err(std::env::VarError::NotPresent) => Ok(IsaCap::Auto),
        Ok(other) => Err(format!(
            "ASYNCLLM_KERNEL_ISA must be \"auto\", \"avx512vnni\", \"avx512\", \"avxvnni\", \"avx2\" or \"portable\", got {other:?}"
        )),
        Err(e) => Err(format!("ASYNCLLM_KERNEL_ISA: {e}")),
    })
    .clone()
    .map_err(KernelError::Isa)
}
