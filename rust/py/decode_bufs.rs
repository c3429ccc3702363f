//! The fused decode plan's buffers as its kernels read them (`decode_layers`):
//! float32 or bfloat16-bits weights and caches (`Buf`), a projection's float or
//! GGUF weight (`ProjBuf`) and its LoRA adapter slots (`LoraBuf`), each checked
//! once when the plan is made.

use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::kernels::{byte_range, data_ptr};
use crate::error::Error;
use crate::kernels::{GgufPart, GgufType, Proj, ProjLora};

/// A C-contiguous buffer of float32 or of bfloat16 bits (int16), any shape.
pub(super) enum Buf {
    F32(PyBuffer<f32>),
    Bf16(PyBuffer<i16>),
}

impl Buf {
    pub(super) fn get(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let raw = PyUntypedBuffer::get(obj).map_err(|_| {
            PyValueError::new_err(format!("{name} must support the buffer protocol"))
        })?;
        let format = raw.format().to_bytes();
        let buf = match format.strip_prefix(b"=").unwrap_or(format) {
            b"f" => raw.into_typed::<f32>().map(Buf::F32),
            b"h" => raw.into_typed::<i16>().map(Buf::Bf16),
            _ => {
                return Err(PyValueError::new_err(format!(
                    "{name} must hold float32 or bfloat16 bits (int16)"
                )))
            }
        }
        .map_err(|_| PyValueError::new_err(format!("{name}: unreadable buffer")))?;
        if !buf.contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name} must be C-contiguous"
            )));
        }
        Ok(buf)
    }

    pub(super) fn contiguous(&self) -> bool {
        match self {
            Buf::F32(b) => b.is_c_contiguous(),
            Buf::Bf16(b) => b.is_c_contiguous(),
        }
    }

    pub(super) fn readonly(&self) -> bool {
        match self {
            Buf::F32(b) => b.readonly(),
            Buf::Bf16(b) => b.readonly(),
        }
    }

    pub(super) fn is_bf16(&self) -> bool {
        matches!(self, Buf::Bf16(_))
    }

    pub(super) fn shape(&self) -> &[usize] {
        match self {
            Buf::F32(b) => b.shape(),
            Buf::Bf16(b) => b.shape(),
        }
    }

    pub(super) fn bytes(&self) -> (usize, usize) {
        match self {
            Buf::F32(b) => byte_range(b),
            Buf::Bf16(b) => byte_range(b),
        }
    }

    /// The elements as `E` (f32 for float32, u16 for bf16 bits).
    ///
    /// # Safety
    /// `E` matches the variant (f32 for `F32`, u16 for `Bf16`), and nothing
    /// writes the buffer while the slice lives.
    pub(super) unsafe fn slice<E>(&self) -> &[E] {
        let (ptr, len) = match self {
            Buf::F32(b) => (data_ptr(b).cast::<E>(), b.item_count()),
            Buf::Bf16(b) => (data_ptr(b).cast::<E>(), b.item_count()),
        };
        // SAFETY: a C-contiguous buffer (checked in `get`), aligned (pyo3) and
        // non-null (`data_ptr`), valid for `len` reads while `self` holds the
        // export; the element type and the absence of writers: the caller's.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    pub(super) fn ptr_mut<E>(&self) -> *mut E {
        match self {
            Buf::F32(b) => data_ptr(b).cast(),
            Buf::Bf16(b) => data_ptr(b).cast(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Buf::F32(b) => b.item_count(),
            Buf::Bf16(b) => b.item_count(),
        }
    }
}

/// A projection's weight as `run` reads it.
pub(super) enum ProjBuf {
    Float(Buf),
    /// Each part's type, blocks and whether they are in the panel layout.
    Gguf(Vec<(GgufType, PyBuffer<u8>, bool)>),
}

