//! Dynamic values: the arguments of utility calls and their results
//! (nil, bool, int, float, str, bytes, list, map with string keys).

use super::error::{WireError, WireResult};
use super::reader::{describe, Reader};
use super::writer::Writer;

/// How deep lists and maps may nest, on both sides, so that a hostile frame
/// cannot exhaust the stack.
pub const MAX_VALUE_DEPTH: usize = 64;

/// A dynamic msgpack value.
///
/// Integers are canonical after a decode: `UInt` for non-negative values,
/// `Int` for negative ones (`Int(3)` encodes like `UInt(3)`).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Map(Vec<(String, Value)>),
}

/// Writes `value`; `path` names it in errors.
pub fn write_value(w: &mut Writer, value: &Value, path: &str) -> WireResult<()> {
    write_nested(w, value, path, 0)
}

fn write_nested(w: &mut Writer, value: &Value, path: &str, depth: usize) -> WireResult<()> {
    match value {
        Value::Nil => w.nil(),
        Value::Bool(b) => w.bool(*b),
        Value::Int(i) => w.int(*i),
        Value::UInt(u) => w.uint(*u),
        Value::Float(f) => w.f64(*f),
        Value::Str(s) => w.str(s, path)?,
        Value::Bytes(b) => w.bin(b, path)?,
        Value::List(items) => {
            check_depth(depth, path, WireError::encode)?;
            w.array_len(items.len(), path)?;
            for item in items {
                write_nested(w, item, path, depth + 1)?;
            }
        }
        Value::Map(entries) => {
            check_depth(depth, path, WireError::encode)?;
            w.map_len(entries.len(), path)?;
            for (key, item) in entries {
                w.str(key, path)?;
                write_nested(w, item, path, depth + 1)?;
            }
        }
    }
    Ok(())
}

fn check_depth(depth: usize, path: &str, err: fn(String, String) -> WireError) -> WireResult<()> {
    if depth >= MAX_VALUE_DEPTH {
        return Err(err(
            path.to_string(),
            format!("lists and maps nest deeper than {MAX_VALUE_DEPTH} levels"),
        ));
    }
    Ok(())
}

/// Reads one value; `path` names it in errors.
pub fn read_value(r: &mut Reader<'_>, path: &str) -> WireResult<Value> {
    read_nested(r, path, 0)
}

fn read_nested(r: &mut Reader<'_>, path: &str, depth: usize) -> WireResult<Value> {
    let m = r.next_marker(path)?;
    Ok(match m {
        0xc0 => Value::Nil,
        0xc2 => Value::Bool(false),
        0xc3 => Value::Bool(true),
        0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => {
            r.unread_marker();
            let v = r.integer(path)?;
            match u64::try_from(v) {
                Ok(u) => Value::UInt(u),
                // Every msgpack int is >= i64::MIN, so a negative one fits.
                Err(_) => Value::Int(v as i64),
            }
        }
        0xca => {
            r.unread_marker();
            Value::Float(r.f32(path)? as f64)
        }
        0xcb => {
            r.unread_marker();
            Value::Float(r.f64(path)?)
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            check_depth(depth, path, malformed)?;
            r.unread_marker();
            let n = r.array_len(path)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_nested(r, path, depth + 1)?);
            }
            Value::List(items)
        }
        0x80..=0x8f | 0xde | 0xdf => {
            check_depth(depth, path, malformed)?;
            r.unread_marker();
            let n = r.map_len(path)?;
            let mut entries = Vec::with_capacity(n);
            for _ in 0..n {
                let key = r.str(path).map_err(|e| match e {
                    WireError::Malformed { path, .. } => {
                        WireError::malformed(path, "map keys must be str")
                    }
                    other => other,
                })?;
                entries.push((key.to_string(), read_nested(r, path, depth + 1)?));
            }
            Value::Map(entries)
        }
        _ => {
            if let Some(s) = r.str_after_marker(m, path)? {
                Value::Str(s.to_string())
            } else if let Some(b) = r.bin_after_marker(m, path)? {
                Value::Bytes(b.to_vec())
            } else {
                return Err(WireError::malformed(
                    path,
                    format!("unsupported msgpack type {} ({m:#04x})", describe(m)),
                ));
            }
        }
    })
}

fn malformed(path: String, reason: String) -> WireError {
    WireError::Malformed { path, reason }
}
