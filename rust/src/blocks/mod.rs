//! Token blocks → chained 64-bit block hashes, bit-exact with the engines' prefix-cache keys.
//!
//! A [`BlockHasher`] cuts a token sequence into blocks of `block_size` tokens and hashes every
//! **full** block together with the chain state left by the block before it. A sequence of `n`
//! tokens gives `n / block_size` hashes: a partial tail is never hashed (engines cache only full
//! blocks). One submodule per profile:
//!
//! - [`native`]: XXH3-64 of the block's tokens as little-endian `u32`, seeded with the previous
//!   block's hash; the first block is seeded with a root derived from the salt and LoRA.
//! - [`vllm`]: vLLM ≥ 0.23, `sha256` (its default: SHA-256 of the protocol-5 pickle of
//!   `(parent, tokens, extra_keys)`) or `sha256_cbor` (of canonical CBOR), each release's
//!   extra-key format ([`vllm::Flavor`]); value = the digest's last 8 bytes, big-endian.
//! - [`sglang`]: SGLang 0.5.23 page hash (SHA-256 over the previous digest and the page's tokens),
//!   value = the digest's first 8 bytes, big-endian (SGLang's signed int64, as the same 64 bits).
//!
//! Invariants:
//! - **Chaining.** For `a` whose length is a multiple of `block_size`,
//!   `hash(a ++ b, p) == hash(a, p) ++ hash(b, s)` where `s` is the [`ChainState`] after the last
//!   block of `a` (multimodal offsets in `b` taken relative to `b`'s start).
//! - **Chain state.** A chain continues from a [`ChainState`]: [`ChainState::Root`] (start of a
//!   sequence), the previous block's 64-bit hash for `native`, or the previous block's full 32-byte
//!   SHA-256 digest for `vllm`/`sglang` (their 64-bit values cannot reconstruct the digest).
//! - **Isolation.** Different salts, LoRA adapters or (vLLM) NONE_HASH seeds give different chains
//!   from the first block on; an empty salt is no salt (as in vLLM and SGLang).
//! - **Validation first.** Every token (the dropped tail included), the parent and the multimodal
//!   items are checked before anything is written; on `Err` the output buffers are unchanged.
//! - **No allocation per block.** A call allocates at most one scratch buffer; the `*_into` and
//!   [`BlockHasher::hash_each`] variants write into caller-owned buffers.
//! - Results are independent of the platform (byte orders are explicit) and, for a given profile,
//!   never change between releases.

pub mod native;
pub mod sglang;
pub mod vllm;

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::value_err;

/// The hash function family, i.e. which engine's block keys are reproduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Profile {
    /// kvroute's own fast chain (XXH3-64); see [`native`].
    Native,
    /// vLLM's block hash, of one algorithm and release; see [`vllm`].
    Vllm(vllm::Flavor),
    /// SGLang 0.5.23 page hash; see [`sglang`].
    Sglang,
}

impl Profile {
    /// The profile's name as accepted by [`Profile::from_str`].
    pub fn name(self) -> &'static str {
        match self {
            Profile::Native => "native",
            Profile::Vllm(_) => "vllm",
            Profile::Sglang => "sglang",
        }
    }

    /// The vLLM flavor of a `vllm` profile.
    pub fn vllm_flavor(self) -> Option<vllm::Flavor> {
        match self {
            Profile::Vllm(f) => Some(f),
            _ => None,
        }
    }

    /// This profile with vLLM's `hash_algo` and/or `vllm_version` set (names as vLLM spells
    /// them, e.g. `"sha256"`, `"0.30.1"`); `None` keeps the current value. Errors (`Value`) for
    /// a bad name, or when either is given for a profile other than `vllm`.
    pub fn with_vllm(self, hash_algo: Option<&str>, vllm_version: Option<&str>) -> Result<Self> {
        if hash_algo.is_none() && vllm_version.is_none() {
            return Ok(self);
        }
        let Profile::Vllm(mut flavor) = self else {
            return value_err!(
                "hash_algo and vllm_version apply only to profile 'vllm', not {:?}",
                self.name()
            );
        };
        if let Some(a) = hash_algo {
            flavor.algo = a.parse()?;
        }
        if let Some(v) = vllm_version {
            flavor.version = v.parse()?;
        }
        Ok(Profile::Vllm(flavor))
    }

    /// Whether the chain state is a 32-byte digest (rather than the 64-bit value itself).
    pub fn chains_on_digest(self) -> bool {
        !matches!(self, Profile::Native)
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Profile {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "native" => Ok(Profile::Native),
            "vllm" => Ok(Profile::Vllm(vllm::Flavor::default())),
            "sglang" => Ok(Profile::Sglang),
            other => value_err!("profile must be 'native', 'vllm' or 'sglang', got {other:?}"),
        }
    }
}

