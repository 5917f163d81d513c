//! msgpack decoding of one KV-event batch, straight from the payload bytes.
//!
//! Invariants:
//! - **Whole or nothing.** [`Decoder::decode`] either decodes the entire payload and returns
//!   `Ok`, or returns [`Error::Value`] naming the byte offset and what was wrong; a batch is
//!   never half-decoded into something usable.
//! - **No allocation per block or per event.** Hashes and token ids land in buffers owned by the
//!   reusable [`Batch`]; strings are spans of the payload (checked UTF-8), resolved to `&str` by
//!   [`Batch::events`].
//! - **Same answer on every path.** The encodings engines send on every event (fixstr keys and
//!   tags, ASCII strings, nil, fixints, arrays of `uint64` hashes, runs of `uint16` token ids)
//!   are read on short fast paths; anything else is read by the general path from the same
//!   position, which accepts and refuses exactly what it would have without the fast paths.
//! - **Never panics, bounded work.** Every length is checked against the bytes left before it is
//!   used (a claimed length can never make the decoder reserve more than the payload's size);
//!   nested values are skipped iteratively, without recursion.
//!
//! Accepted shapes (see `KV_EVENTS_SPEC.md`):
//! - batch `[ts, events, data_parallel_rank?, ...]`: `ts` a float or int, rank an int or nil,
//!   extra trailing elements skipped;
//! - an event as a **tagged map** (vLLM ≥ 0.24, SGLang): `"type"` plus fields, in any order,
//!   fixmap/map16/map32, unknown keys skipped, a repeated key refused;
//! - an event as a **tagged array** (vLLM ≤ 0.23, old SGLang): `[tag, field, ...]` decoded by
//!   position and length, trailing unknown positions skipped;
//! - block hashes as ints (unsigned, or negative two's-complement int64 as SGLang publishes) or
//!   as raw digests (`bin`, 1..=64 bytes): a digest's value is the integer it spells big-endian,
//!   modulo 2^64 — i.e. its **last 8 bytes**, which is exactly the int vLLM publishes when
//!   `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, so both modes give the same keys;
//! - an event whose tag is not one of the three known types is kept as [`EventKind::Unknown`]
//!   (its fields skipped), so a newer engine's extra event types do not invalidate a batch.

use rmp::Marker;

use crate::error::{Error, Result};

/// The type of one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `BlockStored`: the engine cached `block_hashes` (a chain continuing from `parent`).
    Stored,
    /// `BlockRemoved`: the engine evicted `block_hashes`.
    Removed,
    /// `AllBlocksCleared`: the engine dropped its whole prefix cache.
    Cleared,
    /// Any other tag (skipped by the applier, kept so it can be counted).
    Unknown,
}

/// A byte range of the payload holding a UTF-8 string (or a raw msgpack value).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    len: u32,
}

impl Span {
    fn get(self, payload: &[u8]) -> &[u8] {
        let start = self.start as usize;
        payload
            .get(start..start + self.len as usize)
            .unwrap_or_default()
    }

    fn str(self, payload: &[u8]) -> &str {
        // Spans of strings were checked to be UTF-8 when decoded.
        std::str::from_utf8(self.get(payload)).unwrap_or_default()
    }
}

/// One decoded event, stored with ranges into the batch's buffers.
#[derive(Clone, Copy, Debug, Default)]
struct RawEvent {
    kind: Option<EventKind>,
    tag: Span,
    hashes: (u32, u32),
    parent: Option<u64>,
    tokens: (u32, u32),
    block_size: Option<u64>,
    lora_id: Option<i64>,
    medium: Option<Span>,
    lora_name: Option<Span>,
    cache_salt: Option<Span>,
    extra_keys: Option<Span>,
    group_idx: i64,
    wide_tokens: bool,
    lookahead: bool,
}

/// One event of a decoded batch, borrowing the batch's buffers and the payload.
#[derive(Clone, Copy, Debug)]
pub struct Event<'a> {
    /// The event type.
    pub kind: EventKind,
    /// The tag as sent (e.g. `"BlockStored"`).
    pub type_name: &'a str,
    /// `block_hashes` as 64-bit values (empty for `AllBlocksCleared`).
    pub block_hashes: &'a [u64],
    /// `parent_block_hash` (`None` when nil or absent).
    pub parent: Option<u64>,
    /// `token_ids` (empty unless `BlockStored`). Ids above `u32::MAX` set `tokens_fit_u32 = false`
    /// and are stored as 0.
    pub token_ids: &'a [u32],
    /// False when some token id does not fit in 32 bits (or is negative).
    pub tokens_fit_u32: bool,
    /// `block_size` (0 when absent, which only a non-`BlockStored` event may be).
    pub block_size: u64,
    /// `lora_id` (deprecated in vLLM; informational).
    pub lora_id: Option<i64>,
    /// `medium` (`None` when nil or absent, which vLLM means as the GPU).
    pub medium: Option<&'a str>,
    /// `lora_name`.
    pub lora_name: Option<&'a str>,
    /// SGLang's `cache_salt` field.
    pub cache_salt: Option<&'a str>,
    /// `extra_keys`, still encoded (see [`ExtraKeys`]).
    pub extra_keys: ExtraKeys<'a>,
    /// `group_idx` (KV-cache group; 0 when absent).
    pub group_idx: i64,
    /// True when `lookahead_token_ids` holds at least one token (vLLM 0.33 speculative hashing).
    pub has_lookahead: bool,
}

