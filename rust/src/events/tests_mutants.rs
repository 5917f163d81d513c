//! Event tests written for cargo-mutants survivors (`make mutants`): each asserts behaviour a
//! user relies on that `tests.rs` left unchecked. A child module of `tests`, so it shares its
//! payload writer and helpers.

use super::*;
use crate::events::keys::{REMOVED_POSITIONS, STORED_POSITIONS};

/// The salted chain of `tokens` as the router's `BlockHasher(salt=...)` computes it: the
/// reference a rehashed, salted store must reproduce.
fn salted_hashes(tokens: &[u64], salt: &str) -> Vec<u64> {
    let options = Options {
        salt: Some(salt.to_owned()),
        ..Options::default()
    };
    let h = BlockHasher::new(16, Profile::Native, options).expect("hasher");
    let mut out = Vec::new();
    h.hash_into(tokens, &ChainState::Root, &[], &mut out)
        .expect("hash");
    out
}

/// cargo-mutants survivor (shard 5/40): `NamespaceRef::equivalent` → `true`. The applier keeps
/// one hasher per (salt, LoRA) namespace in a hash table; with many tenants, namespaces whose
/// table tags collide would share a hasher, and one tenant's blocks would be keyed with another
/// tenant's salt. 300 tenants store the same tokens on one worker: each must find its own
/// salted chain (and only that one, not the unsalted one).
#[test]
fn many_tenants_each_get_their_own_salted_blocks() {
    let tokens: Vec<u64> = (0..32).collect();
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let tenants = 300u64;
    for t in 0..tenants {
        let salt = format!("tenant-{t}");
        let payload = batch(|w| {
            w.map(6).s("type").s("BlockStored");
            w.s("block_hashes").ints(&[2 * t + 1, 2 * t + 2]);
            w.s("parent_block_hash").nil();
            w.s("token_ids").ints(&tokens);
            w.s("block_size").u(16);
            w.s("cache_salt").s(&salt);
            1
        });
        a.apply("w", &payload).expect("apply");
    }
    for t in 0..tenants {
        let salt = format!("tenant-{t}");
        assert_eq!(
            matched(&index, &salted_hashes(&tokens, &salt), "w"),
            2,
            "{salt}"
        );
    }
    assert_eq!(matched(&index, &own_hashes(&tokens, 16), "w"), 0);
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_unsupported), (2 * tenants, 0));
}

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
            assert_eq!(e.group_idx, w.group_idx, "{at}");
            assert_eq!(e.has_lookahead, w.lookahead, "{at}");
            shapes.insert((payload.len() / 64, e.kind as u8));
        }
    }
    assert!(shapes.len() > 20, "the generator drew too few shapes");
}

/// cargo-mutants survivors (shard 7/40, and 6/40's `&` → `|`): the fast path reads a fixstr
/// value to the length its marker gives (`m & 0x1f`). Another length is refused by the fast
/// path's ASCII check as soon as a marker byte follows — which is why only bytes that read as
/// ASCII can tell: positive fixints after the string, as a legacy array event's trailing
/// positions or a batch's trailing elements (both skipped) may hold. Each string must still be
/// read whole and alone.
#[test]
fn a_fixstr_value_ends_where_its_marker_says_before_ascii_bytes() {
    let fixints = |w: &mut W, n: usize| {
        for i in 0..n {
            w.u(i as u64 % 100);
        }
    };
    let tokens: Vec<u64> = (0..16).collect();
    // A legacy BlockStored array: ..., lora_name "ab", extra_keys 1, group_idx 0, 200 trailing
    // fixints; a legacy BlockRemoved array: hashes, medium "CPU", group_idx 0, 200 fixints.
    let stored = {
        let mut w = W::default();
        w.arr(10 + 200)
            .fs("BlockStored")
            .ints(&[7])
            .nil()
            .ints(&tokens)
            .u(16);
        w.nil().nil().fs("ab").u(1).u(0);
        fixints(&mut w, 200);
        w.0
    };
    let removed = {
        let mut w = W::default();
        w.arr(4 + 200).fs("BlockRemoved").ints(&[7]).fs("CPU").u(0);
        fixints(&mut w, 200);
        w.0
    };
    // A map event whose last field is a fixstr, then the batch's rank and 200 trailing fixints.
    let mapped = {
        let mut w = W::default();
        w.map(3)
            .fs("type")
            .fs("BlockRemoved")
            .fs("block_hashes")
            .ints(&[8]);
        w.fs("medium").fs("DISK");
        w.0
    };
    let mut w = W::default();
    w.arr(3 + 200).f(1.0).arr(3);
    for e in [&stored, &removed, &mapped] {
        w.0.extend_from_slice(e);
    }
    w.u(3);
    fixints(&mut w, 200);
    let mut b = Batch::default();
    Decoder::new().decode(&w.0, &mut b).expect("decode");
    let events: Vec<Event<'_>> = b.events(&w.0).collect();
    assert_eq!(events.len(), 3);
    assert_eq!(
        (
            events[0].lora_name,
            events[0].group_idx,
            events[0].block_size
        ),
        (Some("ab"), 0, 16)
    );
    assert_eq!(
        (events[1].medium, events[1].block_hashes),
        (Some("CPU"), &[7u64][..])
    );
    assert_eq!(
        (events[2].medium, events[2].block_hashes),
        (Some("DISK"), &[8u64][..])
    );
    assert_eq!(b.dp_rank, Some(3));
}

