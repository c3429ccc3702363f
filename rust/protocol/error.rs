//! `WireError`: why a frame could not be decoded or a message could not be
//! encoded. Every message names what was wrong and where (a field path such as
//! `AddRequests[3].prompt_token_ids`), so a bad frame can be traced to its field.

use thiserror::Error;

/// Why a frame could not be decoded or a message could not be encoded.
///
/// Decoding never panics: every malformed input ends up as one of these.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum WireError {
    /// The frame ends before a field does.
    #[error("truncated frame: {path} needs {needed} byte{}, {left} left", if *.needed == 1 { "" } else { "s" })]
    Truncated {
        path: String,
        needed: u64,
        left: usize,
    },
    /// The first byte is not a known message type.
    #[error("unknown message type {0:#04x}")]
    UnknownMessageType(u8),
    /// The frame was written by a build speaking another wire version.
    #[error("wrong wire version: frame has {got}, this build speaks {expected}")]
    WrongVersion { got: u8, expected: u8 },
    /// The frame is larger than the receiver accepts.
    #[error("frame too large: {size} bytes, the limit is {max}")]
    TooLarge { size: usize, max: usize },
    /// A field has the wrong msgpack type, length or value.
    #[error("malformed frame: {path}: {reason}")]
    Malformed { path: String, reason: String },
    /// Bytes follow the end of the message body.
    #[error("malformed frame: {count} trailing bytes after the {message} body")]
    TrailingBytes { message: &'static str, count: usize },
    /// A message cannot be represented on the wire (a value out of range, a
    /// length that does not match, an unsupported dynamic type).
    #[error("cannot encode {path}: {reason}")]
    Encode { path: String, reason: String },
}

impl WireError {
    #[cold]
    pub(crate) fn malformed(path: impl Into<String>, reason: impl Into<String>) -> Self {
        WireError::Malformed {
            path: path.into(),
            reason: reason.into(),
        }
    }

    #[cold]
    pub fn encode(path: impl Into<String>, reason: impl Into<String>) -> Self {
        WireError::Encode {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Prefixes the field path with an outer segment (`AddRequests[3]`), so the
    /// innermost reader names the field and each container adds where it sits.
    #[cold]
    pub(crate) fn within(mut self, outer: &str) -> Self {
        match &mut self {
            WireError::Truncated { path, .. }
            | WireError::Malformed { path, .. }
            | WireError::Encode { path, .. } => {
                *path = if path.is_empty() {
                    outer.to_string()
                } else if path.starts_with('[') {
                    format!("{outer}{path}")
                } else {
                    format!("{outer}.{path}")
                };
            }
            _ => {}
        }
        self
    }
}

pub type WireResult<T> = std::result::Result<T, WireError>;
