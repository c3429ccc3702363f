//! The crate's one error type. It is converted to Python exceptions in exactly
//! one place, `py::errors`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Wire(#[from] crate::protocol::WireError),
    #[error(transparent)]
    Detok(#[from] crate::detok::DetokError),
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
}

pub type Result<T> = std::result::Result<T, Error>;