/// A reusable decoded batch: its buffers keep their capacity between payloads.
#[derive(Debug, Default)]
pub struct Batch {
    /// The batch timestamp (`ts`, seconds since the epoch as the engine's clock has it).
    pub ts: f64,
    /// `data_parallel_rank` (SGLang: `attn_dp_rank`), if present and not nil.
    pub dp_rank: Option<i64>,
    events: Vec<RawEvent>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
}

impl Batch {
    /// Number of events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// True when the batch has no event.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Total block hashes over all events.
    pub fn num_hashes(&self) -> usize {
        self.hashes.len()
    }

    /// The events, resolved against `payload` (which must be the payload this batch was decoded
    /// from; another buffer gives empty strings, never a panic).
    pub fn events<'a>(&'a self, payload: &'a [u8]) -> impl ExactSizeIterator<Item = Event<'a>> {
        self.events.iter().map(move |e| {
            let range = |(a, b): (u32, u32)| a as usize..b as usize;
            Event {
                kind: e.kind.unwrap_or(EventKind::Unknown),
                type_name: match e.kind {
                    Some(EventKind::Stored) => "BlockStored",
                    Some(EventKind::Removed) => "BlockRemoved",
                    Some(EventKind::Cleared) => "AllBlocksCleared",
                    _ => e.tag.str(payload),
                },
                block_hashes: self.hashes.get(range(e.hashes)).unwrap_or_default(),
                parent: e.parent,
                token_ids: self.tokens.get(range(e.tokens)).unwrap_or_default(),
                tokens_fit_u32: !e.wide_tokens,
                block_size: e.block_size.unwrap_or(0),
                lora_id: e.lora_id,
                medium: e.medium.map(|s| match s.get(payload) {
                    b"GPU" => "GPU",
                    _ => s.str(payload),
                }),
                lora_name: e.lora_name.map(|s| s.str(payload)),
                cache_salt: e.cache_salt.map(|s| s.str(payload)),
                extra_keys: ExtraKeys(e.extra_keys.map(|s| s.get(payload))),
                group_idx: e.group_idx,
                has_lookahead: e.lookahead,
            }
        })
    }

    fn clear(&mut self) {
        self.ts = 0.0;
        self.dp_rank = None;
        self.events.clear();
        self.hashes.clear();
        self.tokens.clear();
    }
}

/// The `extra_keys` of a `BlockStored`: one entry per block, each nil or an array of keys, in the
/// untagged form events publish (vLLM ≥ 0.31 and ≤ 0.30 alike): the LoRA name (a string equal to
/// `lora_name`), multimodal items (`[identifier, offset]` arrays), the cache salt (a string, first
/// block of a sequence only) and prompt-embedding digests (`bin`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtraKeys<'a>(Option<&'a [u8]>);

/// What the extra keys mean for re-hashing a chain (see [`ExtraKeys::summary`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtraSummary<'a> {
    /// The cache salt found on the first block, if any.
    pub salt: Option<&'a str>,
    /// True when some key cannot be reproduced from the event alone (a multimodal item, a prompt
    /// embedding digest, a string on a later block, or an unrecognised key).
    pub unsupported: bool,
}

impl<'a> ExtraKeys<'a> {
    /// The field's msgpack encoding, as sent (`None` when absent).
    pub fn raw(&self) -> Option<&'a [u8]> {
        self.0
    }

    /// True when the field was absent or nil.
    pub fn is_none(&self) -> bool {
        self.0.is_none_or(|b| b == [0xc0])
    }

    /// Classifies the keys: on each block, a string equal to `lora_name` is the LoRA key (once per
    /// block); on block 0 one other string is the cache salt; anything else is unsupported.
    pub fn summary(&self, lora_name: Option<&str>) -> ExtraSummary<'a> {
        let Some(bytes) = self.0 else {
            return ExtraSummary::default();
        };
        let mut out = ExtraSummary::default();
        let mut r = Reader::new(bytes);
        let blocks = match r.marker() {
            Ok(Marker::Null) => return out,
            Ok(m) => match r.array_len(m) {
                Ok(n) => n,
                Err(_) => return unsupported(),
            },
            Err(_) => return unsupported(),
        };
        for block in 0..blocks {
            let keys = match r.marker() {
                Ok(Marker::Null) => continue,
                Ok(m) => match r.array_len(m) {
                    Ok(n) => n,
                    Err(_) => return unsupported(),
                },
                Err(_) => return unsupported(),
            };
            let mut lora_seen = false;
            for _ in 0..keys {
                let start = r.pos();
                let Ok(m) = r.marker() else {
                    return unsupported();
                };
                match r.str_span(m, start) {
                    Ok(Some(span)) => {
                        let s = span.str(bytes);
                        if lora_name == Some(s) && !lora_seen {
                            lora_seen = true;
                        } else if block == 0 && out.salt.is_none() {
                            out.salt = Some(s);
                        } else {
                            out.unsupported = true;
                        }
                    }
                    Ok(None) => {
                        out.unsupported = true;
                        if r.skip_rest(m).is_err() {
                            return unsupported();
                        }
                    }
                    Err(_) => return unsupported(),
                }
            }
        }
        out
    }
}

