//! The `vllm` profile: bit-identical to vLLM's prefix-cache block hashes, for both hash
//! algorithms a vLLM engine offers without a random seed and for every extra-key format since 0.23.
//!
//! ```text
//! NONE_HASH = H(seed)                                  seed = $PYTHONHASHSEED or "vllm-none-hash"
//! d_i       = H((d_{i-1} or NONE_HASH, (t_iB, …, t_iB+B-1), extra_keys_i or None))
//! value_i   = last 8 bytes of d_i, big-endian          (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
//! ```
//!
//! `H` is SHA-256 of a serialization ([`HashAlgo`]): `sha256` — vLLM's **default**
//! `--prefix-caching-hash-algo` — serializes with `pickle.dumps(x, protocol=5)` (see [`pickle`]);
//! `sha256_cbor` with canonical CBOR as `cbor2.dumps(x, canonical=True)` writes it (shortest
//! integer heads, definite-length arrays, tuples as arrays, `bytes` as byte strings, `str` as text).
//!
//! The extra keys of block `i`, in this order, and their form by release ([`KeyFormat`], read in
//! `generate_block_hash_extra_keys` at the tags v0.23.0, v0.26.0, v0.29.0, v0.30.0, v0.31.0,
//! v0.33.0):
//!
//! | key | vLLM 0.23–0.30 (`Untagged`) | vLLM ≥ 0.31 (`Tagged`) | on |
//! |---|---|---|---|
//! | LoRA | `lora_name` | `("lora", lora_name, lora_path)` | every block of a LoRA request |
//! | multimodal item | `(identifier, offset - block_start)` | `("mm", identifier, offset - block_start)` | each item the block overlaps |
//! | cache salt | `salt` | `("cache_salt", salt)` | the sequence's first block |
//!
//! NONE_HASH: vLLM ≥ 0.29 derives it from `"vllm-none-hash"` for both algorithms unless
//! `PYTHONHASHSEED` is set; vLLM ≤ 0.28 draws it at random per process unless `PYTHONHASHSEED`
//! is set, so reproducing those engines needs `seed` = their `PYTHONHASHSEED`
//! ([`VllmVersion::random_none_hash`]). Prompt-embedding keys, the `xxhash` algorithms (random
//! seed by design) and vLLM before 0.23 are not reproduced.

pub mod pickle;

use std::fmt;
use std::str::FromStr;

use minicbor::encode::write::{Cursor, EndOfSlice, Write};
use minicbor::encode::Error as CborError;
use minicbor::Encoder;
use sha2::{Digest, Sha256};

use self::pickle::{Memo, Pickler, StrId};
use super::{MmItem, TokenId};
use crate::error::{Error, Result};
use crate::value_err;

/// vLLM ≥ 0.29's NONE_HASH seed when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SEED: &str = "vllm-none-hash";

/// The 64-bit value vLLM publishes for a digest: its last 8 bytes, big-endian.
#[inline]
pub fn value(digest: &[u8; 32]) -> u64 {
    digest
        .last_chunk::<8>()
        .map_or(0, |tail| u64::from_be_bytes(*tail))
}

/// vLLM's `--prefix-caching-hash-algo` (the SHA-256 ones: the `xxhash` ones use a random seed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// `sha256`: SHA-256 of the protocol-5 pickle (vLLM's default).
    Sha256,
    /// `sha256_cbor`: SHA-256 of canonical CBOR.
    Sha256Cbor,
}

impl HashAlgo {
    /// The name vLLM gives it.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
        }
    }
}

impl FromStr for HashAlgo {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sha256" => Ok(HashAlgo::Sha256),
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            other => value_err!(
                "hash_algo must be 'sha256' (vLLM's default) or 'sha256_cbor', got {other:?} \
                 (vLLM's xxhash algorithms use a random per-process seed and cannot be reproduced)"
            ),
        }
    }
}

/// How a release writes the extra keys (see the module docs' table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyFormat {
    /// vLLM 0.23–0.30: bare LoRA name and salt, `(identifier, offset)` multimodal pairs.
    Untagged,
    /// vLLM ≥ 0.31: `("lora", name, path)`, `("mm", identifier, offset)`, `("cache_salt", salt)`.
    Tagged,
}

/// A vLLM release `major.minor` whose block hashes are reproduced (≥ 0.23).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VllmVersion {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
}

impl VllmVersion {
    /// The oldest release reproduced.
    pub const OLDEST: VllmVersion = VllmVersion {
        major: 0,
        minor: 23,
    };
    /// The newest release whose hashing was read (the default: later releases are assumed to
    /// hash as it does until they are read).
    pub const NEWEST: VllmVersion = VllmVersion {
        major: 0,
        minor: 33,
    };

