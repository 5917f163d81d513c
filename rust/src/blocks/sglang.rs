//! The `sglang` profile: SGLang 0.5.23's page hash, as published in its KV events.
//!
//! ```text
//! seed      = SHA-256(b"sglang-cache-salt-v1\0" || utf8(salt))    for a salted request
//! d_i       = SHA-256(d_{i-1} || u32_le(t_iB) || … || u32_le(t_iB+B-1))
//!             d_{-1} = seed, or nothing at all for an unsalted request's first page
//!             if any id of the page exceeds 2^32-1: SHA-256(d_{i-1} || 0xff || u64_le(t) …)
//! value_i   = first 8 bytes of d_i, big-endian
//! ```
//!
//! SGLang publishes the value as a signed int64; kvroute returns the same 64 bits as `u64`
//! (`value as i64` recovers SGLang's number). LoRA `extra_key`s are not part of these hashes.

use sha2::{Digest, Sha256};

use super::TokenId;

const SALT_DOMAIN: &[u8] = b"sglang-cache-salt-v1\0";

/// The 64-bit value SGLang publishes for a digest: its first 8 bytes, big-endian (read as
/// signed by SGLang, returned here as the same bits).
#[inline]
pub fn value(digest: &[u8; 32]) -> u64 {
    digest
        .first_chunk::<8>()
        .map_or(0, |head| u64::from_be_bytes(*head))
}

/// The SGLang chain of one namespace (cache salt or none).
#[derive(Debug, Clone)]
pub struct Sglang {
    salt_seed: Option<[u8; 32]>,
}

/// Per-call scratch: the page's token bytes (4 per token, or 1 + 8 per token for wide ids).
pub struct Scratch {
    bytes: Vec<u8>,
}

impl Scratch {
    /// Scratch for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        Scratch {
            bytes: Vec::with_capacity(page_size.saturating_mul(4)),
        }
    }
}

/// The chain seed of a salted request.
pub fn salt_seed(salt: &str) -> [u8; 32] {
    Sha256::new()
        .chain_update(SALT_DOMAIN)
        .chain_update(salt.as_bytes())
        .finalize()
        .into()
}

impl Sglang {
    /// The chain for `salt` (non-empty) or the unsalted chain.
    pub fn new(salt: Option<&str>) -> Self {
        Sglang {
            salt_seed: salt.map(salt_seed),
        }
    }

    /// The digest a salted chain starts from; `None` when unsalted.
    pub fn salt_seed(&self) -> Option<&[u8; 32]> {
        self.salt_seed.as_ref()
    }

    /// The digest of one full page after `prev` (`None`: an unsalted first page). Tokens must be
    /// validated (non-negative).
    #[inline]
    pub fn hash_block<T: TokenId>(
        &self,
        prev: Option<&[u8; 32]>,
        page: &[T],
        scratch: &mut Scratch,
    ) -> [u8; 32] {
        let bytes = &mut scratch.bytes;
        bytes.clear();
        if page.iter().all(|t| t.bits() <= u64::from(u32::MAX)) {
            for t in page {
                bytes.extend_from_slice(&(t.bits() as u32).to_le_bytes());
            }
        } else {
            bytes.push(0xff);
            for t in page {
                bytes.extend_from_slice(&t.bits().to_le_bytes());
            }
        }
        let mut hasher = Sha256::new();
        if let Some(prev) = prev {
            hasher.update(prev);
        }
        hasher.update(bytes.as_slice());
        hasher.finalize().into()
    }
}