fn unsupported<'a>() -> ExtraSummary<'a> {
    ExtraSummary {
        salt: None,
        unsupported: true,
    }
}

/// Decodes payloads into a reusable [`Batch`].
#[derive(Debug, Default)]
pub struct Decoder {
    _private: (),
}

impl Decoder {
    /// A decoder (stateless; kept as a type so scratch can be added without an API change).
    pub fn new() -> Self {
        Decoder::default()
    }

    /// Decodes `payload` into `batch` (cleared first). On `Err` the batch is left empty.
    pub fn decode(&self, payload: &[u8], batch: &mut Batch) -> Result<()> {
        batch.clear();
        if payload.len() > u32::MAX as usize {
            return Err(Error::Value(format!(
                "KV event payload of {} bytes is too large",
                payload.len()
            )));
        }
        let out = decode_batch(&mut Reader::new(payload), batch);
        if out.is_err() {
            batch.clear();
        }
        out
    }
}

/// Field bits, to refuse a repeated map key.
mod field {
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

fn decode_batch(r: &mut Reader<'_>, batch: &mut Batch) -> Result<()> {
    let m = r.marker()?;
    let n = r
        .array_len(m)
        .map_err(|_| r.error("the batch is not an array"))?;
    if n < 2 {
        return Err(r.error("the batch array has fewer than 2 elements (ts, events)"));
    }
    batch.ts = r.float()?;
    let m = r.marker()?;
    let events = r
        .array_len(m)
        .map_err(|_| r.error("events is not an array"))?;
    r.check_items(events)?;
    batch.events.reserve(events as usize);
    for _ in 0..events {
        // Decoded in place: an event is never copied.
        let Batch {
            events,
            hashes,
            tokens,
            ..
        } = &mut *batch;
        events.push(RawEvent {
            hashes: (hashes.len() as u32, hashes.len() as u32),
            tokens: (tokens.len() as u32, tokens.len() as u32),
            ..RawEvent::default()
        });
        if let Some(e) = events.last_mut() {
            decode_event(r, &mut Out { hashes, tokens }, e)?;
        }
    }
    if n >= 3 {
        batch.dp_rank = r.opt_int("data_parallel_rank")?;
    }
    for _ in 3..n {
        r.skip_value()?;
    }
    if r.remaining() != 0 {
        return Err(r.error("trailing bytes after the batch"));
    }
    Ok(())
}

/// The batch's hash and token buffers, which events append to.
struct Out<'b> {
    hashes: &'b mut Vec<u64>,
    tokens: &'b mut Vec<u32>,
}

/// Decodes one event into `e` (whose buffer ranges start at the buffers' ends).
fn decode_event(r: &mut Reader<'_>, out: &mut Out<'_>, e: &mut RawEvent) -> Result<()> {
    let at = r.pos();
    let m = r.marker()?;
    let fields = if let Some(pairs) = r.map_len(m) {
        decode_map_event(r, out, pairs, e)?
    } else if let Ok(items) = r.array_len(m) {
        decode_array_event(r, out, items, e)?
    } else {
        return Err(Error::Value(format!(
            "malformed KV event payload at byte {at}: an event must be a map or an array"
        )));
    };
    let missing = |what: &str| {
        Error::Value(format!(
            "malformed KV event payload: the event at byte {at} has no {what}"
        ))
    };
    match e.kind {
        None => return Err(missing("\"type\"")),
        Some(EventKind::Stored) => {
            if fields & field::HASHES == 0 {
                return Err(missing("block_hashes"));
            }
            if fields & field::TOKENS == 0 {
                return Err(missing("token_ids"));
            }
            if e.block_size.is_none() {
                return Err(missing("block_size"));
            }
        }
        Some(EventKind::Removed) => {
            if fields & field::HASHES == 0 {
                return Err(missing("block_hashes"));
            }
        }
        Some(EventKind::Cleared | EventKind::Unknown) => {}
    }
    Ok(())
}

fn kind_of(tag: &[u8]) -> EventKind {
    match tag {
        b"BlockStored" => EventKind::Stored,
        b"BlockRemoved" => EventKind::Removed,
        b"AllBlocksCleared" => EventKind::Cleared,
        _ => EventKind::Unknown,
    }
}