/// cargo-mutants survivors (shard 8/40: the offset of a token id that is not an integer, an
/// unknown tag that is not UTF-8) and the class they belong to: a malformed payload is refused
/// with the byte offset of what is wrong and what it is (the message a user debugging an engine
/// reads), and the batch is left empty. The offsets are where each case wrote the bad value.
#[test]
fn each_malformed_payload_is_refused_at_its_byte() {
    let tokens: Vec<u64> = (0..16).collect();
    // A batch of one event: `head` writes its fields before the bad one, `bad` the bad value
    // (the offset recorded just before it), `tail` what follows; `pairs` the map's size.
    type Part<'a> = &'a dyn Fn(&mut W);
    let case = |pairs: usize, head: Part<'_>, bad: Part<'_>, tail: Part<'_>| {
        let mut w = W::default();
        w.arr(3).f(1.0).arr(1).map(pairs);
        head(&mut w);
        let at = w.0.len();
        bad(&mut w);
        tail(&mut w);
        w.nil();
        (w.0, at)
    };
    let stored_head = |w: &mut W| {
        w.fs("type").fs("BlockStored").fs("block_hashes").ints(&[1]);
        w.fs("block_size").u(16);
    };
    let cases: Vec<((Vec<u8>, usize), &str)> = vec![
        (
            case(
                4,
                &|w| {
                    stored_head(w);
                    w.fs("token_ids").arr(16);
                    for &t in &tokens[..5] {
                        w.u(t);
                    }
                },
                &|w| {
                    w.fs("x");
                },
                &|w| {
                    for &t in &tokens[6..] {
                        w.u(t);
                    }
                },
            ),
            "token_ids holds a value that is not an integer",
        ),
        (
            case(
                1,
                &|w| {
                    w.fs("type");
                },
                &|w| {
                    w.0.extend_from_slice(&[0xa3, b'B', 0xff, b'x']);
                },
                &|_| {},
            ),
            "a string is not valid UTF-8",
        ),
        (
            case(
                5,
                &|w| {
                    stored_head(w);
                    w.fs("token_ids").ints(&tokens);
                    w.fs("lora_name");
                },
                &|w| {
                    w.0.extend_from_slice(&[0xd9, 2, 0xc3, 0x28]);
                },
                &|_| {},
            ),
            "a string is not valid UTF-8",
        ),
        (
            case(
                2,
                &|w| {
                    w.fs("type")
                        .fs("BlockRemoved")
                        .fs("block_hashes")
                        .arr(2)
                        .u(5);
                },
                &|w| {
                    w.fs("h");
                },
                &|_| {},
            ),
            "block_hashes holds a value that is not a hash",
        ),
        (
            case(
                2,
                &|w| {
                    w.fs("type").fs("BlockRemoved").fs("block_hashes").arr(1);
                },
                &|w| {
                    w.bin(&[7; 65]);
                },
                &|_| {},
            ),
            "block_hashes holds a 65-byte digest",
        ),
        (
            case(
                3,
                &|w| {
                    w.fs("type")
                        .fs("BlockRemoved")
                        .fs("block_hashes")
                        .ints(&[1]);
                },
                &|w| {
                    w.fs("block_hashes");
                },
                &|w| {
                    w.ints(&[2]);
                },
            ),
            "the event key \"block_hashes\" is repeated",
        ),
        (
            case(
                2,
                &|w| {
                    w.fs("type").fs("BlockRemoved").fs("parent_block_hash");
                },
                &|w| {
                    w.f(0.5);
                },
                &|w| {
                    w.fs("block_hashes").ints(&[1]);
                },
            ),
            "parent_block_hash holds a value that is not a hash",
        ),
        (
            case(
                2,
                &|w| {
                    w.fs("type").fs("BlockRemoved").fs("future");
                },
                &|w| {
                    w.0.push(0xc1);
                },
                &|w| {
                    w.fs("block_hashes").ints(&[1]);
                },
            ),
            "reserved msgpack marker 0xc1",
        ),
    ];
    // A container claiming more elements than bytes are left is refused at once (no
    // reservation or loop of that size): an array16 of 60,000 hashes with 4 bytes after it.
    let mut cases = cases;
    cases.push((
        case(
            2,
            &|w| {
                w.fs("type").fs("BlockRemoved").fs("block_hashes");
                w.0.extend_from_slice(&[0xdc, 0xea, 0x60]);
            },
            &|_| {},
            &|w| {
                w.u(1).u(2);
            },
        ),
        "a container claims 60000 elements but only 3 bytes are left",
    ));
    // A block size that is an empty map (0x80, one past the positive fixints) is not a size
    // (shard 10/40: the fast path's `m < 0x80` → `m == 0x80` read it as 128).
    cases.push((
        case(
            4,
            &|w| {
                w.fs("type").fs("BlockStored").fs("block_hashes").ints(&[1]);
                w.fs("token_ids").ints(&tokens).fs("block_size");
            },
            &|w| {
                w.map(0);
            },
            &|_| {},
        ),
        "block_size is not an integer",
    ));
    // A medium that is the integer 64 is not a string (shard 11/40: the fast path's fixstr check
    // `m & 0xe0 == 0xa0` → `m ^ 0xe0` matched 0x40 and read it as "").
    cases.push((
        case(
            3,
            &|w| {
                w.fs("type")
                    .fs("BlockRemoved")
                    .fs("block_hashes")
                    .ints(&[1]);
                w.fs("medium");
            },
            &|w| {
                w.u(64);
            },
            &|_| {},
        ),
        "medium is neither a string nor nil",
    ));
    let mut b = Batch::default();
    for (i, ((payload, at), what)) in cases.into_iter().enumerate() {
        Decoder::new()
            .decode(&stored_batch(&[9], None, &tokens), &mut b)
            .expect("a good batch first");
        let err = Decoder::new().decode(&payload, &mut b).unwrap_err();
        // The reserved marker is reported where the skip reads it: one byte past it.
        let at = if what.starts_with("reserved") {
            at + 1
        } else {
            at
        };
        let want = format!("malformed KV event payload at byte {at}: {what}");
        assert!(
            err.to_string().starts_with(&want),
            "case {i}: {err} (want {want})"
        );
        assert!(
            b.is_empty(),
            "case {i}: a refused payload leaves the batch empty"
        );
    }
}

