//! msgpack decoding of one KV-event batch, straight from the payload bytes.
//!
//! Invariants:
//! - **Whole or nothing.** [`Decoder::decode`] either decodes the entire payload and returns
//!   `Ok`, or returns [`Error::Value`] naming the byte offset and what was wrong; a batch is
//!   never half-decoded into something usable.
//! - **No allocation per block or per event.** Hashes and token ids land in buffers owned by the
//!   reusable [`Batch`]; strings are spans of the payload (checked UTF-8), resolved to `&str` by
//!   [`Batch::events`].
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

use rmp::decode::{read_marker, Bytes, RmpRead};
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
        let event = decode_event(r, batch)?;
        batch.events.push(event);
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

fn decode_event(r: &mut Reader<'_>, batch: &mut Batch) -> Result<RawEvent> {
    let at = r.pos();
    let m = r.marker()?;
    let mut e = RawEvent {
        hashes: (batch.hashes.len() as u32, batch.hashes.len() as u32),
        tokens: (batch.tokens.len() as u32, batch.tokens.len() as u32),
        ..RawEvent::default()
    };
    let fields = if let Some(pairs) = r.map_len(m) {
        decode_map_event(r, batch, pairs, &mut e)?
    } else if let Ok(items) = r.array_len(m) {
        decode_array_event(r, batch, items, &mut e)?
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
    Ok(e)
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
    batch: &mut Batch,
    pairs: u32,
    e: &mut RawEvent,
) -> Result<u32> {
    r.check_items(pairs.saturating_mul(2))?;
    let mut fields = 0;
    for _ in 0..pairs {
        let key_at = r.pos();
        let m = r.marker()?;
        let Some(key) = r.str_span_checked(m, key_at, false)? else {
            return Err(r.error_at(key_at, "an event map key is not a string"));
        };
        let bit = match key.get(r.payload) {
            b"type" => field::TYPE,
            b"block_hashes" => field::HASHES,
            b"parent_block_hash" => field::PARENT,
            b"token_ids" => field::TOKENS,
            b"block_size" => field::BLOCK_SIZE,
            b"lora_id" => field::LORA_ID,
            b"medium" => field::MEDIUM,
            b"lora_name" => field::LORA_NAME,
            b"cache_salt" => field::CACHE_SALT,
            b"extra_keys" => field::EXTRA_KEYS,
            b"group_idx" => field::GROUP_IDX,
            b"lookahead_token_ids" => field::LOOKAHEAD,
            _ => 0,
        };
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
        read_field(r, batch, bit, e)?;
    }
    Ok(fields)
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
    batch: &mut Batch,
    items: u32,
    e: &mut RawEvent,
) -> Result<u32> {
    let event_at = r.pos();
    r.check_items(items)?;
    let mut fields = field::TYPE;
    if items == 0 {
        return Err(r.error("an event array is empty (no tag)"));
    }
    read_field(r, batch, field::TYPE, e)?;
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
                read_field(r, batch, bit, e)?;
            }
            None => r.skip_value()?,
        }
    }
    Ok(fields)
}

