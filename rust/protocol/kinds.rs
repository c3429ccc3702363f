//! How the compound kinds of request fields travel (the kinds of
//! `python/asyncllm/engine/wire_schema.py`; the scalar ones are one `Writer` /
//! `Reader` call each). The generated `add_request.rs` calls these.
//!
//! ```text
//! opt_str     nil | str
//! token_bias  nil | [token_ids: bin u32, biases: bin f32], same length
//! u32_lists   nil | [bin u32, ...]
//! structured  nil | [kind: str, spec: str]
//! ```
//! The list kinds write nil when empty, so a request without them pays one byte.

use super::error::{WireError, WireResult};
use super::messages::StructuredSpec;
use super::reader::Reader;
use super::writer::Writer;

pub(super) fn write_opt_str(w: &mut Writer, s: Option<&str>, path: &str) -> WireResult<()> {
    match s {
        Some(s) => w.str(s, path),
        None => {
            w.nil();
            Ok(())
        }
    }
}

pub(super) fn write_token_bias(w: &mut Writer, bias: &[(u32, f32)], path: &str) -> WireResult<()> {
    if bias.is_empty() {
        w.nil();
        return Ok(());
    }
    let ids: Vec<u32> = bias.iter().map(|b| b.0).collect();
    let values: Vec<f32> = bias.iter().map(|b| b.1).collect();
    w.array_len(2, path)?;
    w.u32s(&ids, path)?;
    w.f32s(&values, path)
}

pub(super) fn read_token_bias(r: &mut Reader<'_>, path: &str) -> WireResult<Vec<(u32, f32)>> {
    if r.try_nil() {
        return Ok(Vec::new());
    }
    r.expect_array(2, path)?;
    let ids = r.u32s(path)?;
    let values = r.f32s(path)?;
    if ids.len() != values.len() {
        return Err(WireError::malformed(
            path,
            format!("{} token ids but {} biases", ids.len(), values.len()),
        ));
    }
    Ok(ids.into_iter().zip(values).collect())
}

pub(super) fn write_u32_lists(w: &mut Writer, lists: &[Vec<u32>], path: &str) -> WireResult<()> {
    if lists.is_empty() {
        w.nil();
        return Ok(());
    }
    w.array_len(lists.len(), path)?;
    for list in lists {
        w.u32s(list, path)?;
    }
    Ok(())
}

pub(super) fn read_u32_lists(r: &mut Reader<'_>, path: &str) -> WireResult<Vec<Vec<u32>>> {
    if r.try_nil() {
        return Ok(Vec::new());
    }
    let n = r.array_len(path)?;
    // each list takes at least its one-byte bin header: a forged count cannot
    // reserve more than the frame's remaining bytes
    let mut lists = Vec::with_capacity(n.min(r.remaining()));
    for i in 0..n {
        lists.push(r.u32s(&format!("{path}[{i}]"))?);
    }
    Ok(lists)
}

pub(super) fn write_structured(w: &mut Writer, s: Option<&StructuredSpec>) -> WireResult<()> {
    let Some(s) = s else {
        w.nil();
        return Ok(());
    };
    s.check()
        .map_err(|e| WireError::encode("structured_outputs", e))?;
    w.array_len(2, "structured_outputs")?;
    w.str(&s.kind, "structured_outputs.kind")?;
    w.str(&s.spec, "structured_outputs.spec")
}

pub(super) fn read_structured(r: &mut Reader<'_>) -> WireResult<StructuredSpec> {
    r.expect_array(2, "structured_outputs")?;
    let spec = StructuredSpec {
        kind: r.str("structured_outputs.kind")?.to_string(),
        spec: r.str("structured_outputs.spec")?.to_string(),
    };
    spec.check()
        .map_err(|e| WireError::malformed("structured_outputs", e))?;
    Ok(spec)
}
