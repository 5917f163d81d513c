//! The event decoder against every msgpack encoding an engine may send (a cargo-mutants class
//! test, `make mutants`): each field in each width, any field order, unknown fields and the legacy
//! array form, drawn at random and compared with the event as written. A child module of
//! `tests`, so it shares its payload writer and helpers.

use super::*;
use crate::events::keys::{REMOVED_POSITIONS, STORED_POSITIONS};

/// An event as the engine means it: the reference the decoder's answer is compared with.
#[derive(Clone, Debug, Default)]
struct Want {
    tag: String,
    kind: Option<EventKind>,
    hashes: Vec<u64>,
    parent: Option<u64>,
    /// Token ids as sent (`u64::MAX`: a negative one).
    tokens: Vec<u64>,
    block_size: u64,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    /// `extra_keys`' encoding as written.
    extra: Option<Vec<u8>>,
    group_idx: i64,
    lookahead: bool,
}

/// A msgpack writer that picks, at random, any encoding the msgpack spec allows for each value
/// (`fixint` or `uint8` … `uint64`, or a signed width where the value fits; `fixstr` or `str8` …
/// `str32`; `fixarray` / `array16` / `array32`; …), so that every marker the decoder's general
/// and fast paths accept is exercised against the value it must give.
struct Any {
    rng: crate::router::SplitMix64,
    out: Vec<u8>,
}

