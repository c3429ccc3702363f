//! The only modules that import pyo3: extract owned inputs, release the GIL,
//! wrap the results.

mod codec;
mod decode_bufs;
mod decode_layers;
mod detok;
mod elementwise;
mod errors;
mod gguf;
mod kernels;
mod linear;
mod lora;
mod mask_job;
mod peak;
mod prefix_hash;
mod sampler;
mod spec;
mod structured;

use pyo3::prelude::*;

/// Version of the native module, so the Python side can check it loaded the
/// build it was packaged with.
#[pyfunction]
fn native_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Version byte of the wire schema this build speaks.
#[pyfunction]
fn wire_version() -> u8 {
    crate::protocol::WIRE_VERSION
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(native_version, m)?)?;
    m.add_function(wrap_pyfunction!(wire_version, m)?)?;
    errors::register(m)?;
    gguf::register(m)?;
    codec::register(m)?;
    decode_layers::register(m)?;
    detok::register(m)?;
    elementwise::register(m)?;
    kernels::register(m)?;
    linear::register(m)?;
    lora::register(m)?;
    peak::register(m)?;
    prefix_hash::register(m)?;
    sampler::register(m)?;
    spec::register(m)?;
    structured::register(m)?;
    Ok(())
}
