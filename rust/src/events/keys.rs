//! Which event field a msgpack map key or a legacy array position is.
//!
//! Invariants: [`field_of`] recognises exactly the keys of [`KEYS`] (byte for byte; anything
//! else is 0, "skip"), with one table probe and no branch on the key's bytes; the positional
//! tables give the fields of the tagged-array events of vLLM ≤ 0.23 in order.

use super::reader::Span;

/// Field bits, to refuse a repeated map key.
pub(super) mod field {
    pub const TYPE: u32 = 1;
    pub const HASHES: u32 = 1 << 1;
    pub const PARENT: u32 = 1 << 2;
    pub const TOKENS: u32 = 1 << 3;
    pub const BLOCK_SIZE: u32 = 1 << 4;
    pub const LORA_ID: u32 = 1 << 5;
    pub const MEDIUM: u32 = 1 << 6;
    pub const LORA_NAME: u32 = 1 << 7;
    pub const CACHE_SALT: u32 = 1 << 8;
    pub const EXTRA_KEYS: u32 = 1 << 9;
    pub const GROUP_IDX: u32 = 1 << 10;
    pub const LOOKAHEAD: u32 = 1 << 11;
}

/// The event map keys the decoder reads, with their field bits.
pub(super) const KEYS: [(&[u8], u32); 12] = [
    (b"type", field::TYPE),
    (b"block_hashes", field::HASHES),
    (b"parent_block_hash", field::PARENT),
    (b"token_ids", field::TOKENS),
    (b"block_size", field::BLOCK_SIZE),
    (b"lora_id", field::LORA_ID),
    (b"medium", field::MEDIUM),
    (b"lora_name", field::LORA_NAME),
    (b"cache_salt", field::CACHE_SALT),
    (b"extra_keys", field::EXTRA_KEYS),
    (b"group_idx", field::GROUP_IDX),
    (b"lookahead_token_ids", field::LOOKAHEAD),
];

/// Slot of a key in [`KEY_TABLE`]: distinct for the twelve [`KEYS`] (length and first byte).
const fn key_slot(len: usize, first: u8) -> usize {
    (len + 9 * first as usize) & 31
}

/// Bytes `skip..skip + 8` of `key` as a little-endian word (zero past the key's end).
const fn key_word(key: &[u8], skip: usize) -> u64 {
    let mut rest = key;
    let mut i = 0;
    let mut word = 0;
    while let [b, tail @ ..] = rest {
        if i >= skip && i < skip + 8 {
            word |= (*b as u64) << (8 * (i - skip));
        }
        i += 1;
        rest = tail;
    }
    word
}

/// The entry of [`KEY_TABLE`] at `slot`: the key of [`KEYS`] that [`key_slot`] puts there,
/// zero-padded to 24 bytes as three little-endian words, and its field bit (0 for none; the
/// test `map_keys_are_recognised_exactly` fails if two keys share a slot).
const fn key_entry(slot: usize) -> ([u64; 3], u32) {
    let mut rest: &[(&[u8], u32)] = &KEYS;
    while let [(key, bit), tail @ ..] = rest {
        if let [first, ..] = key {
            if key_slot(key.len(), *first) == slot {
                return (
                    [key_word(key, 0), key_word(key, 8), key_word(key, 16)],
                    *bit,
                );
            }
        }
        rest = tail;
    }
    ([0; 3], 0)
}

/// [`KEYS`] by [`key_slot`] (see [`key_entry`]).
const KEY_TABLE: [([u64; 3], u32); 32] = [
    key_entry(0),
    key_entry(1),
    key_entry(2),
    key_entry(3),
    key_entry(4),
    key_entry(5),
    key_entry(6),
    key_entry(7),
    key_entry(8),
    key_entry(9),
    key_entry(10),
    key_entry(11),
    key_entry(12),
    key_entry(13),
    key_entry(14),
    key_entry(15),
    key_entry(16),
    key_entry(17),
    key_entry(18),
    key_entry(19),
    key_entry(20),
    key_entry(21),
    key_entry(22),
    key_entry(23),
    key_entry(24),
    key_entry(25),
    key_entry(26),
    key_entry(27),
    key_entry(28),
    key_entry(29),
    key_entry(30),
    key_entry(31),
];

/// The field bit of map key `key` (a span of `payload`), 0 for a key the decoder skips. Keys
/// are told apart without branching on their bytes (one table slot, one masked comparison of
/// 24 bytes), since the keys of consecutive events alternate in ways branch predictors miss.
#[inline]
pub(super) fn field_of(payload: &[u8], key: Span) -> u32 {
    let len = key.len as usize;
    let start = key.start as usize;
    if let (Some(window), Some(&first)) = (
        payload.get(start..).and_then(|b| b.first_chunk::<24>()),
        payload.get(start),
    ) {
        if len <= 24 {
            let (words, bit) = KEY_TABLE
                .get(key_slot(len, first))
                .copied()
                .unwrap_or_default();
            let mut diff = 0u64;
            for (i, (chunk, want)) in window.chunks_exact(8).zip(words).enumerate() {
                let got = chunk.try_into().map_or(0, u64::from_le_bytes);
                // The bytes of this word that belong to the key.
                let keep = match len.saturating_sub(8 * i) {
                    0 => 0,
                    n @ 1..8 => (1u64 << (8 * n)) - 1,
                    _ => u64::MAX,
                };
                diff |= (got & keep) ^ want;
            }
            return if diff == 0 { bit } else { 0 };
        }
    }
    let key = key.get(payload);
    KEYS.iter()
        .find(|(name, _)| *name == key)
        .map_or(0, |&(_, bit)| bit)
}

/// Positions of the legacy tagged-array fields (vLLM ≤ 0.23), after the tag.
pub(super) const STORED_POSITIONS: [u32; 9] = [
    field::HASHES,
    field::PARENT,
    field::TOKENS,
    field::BLOCK_SIZE,
    field::LORA_ID,
    field::MEDIUM,
    field::LORA_NAME,
    field::EXTRA_KEYS,
    field::GROUP_IDX,
];
pub(super) const REMOVED_POSITIONS: [u32; 3] = [field::HASHES, field::MEDIUM, field::GROUP_IDX];