impl ProjBuf {
    pub(super) fn get(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if !obj.is_instance_of::<PyList>() {
            return Buf::get(obj, name).map(ProjBuf::Float);
        }
        let mut parts = Vec::new();
        for part in obj.cast::<PyList>()?.iter() {
            let bad =
                || PyValueError::new_err(format!("{name}: a part is (qtype, uint8 rows, panels)"));
            let (qtype, rows, panels): (String, Bound<'_, PyAny>, bool) =
                part.extract().map_err(|_| bad())?;
            let t = GgufType::from_name(&qtype).map_err(|e| PyErr::from(Error::from(e)))?;
            let buf = PyBuffer::<u8>::get(&rows).map_err(|_| bad())?;
            if !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "{name} must be C-contiguous"
                )));
            }
            parts.push((t, buf, panels));
        }
        if parts.is_empty() {
            return Err(PyValueError::new_err(format!("{name} has no parts")));
        }
        Ok(ProjBuf::Gguf(parts))
    }

    pub(super) fn float_is_bf16(&self) -> Option<bool> {
        match self {
            ProjBuf::Float(b) => Some(b.is_bf16()),
            ProjBuf::Gguf(_) => None,
        }
    }

    /// The weight for the kernel.
    ///
    /// # Safety
    /// As `Buf::slice`: `E` matches a float buffer's variant, and nothing writes
    /// the buffers while the projection lives.
    pub(super) unsafe fn proj<E>(&self) -> Proj<'_, E> {
        match self {
            // SAFETY: the caller's (above).
            ProjBuf::Float(b) => Proj::Float(unsafe { b.slice() }),
            ProjBuf::Gguf(parts) => Proj::Gguf(
                parts
                    .iter()
                    .map(|(t, b, panels)| GgufPart {
                        t: *t,
                        // SAFETY: C-contiguous (checked in `get`); no writers: the
                        // caller's (above).
                        blocks: unsafe { super::gguf::bytes(b) },
                        panels: *panels,
                    })
                    .collect(),
            ),
        }
    }
}

/// A projection's adapter slots: A `[slots * k, width]`, B `[slots * width, n]`
/// (`_lora_add`'s layout), the fused parts' output sizes and each slot's rank
/// (int64 `[slots]`, read at each step: slot writes change it).
pub(super) struct LoraBuf {
    pub(super) a: Buf,
    pub(super) b: Buf,
    parts: Vec<usize>,
    ranks: PyBuffer<i64>,
}

impl LoraBuf {
    pub(super) fn get(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Self>> {
        if obj.is_none() {
            return Ok(None);
        }
        let bad = || PyValueError::new_err(format!("{name}: adapters are (a, b, parts, ranks)"));
        let (a, b, parts, ranks): (
            Bound<'_, PyAny>,
            Bound<'_, PyAny>,
            Vec<usize>,
            Bound<'_, PyAny>,
        ) = obj.extract().map_err(|_| bad())?;
        let (a, b) = (Buf::get(&a, name)?, Buf::get(&b, name)?);
        let ranks = PyBuffer::<i64>::get(&ranks)
            .map_err(|_| PyValueError::new_err(format!("{name}: ranks must be int64")))?;
        if a.shape().len() != 2 || b.shape().len() != 2 || !ranks.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name}: adapters need a [slots * k, width], b [slots * width, n] and \
                 contiguous ranks"
            )));
        }
        Ok(Some(LoraBuf { a, b, parts, ranks }))
    }

    /// The slots' ranks now (non-negative: checked against the rank blocks by the
    /// kernel's own checks).
    pub(super) fn ranks(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let ranks = self.ranks.to_vec(py)?;
        ranks
            .into_iter()
            .map(|r| usize::try_from(r).map_err(|_| PyValueError::new_err("a negative rank")))
            .collect()
    }

    /// # Safety
    /// As `Buf::slice`: `E` matches the buffers' variant, and nothing writes them
    /// while the adapters live.
    pub(super) unsafe fn lora<'a, E>(&'a self, ranks: &'a [usize]) -> ProjLora<'a, E> {
        ProjLora {
            // SAFETY: the caller's (above).
            a: unsafe { self.a.slice() },
            b: unsafe { self.b.slice() },
            width: self.a.shape()[1],
            parts: &self.parts,
            ranks,
        }
    }
}
