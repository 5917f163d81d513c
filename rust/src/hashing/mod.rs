//! Stable key hashing and consistent hashing.
//!
//! Invariants:
//! - [`hash_key`] is XXH3-64 with seed 0 over the key's bytes (a string's UTF-8 bytes; an integer's
//!   8 little-endian bytes). It is part of the public contract and never changes between releases.
//! - [`jump_hash`] is Lamping & Veach's jump consistent hash, bit-exact with the paper's reference
//!   code, applied to the 64-bit key exactly as given.

mod jump;

pub use jump::jump_hash;

use xxhash_rust::xxh3::xxh3_64;

/// A routing key: arbitrary bytes (a `str` is its UTF-8 bytes) or an unsigned 64-bit integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key<'a> {
    /// Raw bytes (strings are passed as their UTF-8 encoding).
    Bytes(&'a [u8]),
    /// An integer key, 0 ≤ k < 2^64.
    Int(u64),
}

impl Key<'_> {
    /// The key's stable 64-bit hash; see [`hash_key`].
    #[inline]
    pub fn hash64(&self) -> u64 {
        match *self {
            Key::Bytes(b) => hash_key(b),
            Key::Int(k) => hash_key(&k.to_le_bytes()),
        }
    }
}

/// XXH3-64, seed 0, over `bytes`. Stable forever: persisted placements depend on it.
#[inline]
pub fn hash_key(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_key_matches_xxh3_reference_vectors() {
        // XXH3-64 seed 0 reference values (xxHash test suite): empty input.
        assert_eq!(hash_key(b""), 0x2D06_8005_38D3_94C2);
        // Integers hash as their 8 little-endian bytes.
        assert_eq!(Key::Int(7).hash64(), hash_key(&7u64.to_le_bytes()));
        assert_eq!(Key::Bytes(b"abc").hash64(), hash_key(b"abc"));
    }
}
