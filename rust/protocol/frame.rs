//! Framing: `[message type: u8][wire version: u8][msgpack body]`, and the size
//! limit a receiver enforces before it reads anything.

use super::error::{WireError, WireResult};
use super::messages::MessageType;
use super::WIRE_VERSION;

/// Bytes before the msgpack body.
pub const HEADER_LEN: usize = 2;

/// Frames larger than this are rejected unless the receiver raises the limit.
pub const DEFAULT_MAX_FRAME_SIZE: usize = 256 << 20;

/// Checks the size limit, the header and the version; returns the message type
/// and the body.
pub fn split_frame(frame: &[u8], max_frame_size: usize) -> WireResult<(MessageType, &[u8])> {
    if frame.len() > max_frame_size {
        return Err(WireError::TooLarge {
            size: frame.len(),
            max: max_frame_size,
        });
    }
    if frame.len() < HEADER_LEN {
        return Err(WireError::Truncated {
            path: "frame header (message type, wire version)".to_string(),
            needed: HEADER_LEN as u64,
            left: frame.len(),
        });
    }
    if frame[1] != WIRE_VERSION {
        return Err(WireError::WrongVersion {
            got: frame[1],
            expected: WIRE_VERSION,
        });
    }
    let message_type =
        MessageType::from_u8(frame[0]).ok_or(WireError::UnknownMessageType(frame[0]))?;
    Ok((message_type, &frame[HEADER_LEN..]))
}

/// The header bytes of a frame of `message_type`.
pub fn header(message_type: MessageType) -> [u8; HEADER_LEN] {
    [message_type as u8, WIRE_VERSION]
}