/// Where a chain continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChainState {
    /// The start of a sequence: the profile's root (native root, vLLM NONE_HASH plus the cache
    /// salt on the first block, SGLang's empty or salted prefix).
    Root,
    /// After a `native` block: that block's 64-bit hash.
    Native(u64),
    /// After a `vllm`/`sglang` block: that block's full SHA-256 digest.
    Digest([u8; 32]),
}

/// A multimodal item of a vLLM request: its identifier (vLLM's `mm_hash`) and the token span
/// `offset..offset + length` it occupies, `offset` relative to the first token passed in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmItem {
    /// vLLM's `mm_feature.identifier`.
    pub identifier: String,
    /// First placeholder token, relative to the start of the tokens being hashed (may be
    /// negative when continuing a chain after the item began).
    pub offset: i64,
    /// Number of placeholder tokens.
    pub length: u64,
}

/// Largest |offset| and length accepted for a multimodal item (keeps all arithmetic in `i64`).
pub const MM_LIMIT: i64 = 1 << 62;

/// A token id as stored in an input buffer. Validation rejects negative ids (and, for `native`,
/// ids above `u32::MAX`) before hashing reads them with [`TokenId::bits`].
pub trait TokenId: Copy + fmt::Display + Send + Sync {
    /// True for a negative id.
    fn is_negative(self) -> bool;
    /// The id as `u64` (exact for every id that passed validation).
    fn bits(self) -> u64;
}

macro_rules! token_id {
    (unsigned $($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline(always)]
            fn is_negative(self) -> bool { false }
            #[inline(always)]
            fn bits(self) -> u64 { u64::from(self) }
        }
    )*};
    (signed $($t:ty),*) => {$(
        impl TokenId for $t {
            #[inline(always)]
            fn is_negative(self) -> bool { self < 0 }
            #[inline(always)]
            fn bits(self) -> u64 { self as u64 }
        }
    )*};
}
token_id!(unsigned u32, u64);
token_id!(signed i32, i64);

/// Per-hasher options. Empty strings for `salt` mean "no salt".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// vLLM `cache_salt` (first block only) / SGLang cache salt / a separate native chain.
    pub salt: Option<String>,
    /// LoRA adapter name (vLLM `("lora", name, path)` extra key; a separate native chain).
    pub lora_name: Option<String>,
    /// LoRA adapter path; requires `lora_name`. Defaults to `""` (vLLM's `LoRARequest` default).
    pub lora_path: Option<String>,
    /// vLLM NONE_HASH seed string (`$PYTHONHASHSEED`); default `"vllm-none-hash"`.
    pub seed: Option<String>,
}

/// Turns token sequences into chained block hashes; immutable once built, so shareable freely.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    profile: Profile,
    options: Options,
    engine: Engine,
}