fn decode_map_event(
    r: &mut Reader<'_>,
    out: &mut Out<'_>,
    pairs: u32,
    e: &mut RawEvent,
) -> Result<u32> {
    r.check_items(pairs.saturating_mul(2))?;
    let mut fields = 0;
    for _ in 0..pairs {
        let key_at = r.pos();
        let key = match r.fixstr() {
            Some(key) => key,
            None => {
                let m = r.marker()?;
                match r.str_span_checked(m, key_at, false)? {
                    Some(key) => key,
                    None => return Err(r.error_at(key_at, "an event map key is not a string")),
                }
            }
        };
        let bit = field_of(r.payload, key);
        if bit == 0 {
            r.skip_value()?;
            continue;
        }
        if fields & bit != 0 {
            return Err(r.error_at(
                key_at,
                &format!(
                    "the event key {:?} is repeated",
                    String::from_utf8_lossy(key.get(r.payload))
                ),
            ));
        }
        fields |= bit;
        if !read_field_fast(r, out, bit, e) {
            read_field(r, out, bit, e)?;
        }
    }
    Ok(fields)
}

/// [`read_field`] for the encodings engines send on every event — nil, fixstr tags and strings
/// in ASCII, positive fixints, arrays of `uint64` hashes — with no error path: returns false,
/// having read nothing, for anything else, and [`read_field`] takes over at the same position.
#[inline(always)]
fn read_field_fast(r: &mut Reader<'_>, out: &mut Out<'_>, bit: u32, e: &mut RawEvent) -> bool {
    let rest = r.rest();
    let Some(&m) = rest.first() else {
        return false;
    };
    let ascii_fixstr = || -> Option<Span> {
        let len = usize::from(m & 0x1f);
        let bytes = rest.get(1..=len)?;
        (m & 0xe0 == 0xa0 && bytes.is_ascii()).then_some(Span {
            start: (r.pos + 1) as u32,
            len: len as u32,
        })
    };
    let opt_str = |slot: &mut Option<Span>| -> Option<usize> {
        if m == 0xc0 {
            *slot = None;
            return Some(1);
        }
        let span = ascii_fixstr()?;
        *slot = Some(span);
        Some(1 + span.len as usize)
    };
    let used = match bit {
        field::TYPE => ascii_fixstr().and_then(|tag| {
            let kind = kind_of(tag.get(r.payload));
            (kind != EventKind::Unknown).then(|| {
                e.tag = tag;
                e.kind = Some(kind);
                1 + tag.len as usize
            })
        }),
        field::HASHES => {
            let n = usize::from(m & 0x0f);
            let items = rest.get(1..1 + 9 * n).unwrap_or_default();
            let all_u64 = m & 0xf0 == 0x90
                && items.len() == 9 * n
                && items.chunks_exact(9).all(|c| c.first() == Some(&0xcf));
            all_u64.then(|| {
                let start = out.hashes.len();
                out.hashes.extend(items.chunks_exact(9).map(|c| {
                    c.get(1..9)
                        .and_then(|b| <[u8; 8]>::try_from(b).ok())
                        .map_or(0, u64::from_be_bytes)
                }));
                e.hashes = (start as u32, out.hashes.len() as u32);
                1 + 9 * n
            })
        }
        field::PARENT => match (m, rest.get(1..9).map(<[u8; 8]>::try_from)) {
            (0xc0, _) => {
                e.parent = None;
                Some(1)
            }
            (0xcf, Some(Ok(b))) => {
                e.parent = Some(u64::from_be_bytes(b));
                Some(9)
            }
            _ => None,
        },
        field::BLOCK_SIZE => (m < 0x80).then(|| {
            e.block_size = Some(u64::from(m));
            1
        }),
        field::LORA_ID => match m {
            0xc0 => {
                e.lora_id = None;
                Some(1)
            }
            0x00..=0x7f => {
                e.lora_id = Some(i64::from(m));
                Some(1)
            }
            _ => None,
        },
        field::GROUP_IDX => match m {
            0xc0 => {
                e.group_idx = 0;
                Some(1)
            }
            0x00..=0x7f => {
                e.group_idx = i64::from(m);
                Some(1)
            }
            _ => None,
        },
        field::MEDIUM => opt_str(&mut e.medium),
        field::LORA_NAME => opt_str(&mut e.lora_name),
        field::CACHE_SALT => opt_str(&mut e.cache_salt),
        _ => None,
    };
    match used {
        Some(n) => {
            r.pos += n;
            true
        }
        None => false,
    }
}