    /// The release's extra-key format.
    pub fn key_format(self) -> KeyFormat {
        if self
            >= (VllmVersion {
                major: 0,
                minor: 31,
            })
        {
            KeyFormat::Tagged
        } else {
            KeyFormat::Untagged
        }
    }

    /// Whether the release draws NONE_HASH at random when `PYTHONHASHSEED` is unset (≤ 0.28).
    pub fn random_none_hash(self) -> bool {
        self < VllmVersion {
            major: 0,
            minor: 29,
        }
    }
}

impl fmt::Display for VllmVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl FromStr for VllmVersion {
    type Err = Error;

    /// `"0.30"`, `"0.30.0"`, `"0.30.1rc1"`, `"v0.31.0"`: major and minor are what count.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.strip_prefix('v').unwrap_or(s);
        let mut parts = t.split('.');
        let num = |p: Option<&str>| -> Option<u16> {
            let p = p?;
            let digits = p.find(|c: char| !c.is_ascii_digit()).map_or(p, |i| &p[..i]);
            digits.parse().ok()
        };
        let version = match (num(parts.next()), num(parts.next())) {
            (Some(major), Some(minor)) => VllmVersion { major, minor },
            _ => return value_err!("vllm_version must look like '0.30' or '0.30.1', got {s:?}"),
        };
        if version < Self::OLDEST {
            return value_err!(
                "vllm_version {s:?} is older than {}, the oldest release whose block hashes \
                 kvroute reproduces",
                Self::OLDEST
            );
        }
        Ok(version)
    }
}

/// Which vLLM hashing a `vllm` hasher reproduces: the algorithm and the release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Flavor {
    /// `--prefix-caching-hash-algo`.
    pub algo: HashAlgo,
    /// The engine's release.
    pub version: VllmVersion,
}

impl Default for Flavor {
    /// `sha256_cbor` (kvroute's historical default for `profile="vllm"`), newest release.
    fn default() -> Self {
        Flavor {
            algo: HashAlgo::Sha256Cbor,
            version: VllmVersion::NEWEST,
        }
    }
}

/// The vLLM chain of one request shape (flavor, seed, cache salt, LoRA).
#[derive(Debug, Clone)]
pub struct Vllm {
    pub(in crate::blocks) flavor: Flavor,
    none_hash: [u8; 32],
    lora: Option<(String, String)>,
    salt: Option<String>,
    /// CBOR of the LoRA key in the flavor's format, empty without LoRA.
    lora_key: Vec<u8>,
    /// CBOR of the cache-salt key in the flavor's format, empty without a salt.
    salt_key: Vec<u8>,
}

/// Per-call scratch: the pre-image buffer, the pickle memo and the multimodal items of the
/// current block.
pub struct Scratch {
    /// CBOR: sized once to the largest pre-image a block of this call can have (minicbor writes
    /// into a slice cursor markedly faster than into a `Vec`). Pickle: grown once, then reused.
    pub(in crate::blocks) preimage: Vec<u8>,
    pub(in crate::blocks) memo: Memo,
    pub(in crate::blocks) mm_selected: Vec<usize>,
}

/// Upper bound of a CBOR head (major type + argument) in bytes.
const HEAD: usize = 9;