impl Any {
    fn below(&mut self, n: u64) -> u64 {
        self.rng.next_u64() % n
    }
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
    fn raw(&mut self, marker: u8, bytes: &[u8]) {
        self.out.push(marker);
        self.out.extend_from_slice(bytes);
    }
    /// A non-negative integer; `signed`: the signed widths are allowed too.
    fn uint(&mut self, v: u64, signed: bool) {
        let mut ways: Vec<u8> = vec![0xcf];
        for (marker, max) in [(0xcc, 0xff), (0xcd, 0xffff), (0xce, 0xffff_ffff)] {
            if v <= max {
                ways.push(marker);
            }
        }
        if v < 0x80 {
            ways.push(0);
        }
        if signed {
            for (marker, max) in [
                (0xd0, i8::MAX as u64),
                (0xd1, i16::MAX as u64),
                (0xd2, i32::MAX as u64),
                (0xd3, i64::MAX as u64),
            ] {
                if v <= max {
                    ways.push(marker);
                }
            }
        }
        let way = ways[self.below(ways.len() as u64) as usize];
        match way {
            0 => self.out.push(v as u8),
            0xcc | 0xd0 => self.raw(way, &[v as u8]),
            0xcd | 0xd1 => self.raw(way, &(v as u16).to_be_bytes()),
            0xce | 0xd2 => self.raw(way, &(v as u32).to_be_bytes()),
            _ => self.raw(way, &v.to_be_bytes()),
        }
    }
    fn int(&mut self, v: i64) {
        if v >= 0 {
            return self.uint(v as u64, true);
        }
        let mut ways: Vec<u8> = vec![0xd3];
        for (marker, min) in [
            (0xd0, i64::from(i8::MIN)),
            (0xd1, i64::from(i16::MIN)),
            (0xd2, i64::from(i32::MIN)),
        ] {
            if v >= min {
                ways.push(marker);
            }
        }
        if v >= -32 {
            ways.push(0xe0);
        }
        let way = ways[self.below(ways.len() as u64) as usize];
        match way {
            0xe0 => self.out.push(v as i8 as u8),
            0xd0 => self.raw(way, &(v as i8).to_be_bytes()),
            0xd1 => self.raw(way, &(v as i16).to_be_bytes()),
            0xd2 => self.raw(way, &(v as i32).to_be_bytes()),
            _ => self.raw(way, &v.to_be_bytes()),
        }
    }
    /// A length-prefixed value: `fix` (the fixed marker's base and its largest length) or the
    /// 8/16/32-bit length markers (`None` where the type has no 8-bit one).
    fn len(&mut self, n: usize, fix: Option<(u8, usize)>, wide: [Option<u8>; 3]) {
        let mut ways: Vec<u8> = Vec::new();
        if let Some((base, _)) = fix.filter(|&(_, max)| n <= max) {
            ways.push(base);
        }
        for (marker, max) in wide.into_iter().zip([0xff, 0xffff, usize::MAX]) {
            if let Some(m) = marker.filter(|_| n <= max) {
                ways.push(m);
            }
        }
        let way = ways[self.below(ways.len() as u64) as usize];
        match wide.iter().position(|&m| m == Some(way)) {
            None => self.out.push(way | n as u8),
            Some(0) => self.raw(way, &[n as u8]),
            Some(1) => self.raw(way, &(n as u16).to_be_bytes()),
            Some(_) => self.raw(way, &(n as u32).to_be_bytes()),
        }
    }
    fn str(&mut self, s: &str) {
        self.len(
            s.len(),
            Some((0xa0, 31)),
            [Some(0xd9), Some(0xda), Some(0xdb)],
        );
        self.out.extend_from_slice(s.as_bytes());
    }
    fn arr(&mut self, n: usize) {
        self.len(n, Some((0x90, 15)), [None, Some(0xdc), Some(0xdd)]);
    }
    fn map(&mut self, n: usize) {
        self.len(n, Some((0x80, 15)), [None, Some(0xde), Some(0xdf)]);
    }
    fn nil(&mut self) {
        self.out.push(0xc0);
    }
    /// A block hash: an int (a negative one for a value past `i64::MAX`, as SGLang sends) or a
    /// digest (`bin`) of 1 to 64 bytes whose last 8 bytes spell it.
    fn hash(&mut self, h: u64) {
        let need = (8 - h.leading_zeros() as usize / 8).max(1);
        match self.below(3) {
            0 if h > i64::MAX as u64 => self.int(h as i64),
            0 | 1 => self.uint(h, h <= i64::MAX as u64),
            _ => {
                let k = need + self.below((65 - need) as u64) as usize;
                self.len(k, None, [Some(0xc4), Some(0xc5), Some(0xc6)]);
                for _ in 8..k {
                    let b = self.below(256) as u8;
                    self.out.push(b);
                }
                let be = h.to_be_bytes();
                self.out.extend_from_slice(&be[8 - k.min(8)..]);
            }
        }
    }
    /// A token id: unsigned widths only (a signed encoding is read as "not a u32", as a
    /// negative id is).
    /// `minimal`: the smallest encoding, as msgspec writes (runs of `uint16` ids take the
    /// decoder's eight-at-a-time path).
    fn token(&mut self, t: u64, minimal: bool) {
        if t == u64::MAX {
            let v = -1 - self.below(100) as i64;
            self.int(v);
        } else if minimal {
            match t {
                0..0x80 => self.out.push(t as u8),
                0x80..0x100 => self.raw(0xcc, &[t as u8]),
                0x100..0x1_0000 => self.raw(0xcd, &(t as u16).to_be_bytes()),
                0x1_0000..0x1_0000_0000 => self.raw(0xce, &(t as u32).to_be_bytes()),
                _ => self.raw(0xcf, &t.to_be_bytes()),
            }
        } else {
            self.uint(t, false);
        }
    }
    /// A string of 0 to 70 bytes, ASCII or not (a non-ASCII one leaves the fast path).
    fn text(&mut self) -> String {
        let n = self.below(71);
        let alphabet = ['a', 'Z', '7', '-', 'é', '✓'];
        let ascii = !self.one_in(4);
        (0..n)
            .map(|_| alphabet[self.below(if ascii { 4 } else { 6 }) as usize])
            .collect()
    }
    /// Any value (nested to `depth`), as an unknown field or `extra_keys` may hold.
    fn value(&mut self, depth: u32) {
        let kinds = if depth == 0 { 10 } else { 12 };
        match self.below(kinds) {
            0 => self.nil(),
            1 => {
                let b = 0xc2 + self.below(2) as u8;
                self.out.push(b);
            }
            2 => {
                let v = self.rng.next_u64() >> self.below(64);
                self.uint(v, true);
            }
            3 => {
                let v = -((self.rng.next_u64() >> (1 + self.below(63))) as i64) - 1;
                self.int(v);
            }
            4 => self.raw(0xca, &1.25f32.to_be_bytes()),
            5 => self.raw(0xcb, &(-2.5f64).to_be_bytes()),
            6 => {
                let s = self.text();
                self.str(&s);
            }
            7 => {
                let n = self.below(40) as usize;
                self.len(n, None, [Some(0xc4), Some(0xc5), Some(0xc6)]);
                self.out.extend(std::iter::repeat_n(0xab, n));
            }
            8 => {
                // fixext 1/2/4/8/16: marker, type, data.
                let k = self.below(5) as u8;
                self.raw(0xd4 + k, &[7]);
                self.out.extend(std::iter::repeat_n(0xc1, 1 << k));
            }
            9 => {
                let n = self.below(20) as usize;
                self.len(n, None, [Some(0xc7), Some(0xc8), Some(0xc9)]);
                self.out.push(9); // the ext type
                self.out.extend(std::iter::repeat_n(0xc1, n));
            }
            10 => {
                let n = self.below(20) as usize;
                self.arr(n);
                for _ in 0..n {
                    self.value(depth - 1);
                }
            }
            _ => {
                let n = self.below(18) as usize;
                self.map(n);
                for _ in 0..n {
                    self.value(depth - 1);
                    self.value(depth - 1);
                }
            }
        }
    }
}