/// cargo-mutants survivor (shard 9/40): a store whose router-side hashing fails is counted once
/// as unsupported and stores nothing. With the `sglang` profile a `lora_name` cannot be hashed
/// (SGLang's page hashes do not include the adapter: the hasher refuses it), so such a store is
/// skipped; the same store without the adapter is kept.
#[test]
fn a_store_the_router_cannot_hash_is_counted_as_unsupported() {
    let tokens: Vec<u64> = (0..16).collect();
    let index = shared();
    let config = Config {
        profile: Profile::Sglang,
        ..Config::default()
    };
    let mut a = Applier::new(index.clone(), config).expect("applier");
    let store = |hash: u64, lora: Option<&str>| {
        batch(|w| {
            w.map(if lora.is_some() { 6 } else { 5 });
            w.s("type").s("BlockStored");
            w.s("block_hashes").ints(&[hash]);
            w.s("parent_block_hash").nil();
            w.s("token_ids").ints(&tokens);
            w.s("block_size").u(16);
            if let Some(name) = lora {
                w.s("lora_name").s(name);
            }
            1
        })
    };
    a.apply("w", &store(1, Some("sql-lora"))).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.skipped_unsupported, c.blocks_stored), (1, 0));
    a.apply("w", &store(2, None)).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.skipped_unsupported, c.blocks_stored), (1, 1));
}

/// cargo-mutants survivor (shard 10/40): `Applier::config` is the configuration the applier was
/// built with (the bindings' `KvEventApplier` properties read it).
#[test]
fn the_applier_reports_its_configuration() {
    let config = Config {
        mode: Mode::Direct,
        block_size: 32,
        profile: Profile::Sglang,
        seed: None,
        group_idx: 2,
    };
    let a = Applier::new(shared(), config.clone()).expect("applier");
    let c = a.config();
    assert_eq!(
        (c.mode, c.block_size, c.profile, c.group_idx),
        (Mode::Direct, 32, Profile::Sglang, 2)
    );
    assert_eq!(c.seed, None);
}

/// cargo-mutants survivors (shard 11/40): `Applier::index` is the GPU index it was built with;
/// at most [`MAX_TIERS`] storage tiers besides the GPU get an index, and a store to one more is
/// counted once as unsupported (nothing stored).
#[test]
fn the_applier_shares_its_index_and_caps_its_tiers() {
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    assert!(Arc::ptr_eq(a.index(), &index));
    let tokens: Vec<u64> = (0..16).collect();
    for t in 0..=MAX_TIERS {
        let medium = format!("TIER{t}");
        let payload = batch(|w| {
            let e = Ev {
                hashes: &[t as u64 + 1],
                parent: None,
                tokens: &tokens,
                block_size: 16,
                medium: Some(&medium),
            };
            stored(w, &e);
            1
        });
        a.apply("w", &payload).expect("apply");
    }
    let c = a.counters("w").expect("counters");
    assert_eq!(
        (c.blocks_stored, c.skipped_unsupported),
        (MAX_TIERS as u64, 1)
    );
    assert!(a.tier_index("TIER0").is_some());
    assert!(a.tier_index(&format!("TIER{MAX_TIERS}")).is_none());
}
