//! Prefix-cache block keys: a SHA-256 chain over the full blocks of a token
//! sequence. Pure Rust; `py::prefix_hash` is the binding.
//!
//! ```text
//! root      = SHA-256(DOMAIN || 0x00)                      no cache salt
//!           = SHA-256(DOMAIN || 0x01 || salt as UTF-8)     with one
//! key[0]    = SHA-256(root     || block 0's ids, 4-byte little-endian each)
//! key[i]    = SHA-256(key[i-1] || block i's ids)
//! ```
//!
//! Every input has a fixed width (a 32-byte parent, `block_size` ids) except
//! the salt, which only ever ends the root's input, so two different
//! (salt, prefix) pairs give different inputs at every link; keys collide only
//! if SHA-256 does. A block's key therefore stands for its whole prefix and
//! its salt, and the prefix cache can share K/V blocks on key equality alone.

use sha2::{Digest, Sha256};

/// Length of one block key in bytes.
pub const DIGEST_LEN: usize = 32;

/// One block's key.
pub type BlockDigest = [u8; DIGEST_LEN];

/// Separates these digests from any other use of SHA-256 over similar bytes;
/// bump the version if the layout above ever changes.
const DOMAIN: &[u8] = b"asyncllm prefix-cache block v1\0";

/// The parent of a sequence's first block: it carries the optional cache salt,
/// so requests with different salts never share a block.
pub fn root_digest(cache_salt: Option<&str>) -> BlockDigest {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    match cache_salt {
        None => h.update([0u8]),
        Some(salt) => {
            h.update([1u8]);
            h.update(salt.as_bytes());
        }
    }
    h.finalize().into()
}

/// Appends to `out` the key of every full block of `token_ids`, chained from
/// `parent` (the key of the block before `token_ids[0]`, or a `root_digest`).
/// A trailing partial block is not hashed. Returns the number of keys appended.
///
/// # Panics
/// If `block_size` is 0.
pub fn chain_blocks(
    parent: &BlockDigest,
    token_ids: &[u32],
    block_size: usize,
    out: &mut Vec<BlockDigest>,
) -> usize {
    assert!(block_size > 0, "block_size must be at least 1");
    let num_blocks = token_ids.len() / block_size;
    out.reserve(num_blocks);
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut parent = *parent;
    for block in token_ids.chunks_exact(block_size) {
        bytes.clear();
        for &t in block {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut h = Sha256::new();
        h.update(parent);
        h.update(&bytes);
        parent = h.finalize().into();
        out.push(parent);
    }
    num_blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(salt: Option<&str>, tokens: &[u32], block_size: usize) -> Vec<BlockDigest> {
        let mut out = Vec::new();
        chain_blocks(&root_digest(salt), tokens, block_size, &mut out);
        out
    }

    fn hex(d: &BlockDigest) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn matches_the_documented_layout() {
        // Recomputed by hand from the layout in the module docs.
        let mut root = Sha256::new();
        root.update(b"asyncllm prefix-cache block v1\0\x00");
        let root: BlockDigest = root.finalize().into();
        let mut first = Sha256::new();
        first.update(root);
        first.update([1, 0, 0, 0, 2, 0, 0, 0]);
        let first: BlockDigest = first.finalize().into();
        assert_eq!(keys(None, &[1, 2, 3], 2), vec![first]);
    }

    #[test]
    fn keys_are_pinned() {
        // Computed independently (Python's hashlib), so that a change of layout
        // is a visible, deliberate change.
        assert_eq!(
            hex(&root_digest(None)),
            "d359f5ccb287ea576973f8694b2c6c98ec8ab83480cce402f90b470fc11041f2"
        );
        assert_eq!(
            hex(&keys(None, &[0, 1, 2, 3], 4)[0]),
            "7247c33dfa04cbc3c38f6676e854dd04abaa14eeeffb035e8c3bbddd7c406e9a"
        );
        assert_ne!(root_digest(None), root_digest(Some("")));
    }

    #[test]
    fn chaining_in_pieces_equals_chaining_at_once() {
        let tokens: Vec<u32> = (0..100).map(|i| i * 7919 % 150_000).collect();
        let whole = keys(Some("tenant-a"), &tokens, 16);
        assert_eq!(whole.len(), 6);
        let mut pieces = keys(Some("tenant-a"), &tokens[..48], 16);
        let last = *pieces.last().unwrap();
        chain_blocks(&last, &tokens[48..], 16, &mut pieces);
        assert_eq!(pieces, whole);
    }

    #[test]
    fn salts_separate_and_equal_salts_share() {
        let tokens: Vec<u32> = (0..64).collect();
        let a = keys(Some("a"), &tokens, 16);
        assert_eq!(a, keys(Some("a"), &tokens, 16));
        let b = keys(Some("b"), &tokens, 16);
        let none = keys(None, &tokens, 16);
        for i in 0..a.len() {
            assert_ne!(a[i], b[i]);
            assert_ne!(a[i], none[i]);
        }
    }

    #[test]
    fn every_key_depends_on_the_whole_prefix() {
        let tokens: Vec<u32> = (0..64).collect();
        let mut other = tokens.clone();
        other[0] = 1_000;
        let (a, b) = (keys(None, &tokens, 16), keys(None, &other, 16));
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        // token ids are fixed-width: [1, 0x100] and [0x1_0001, 0] differ
        assert_ne!(keys(None, &[1, 0x100], 2), keys(None, &[0x1_0001, 0], 2));
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        assert!(keys(None, &[1, 2, 3], 4).is_empty());
        let mut out = Vec::new();
        assert_eq!(chain_blocks(&root_digest(None), &[], 4, &mut out), 0);
    }
}