/// The event map keys the decoder reads, with their field bits.
const KEYS: [(&[u8], u32); 12] = [
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
fn field_of(payload: &[u8], key: Span) -> u32 {
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
const STORED_POSITIONS: [u32; 9] = [
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
const REMOVED_POSITIONS: [u32; 3] = [field::HASHES, field::MEDIUM, field::GROUP_IDX];

fn decode_array_event(
    r: &mut Reader<'_>,
    out: &mut Out<'_>,
    items: u32,
    e: &mut RawEvent,
) -> Result<u32> {
    let event_at = r.pos();
    r.check_items(items)?;
    let mut fields = field::TYPE;
    if items == 0 {
        return Err(r.error("an event array is empty (no tag)"));
    }
    read_field(r, out, field::TYPE, e)?;
    let positions: &[u32] = match e.kind {
        Some(EventKind::Stored) => {
            if items < 5 {
                return Err(r.error_at(
                    event_at,
                    &format!("a BlockStored array has {items} elements, fewer than 5"),
                ));
            }
            &STORED_POSITIONS
        }
        Some(EventKind::Removed) => {
            if items < 2 {
                return Err(r.error_at(event_at, "a BlockRemoved array has no block_hashes"));
            }
            &REMOVED_POSITIONS
        }
        _ => &[],
    };
    for i in 1..items {
        match positions.get(i as usize - 1) {
            Some(&bit) => {
                fields |= bit;
                if !read_field_fast(r, out, bit, e) {
                    read_field(r, out, bit, e)?;
                }
            }
            None => r.skip_value()?,
        }
    }
    Ok(fields)
}

fn read_field(r: &mut Reader<'_>, out: &mut Out<'_>, bit: u32, e: &mut RawEvent) -> Result<()> {
    match bit {
        field::TYPE => {
            let at = r.pos();
            let tag = match r.fixstr() {
                Some(tag) => tag,
                None => {
                    let m = r.marker()?;
                    match r.str_span_checked(m, at, false)? {
                        Some(tag) => tag,
                        None => return Err(r.error_at(at, "the event type tag is not a string")),
                    }
                }
            };
            let kind = kind_of(tag.get(r.payload));
            if kind == EventKind::Unknown && std::str::from_utf8(tag.get(r.payload)).is_err() {
                return Err(r.error_at(at, "a string is not valid UTF-8"));
            }
            e.tag = tag;
            e.kind = Some(kind);
        }
        field::HASHES => {
            let m = r.marker()?;
            let n = r
                .array_len(m)
                .map_err(|_| r.error("block_hashes is not an array"))?;
            r.check_items(n)?;
            let start = out.hashes.len();
            out.hashes.reserve(n as usize);
            for _ in 0..n {
                let h = r.block_hash("block_hashes")?;
                out.hashes.push(h);
            }
            e.hashes = (start as u32, out.hashes.len() as u32);
        }
        field::PARENT => {
            let m = r.peek()?;
            e.parent = if m == 0xc0 {
                r.marker()?;
                None
            } else {
                Some(r.block_hash("parent_block_hash")?)
            };
        }
        field::TOKENS => {
            let m = r.marker()?;
            let n = r
                .array_len(m)
                .map_err(|_| r.error("token_ids is not an array"))?;
            r.check_items(n)?;
            let start = out.tokens.len();
            let wide = r.token_ids(n, out.tokens)?;
            e.tokens = (start as u32, out.tokens.len() as u32);
            e.wide_tokens = wide;
        }
        field::BLOCK_SIZE => match r.int("block_size")? {
            Int::Pos(v) => e.block_size = Some(v),
            Int::Neg(v) => return Err(r.error(&format!("block_size = {v} is negative"))),
        },
        field::LORA_ID => e.lora_id = r.opt_int("lora_id")?,
        field::MEDIUM => e.medium = r.opt_str("medium")?,
        field::LORA_NAME => e.lora_name = r.opt_str("lora_name")?,
        field::CACHE_SALT => e.cache_salt = r.opt_str("cache_salt")?,
        field::EXTRA_KEYS => {
            let start = r.pos();
            r.skip_value()?;
            let len = (r.pos() - start) as u32;
            e.extra_keys = Some(Span {
                start: start as u32,
                len,
            });
        }
        field::GROUP_IDX => e.group_idx = r.opt_int("group_idx")?.unwrap_or(0),
        field::LOOKAHEAD => {
            let m = r.marker()?;
            if m != Marker::Null {
                let n = r
                    .array_len(m)
                    .map_err(|_| r.error("lookahead_token_ids is not an array"))?;
                r.check_items(n)?;
                for _ in 0..n {
                    let at = r.pos();
                    let m = r.marker()?;
                    if m == Marker::Null {
                        continue;
                    }
                    let inner = r
                        .array_len(m)
                        .map_err(|_| r.error_at(at, "lookahead_token_ids[i] is not an array"))?;
                    r.check_items(inner)?;
                    e.lookahead |= inner > 0;
                    for _ in 0..inner {
                        r.skip_value()?;
                    }
                }
            }
        }
        _ => r.skip_value()?,
    }
    Ok(())
}

/// A msgpack integer, split by sign.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Int {
    Pos(u64),
    Neg(i64),
}

/// A cursor over the payload (`pos <= payload.len()` always); `rmp` classifies the markers.
/// Reads check their bounds and fail with [`Error::Value`]; the error paths are out of line, so
/// the success paths stay small enough to inline.
struct Reader<'a> {
    payload: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(payload: &'a [u8]) -> Self {
        Reader { payload, pos: 0 }
    }

    #[inline]
    fn pos(&self) -> usize {
        self.pos
    }

    /// The bytes not read yet.
    #[inline]
    fn rest(&self) -> &'a [u8] {
        self.payload.get(self.pos..).unwrap_or_default()
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.payload.len().saturating_sub(self.pos)
    }

    #[cold]
    #[inline(never)]
    fn error_at(&self, at: usize, what: &str) -> Error {
        Error::Value(format!("malformed KV event payload at byte {at}: {what}"))
    }

    #[cold]
    #[inline(never)]
    fn error(&self, what: &str) -> Error {
        self.error_at(self.pos(), what)
    }

    #[cold]
    #[inline(never)]
    fn truncated(&self) -> Error {
        self.error("the payload ends in the middle of a value")
    }

    #[inline]
    fn peek(&self) -> Result<u8> {
        match self.rest().first() {
            Some(&b) => Ok(b),
            None => Err(self.truncated()),
        }
    }

    #[inline]
    fn marker(&mut self) -> Result<Marker> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(Marker::from_u8(b))
    }

    #[inline]
    fn data<const N: usize>(&mut self) -> Result<[u8; N]> {
        match self.rest().first_chunk::<N>() {
            Some(&buf) => {
                self.pos += N;
                Ok(buf)
            }
            None => Err(self.truncated()),
        }
    }

    #[inline]
    fn skip(&mut self, n: usize) -> Result<()> {
        if n > self.remaining() {
            return Err(self.truncated());
        }
        self.pos += n;
        Ok(())
    }

    /// The next `n` bytes, read.
    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.rest().get(..n) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(self.truncated()),
        }
    }

    /// Refuses a claimed element count larger than the bytes left (each element takes ≥ 1 byte),
    /// so no count can make the decoder reserve or loop beyond the payload's size.
    fn check_items(&self, n: u32) -> Result<()> {
        if n as usize > self.remaining() {
            return Err(self.error(&format!(
                "a container claims {n} elements but only {} bytes are left",
                self.remaining()
            )));
        }
        Ok(())
    }

    fn len16(&mut self) -> Result<u32> {
        Ok(u32::from(u16::from_be_bytes(self.data::<2>()?)))
    }

    fn len32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.data::<4>()?))
    }

    fn array_len(&mut self, m: Marker) -> Result<u32> {
        match m {
            Marker::FixArray(n) => Ok(u32::from(n)),
            Marker::Array16 => self.len16(),
            Marker::Array32 => self.len32(),
            _ => Err(self.error("expected an array")),
        }
    }

    /// `Some(pairs)` for a map marker (reading its length), `None` for anything else.
    fn map_len(&mut self, m: Marker) -> Option<u32> {
        match m {
            Marker::FixMap(n) => Some(u32::from(n)),
            Marker::Map16 => self.len16().ok(),
            Marker::Map32 => self.len32().ok(),
            _ => None,
        }
    }

    /// The span of a complete fixstr (up to 31 bytes, as map keys and tags come) at the cursor,
    /// read, without a UTF-8 check; `None` (nothing read) for anything else.
    #[inline]
    fn fixstr(&mut self) -> Option<Span> {
        let rest = self.rest();
        let &m = rest.first()?;
        if m & 0xe0 != 0xa0 {
            return None;
        }
        let len = usize::from(m & 0x1f);
        if len >= rest.len() {
            return None;
        }
        let start = self.pos + 1;
        self.pos = start + len;
        Some(Span {
            start: start as u32,
            len: len as u32,
        })
    }

    /// For a string marker, the (UTF-8 checked) span of its bytes; `None` for a non-string.
    fn str_span(&mut self, m: Marker, at: usize) -> Result<Option<Span>> {
        self.str_span_checked(m, at, true)
    }

    /// [`Reader::str_span`], with the UTF-8 check only when `validate` (map keys are compared
    /// as bytes and never turned into `str`).
    fn str_span_checked(&mut self, m: Marker, at: usize, validate: bool) -> Result<Option<Span>> {
        let len = match m {
            Marker::FixStr(n) => u32::from(n),
            Marker::Str8 => u32::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Str16 => self.len16()?,
            Marker::Str32 => self.len32()?,
            _ => return Ok(None),
        };
        let start = self.pos();
        let bytes = self.take(len as usize)?;
        if validate && !bytes.is_ascii() && std::str::from_utf8(bytes).is_err() {
            return Err(self.error_at(at, "a string is not valid UTF-8"));
        }
        Ok(Some(Span {
            start: start as u32,
            len,
        }))
    }

    fn opt_str(&mut self, what: &str) -> Result<Option<Span>> {
        let at = self.pos();
        match self.marker()? {
            Marker::Null => Ok(None),
            m => match self.str_span(m, at)? {
                Some(s) => Ok(Some(s)),
                None => Err(self.error_at(at, &format!("{what} is neither a string nor nil"))),
            },
        }
    }

    #[inline]
    fn int_from(&mut self, m: Marker) -> Result<Option<Int>> {
        Ok(Some(match m {
            Marker::FixPos(v) => Int::Pos(u64::from(v)),
            Marker::FixNeg(v) => Int::Neg(i64::from(v)),
            Marker::U8 => Int::Pos(u64::from(u8::from_be_bytes(self.data::<1>()?))),
            Marker::U16 => Int::Pos(u64::from(u16::from_be_bytes(self.data::<2>()?))),
            Marker::U32 => Int::Pos(u64::from(u32::from_be_bytes(self.data::<4>()?))),
            Marker::U64 => Int::Pos(u64::from_be_bytes(self.data::<8>()?)),
            Marker::I8 => signed(i64::from(i8::from_be_bytes(self.data::<1>()?))),
            Marker::I16 => signed(i64::from(i16::from_be_bytes(self.data::<2>()?))),
            Marker::I32 => signed(i64::from(i32::from_be_bytes(self.data::<4>()?))),
            Marker::I64 => signed(i64::from_be_bytes(self.data::<8>()?)),
            _ => return Ok(None),
        }))
    }

    fn int(&mut self, what: &str) -> Result<Int> {
        let at = self.pos();
        let m = self.marker()?;
        self.int_from(m)?
            .ok_or_else(|| self.error_at(at, &format!("{what} is not an integer")))
    }

    fn opt_int(&mut self, what: &str) -> Result<Option<i64>> {
        let at = self.pos();
        let m = self.marker()?;
        if m == Marker::Null {
            return Ok(None);
        }
        match self.int_from(m)? {
            Some(Int::Neg(v)) => Ok(Some(v)),
            Some(Int::Pos(v)) => match i64::try_from(v) {
                Ok(v) => Ok(Some(v)),
                Err(_) => Err(self.error_at(at, &format!("{what} = {v} is out of range"))),
            },
            None => Err(self.error_at(at, &format!("{what} is neither an integer nor nil"))),
        }
    }

    fn float(&mut self) -> Result<f64> {
        let at = self.pos();
        let m = self.marker()?;
        match m {
            Marker::F64 => Ok(f64::from_be_bytes(self.data::<8>()?)),
            Marker::F32 => Ok(f64::from(f32::from_be_bytes(self.data::<4>()?))),
            m => match self.int_from(m)? {
                Some(Int::Pos(v)) => Ok(v as f64),
                Some(Int::Neg(v)) => Ok(v as f64),
                None => Err(self.error_at(at, "ts is not a number")),
            },
        }
    }

    /// Appends `n` token ids to `out` (the hot loop: a direct scan of the integer encodings,
    /// eight `uint16` ids at a time when they come that way, as vocabularies below 65,536 make
    /// them); returns true when some id is negative or beyond `u32` (stored as 0). On `Err`,
    /// `out` and the cursor are unchanged.
    fn token_ids(&mut self, n: u32, out: &mut Vec<u32>) -> Result<bool> {
        const LANES: usize = 8;
        let bytes = self.rest();
        let start = out.len();
        out.resize(start + n as usize, 0);
        let mut todo = out.get_mut(start..).unwrap_or_default();
        let mut at = 0usize;
        let mut wide = false;
        let mut failed = None;
        'scan: while !todo.is_empty() {
            let rest = std::mem::take(&mut todo);
            let Some((dst, tail)) = rest.split_at_mut_checked(rest.len().min(LANES)) else {
                break;
            };
            todo = tail;
            let src = bytes
                .get(at..)
                .and_then(|b| b.first_chunk::<{ 3 * LANES }>());
            if let (Ok(dst), Some(src)) = (<&mut [u32; LANES]>::try_from(&mut *dst), src) {
                if src.chunks_exact(3).all(|c| c.first() == Some(&0xcd)) {
                    for (slot, c) in dst.iter_mut().zip(src.chunks_exact(3)) {
                        if let &[_, a, b] = c {
                            *slot = u32::from(u16::from_be_bytes([a, b]));
                        }
                    }
                    at += 3 * LANES;
                    continue;
                }
            }
            for slot in dst.iter_mut() {
                match token_at(bytes, at) {
                    Ok((value, len)) => {
                        at += len;
                        match u32::try_from(value) {
                            Ok(t) => *slot = t,
                            Err(_) => wide = true,
                        }
                    }
                    Err(e) => {
                        failed = Some(e);
                        break 'scan;
                    }
                }
            }
        }
        let failed = failed.or_else(|| self.skip(at).err().map(|_| TokenError::Truncated));
        match failed {
            None => Ok(wide),
            Some(e) => {
                out.truncate(start);
                Err(match e {
                    TokenError::Truncated => self.truncated(),
                    TokenError::NotAnInteger(offset) => self.error_at(
                        self.pos() + offset,
                        "token_ids holds a value that is not an integer",
                    ),
                })
            }
        }
    }

    /// A block hash: an int (negative ones as their two's-complement bits) or a digest (`bin`).
    #[inline]
    fn block_hash(&mut self, what: &str) -> Result<u64> {
        if let Some((&0xcf, rest)) = self.rest().split_first() {
            if let Some(&value) = rest.first_chunk::<8>() {
                self.pos += 9;
                return Ok(u64::from_be_bytes(value));
            }
        }
        let at = self.pos();
        let m = self.marker()?;
        if let Some(int) = self.int_from(m)? {
            return Ok(match int {
                Int::Pos(v) => v,
                Int::Neg(v) => v as u64,
            });
        }
        let len = match m {
            Marker::Bin8 => u32::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Bin16 => self.len16()?,
            Marker::Bin32 => self.len32()?,
            _ => return Err(self.error_at(at, &format!("{what} holds a value that is not a hash"))),
        };
        if !(1..=64).contains(&len) {
            return Err(self.error_at(
                at,
                &format!("{what} holds a {len}-byte digest (1 to 64 bytes accepted)"),
            ));
        }
        let bytes = self.take(len as usize)?;
        Ok(bytes.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b)))
    }

    /// Skips one complete value (any nesting), iteratively.
    fn skip_value(&mut self) -> Result<()> {
        let m = self.marker()?;
        self.skip_rest(m)
    }

    /// Skips the rest of the value whose marker `m` was just read (all of its nested values).
    fn skip_rest(&mut self, m: Marker) -> Result<()> {
        let mut pending = self.skip_body(m)?;
        while pending > 0 {
            if pending > self.remaining() as u64 {
                return Err(self.error(&format!(
                    "a container claims {pending} more elements but only {} bytes are left",
                    self.remaining()
                )));
            }
            pending -= 1;
            let m = self.marker()?;
            pending += self.skip_body(m)?;
        }
        Ok(())
    }

    /// Skips the fixed part of a value after its marker; returns the number of nested values
    /// that follow (container elements).
    fn skip_body(&mut self, m: Marker) -> Result<u64> {
        let fixed = match m {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => usize::from(n),
            Marker::Str8 | Marker::Bin8 => usize::from(u8::from_be_bytes(self.data::<1>()?)),
            Marker::Str16 | Marker::Bin16 => self.len16()? as usize,
            Marker::Str32 | Marker::Bin32 => self.len32()? as usize,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => usize::from(u8::from_be_bytes(self.data::<1>()?)) + 1,
            Marker::Ext16 => self.len16()? as usize + 1,
            Marker::Ext32 => self.len32()? as usize + 1,
            Marker::FixArray(n) => return Ok(u64::from(n)),
            Marker::Array16 => return Ok(u64::from(self.len16()?)),
            Marker::Array32 => return Ok(u64::from(self.len32()?)),
            Marker::FixMap(n) => return Ok(2 * u64::from(n)),
            Marker::Map16 => return Ok(2 * u64::from(self.len16()?)),
            Marker::Map32 => return Ok(2 * u64::from(self.len32()?)),
            Marker::Reserved => return Err(self.error("reserved msgpack marker 0xc1")),
        };
        self.skip(fixed)?;
        Ok(0)
    }
}

