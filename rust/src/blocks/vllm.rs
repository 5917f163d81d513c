//! The `vllm` profile: bit-identical to vLLM ≥ 0.29 with `prefix_caching_hash_algo="sha256_cbor"`.
//!
//! ```text
//! NONE_HASH = SHA-256(cbor(seed))                      seed = $PYTHONHASHSEED or "vllm-none-hash"
//! d_i       = SHA-256(cbor([d_{i-1} or NONE_HASH, [t_iB, …, t_iB+B-1], extra_keys_i or None]))
//! value_i   = last 8 bytes of d_i, big-endian          (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
//! ```
//!
//! `cbor` is canonical CBOR as `cbor2.dumps(x, canonical=True)` writes it: shortest integer heads,
//! definite-length arrays, tuples as arrays, `bytes` as byte strings, `str` as text strings. The
//! extra keys of block `i` are, in vLLM ≥ 0.31's tagged form and in this order:
//! `("lora", lora_name, lora_path)` on every block of a LoRA request; `("mm", identifier,
//! offset - block_start)` for each multimodal item the block's token range overlaps (vLLM's walk
//! over items sorted by offset); `("cache_salt", salt)` on the first block of the sequence only.
//! Prompt-embedding keys and the pickle-based `sha256` algorithm are not reproduced.

use minicbor::encode::write::{Cursor, EndOfSlice, Write};
use minicbor::encode::Error as CborError;
use minicbor::Encoder;
use sha2::{Digest, Sha256};

use super::{MmItem, TokenId};
use crate::error::{Error, Result};

/// vLLM ≥ 0.29's NONE_HASH seed for `sha256_cbor` when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// The 64-bit value vLLM publishes for a digest: its last 8 bytes, big-endian.
#[inline]
pub fn value(digest: &[u8; 32]) -> u64 {
    digest
        .last_chunk::<8>()
        .map_or(0, |tail| u64::from_be_bytes(*tail))
}

/// The vLLM chain of one request shape (seed, cache salt, LoRA).
#[derive(Debug, Clone)]
pub struct Vllm {
    none_hash: [u8; 32],
    /// Canonical CBOR of `("lora", name, path)`, empty without LoRA.
    lora_key: Vec<u8>,
    /// Canonical CBOR of `("cache_salt", salt)`, empty without a salt.
    salt_key: Vec<u8>,
}

/// Per-call scratch: the CBOR pre-image buffer and the multimodal items of the current block.
pub struct Scratch {
    /// Sized once to the largest pre-image a block of this call can have; CBOR is written
    /// through a slice cursor, which minicbor encodes into markedly faster than into a `Vec`.
    pub(super) preimage: Vec<u8>,
    pub(super) mm_selected: Vec<usize>,
}

/// Upper bound of a CBOR head (major type + argument) in bytes.
const HEAD: usize = 9;

impl Scratch {
    /// Scratch for blocks of `block_size` tokens hashed by `vllm` with multimodal items `mm`.
    pub fn new(vllm: &Vllm, block_size: usize, mm: &[MmItem]) -> Self {
        // [parent, [tokens], [lora, mm…, salt]]: every head at most 9 bytes.
        let mm_bytes = mm.iter().fold(0usize, |n, item| {
            n.saturating_add(item.identifier.len() + 4 * HEAD)
        });
        let bound = [
            HEAD + HEAD + 32,
            HEAD.saturating_mul(block_size.saturating_add(1)),
            HEAD + vllm.lora_key.len() + vllm.salt_key.len(),
            mm_bytes,
        ]
        .iter()
        .fold(0usize, |n, &b| n.saturating_add(b));
        Scratch {
            preimage: vec![0; bound],
            mm_selected: Vec::new(),
        }
    }

    /// Records which items of `mm` the block `start..end` carries as extra keys, walking from
    /// `cursor` exactly as vLLM's `_gen_mm_extra_hash_keys` does; returns the next cursor.
    pub fn select_mm(&mut self, mm: &[MmItem], mut cursor: usize, start: i64, end: i64) -> usize {
        self.mm_selected.clear();
        while let Some(item) = mm.get(cursor) {
            // Offsets and lengths are validated to |x| < 2^62, so the sum cannot overflow.
            let item_end = item.offset + item.length as i64;
            if end <= item.offset {
                break; // the block has not reached this item
            }
            if start >= item_end {
                cursor += 1; // the block is past this item
                continue;
            }
            self.mm_selected.push(cursor);
            if end >= item_end {
                cursor += 1; // the item ends in this block; the next may start in it too
            } else {
                break;
            }
        }
        cursor
    }
}

