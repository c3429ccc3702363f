//! Python binding of the prefix-cache block keys (`crate::prefix_hash`): keys
//! are 32-byte `bytes`. One call hashes every full block of a token run (a
//! whole prompt, or the block a decode step filled).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use super::codec::extract;
use crate::prefix_hash::{self, BlockDigest, DIGEST_LEN};
use crate::protocol::WireError;

/// Runs of at least this many tokens are hashed with the GIL released (a
/// prompt, hashed off the busy loop); shorter ones, such as the one block a
/// decode step fills, keep it, since handing the GIL over and taking it back
/// would cost more than the hashing and could stall the busy loop behind
/// another thread.
const DETACH_MIN_TOKENS: usize = 1024;

fn value_error(e: WireError) -> PyErr {
    let message = match e {
        WireError::Encode { path, reason } => format!("{path}: {reason}"),
        other => other.to_string(),
    };
    PyValueError::new_err(message)
}

/// The parent key of a sequence's first block, carrying the optional cache salt.
#[pyfunction]
#[pyo3(signature = (cache_salt=None))]
fn block_hash_root<'py>(py: Python<'py>, cache_salt: Option<&str>) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &prefix_hash::root_digest(cache_salt))
}

/// The key of every full block of `token_ids`, chained from `parent` (the key
/// of the block before them, or `block_hash_root(...)`); a trailing partial
/// block is left out.
#[pyfunction]
fn hash_blocks<'py>(
    py: Python<'py>,
    parent: &[u8],
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
) -> PyResult<Bound<'py, PyList>> {
    let parent: BlockDigest = parent.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "parent must be a {DIGEST_LEN}-byte block key, got {} bytes",
            parent.len()
        ))
    })?;
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be at least 1"));
    }
    let tokens = extract::u32s(token_ids, &|| "token_ids".into()).map_err(value_error)?;
    let mut keys = Vec::new();
    if tokens.len() >= DETACH_MIN_TOKENS {
        py.detach(|| prefix_hash::chain_blocks(&parent, &tokens, block_size, &mut keys));
    } else {
        prefix_hash::chain_blocks(&parent, &tokens, block_size, &mut keys);
    }
    PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("BLOCK_HASH_LEN", DIGEST_LEN)?;
    m.add_function(wrap_pyfunction!(block_hash_root, m)?)?;
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    Ok(())
}