/// The fields a map event may carry, in [`write_field`]'s numbering.
const FIELDS: [&str; 12] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "cache_salt",
    "extra_keys",
    "group_idx",
    "lookahead_token_ids",
];

/// Draws an event of any kind with any subset of its fields (the required ones always).
fn draw_event(a: &mut Any, array_form: bool) -> (Want, Vec<usize>) {
    let mut w = Want::default();
    let (tag, kind) = match a.below(8) {
        0..4 => ("BlockStored", Some(EventKind::Stored)),
        4 | 5 => ("BlockRemoved", Some(EventKind::Removed)),
        6 => ("AllBlocksCleared", Some(EventKind::Cleared)),
        _ => ("BlockMoved", Some(EventKind::Unknown)),
    };
    w.tag = tag.to_owned();
    w.kind = kind;
    // Which fields are written: required ones, then each other one with probability 1/2 (the
    // legacy array form: a prefix of its positions).
    let mut present: Vec<usize> = match (kind, array_form) {
        (Some(EventKind::Stored), true) => {
            let extra = a.below(6) as usize;
            [1, 2, 3, 4, 5, 6, 7, 9, 10][..4 + extra].to_vec()
        }
        (Some(EventKind::Removed), true) => [1, 6, 10][..1 + a.below(3) as usize].to_vec(),
        (_, true) => Vec::new(),
        (Some(EventKind::Stored), false) => vec![1, 3, 4],
        (Some(EventKind::Removed), false) => vec![1],
        (_, false) => Vec::new(),
    };
    if !array_form {
        for f in 1..FIELDS.len() {
            if !present.contains(&f) && a.one_in(2) {
                present.push(f);
            }
        }
    }
    let hash = |a: &mut Any| a.rng.next_u64() >> a.below(64);
    for &f in &present {
        match f {
            1 => w.hashes = (0..a.below(20)).map(|_| hash(a)).collect(),
            2 => w.parent = (!a.one_in(3)).then(|| hash(a)),
            3 => {
                // Mixed widths, or (a third of events) a vocabulary below 65,536 past 255: runs
                // of `uint16` ids, which the decoder reads eight at a time.
                let odd = if a.one_in(3) { 200 } else { 20 };
                w.tokens = (0..a.below(40))
                    .map(|_| match a.below(odd) {
                        0 => u64::MAX,
                        1 => (1 << 32) + a.below(1 << 40),
                        2..8 => a.below(0x80),
                        8..16 => 0x100 + a.below(0xff00),
                        16..20 => a.below(1 << 32),
                        _ => 0x100 + a.below(0xff00),
                    })
                    .collect()
            }
            4 => w.block_size = a.below(300),
            5 => w.lora_id = (!a.one_in(3)).then(|| (a.rng.next_u64() as i64) >> a.below(64)),
            6 => {
                w.medium = match a.below(4) {
                    0 => None,
                    1 => Some("GPU".to_owned()),
                    _ => Some(a.text()),
                }
            }
            7 => w.lora_name = (!a.one_in(3)).then(|| a.text()),
            8 => w.cache_salt = (!a.one_in(3)).then(|| a.text()),
            9 => {
                let mut v = Any {
                    rng: crate::router::SplitMix64(a.rng.next_u64()),
                    out: Vec::new(),
                };
                v.value(2);
                w.extra = Some(v.out);
            }
            10 => {
                w.group_idx = match a.below(3) {
                    0 => 0,
                    1 => a.below(4) as i64 - 2,
                    _ => (a.rng.next_u64() as i64) >> a.below(64),
                }
            }
            _ => {
                // Written in `write_field`; known here by what it holds.
            }
        }
    }
    (w, present)
}