#[derive(Debug, Clone)]
enum Engine {
    Native(native::Native),
    Vllm(vllm::Vllm),
    Sglang(sglang::Sglang),
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens (≥ 1).
    ///
    /// Errors (`Value`): `block_size == 0`; `lora_path` without `lora_name`; `seed` outside the
    /// `vllm` profile; a LoRA with the `sglang` profile (SGLang does not fold LoRA into its
    /// published page hashes by default).
    pub fn new(block_size: usize, profile: Profile, options: Options) -> Result<Self> {
        if block_size == 0 {
            return value_err!("block_size must be >= 1, got 0");
        }
        let Options {
            salt,
            lora_name,
            lora_path,
            seed,
        } = options;
        if let (Some(path), None) = (&lora_path, &lora_name) {
            return value_err!("lora_path {path:?} was given without lora_name");
        }
        if seed.is_some() && profile.vllm_flavor().is_none() {
            return value_err!(
                "seed is vLLM's NONE_HASH seed; it does not apply to profile {:?}",
                profile.name()
            );
        }
        if lora_name.is_some() && profile == Profile::Sglang {
            return value_err!(
                "profile 'sglang' does not support lora_name: SGLang's published page hashes \
                 do not include the adapter; use salt to separate tenants"
            );
        }
        let salt = salt.filter(|s| !s.is_empty());
        let lora_path = lora_name.as_ref().map(|_| lora_path.unwrap_or_default());
        let lora = lora_name.as_deref().zip(lora_path.as_deref());
        let engine = match profile {
            Profile::Native => Engine::Native(native::Native::new(salt.as_deref(), lora)),
            Profile::Vllm(flavor) => {
                if seed.is_none() && flavor.version.random_none_hash() {
                    return value_err!(
                        "vLLM {} draws its NONE_HASH at random in every process unless \
                         PYTHONHASHSEED is set; pass seed= the engines' PYTHONHASHSEED (or use \
                         the events index in rehash mode, which needs no seed)",
                        flavor.version
                    );
                }
                Engine::Vllm(vllm::Vllm::new(
                    flavor,
                    seed.as_deref().unwrap_or(vllm::DEFAULT_SEED),
                    salt.as_deref(),
                    lora,
                )?)
            }
            Profile::Sglang => Engine::Sglang(sglang::Sglang::new(salt.as_deref())),
        };
        let seed = match profile {
            Profile::Vllm(_) => Some(seed.unwrap_or_else(|| vllm::DEFAULT_SEED.to_owned())),
            _ => None,
        };
        Ok(BlockHasher {
            block_size,
            profile,
            options: Options {
                salt,
                lora_name,
                lora_path,
                seed,
            },
            engine,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The profile.
    pub fn profile(&self) -> Profile {
        self.profile
    }

    /// The effective options: empty salt dropped, `lora_path` defaulted to `""` when a LoRA is set,
    /// `seed` filled in for `vllm` (and `None` for other profiles).
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The state a chain starts from, made explicit: the native root hash, vLLM's NONE_HASH, or
    /// SGLang's salt seed (`None` for unsalted SGLang, whose first page has no prefix).
    ///
    /// Note that continuing from this explicit state is *not* the same as [`ChainState::Root`]
    /// for a salted `vllm` hasher: the cache salt is an extra key of the sequence's first block.
    pub fn root_state(&self) -> Option<ChainState> {
        match &self.engine {
            Engine::Native(e) => Some(ChainState::Native(e.root())),
            Engine::Vllm(e) => Some(ChainState::Digest(*e.none_hash())),
            Engine::Sglang(e) => e.salt_seed().map(|d| ChainState::Digest(*d)),
        }
    }

    /// Number of full blocks in `num_tokens` tokens: `num_tokens / block_size`.
    pub fn num_blocks(&self, num_tokens: usize) -> usize {
        num_tokens / self.block_size
    }

    /// Checks everything a hashing call would check, without hashing.
    pub fn validate<T: TokenId>(
        &self,
        tokens: &[T],
        parent: &ChainState,
        mm: &[MmItem],
    ) -> Result<()> {
        self.check_parent(parent)?;
        self.check_tokens(tokens)?;
        self.check_mm(mm)
    }

    /// Appends the hashes of the full blocks of `tokens` (chained from `parent`) to `out` and
    /// returns the chain state after the last block (`parent` itself when there is none).
    pub fn hash_into<T: TokenId>(
        &self,
        tokens: &[T],
        parent: &ChainState,
        mm: &[MmItem],
        out: &mut Vec<u64>,
    ) -> Result<ChainState> {
        self.validate(tokens, parent, mm)?;
        out.reserve(self.num_blocks(tokens.len()));
        let len = out.len();
        let result = self.run(tokens, parent, mm, |value, _| out.push(value));
        if result.is_err() {
            out.truncate(len);
        }
        result
    }

    /// Like [`BlockHasher::hash_into`], also appending each block's chain state to `states`.
    pub fn hash_with_states_into<T: TokenId>(
        &self,
        tokens: &[T],
        parent: &ChainState,
        mm: &[MmItem],
        out: &mut Vec<u64>,
        states: &mut Vec<ChainState>,
    ) -> Result<ChainState> {
        self.validate(tokens, parent, mm)?;
        let n = self.num_blocks(tokens.len());
        out.reserve(n);
        states.reserve(n);
        let (len, states_len) = (out.len(), states.len());
        let result = self.run(tokens, parent, mm, |value, state| {
            out.push(value);
            states.push(*state);
        });
        if result.is_err() {
            out.truncate(len);
            states.truncate(states_len);
        }
        result
    }

    /// The general form: validates, then calls `sink(value, state_after_block)` for every full
    /// block in order, and returns the final chain state. Invalid input calls `sink` for nothing.
    pub fn hash_each<T: TokenId>(
        &self,
        tokens: &[T],
        parent: &ChainState,
        mm: &[MmItem],
        sink: impl FnMut(u64, &ChainState),
    ) -> Result<ChainState> {
        self.validate(tokens, parent, mm)?;
        self.run(tokens, parent, mm, sink)
    }

    /// Hashes exactly one block (`block.len() == block_size`) continuing from `parent`; returns
    /// its value and the state after it. `mm` offsets are relative to the block's first token.
    pub fn hash_block<T: TokenId>(
        &self,
        block: &[T],
        parent: &ChainState,
        mm: &[MmItem],
    ) -> Result<(u64, ChainState)> {
        if block.len() != self.block_size {
            return value_err!(
                "a block must hold exactly block_size = {} tokens, got {}",
                self.block_size,
                block.len()
            );
        }
        let mut value = 0;
        let state = self.hash_each(block, parent, mm, |v, _| value = v)?;
        Ok((value, state))
    }

    fn check_parent(&self, parent: &ChainState) -> Result<()> {
        match (parent, self.profile.chains_on_digest()) {
            (ChainState::Root, _)
            | (ChainState::Native(_), false)
            | (ChainState::Digest(_), true) => Ok(()),
            (ChainState::Native(v), true) => Err(Error::Type(format!(
                "profile {:?} continues a chain from the parent block's 32-byte SHA-256 digest, \
                 which its 64-bit value {v} cannot reconstruct; pass the digest instead",
                self.profile.name()
            ))),
            (ChainState::Digest(_), false) => Err(Error::Type(
                "profile 'native' continues a chain from the parent block's 64-bit hash, \
                 not a 32-byte digest"
                    .to_owned(),
            )),
        }
    }

    fn check_tokens<T: TokenId>(&self, tokens: &[T]) -> Result<()> {
        let limit = match self.profile {
            Profile::Native => u64::from(u32::MAX),
            Profile::Vllm(_) | Profile::Sglang => u64::MAX,
        };
        // One cheap pass; the error path below finds and names the first offender.
        let ok = tokens
            .iter()
            .fold(true, |ok, &t| ok & !t.is_negative() & (t.bits() <= limit));
        if ok {
            return Ok(());
        }
        for (i, &t) in tokens.iter().enumerate() {
            if t.is_negative() {
                return value_err!("tokens[{i}] = {t} is negative");
            }
            if t.bits() > limit {
                return value_err!(
                    "tokens[{i}] = {t} does not fit in 32 bits (profile 'native' hashes token \
                     ids as u32)"
                );
            }
        }
        Ok(())
    }

    fn check_mm(&self, mm: &[MmItem]) -> Result<()> {
        if mm.is_empty() {
            return Ok(());
        }
        if self.profile.vllm_flavor().is_none() {
            return value_err!(
                "mm (multimodal items) applies only to profile 'vllm', not {:?}",
                self.profile.name()
            );
        }
        let mut previous = i64::MIN;
        for (i, item) in mm.iter().enumerate() {
            if !(-MM_LIMIT..MM_LIMIT).contains(&item.offset) {
                return value_err!("mm[{i}] offset {} is out of range ±2**62", item.offset);
            }
            if item.length >= MM_LIMIT as u64 {
                return value_err!("mm[{i}] length {} is out of range 0..2**62", item.length);
            }
            if item.offset < previous {
                return value_err!(
                    "mm items must be sorted by offset (as vLLM keeps them): mm[{i}] offset {} \
                     comes after {previous}",
                    item.offset
                );
            }
            previous = item.offset;
        }
        Ok(())
    }

    /// Hashes every full block; input already validated. The only `Err` is a CBOR encoding
    /// failure, which the scratch buffer's sizing rules out (see [`vllm::Vllm::hash_block`]).
    fn run<T: TokenId>(
        &self,
        tokens: &[T],
        parent: &ChainState,
        mm: &[MmItem],
        mut sink: impl FnMut(u64, &ChainState),
    ) -> Result<ChainState> {
        let blocks = tokens.chunks_exact(self.block_size);
        if blocks.len() == 0 {
            return Ok(*parent);
        }
        match &self.engine {
            Engine::Native(e) => {
                let mut prev = match *parent {
                    ChainState::Native(v) => v,
                    _ => e.root(),
                };
                let mut scratch = native::Scratch::new(self.block_size);
                for block in blocks {
                    prev = e.hash_block(prev, block, &mut scratch);
                    sink(prev, &ChainState::Native(prev));
                }
                Ok(ChainState::Native(prev))
            }
            Engine::Vllm(e) => {
                let mut prev = match parent {
                    ChainState::Digest(d) => *d,
                    _ => *e.none_hash(),
                };
                let mut first = matches!(parent, ChainState::Root);
                let mut scratch = vllm::Scratch::new(e, self.block_size, mm);
                let mut cursor = 0;
                for (i, block) in blocks.enumerate() {
                    // i * block_size <= tokens.len() <= isize::MAX, so this fits in i64.
                    let start = (i * self.block_size) as i64;
                    let end = start + self.block_size as i64;
                    cursor = scratch.select_mm(mm, cursor, start, end);
                    prev = e.hash_block(&prev, block, first, mm, start, &mut scratch)?;
                    first = false;
                    sink(vllm::value(&prev), &ChainState::Digest(prev));
                }
                Ok(ChainState::Digest(prev))
            }
            Engine::Sglang(e) => {
                let mut prev = match parent {
                    ChainState::Digest(d) => Some(*d),
                    _ => e.salt_seed().copied(),
                };
                let mut scratch = sglang::Scratch::new(self.block_size);
                let mut last = [0u8; 32];
                for block in blocks {
                    last = e.hash_block(prev.as_ref(), block, &mut scratch);
                    prev = Some(last);
                    sink(sglang::value(&last), &ChainState::Digest(last));
                }
                Ok(ChainState::Digest(last))
            }
        }
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_api;
#[cfg(test)]
mod tests_pickle;
