//! Python bindings of the wire codec (`crate::protocol`). Every function
//! extracts owned Rust values with the GIL held, encodes or decodes inside
//! `py.detach` (the GIL released), then wraps the result. Frames are `bytes`;
//! decoded messages are plain Python objects or the small views in `classes`.

mod add_request;
mod batch;
mod classes;
pub(crate) mod extract;
mod kinds;
mod value;

use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::protocol::{self, Message, MessageType, WireError, DEFAULT_MAX_FRAME_SIZE};
use add_request::PyAddRequest;
use batch::{encode_output_batch, PyOutputBatch};
use classes::{wire_err, PyLogprobs, PyReady, PySchedulerStats};
use value::{value_from_py, value_to_py};

/// Scratch buffers for the frames of the two hot encoders, one per thread: large
/// frames are written into warm memory and copied once into the `bytes` result,
/// instead of faulting in a fresh allocation per frame.
pub(crate) mod scratch {
    use std::cell::Cell;

    /// Buffers that grew past this are dropped rather than kept.
    const MAX_KEPT: usize = 32 << 20;

    thread_local! {
        static BUFFER: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
    }

    /// An empty buffer with the thread's kept capacity.
    pub fn take() -> Vec<u8> {
        let mut buf = BUFFER.with(Cell::take);
        buf.clear();
        buf
    }

    /// Gives a buffer back for the next frame on this thread.
    pub fn give_back(buf: Vec<u8>) {
        if buf.capacity() <= MAX_KEPT {
            BUFFER.with(|b| b.set(buf));
        }
    }
}

fn bytes_result<'py>(
    py: Python<'py>,
    frame: Result<Vec<u8>, WireError>,
) -> PyResult<Bound<'py, PyBytes>> {
    Ok(PyBytes::new(py, &frame.map_err(wire_err)?))
}

/// Encodes a burst of new requests as one frame.
#[pyfunction]
fn encode_add_requests<'py>(
    py: Python<'py>,
    requests: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let path = || "AddRequests".to_string();
    let mut owned: Vec<Arc<protocol::AddRequest>> = Vec::with_capacity(requests.len().unwrap_or(0));
    extract::for_each(requests, &path, |i, item| {
        let request = item
            .cast::<PyAddRequest>()
            .map_err(|_| extract::bad(|| format!("AddRequests[{i}]"), "an AddRequest", item))?;
        owned.push(request.get().0.clone());
        Ok(())
    })
    .map_err(wire_err)?;
    let buf = scratch::take();
    let frame = py
        .detach(|| protocol::encode_add_requests_in(buf, owned.iter().map(|r| &**r)))
        .map_err(wire_err)?;
    let bytes = PyBytes::new(py, &frame);
    scratch::give_back(frame);
    Ok(bytes)
}

/// Encodes one new request (a burst of one).
#[pyfunction]
fn encode_add_request<'py>(
    py: Python<'py>,
    request: &Bound<'py, PyAddRequest>,
) -> PyResult<Bound<'py, PyBytes>> {
    let owned = request.get().0.clone();
    let frame = py.detach(|| protocol::encode_add_requests([&*owned]));
    bytes_result(py, frame)
}

#[pyfunction]
fn encode_abort<'py>(
    py: Python<'py>,
    wire_ids: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let ids = extract::u64s(wire_ids, &|| "Abort.wire_ids".into()).map_err(wire_err)?;
    let frame = py.detach(|| protocol::encode_abort(&ids));
    bytes_result(py, frame)
}

#[pyfunction]
fn encode_utility_call<'py>(
    py: Python<'py>,
    call_id: u64,
    method: &str,
    args: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let args = value_from_py(args, "UtilityCall.args").map_err(wire_err)?;
    let frame = py.detach(|| protocol::encode_utility_call(call_id, method, &args));
    bytes_result(py, frame)
}

#[pyfunction]
fn encode_utility_result<'py>(
    py: Python<'py>,
    call_id: u64,
    ok: bool,
    value: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let frame = if ok {
        let value = value_from_py(value, "UtilityResult.value").map_err(wire_err)?;
        py.detach(|| protocol::encode_utility_result(call_id, Ok(&value)))
    } else {
        let message = extract::str_(value, || "UtilityResult.error".into()).map_err(wire_err)?;
        py.detach(|| protocol::encode_utility_result(call_id, Err(&message)))
    };
    bytes_result(py, frame)
}

#[pyfunction]
fn encode_ready<'py>(
    py: Python<'py>,
    ready: &Bound<'py, PyReady>,
) -> PyResult<Bound<'py, PyBytes>> {
    bytes_result(py, protocol::encode_ready(&ready.get().0))
}

#[pyfunction]
fn encode_engine_error<'py>(py: Python<'py>, message: &str) -> PyResult<Bound<'py, PyBytes>> {
    bytes_result(py, protocol::encode_engine_error(message))
}

#[pyfunction]
fn encode_shutdown(py: Python<'_>) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &protocol::encode_shutdown())
}

