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
//!   nested values are skipped iteratively, without recursion (see [`super::reader`]).
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

use super::extra::ExtraKeys;
use super::keys::{field, field_of, REMOVED_POSITIONS, STORED_POSITIONS};
use super::reader::{Int, Reader, Span};
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
        check_payload_len(payload.len())?;
        let out = decode_batch(&mut Reader::new(payload), batch);
        if out.is_err() {
            batch.clear();
        }
        out
    }
}

/// The longest payload [`Decoder::decode`] takes: a batch keeps its strings as `u32` offsets and
/// lengths into the payload (`Span`), which reach every byte of a payload this long.
pub const MAX_PAYLOAD_BYTES: usize = u32::MAX as usize;

/// `Ok` for a payload of `len` bytes, at most [`MAX_PAYLOAD_BYTES`]; else the `Value` error
/// [`Decoder::decode`] returns.
pub(super) fn check_payload_len(len: usize) -> Result<()> {
    if len > MAX_PAYLOAD_BYTES {
        return Err(Error::Value(format!(
            "KV event payload of {len} bytes is too large"
        )));
    }
    Ok(())
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