/// Writes field `f` of `w` (its value only); returns whether it made `lookahead` true.
fn write_field(a: &mut Any, w: &Want, f: usize, minimal_tokens: bool) -> bool {
    let opt_str = |a: &mut Any, s: &Option<String>| match s {
        Some(s) => a.str(s),
        None => a.nil(),
    };
    match f {
        0 => a.str(&w.tag),
        1 => {
            a.arr(w.hashes.len());
            for &h in &w.hashes {
                a.hash(h);
            }
        }
        2 => match w.parent {
            Some(p) => a.hash(p),
            None => a.nil(),
        },
        3 => {
            a.arr(w.tokens.len());
            for &t in &w.tokens {
                a.token(t, minimal_tokens);
            }
        }
        4 => a.uint(w.block_size, true),
        5 => match w.lora_id {
            Some(v) => a.int(v),
            None => a.nil(),
        },
        6 => opt_str(a, &w.medium),
        7 => opt_str(a, &w.lora_name),
        8 => opt_str(a, &w.cache_salt),
        9 => a
            .out
            .extend_from_slice(w.extra.as_deref().unwrap_or(&[0xc0])),
        10 => {
            if w.group_idx == 0 && a.one_in(2) {
                a.nil();
            } else {
                a.int(w.group_idx);
            }
        }
        _ => {
            if a.one_in(4) {
                a.nil();
                return false;
            }
            let n = a.below(4) as usize;
            a.arr(n);
            let mut any = false;
            for _ in 0..n {
                if a.one_in(3) {
                    a.nil();
                    continue;
                }
                let k = a.below(3) as usize;
                any |= k > 0;
                a.arr(k);
                for _ in 0..k {
                    let t = a.below(1 << 20);
                    a.uint(t, false);
                }
            }
            return any;
        }
    }
    false
}

/// Writes the event (its fields in random order, unknown fields between them, or the legacy
/// array form) and returns what it holds.
fn write_event(a: &mut Any) -> Want {
    let array_form = a.one_in(4);
    let (mut w, mut present) = draw_event(a, array_form);
    let minimal = a.one_in(2);
    let mut unknown = a.below(3) as usize;
    if array_form {
        // Values past the known positions are skipped; before them they would be read as fields.
        let full = match w.kind {
            Some(EventKind::Stored) => STORED_POSITIONS.len(),
            Some(EventKind::Removed) => REMOVED_POSITIONS.len(),
            _ => 0,
        };
        if present.len() < full {
            unknown = 0;
        }
        a.arr(1 + present.len() + unknown);
        write_field(a, &w, 0, minimal);
        for &f in &present {
            write_field(a, &w, f, minimal);
        }
        for _ in 0..unknown {
            a.value(2);
        }
        return w;
    }
    present.push(0);
    for i in (1..present.len()).rev() {
        let j = a.below(i as u64 + 1) as usize;
        present.swap(i, j);
    }
    a.map(present.len() + unknown);
    let mut unknown_left = unknown;
    for (i, &f) in present.iter().enumerate() {
        while unknown_left > 0 && a.below((present.len() - i + unknown_left) as u64) == 0 {
            let key = format!("x-{}", a.text());
            a.str(&key);
            a.value(2);
            unknown_left -= 1;
        }
        a.str(FIELDS[f]);
        w.lookahead |= write_field(a, &w, f, minimal);
    }
    for _ in 0..unknown_left {
        let key = format!("x-{}", a.text());
        a.str(&key);
        a.value(2);
    }
    w
}