fn read_field(r: &mut Reader<'_>, batch: &mut Batch, bit: u32, e: &mut RawEvent) -> Result<()> {
    match bit {
        field::TYPE => {
            let at = r.pos();
            let m = r.marker()?;
            let Some(tag) = r.str_span_checked(m, at, false)? else {
                return Err(r.error_at(at, "the event type tag is not a string"));
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
            let start = batch.hashes.len();
            batch.hashes.reserve(n as usize);
            for _ in 0..n {
                let h = r.block_hash("block_hashes")?;
                batch.hashes.push(h);
            }
            e.hashes = (start as u32, batch.hashes.len() as u32);
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
            let start = batch.tokens.len();
            let wide = r.token_ids(n, &mut batch.tokens)?;
            e.tokens = (start as u32, batch.tokens.len() as u32);
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

/// A cursor over the payload built on `rmp`'s low-level reader (markers and fixed-width data).
struct Reader<'a> {
    payload: &'a [u8],
    rd: Bytes<'a>,
    base: usize,
}

impl<'a> Reader<'a> {
    fn new(payload: &'a [u8]) -> Self {
        Reader {
            payload,
            rd: Bytes::new(payload),
            base: 0,
        }
    }

    fn pos(&self) -> usize {
        self.base + self.rd.position() as usize
    }

    fn remaining(&self) -> usize {
        self.rd.remaining_slice().len()
    }

    fn error_at(&self, at: usize, what: &str) -> Error {
        Error::Value(format!("malformed KV event payload at byte {at}: {what}"))
    }

    fn error(&self, what: &str) -> Error {
        self.error_at(self.pos(), what)
    }

    fn truncated(&self) -> Error {
        self.error("the payload ends in the middle of a value")
    }

    fn peek(&self) -> Result<u8> {
        self.rd
            .remaining_slice()
            .first()
            .copied()
            .ok_or_else(|| self.truncated())
    }

    fn marker(&mut self) -> Result<Marker> {
        read_marker(&mut self.rd).map_err(|_| self.truncated())
    }

    fn data<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = [0u8; N];
        match self.rd.read_exact_buf(&mut buf) {
            Ok(()) => Ok(buf),
            Err(_) => Err(self.truncated()),
        }
    }

    fn skip(&mut self, n: usize) -> Result<()> {
        let rest = self.rd.remaining_slice();
        let Some(tail) = rest.get(n..) else {
            return Err(self.truncated());
        };
        self.base = self.pos() + n;
        self.rd = Bytes::new(tail);
        Ok(())
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
        let bytes = self
            .rd
            .remaining_slice()
            .get(..len as usize)
            .ok_or_else(|| self.truncated())?;
        if validate && std::str::from_utf8(bytes).is_err() {
            return Err(self.error_at(at, "a string is not valid UTF-8"));
        }
        self.skip(len as usize)?;
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

    /// Appends `n` token ids to `out` (the hot loop: a direct scan of the integer encodings);
    /// returns true when some id is negative or beyond `u32` (stored as 0). `n` was checked
    /// against the bytes left.
    fn token_ids(&mut self, n: u32, out: &mut Vec<u32>) -> Result<bool> {
        let bytes = self.rd.remaining_slice();
        let start = out.len();
        out.resize(start + n as usize, 0);
        let slots = out.get_mut(start..).unwrap_or_default();
        let mut at = 0usize;
        let mut wide = false;
        let mut done = 0usize;
        for slot in slots.iter_mut() {
            done += 1;
            match bytes.get(at..at + 3) {
                Some(&[m @ 0x00..=0x7f, _, _]) => {
                    *slot = u32::from(m);
                    at += 1;
                    continue;
                }
                Some(&[0xcd, a, b]) => {
                    *slot = u32::from(u16::from_be_bytes([a, b]));
                    at += 3;
                    continue;
                }
                _ => {}
            }
            let Some(&m) = bytes.get(at) else {
                done -= 1;
                break;
            };
            let (value, len): (u64, usize) = match m {
                0x00..=0x7f => (u64::from(m), 1),
                0xcc => match bytes.get(at + 1) {
                    Some(&b) => (u64::from(b), 2),
                    None => (0, usize::MAX / 2),
                },
                0xcd => match bytes.get(at + 1..at + 3) {
                    Some(&[a, b]) => (u64::from(u16::from_be_bytes([a, b])), 3),
                    _ => (0, usize::MAX / 2),
                },
                0xce => match bytes.get(at + 1..at + 5) {
                    Some(&[a, b, c, d]) => (u64::from(u32::from_be_bytes([a, b, c, d])), 5),
                    _ => (0, usize::MAX / 2),
                },
                0xcf => match bytes.get(at + 1..at + 9).map(<[u8; 8]>::try_from) {
                    Some(Ok(b)) => (u64::from_be_bytes(b), 9),
                    _ => (0, usize::MAX / 2),
                },
                0xd0 => (u64::MAX, 2),
                0xd1 => (u64::MAX, 3),
                0xd2 => (u64::MAX, 5),
                0xd3 => (u64::MAX, 9),
                0xe0..=0xff => (u64::MAX, 1),
                _ => {
                    let pos = self.pos() + at;
                    out.truncate(start);
                    return Err(
                        self.error_at(pos, "token_ids holds a value that is not an integer")
                    );
                }
            };
            at = at.saturating_add(len);
            if at > bytes.len() {
                break; // truncated inside the value
            }
            match u32::try_from(value) {
                Ok(t) => *slot = t,
                Err(_) => wide = true,
            }
        }
        if done != n as usize || at > bytes.len() || self.skip(at).is_err() {
            out.truncate(start);
            return Err(self.truncated());
        }
        Ok(wide)
    }

    /// A block hash: an int (negative ones as their two's-complement bits) or a digest (`bin`).
    fn block_hash(&mut self, what: &str) -> Result<u64> {
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
        let bytes = self
            .rd
            .remaining_slice()
            .get(..len as usize)
            .ok_or_else(|| self.truncated())?;
        let value = bytes.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b));
        self.skip(len as usize)?;
        Ok(value)
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

fn signed(v: i64) -> Int {
    if v < 0 {
        Int::Neg(v)
    } else {
        Int::Pos(v as u64)
    }
}
