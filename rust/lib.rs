//! asyncllm's native core.
//!
//! `protocol` (the engine wire codec), `detok` (batched incremental
//! detokenization and stop strings) and `prefix_hash` (prefix-cache block
//! keys) are pure Rust and never import pyo3, so
//! `cargo test` and `cargo bench` need no Python. `py` is the only place that
//! touches the interpreter: extract owned inputs, release the GIL, wrap results.

pub mod alloc_count;
pub mod detok;
pub mod error;
pub mod kernels;
pub mod prefix_hash;
pub mod protocol;
mod py;
pub mod sampler;
pub mod spec;
pub mod structured;

use pyo3::prelude::*;

/// Counted, so that a compiled grammar's size can be measured (`alloc_count`).
#[global_allocator]
static ALLOCATOR: alloc_count::Counting = alloc_count::Counting;

/// The `asyncllm._core` extension module: registration only.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    py::register(m)
}
