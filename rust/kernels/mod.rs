//! CPU compute kernels for the model runner. Pure Rust: no pyo3, so `cargo test`
//! checks them without Python; `py::kernels` is their binding.
//!
//! Kernels are compiled once, at install time, for the portable baseline, and
//! carry `#[target_feature]` variants (AVX2 + FMA on x86-64, and AVX512-BF16 for
//! bf16 caches) picked at run time,
//! so one wheel runs everywhere and still uses the vector units it finds.

mod attention_block;
mod attention_job;
mod attention_runs;
mod bf16;
mod decode_layers;
mod decode_proj;
mod decode_rows;
mod elementwise;
mod exp;
mod gguf;
mod gguf_int;
mod gguf_int_blocks;
mod gguf_int_loop;
mod gguf_linear;
mod gguf_panel;
#[cfg(target_arch = "x86_64")]
mod gguf_panel_x86;
mod gguf_panels;
mod gguf_q8;
mod linear;
#[cfg(target_arch = "x86_64")]
mod linear_dpbf16;
mod linear_simd;
mod lora;
mod lora_tile;
mod paged_attention;
mod peak;
mod rotary;
mod silu_mul;
// `pub(crate)`: the sampler (`crate::sampler`) runs on the same team.
pub(crate) mod team;
mod team_region;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_attention_runs;
#[cfg(test)]
mod tests_gguf;
#[cfg(test)]
mod tests_gguf_int;
#[cfg(test)]
mod tests_gguf_panels;
#[cfg(test)]
mod tests_linear;
#[cfg(test)]
mod tests_lora;

pub use bf16::{bf16_to_f32, f32_to_bf16, KvElem};
pub use decode_layers::{decode_layers, Adapters, CacheMut, DecodeDims, DecodeStep, LayerWeights};
pub use decode_proj::{GgufPart, Proj, ProjLora};
pub use elementwise::{add_rms_norm, rms_norm};
pub use gguf::{dequantize as gguf_dequantize, GgufType};
pub use gguf_int::{gguf_int_isa, gguf_linear_int};
pub use gguf_linear::gguf_linear;
pub use gguf_panels::{
    dequantize as gguf_dequantize_panels, pack as gguf_pack_panels, unpack_rows as gguf_unpack_rows,
};
pub use linear::{linear, linear_isa, Elem, LinearShape};
pub use lora::{lora_add, LoraLayout, LoraShape};
pub use paged_attention::{
    kernel_isa, paged_decode_attention, paged_decode_attention_windowed, BlockIndex, DecodeShape,
    KvCache,
};
pub use peak::{fma_peak, read_bandwidth};
pub use rotary::{rotary, RotaryShape};
pub use silu_mul::silu_mul;

/// An argument a kernel cannot work with. Every check runs before any output is
/// written, so on error the output buffer is untouched.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    Shape(String),
    #[error("sequence {seq}: seq_len {len} is not in 1..={max} (block table row of {blocks} blocks of {block_size})")]
    SeqLen {
        seq: usize,
        len: i64,
        max: usize,
        blocks: usize,
        block_size: usize,
    },
    #[error(
        "sequence {seq}: block id {id} at block table position {pos} is not in 0..{num_blocks}"
    )]
    BlockId {
        seq: usize,
        pos: usize,
        id: i64,
        num_blocks: usize,
    },
    #[error("cannot start {0} kernel threads: {1}")]
    Threads(usize, String),
    #[error("{0}")]
    Isa(String),
}