fn cbor<E: std::fmt::Debug>(e: CborError<E>) -> Error {
    Error::Value(format!("CBOR encoding failed: {e:?}"))
}

/// Canonical CBOR of a tuple of text strings.
fn str_tuple(items: &[&str]) -> Result<Vec<u8>> {
    let mut enc = Encoder::new(Vec::new());
    enc.array(items.len() as u64).map_err(cbor)?;
    for s in items {
        enc.str(s).map_err(cbor)?;
    }
    Ok(enc.into_writer())
}

/// SHA-256 of the canonical CBOR of `seed` (a text string): vLLM's `NONE_HASH`.
pub fn none_hash(seed: &str) -> Result<[u8; 32]> {
    let mut enc = Encoder::new(Vec::new());
    enc.str(seed).map_err(cbor)?;
    Ok(Sha256::digest(enc.writer()).into())
}

impl Vllm {
    /// The chain for NONE_HASH `seed`, cache `salt` (non-empty) and `lora` = `(name, path)`.
    pub fn new(seed: &str, salt: Option<&str>, lora: Option<(&str, &str)>) -> Result<Self> {
        Ok(Vllm {
            none_hash: none_hash(seed)?,
            lora_key: match lora {
                Some((name, path)) => str_tuple(&["lora", name, path])?,
                None => Vec::new(),
            },
            salt_key: match salt {
                Some(salt) => str_tuple(&["cache_salt", salt])?,
                None => Vec::new(),
            },
        })
    }

    /// vLLM's `NONE_HASH`: the parent digest of a sequence's first block.
    pub fn none_hash(&self) -> &[u8; 32] {
        &self.none_hash
    }

    /// The digest of one full block after `parent`. `first` marks the sequence's first block
    /// (it carries the cache salt); the multimodal keys are `scratch`'s items selected by
    /// [`Scratch::select_mm`] for the block starting at token `start`. Errors only if the
    /// pre-image outgrew the scratch buffer, which its sizing rules out.
    #[inline]
    pub fn hash_block<T: TokenId>(
        &self,
        parent: &[u8; 32],
        block: &[T],
        first: bool,
        mm: &[MmItem],
        start: i64,
        scratch: &mut Scratch,
    ) -> Result<[u8; 32]> {
        let Scratch {
            preimage,
            mm_selected,
        } = scratch;
        let mut enc = Encoder::new(Cursor::new(preimage.as_mut_slice()));
        // The buffer is sized for the largest pre-image (see `Scratch::new`), so this cannot fail.
        self.encode_preimage(&mut enc, parent, block, first, mm, mm_selected, start)
            .map_err(cbor)?;
        let len = enc.writer().position();
        let written = preimage.get(..len).unwrap_or_default();
        Ok(Sha256::digest(written).into())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn encode_preimage<T: TokenId>(
        &self,
        enc: &mut Encoder<Cursor<&mut [u8]>>,
        parent: &[u8; 32],
        block: &[T],
        first: bool,
        mm: &[MmItem],
        mm_selected: &[usize],
        start: i64,
    ) -> std::result::Result<(), CborError<EndOfSlice>> {
        enc.array(3)?.bytes(parent)?.array(block.len() as u64)?;
        for t in block {
            enc.u64(t.bits())?;
        }
        let salt = first && !self.salt_key.is_empty();
        let count = usize::from(!self.lora_key.is_empty()) + mm_selected.len() + usize::from(salt);
        if count == 0 {
            enc.null()?;
            return Ok(());
        }
        enc.array(count as u64)?;
        enc.writer_mut()
            .write_all(&self.lora_key)
            .map_err(CborError::write)?;
        for item in mm_selected.iter().filter_map(|&i| mm.get(i)) {
            enc.array(3)?
                .str("mm")?
                .str(&item.identifier)?
                .i64(item.offset - start)?;
        }
        if salt {
            enc.writer_mut()
                .write_all(&self.salt_key)
                .map_err(CborError::write)?;
        }
        Ok(())
    }
}