/// The class of survivor most often found in the events module (shards 0/40 to 5/40: a
/// `lora_name` or `cache_salt` as str8, a `lora_id` past a fixint, ext values, an empty hash
/// array, …): an encoding the engines' usual one does not use, read wrong or not at all by one
/// arm of the general decoder. Every encoding msgpack allows for each field (every int, str,
/// bin, array and map width, digests of 1 to 64 bytes, negative hashes, ASCII or not, fields in
/// any order with unknown fields of any shape between them, the legacy array form, batches of
/// any length) must decode to the event written — the reference is the generator's own value.
#[test]
fn every_msgpack_encoding_of_every_field_decodes_to_its_value() {
    let mut a = Any {
        rng: crate::router::SplitMix64(2026),
        out: Vec::new(),
    };
    let mut batch = Batch::default();
    let mut shapes = std::collections::HashSet::new();
    for round in 0..600 {
        a.out.clear();
        let events = a.below(5) as usize;
        // dp_rank, then values skipped: a few of any shape, or a long run of fixints (bytes
        // that read as ASCII: a fast path that took a string for longer than its fixstr marker
        // says would find them).
        let long = a.one_in(4);
        let tail = if long { 200 } else { a.below(4) as usize };
        let dp_rank = (tail > 0 && !a.one_in(3)).then(|| a.below(64) as i64 - 8);
        a.arr(2 + tail);
        let ts = match a.below(3) {
            0 => {
                a.raw(0xcb, &1_733_000_000.25f64.to_be_bytes());
                1_733_000_000.25
            }
            1 => {
                a.raw(0xca, &0.5f32.to_be_bytes());
                0.5
            }
            _ => {
                a.uint(1_733_000_000, true);
                1_733_000_000.0
            }
        };
        a.arr(events);
        let wants: Vec<Want> = (0..events).map(|_| write_event(&mut a)).collect();
        if tail > 0 {
            match dp_rank {
                Some(r) => a.int(r),
                None => a.nil(),
            }
        }
        for _ in 1..tail {
            if long {
                let b = a.below(0x80) as u8;
                a.out.push(b);
            } else {
                a.value(2);
            }
        }
        let payload = std::mem::take(&mut a.out);
        Decoder::new()
            .decode(&payload, &mut batch)
            .unwrap_or_else(|e| panic!("round {round}: {e}\n{payload:02x?}"));
        assert_eq!((batch.ts, batch.dp_rank), (ts, dp_rank), "round {round}");
        assert_eq!(batch.len(), events, "round {round}");
        assert_eq!(
            batch.num_hashes(),
            wants.iter().map(|w| w.hashes.len()).sum::<usize>()
        );
        for (i, (e, w)) in batch.events(&payload).zip(&wants).enumerate() {
            let at = format!("round {round}, event {i}: {w:?}");
            assert_eq!(Some(e.kind), w.kind, "{at}");
            assert_eq!(e.type_name, w.tag, "{at}");
            assert_eq!(e.block_hashes, &w.hashes[..], "{at}");
            assert_eq!(e.parent, w.parent, "{at}");
            let tokens: Vec<u32> = w
                .tokens
                .iter()
                .map(|&t| u32::try_from(t).unwrap_or(0))
                .collect();
            assert_eq!(e.token_ids, &tokens[..], "{at}");
            let fit = w.tokens.iter().all(|&t| t <= u64::from(u32::MAX));
            assert_eq!(e.tokens_fit_u32, fit, "{at}");
            assert_eq!(e.block_size, w.block_size, "{at}");
            assert_eq!(e.lora_id, w.lora_id, "{at}");
            assert_eq!(e.medium, w.medium.as_deref(), "{at}");
            assert_eq!(e.lora_name, w.lora_name.as_deref(), "{at}");
            assert_eq!(e.cache_salt, w.cache_salt.as_deref(), "{at}");
            assert_eq!(e.extra_keys.raw(), w.extra.as_deref(), "{at}");
            // `is_none`: the field absent, or its one value a msgpack nil (as rmp reads it).
            let nil = w
                .extra
                .as_deref()
                .is_none_or(|b| rmp::decode::read_nil(&mut &b[..]).is_ok());
            assert_eq!(e.extra_keys.is_none(), nil, "{at}");
            assert_eq!(e.group_idx, w.group_idx, "{at}");
            assert_eq!(e.has_lookahead, w.lookahead, "{at}");
            shapes.insert((payload.len() / 64, e.kind as u8));
        }
    }
    assert!(shapes.len() > 20, "the generator drew too few shapes");
}
