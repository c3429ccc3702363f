//! The engine wire protocol: message types, framing, encode/decode. Pure Rust.

use thiserror::Error;

/// Version byte carried by every frame; bumped on any schema change.
pub const WIRE_VERSION: u8 = 1;

/// Why a frame could not be decoded or a message could not be encoded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("truncated frame: {0}")]
    Truncated(String),
}
