//! Decoders: the inverse of `encode.rs`. Strict about every field's type and
//! every array's length; a frame with bytes after its body is rejected too.

use super::add_request::{read_add_request, AddRequest};
use super::columns::read_output_batch_columns;
use super::encode::READY_FIELDS;
use super::error::{WireError, WireResult};
use super::frame::{split_frame, DEFAULT_MAX_FRAME_SIZE};
use super::messages::{Message, MessageType, Ready};
use super::reader::Reader;
use super::value::read_value;

/// Decodes a frame of at most `DEFAULT_MAX_FRAME_SIZE` bytes.
pub fn decode(frame: &[u8]) -> WireResult<Message> {
    decode_with_limit(frame, DEFAULT_MAX_FRAME_SIZE)
}

/// Decodes a frame, rejecting it if it is larger than `max_frame_size` bytes.
pub fn decode_with_limit(frame: &[u8], max_frame_size: usize) -> WireResult<Message> {
    let (message_type, body) = split_frame(frame, max_frame_size)?;
    let mut r = Reader::new(body);
    let message = match message_type {
        MessageType::AddRequests => Message::AddRequests(read_add_requests(&mut r)?),
        MessageType::Abort => read_abort(&mut r)?,
        MessageType::UtilityCall => read_utility_call(&mut r)?,
        MessageType::UtilityResult => read_utility_result(&mut r)?,
        MessageType::Ready => Message::Ready(read_ready(&mut r)?),
        MessageType::EngineError => {
            r.expect_array(1, "EngineError")?;
            Message::EngineError {
                message: r.str("EngineError.message")?.to_string(),
            }
        }
        MessageType::Shutdown => {
            r.expect_array(0, "Shutdown")?;
            Message::Shutdown
        }
        MessageType::OutputBatch => {
            Message::OutputBatch(read_output_batch_columns(&mut r)?.into_batch())
        }
    };
    if r.remaining() != 0 {
        return Err(WireError::TrailingBytes {
            message: message_type.name(),
            count: r.remaining(),
        });
    }
    Ok(message)
}

fn read_add_requests(r: &mut Reader<'_>) -> WireResult<Vec<AddRequest>> {
    let n = r.array_len("AddRequests")?;
    let mut requests = Vec::with_capacity(n);
    for i in 0..n {
        requests.push(read_add_request(r).map_err(|e| e.within(&format!("AddRequests[{i}]")))?);
    }
    Ok(requests)
}

fn read_abort(r: &mut Reader<'_>) -> WireResult<Message> {
    r.expect_array(1, "Abort")?;
    let n = r.array_len("Abort.wire_ids")?;
    let mut wire_ids = Vec::with_capacity(n);
    for i in 0..n {
        wire_ids.push(
            r.u64("Abort.wire_ids")
                .map_err(|e| e.within(&format!("[{i}]")))?,
        );
    }
    Ok(Message::Abort { wire_ids })
}

fn read_utility_call(r: &mut Reader<'_>) -> WireResult<Message> {
    r.expect_array(3, "UtilityCall")?;
    Ok(Message::UtilityCall {
        call_id: r.u64("UtilityCall.call_id")?,
        method: r.str("UtilityCall.method")?.to_string(),
        args: read_value(r, "UtilityCall.args")?,
    })
}

fn read_utility_result(r: &mut Reader<'_>) -> WireResult<Message> {
    r.expect_array(3, "UtilityResult")?;
    let call_id = r.u64("UtilityResult.call_id")?;
    let result = if r.bool("UtilityResult.ok")? {
        Ok(read_value(r, "UtilityResult.value")?)
    } else {
        Err(r.str("UtilityResult.error")?.to_string())
    };
    Ok(Message::UtilityResult { call_id, result })
}

fn read_ready(r: &mut Reader<'_>) -> WireResult<Ready> {
    r.expect_array(READY_FIELDS, "Ready")?;
    Ok(Ready {
        max_model_len: r.u32("Ready.max_model_len")?,
        num_kv_blocks: r.u32("Ready.num_kv_blocks")?,
        block_size: r.u32("Ready.block_size")?,
        vocab_size: r.u32("Ready.vocab_size")?,
        eos_token_ids: r.u32s("Ready.eos_token_ids")?,
        hidden_size: r.u32("Ready.hidden_size")?,
    })
}
