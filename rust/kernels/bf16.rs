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

/// An element of the KV cache the kernel reads.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Whether this is bf16 (the AVX512-BF16 variant applies).
    const IS_BF16: bool;
    fn to_f32(self) -> f32;
    /// The row as bf16 bits, when it is bf16.
    fn bits(row: &[Self]) -> Option<&[u16]>;
}

impl KvElem for f32 {
    const IS_BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn bits(_: &[f32]) -> Option<&[u16]> {
        None
    }
}

/// bf16, as its bit pattern (torch's `tensor.view(torch.int16)`).
impl KvElem for u16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn bits(row: &[u16]) -> Option<&[u16]> {
        Some(row)
    }
}

/// bf16 bits to f32: exact (bf16 is f32 with the low 16 mantissa bits dropped).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (as torch does); NaN stays NaN.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let b = x.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
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

/// `q · k` on `vdpbf16ps`: 32 bf16 pairs per instruction into 16 f32 lanes,
/// the tail (head_dim not a multiple of 32) widened and done in f32.
///
/// Call only from code compiled with `avx512f,avx512bf16` (inside
/// `attend_avx512_bf16`), which runs only on CPUs that have them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn dot_dpbf16(q: &[u16], k: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let (cq, rq) = q.as_chunks::<32>();
    let (ck, rk) = k.as_chunks::<32>();
    let mut tail = 0.0f32;
    for (x, y) in rq.iter().zip(rk) {
        tail += bf16_to_f32(*x) * bf16_to_f32(*y);
    }
    // SAFETY: the caller runs this only on a CPU with AVX512F and AVX512-BF16
    // (see above); every load reads one whole 32-element chunk of a slice
    // (`as_chunks`), unaligned loads being allowed, and `__m512i` and
    // `__m512bh` are both 512 bits, so the transmutes reinterpret bits only.
    unsafe {
        let mut acc = _mm512_setzero_ps();
        for (x, y) in cq.iter().zip(ck) {
            let a: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.as_ptr().cast()));
            let b: __m512bh = std::mem::transmute(_mm512_loadu_si512(y.as_ptr().cast()));
            acc = _mm512_dpbf16_ps(acc, a, b);
        }
        _mm512_reduce_add_ps(acc) + tail
    }
}

/// Stand-in where there is no AVX512-BF16 variant (never called).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub(super) fn dot_dpbf16(_: &[u16], _: &[u16]) -> f32 {
    unreachable!("no AVX512-BF16 variant off x86-64")
}