impl Scratch {
    /// Scratch for blocks of `block_size` tokens hashed by `vllm` with multimodal items `mm`.
    pub fn new(vllm: &Vllm, block_size: usize, mm: &[MmItem]) -> Self {
        let preimage = match vllm.flavor.algo {
            HashAlgo::Sha256Cbor => {
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
                vec![0; bound]
            }
            HashAlgo::Sha256 => Vec::with_capacity(64 + 5 * block_size),
        };
        Scratch {
            preimage,
            memo: Memo::default(),
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

/// Canonical CBOR of one text string, or of a tuple of them.
fn cbor_strs(items: &[&str], tuple: bool) -> Result<Vec<u8>> {
    let mut enc = Encoder::new(Vec::new());
    if tuple {
        enc.array(items.len() as u64).map_err(cbor)?;
    }
    for s in items {
        enc.str(s).map_err(cbor)?;
    }
    Ok(enc.into_writer())
}

/// vLLM's `NONE_HASH` for `seed` under `algo`: SHA-256 of the seed string serialized.
pub fn none_hash(seed: &str, algo: HashAlgo) -> Result<[u8; 32]> {
    match algo {
        HashAlgo::Sha256Cbor => {
            let mut enc = Encoder::new(Vec::new());
            enc.str(seed).map_err(cbor)?;
            Ok(Sha256::digest(enc.writer()).into())
        }
        HashAlgo::Sha256 => {
            let (mut out, mut memo) = (Vec::new(), Memo::default());
            let mut p = Pickler::new(&mut out, &mut memo);
            p.str(seed, StrId::Value);
            Ok(Sha256::digest(p.finish()).into())
        }
    }
}

impl Vllm {
    /// The chain for `flavor`, NONE_HASH `seed`, cache `salt` (non-empty) and `lora` =
    /// `(name, path)`.
    pub fn new(
        flavor: Flavor,
        seed: &str,
        salt: Option<&str>,
        lora: Option<(&str, &str)>,
    ) -> Result<Self> {
        let tagged = flavor.version.key_format() == KeyFormat::Tagged;
        Ok(Vllm {
            flavor,
            none_hash: none_hash(seed, flavor.algo)?,
            lora: lora.map(|(n, p)| (n.to_owned(), p.to_owned())),
            salt: salt.map(str::to_owned),
            lora_key: match lora {
                Some((name, path)) if tagged => cbor_strs(&["lora", name, path], true)?,
                Some((name, _)) => cbor_strs(&[name], false)?,
                None => Vec::new(),
            },
            salt_key: match salt {
                Some(salt) if tagged => cbor_strs(&["cache_salt", salt], true)?,
                Some(salt) => cbor_strs(&[salt], false)?,
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
    /// [`Scratch::select_mm`] for the block starting at token `start`. Errors only if a CBOR
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
            memo,
            mm_selected,
        } = scratch;
        match self.flavor.algo {
            HashAlgo::Sha256Cbor => {
                let mut enc = Encoder::new(Cursor::new(preimage.as_mut_slice()));
                self.encode_cbor(&mut enc, parent, block, first, mm, mm_selected, start)
                    .map_err(cbor)?;
                let len = enc.writer().position();
                let written = preimage.get(..len).unwrap_or_default();
                Ok(Sha256::digest(written).into())
            }
            HashAlgo::Sha256 => {
                let mut p = Pickler::new(preimage, memo);
                self.encode_pickle(&mut p, parent, block, first, mm, mm_selected, start);
                Ok(Sha256::digest(p.finish()).into())
            }
        }
    }

    fn extra_key_count(&self, first: bool, mm_selected: &[usize]) -> usize {
        usize::from(self.lora.is_some())
            + mm_selected.len()
            + usize::from(first && self.salt.is_some())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::blocks) fn encode_cbor<T: TokenId>(
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
        let count = self.extra_key_count(first, mm_selected);
        if count == 0 {
            enc.null()?;
            return Ok(());
        }
        enc.array(count as u64)?;
        enc.writer_mut()
            .write_all(&self.lora_key)
            .map_err(CborError::write)?;
        let tagged = self.flavor.version.key_format() == KeyFormat::Tagged;
        for item in mm_selected.iter().filter_map(|&i| mm.get(i)) {
            if tagged {
                enc.array(3)?.str("mm")?;
            } else {
                enc.array(2)?;
            }
            enc.str(&item.identifier)?.i64(item.offset - start)?;
        }
        if first && self.salt.is_some() {
            enc.writer_mut()
                .write_all(&self.salt_key)
                .map_err(CborError::write)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::blocks) fn encode_pickle<T: TokenId>(
        &self,
        p: &mut Pickler<'_>,
        parent: &[u8; 32],
        block: &[T],
        first: bool,
        mm: &[MmItem],
        mm_selected: &[usize],
        start: i64,
    ) {
        p.begin_tuple(3);
        p.bytes(parent);
        p.begin_tuple(block.len());
        for t in block {
            p.int(i128::from(t.bits()));
        }
        p.end_tuple(block.len());
        let count = self.extra_key_count(first, mm_selected);
        if count == 0 {
            p.none();
        } else {
            let tagged = self.flavor.version.key_format() == KeyFormat::Tagged;
            p.begin_tuple(count);
            if let Some((name, path)) = &self.lora {
                if tagged {
                    p.begin_tuple(3);
                    p.str("lora", StrId::Literal("lora"));
                    p.str(name, StrId::Value);
                    p.str(path, StrId::Value);
                    p.end_tuple(3);
                } else {
                    p.str(name, StrId::Value);
                }
            }
            for item in mm_selected.iter().filter_map(|&i| mm.get(i)) {
                let n = if tagged { 3 } else { 2 };
                p.begin_tuple(n);
                if tagged {
                    p.str("mm", StrId::Literal("mm"));
                }
                p.str(&item.identifier, StrId::Value);
                p.int(i128::from(item.offset - start));
                p.end_tuple(n);
            }
            if let (true, Some(salt)) = (first, &self.salt) {
                if tagged {
                    p.begin_tuple(2);
                    p.str("cache_salt", StrId::Literal("cache_salt"));
                    p.str(salt, StrId::Value);
                    p.end_tuple(2);
                } else {
                    p.str(salt, StrId::Value);
                }
            }
            p.end_tuple(count);
        }
        p.end_tuple(3);
    }
}