/// Why a token id could not be read.
#[derive(Clone, Copy, Debug)]
enum TokenError {
    /// The payload ends inside it.
    Truncated,
    /// The value at this offset (from the first id) is not an integer.
    NotAnInteger(usize),
}

/// The token id encoded at `bytes[at..]` and its encoded length. Negative ids and signed
/// encodings give `u64::MAX` (not a `u32`).
#[inline]
fn token_at(bytes: &[u8], at: usize) -> std::result::Result<(u64, usize), TokenError> {
    let rest = bytes.get(at..).unwrap_or_default();
    let Some(&m) = rest.first() else {
        return Err(TokenError::Truncated);
    };
    let fixed = |n: usize| -> std::result::Result<u64, TokenError> {
        match rest.get(1..=n) {
            Some(b) => Ok(b.iter().fold(0u64, |v, &x| (v << 8) | u64::from(x))),
            None => Err(TokenError::Truncated),
        }
    };
    Ok(match m {
        0x00..=0x7f => (u64::from(m), 1),
        0xcc => (fixed(1)?, 2),
        0xcd => (fixed(2)?, 3),
        0xce => (fixed(4)?, 5),
        0xcf => (fixed(8)?, 9),
        0xd0..=0xd3 => {
            let len = 1usize << (m - 0xd0);
            fixed(len)?;
            (u64::MAX, 1 + len)
        }
        0xe0..=0xff => (u64::MAX, 1),
        _ => return Err(TokenError::NotAnInteger(at)),
    })
}