/// Decodes one frame into `(message type, payload)`.
#[pyfunction]
#[pyo3(signature = (frame, max_frame_size=None))]
fn decode_message<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyAny>,
    max_frame_size: Option<usize>,
) -> PyResult<Bound<'py, PyTuple>> {
    let max_frame_size = max_frame_size.unwrap_or(DEFAULT_MAX_FRAME_SIZE);
    let message = if let Ok(bytes) = frame.cast::<PyBytes>() {
        // `bytes` is immutable, so reading it without the GIL is sound.
        let data = bytes.as_bytes();
        py.detach(|| decode_prepared(data, max_frame_size))
    } else {
        // Other buffers (bytearray, memoryview, zmq frames) may change under us:
        // copy first. The size check comes before the copy.
        let buffer = PyBuffer::<u8>::get(frame).map_err(|_| {
            wire_err(extract::bad(
                || "frame".into(),
                "bytes or a byte buffer",
                frame,
            ))
        })?;
        if buffer.len_bytes() > max_frame_size {
            return Err(wire_err(WireError::TooLarge {
                size: buffer.len_bytes(),
                max: max_frame_size,
            }));
        }
        let data = buffer.to_vec(py)?;
        py.detach(|| decode_prepared(&data, max_frame_size))
    }
    .map_err(wire_err)?;
    let (message_type, payload) = match message {
        Decoded::OutputBatch(batch) => (
            MessageType::OutputBatch as u8,
            Bound::new(py, *batch)?.into_any(),
        ),
        Decoded::Other(message) => (message.message_type() as u8, message_to_py(py, message)?),
    };
    PyTuple::new(py, [message_type.into_pyobject(py)?.into_any(), payload])
}

/// A decoded message, with an output batch already wrapped (done while detached).
enum Decoded {
    OutputBatch(Box<PyOutputBatch>),
    Other(Message),
}

/// Decodes a frame; an output batch goes straight into columns and its view.
fn decode_prepared(frame: &[u8], max_frame_size: usize) -> Result<Decoded, WireError> {
    let (message_type, _) = protocol::split_frame(frame, max_frame_size)?;
    if message_type == MessageType::OutputBatch {
        let columns = protocol::decode_output_batch(frame, max_frame_size)?;
        return Ok(Decoded::OutputBatch(Box::new(PyOutputBatch::new(columns))));
    }
    protocol::decode_with_limit(frame, max_frame_size).map(Decoded::Other)
}

fn message_to_py(py: Python<'_>, message: Message) -> PyResult<Bound<'_, PyAny>> {
    Ok(match message {
        Message::AddRequests(requests) => {
            let views = requests
                .into_iter()
                .map(|r| Bound::new(py, PyAddRequest(Arc::new(r))))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, views)?.into_any()
        }
        Message::Abort { wire_ids } => PyList::new(py, wire_ids)?.into_any(),
        Message::UtilityCall {
            call_id,
            method,
            args,
        } => (call_id, method, value_to_py(py, &args)?)
            .into_pyobject(py)?
            .into_any(),
        Message::UtilityResult { call_id, result } => match result {
            Ok(value) => (call_id, true, value_to_py(py, &value)?)
                .into_pyobject(py)?
                .into_any(),
            Err(message) => (call_id, false, message).into_pyobject(py)?.into_any(),
        },
        Message::Ready(ready) => Bound::new(py, PyReady(ready))?.into_any(),
        Message::EngineError { message } => message.into_pyobject(py)?.into_any(),
        Message::Shutdown => py.None().into_bound(py),
        Message::OutputBatch(batch) => Bound::new(py, PyOutputBatch::new(batch.into()))?.into_any(),
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for t in MessageType::ALL {
        let name = match t {
            MessageType::AddRequests => "MSG_ADD_REQUESTS",
            MessageType::Abort => "MSG_ABORT",
            MessageType::UtilityCall => "MSG_UTILITY_CALL",
            MessageType::Shutdown => "MSG_SHUTDOWN",
            MessageType::OutputBatch => "MSG_OUTPUT_BATCH",
            MessageType::UtilityResult => "MSG_UTILITY_RESULT",
            MessageType::Ready => "MSG_READY",
            MessageType::EngineError => "MSG_ENGINE_ERROR",
        };
        m.add(name, t as u8)?;
    }
    m.add("DEFAULT_MAX_FRAME_SIZE", DEFAULT_MAX_FRAME_SIZE)?;
    m.add_class::<PyAddRequest>()?;
    m.add_class::<PySchedulerStats>()?;
    m.add_class::<PyReady>()?;
    m.add_class::<PyLogprobs>()?;
    m.add_class::<PyOutputBatch>()?;
    m.add_function(wrap_pyfunction!(encode_add_requests, m)?)?;
    m.add_function(wrap_pyfunction!(encode_add_request, m)?)?;
    m.add_function(wrap_pyfunction!(encode_abort, m)?)?;
    m.add_function(wrap_pyfunction!(encode_utility_call, m)?)?;
    m.add_function(wrap_pyfunction!(encode_utility_result, m)?)?;
    m.add_function(wrap_pyfunction!(encode_ready, m)?)?;
    m.add_function(wrap_pyfunction!(encode_engine_error, m)?)?;
    m.add_function(wrap_pyfunction!(encode_shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(encode_output_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_message, m)?)?;
    Ok(())
}
