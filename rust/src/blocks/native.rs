//! The `native` profile: kvroute's own chained XXH3-64 block hash.
//!
//! Definition (stable; changing it is a breaking change):
//!
//! ```text
//! field(None)  = 0x00
//! field(s)     = 0x01 || u64_le(len(utf8(s))) || utf8(s)
//! lora         = None, or field(lora_name) || field(lora_path)   (lora_path "" when not given)
//! root         = XXH3-64(b"kvroute-native-v1" || field(salt) || (0x00 | 0x01 || lora), seed = 0)
//! h_{-1}       = root                       (or the parent block's hash when continuing a chain)
//! h_i          = XXH3-64(u32_le(t_{iB}) || … || u32_le(t_{iB+B-1}), seed = h_{i-1})
//! ```
//!
//! Token ids must fit in `u32`. Salt and LoRA only change the root, so two tenants share a block
//! exactly when they share the salt, the adapter and every token up to and including the block.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::TokenId;

const DOMAIN: &[u8] = b"kvroute-native-v1";

/// The native chain for one (salt, LoRA) namespace.
#[derive(Debug, Clone)]
pub struct Native {
    root: u64,
}

/// Per-call scratch: the block's tokens as little-endian `u32` bytes.
pub struct Scratch {
    bytes: Vec<u8>,
}

impl Scratch {
    /// Scratch for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Scratch {
            bytes: vec![0; block_size.saturating_mul(4)],
        }
    }
}

fn push_field(buf: &mut Vec<u8>, field: Option<&str>) {
    match field {
        None => buf.push(0),
        Some(s) => {
            buf.push(1);
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }
    }
}

/// The root seed of the chain for `salt` (non-empty) and `lora` = `(name, path)`.
pub fn root(salt: Option<&str>, lora: Option<(&str, &str)>) -> u64 {
    let mut pre = DOMAIN.to_vec();
    push_field(&mut pre, salt);
    match lora {
        None => pre.push(0),
        Some((name, path)) => {
            pre.push(1);
            push_field(&mut pre, Some(name));
            push_field(&mut pre, Some(path));
        }
    }
    xxh3_64_with_seed(&pre, 0)
}

impl Native {
    /// The chain for `salt` and `lora` = `(name, path)`.
    pub fn new(salt: Option<&str>, lora: Option<(&str, &str)>) -> Self {
        Native {
            root: root(salt, lora),
        }
    }

    /// The seed of the first block.
    pub fn root(&self) -> u64 {
        self.root
    }

    /// The hash of one full block after a block whose hash is `parent`. Tokens must be validated
    /// (non-negative, < 2^32) and `block.len()` must be the scratch's block size.
    #[inline]
    pub fn hash_block<T: TokenId>(&self, parent: u64, block: &[T], scratch: &mut Scratch) -> u64 {
        for (dst, t) in scratch.bytes.chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&(t.bits() as u32).to_le_bytes());
        }
        xxh3_64_with_seed(&scratch.bytes, parent)
    }
}