fn signed(v: i64) -> Int {
    if v < 0 {
        Int::Neg(v)
    } else {
        Int::Pos(v as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `field_of` against a plain comparison with [`KEYS`], for every key, its one-byte edits,
    /// truncations and extensions, read both far from the payload's end (the table) and at its
    /// end (the fallback).
    #[test]
    fn map_keys_are_recognised_exactly() {
        let plain = |key: &[u8]| {
            KEYS.iter()
                .find(|(name, _)| *name == key)
                .map_or(0, |&(_, bit)| bit)
        };
        let mut candidates: Vec<Vec<u8>> = vec![Vec::new(), b"ts".to_vec(), vec![0; 24]];
        for (key, _) in KEYS {
            candidates.push(key.to_vec());
            for i in 0..key.len() {
                for b in [0u8, b'a', b'_', key[i] ^ 0x20, 0xff] {
                    let mut edit = key.to_vec();
                    edit[i] = b;
                    candidates.push(edit);
                }
            }
            candidates.push(key[..key.len() - 1].to_vec());
            for tail in [0u8, b's', b'_'] {
                let mut longer = key.to_vec();
                longer.push(tail);
                candidates.push(longer);
            }
        }
        for key in candidates {
            let span = Span {
                start: 1,
                len: key.len() as u32,
            };
            let mut at_end = vec![0xa0];
            at_end.extend_from_slice(&key);
            let mut far = at_end.clone();
            far.extend_from_slice(&[0x61; 32]);
            assert_eq!(field_of(&far, span), plain(&key), "{key:?}");
            assert_eq!(field_of(&at_end, span), plain(&key), "{key:?}");
        }
    }
}
