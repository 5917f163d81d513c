use std::sync::Arc;

use parking_lot::RwLock;

use super::keys::{field_of, KEYS};
use super::reader::Span;
use super::*;
use crate::blocks::{BlockHasher, ChainState, Options, Profile};
use crate::index::{PrefixIndex, SharedPrefixIndex};

/// vLLM 0.33 vector `batch_stored_stored` (tests/data/vectors/vllm_0.33.0_...json).
const STORED_STORED: &str = "93cb41d954fc4020000092de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf7b0bf7bf7fd01682cf0b368b33d87bf3bfb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00200102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6ede000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf96f37f6bfe25db82b1706172656e745f626c6f636b5f68617368cf0b368b33d87bf3bfa9746f6b656e5f696473dc00102122232425262728292a2b2c2d2e2f30aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00";
/// vLLM 0.33 vector `batch_removed`.
const REMOVED: &str = "93cb41d954fc405000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf96f37f6bfe25db82a66d656469756da3475055a967726f75705f6964780000";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A minimal msgpack writer for building test payloads.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn arr(&mut self, n: usize) -> &mut Self {
        if n < 16 {
            self.0.push(0x90 | n as u8);
        } else {
            self.0.push(0xdc);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        }
        self
    }
    fn map(&mut self, n: usize) -> &mut Self {
        self.0.push(0x80 | n as u8);
        self
    }
    /// A string of fewer than 32 bytes as msgspec writes it: `fixstr`.
    fn fs(&mut self, s: &str) -> &mut Self {
        assert!(s.len() < 32);
        self.0.push(0xa0 | s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn s(&mut self, s: &str) -> &mut Self {
        self.0.push(0xd9);
        self.0.push(s.len() as u8);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// The smallest encoding, as msgspec and msgpack write.
    fn u(&mut self, v: u64) -> &mut Self {
        if v < 128 {
            self.0.push(v as u8);
        } else if v < 1 << 16 {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v < 1 << 32 {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
        self
    }
    fn i(&mut self, v: i64) -> &mut Self {
        self.0.push(0xd3);
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }
    fn f(&mut self, v: f64) -> &mut Self {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn bin(&mut self, b: &[u8]) -> &mut Self {
        self.0.push(0xc4);
        self.0.push(b.len() as u8);
        self.0.extend_from_slice(b);
        self
    }
    fn ints(&mut self, v: &[u64]) -> &mut Self {
        self.arr(v.len());
        for &x in v {
            self.u(x);
        }
        self
    }
}

struct Ev<'a> {
    hashes: &'a [u64],
    parent: Option<u64>,
    tokens: &'a [u64],
    block_size: u64,
    medium: Option<&'a str>,
}

fn stored(w: &mut W, e: &Ev<'_>) {
    stored_with(w, e, |_| 0);
}

/// A `BlockStored` map event; `extra` writes more (key, value) pairs after the usual six and
/// returns how many.
fn stored_with(w: &mut W, e: &Ev<'_>, extra: impl FnOnce(&mut W) -> usize) {
    let mut more = W::default();
    let n = extra(&mut more);
    w.map(6 + n).s("type").s("BlockStored");
    w.s("block_hashes").ints(e.hashes);
    w.s("parent_block_hash");
    match e.parent {
        Some(p) => w.u(p),
        None => w.nil(),
    };
    w.s("token_ids").ints(e.tokens);
    w.s("block_size").u(e.block_size);
    w.s("medium");
    match e.medium {
        Some(m) => w.s(m),
        None => w.nil(),
    };
    w.0.extend_from_slice(&more.0);
}

fn removed(w: &mut W, hashes: &[u64], medium: Option<&str>) {
    w.map(3).s("type").s("BlockRemoved");
    w.s("block_hashes").ints(hashes);
    w.s("medium");
    match medium {
        Some(m) => w.s(m),
        None => w.nil(),
    };
}

fn batch(events: impl FnOnce(&mut W) -> usize) -> Vec<u8> {
    let mut body = W::default();
    let n = events(&mut body);
    let mut w = W::default();
    w.arr(3).f(1.5);
    w.arr(n);
    w.0.extend_from_slice(&body.0);
    w.nil();
    w.0
}

/// A batch of one `BlockStored` event of 16-token blocks (no medium).
fn stored_batch(hashes: &[u64], parent: Option<u64>, tokens: &[u64]) -> Vec<u8> {
    batch(|w| {
        let e = Ev {
            hashes,
            parent,
            tokens,
            block_size: 16,
            medium: None,
        };
        stored(w, &e);
        1
    })
}

fn shared() -> SharedPrefixIndex {
    Arc::new(RwLock::new(PrefixIndex::new(None).expect("index")))
}

fn own_hashes(tokens: &[u64], block_size: usize) -> Vec<u64> {
    let h = BlockHasher::new(block_size, Profile::Native, Options::default()).expect("hasher");
    let mut out = Vec::new();
    h.hash_into(tokens, &ChainState::Root, &[], &mut out)
        .expect("hash");
    out
}

fn matched(index: &SharedPrefixIndex, query: &[u64], worker: &str) -> u32 {
    index
        .read()
        .match_names(query)
        .into_iter()
        .find(|(w, _)| &**w == worker)
        .map_or(0, |(_, n)| n)
}

#[test]
fn decodes_the_vllm_vector() {
    let payload = unhex(STORED_STORED);
    let mut batch = Batch::default();
    Decoder::new().decode(&payload, &mut batch).expect("decode");
    assert_eq!(batch.ts, 1700000000.5);
    assert_eq!(batch.dp_rank, Some(0));
    let events: Vec<Event<'_>> = batch.events(&payload).collect();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].kind, EventKind::Stored);
    assert_eq!(
        events[0].block_hashes,
        &[8866452693264111234, 807986237951177663]
    );
    assert_eq!(events[0].parent, None);
    assert_eq!(events[0].token_ids, (1..=32).collect::<Vec<u32>>());
    assert_eq!(events[0].block_size, 16);
    assert_eq!(events[0].medium, Some("GPU"));
    assert_eq!(events[1].parent, Some(807986237951177663));
    assert_eq!(events[1].block_hashes, &[10877177626832001922]);

    let payload = unhex(REMOVED);
    Decoder::new().decode(&payload, &mut batch).expect("decode");
    let e = batch.events(&payload).next().expect("one event");
    assert_eq!(e.kind, EventKind::Removed);
    assert_eq!(e.block_hashes, &[10877177626832001922]);
}

#[test]
fn every_truncation_is_an_error_and_leaves_the_batch_empty() {
    let payload = unhex(STORED_STORED);
    let mut batch = Batch::default();
    for cut in 0..payload.len() {
        let out = Decoder::new().decode(&payload[..cut], &mut batch);
        assert!(out.is_err(), "prefix of {cut} bytes decoded");
        assert!(batch.is_empty());
    }
    let mut longer = payload.clone();
    longer.push(0);
    assert!(Decoder::new().decode(&longer, &mut batch).is_err());
}

#[test]
fn legacy_arrays_signed_and_digest_hashes() {
    let digest: Vec<u8> = (0u8..32).collect();
    let payload = batch(|w| {
        // vLLM <= 0.23: ["BlockStored", hashes, parent, tokens, block_size, lora_id]
        w.arr(6).s("BlockStored").arr(2).i(-5).bin(&digest);
        w.nil().ints(&[1, 2]).u(1).nil();
        // ["BlockRemoved", hashes] and ["AllBlocksCleared"] and an unknown type
        w.arr(2).s("BlockRemoved").arr(1).i(-5);
        w.arr(1).s("AllBlocksCleared");
        w.arr(3).s("BlockMoved").u(1).u(2);
        4
    });
    let mut b = Batch::default();
    Decoder::new().decode(&payload, &mut b).expect("decode");
    let events: Vec<Event<'_>> = b.events(&payload).collect();
    let last8 = u64::from_be_bytes(digest[24..].try_into().expect("8 bytes"));
    assert_eq!(events[0].block_hashes, &[(-5i64) as u64, last8]);
    assert_eq!(events[1].block_hashes, &[(-5i64) as u64]);
    assert_eq!(events[2].kind, EventKind::Cleared);
    assert_eq!(events[3].kind, EventKind::Unknown);
    assert_eq!(events[3].type_name, "BlockMoved");
}

#[test]
fn rehash_chains_removes_and_clears() {
    let tokens: Vec<u64> = (100..164).collect(); // 4 blocks of 16
    let own = own_hashes(&tokens, 16);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let p1 = batch(|w| {
        stored(
            w,
            &Ev {
                hashes: &[11, 12],
                parent: None,
                tokens: &tokens[..32],
                block_size: 16,
                medium: None,
            },
        );
        stored(
            w,
            &Ev {
                hashes: &[13, 14],
                parent: Some(12),
                tokens: &tokens[32..],
                block_size: 16,
                medium: Some("GPU"),
            },
        );
        2
    });
    a.apply("w", &p1).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 4);
    // Unknown parent: skipped, counted, nothing stored.
    let p2 = stored_batch(&[99], Some(98), &tokens[..16]);
    a.apply("w", &p2).expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!(c.skipped_unknown_parent, 1);
    assert_eq!(c.blocks_stored, 4);
    // Removing engine block 13 drops own blocks 2 and 3.
    let p3 = batch(|w| {
        removed(w, &[13], None);
        1
    });
    a.apply("w", &p3).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 2);
    // A malformed payload changes nothing.
    assert!(a.apply("w", &p1[..p1.len() - 3]).is_err());
    assert_eq!(matched(&index, &own, "w"), 2);
    assert_eq!(a.counters("w").expect("c").malformed, 1);
    // AllBlocksCleared.
    let p4 = batch(|w| {
        w.map(1).s("type").s("AllBlocksCleared");
        1
    });
    a.apply("w", &p4).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 0);
    assert_eq!(index.read().num_blocks("w").expect("known"), 0);
}

#[test]
fn engine_blocks_larger_than_router_blocks_and_tiers() {
    let tokens: Vec<u64> = (0..64).collect();
    let own = own_hashes(&tokens, 16);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let p = batch(|w| {
        stored(
            w,
            &Ev {
                hashes: &[1, 2],
                parent: None,
                tokens: &tokens,
                block_size: 32,
                medium: None,
            },
        );
        stored(
            w,
            &Ev {
                hashes: &[1],
                parent: None,
                tokens: &tokens[..32],
                block_size: 32,
                medium: Some("CPU"),
            },
        );
        // Partial block (5 tokens) and a block size that is not a multiple of 16.
        stored(
            w,
            &Ev {
                hashes: &[7],
                parent: Some(2),
                tokens: &tokens[..5],
                block_size: 5,
                medium: None,
            },
        );
        stored(
            w,
            &Ev {
                hashes: &[8],
                parent: Some(2),
                tokens: &tokens[..24],
                block_size: 24,
                medium: None,
            },
        );
        4
    });
    a.apply("w", &p).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 4);
    let cpu = a.tier_index("CPU").expect("CPU tier");
    assert_eq!(matched(&cpu, &own, "w"), 2);
    // The shared registry lists the same tier index.
    let registry = a.tier_registry();
    let tiers = registry.read();
    assert_eq!(tiers.len(), 1);
    assert_eq!(&*tiers[0].0, "CPU");
    assert!(Arc::ptr_eq(&tiers[0].1, &cpu));
    drop(tiers);
    let c = a.counters("w").expect("c");
    assert_eq!((c.skipped_partial, c.skipped_block_size), (1, 1));
    assert_eq!(
        c.engine_block_size, 32,
        "the largest GPU store's block size (a skipped store's counts: an engine of 24 is named)"
    );
    // Removing engine block 2 (own blocks 2, 3) on the GPU leaves the CPU tier alone.
    let r = batch(|w| {
        removed(w, &[2], None);
        1
    });
    a.apply("w", &r).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 2);
    assert_eq!(matched(&cpu, &own, "w"), 2);
    a.clear_worker("w");
    assert_eq!(matched(&cpu, &own, "w"), 0);
    assert_eq!(a.counters("w").expect("c").resets, 1);
}

#[test]
fn direct_mode_uses_engine_hashes() {
    let index = shared();
    let config = Config {
        mode: Mode::Direct,
        ..Config::default()
    };
    let mut a = Applier::new(index.clone(), config).expect("applier");
    let payload = unhex(STORED_STORED);
    a.apply("w", &payload).expect("apply");
    let engine = [
        8866452693264111234,
        807986237951177663,
        10877177626832001922,
    ];
    assert_eq!(matched(&index, &engine, "w"), 3);
    a.apply("w", &unhex(REMOVED)).expect("apply");
    assert_eq!(matched(&index, &engine, "w"), 2);
}

#[test]
fn a_worker_removed_from_the_index_is_re_registered_empty() {
    let tokens: Vec<u64> = (0..32).collect();
    let own = own_hashes(&tokens, 16);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let first = stored_batch(&[1], None, &tokens[..16]);
    a.apply("w", &first).expect("apply");
    index.write().remove_worker("w").expect("known");
    let child = stored_batch(&[2], Some(1), &tokens[16..]);
    a.apply("w", &child).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 0);
    assert_eq!(a.counters("w").expect("c").index_rejected, 1);
}

/// cargo-mutants survivor (shard 0/40): `AllBlocksCleared` forgets the engine blocks before it
/// (rehash mode), so a store naming one of them as its parent is skipped as an unknown parent —
/// even once the worker holds that block's tokens again under another engine hash (an engine
/// restarted with a new hash seed).
#[test]
fn a_clear_forgets_the_engine_blocks_before_it() {
    let tokens: Vec<u64> = (0..32).collect();
    let own = own_hashes(&tokens, 16);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let root = |hash: u64| stored_batch(&[hash], None, &tokens[..16]);
    a.apply("w", &root(1)).expect("apply");
    let clear = batch(|w| {
        w.map(1).s("type").s("AllBlocksCleared");
        1
    });
    a.apply("w", &clear).expect("apply");
    a.apply("w", &root(7)).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 1);
    let child = stored_batch(&[2], Some(1), &tokens[16..]);
    a.apply("w", &child).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 1);
    let c = a.counters("w").expect("counters");
    assert_eq!((c.skipped_unknown_parent, c.blocks_stored), (1, 2));
}

/// cargo-mutants survivors (shard 4/40): `extra_keys` (read only by the general field decoder)
/// decides a rehashed store — a string on the first block (a `fixstr`, as msgspec writes it) is
/// the cache salt, so the blocks are the salted chain's; a multimodal item (`[identifier, offset]`) cannot be reproduced, so the
/// store is skipped as unsupported.
#[test]
fn extra_keys_salt_a_store_or_make_it_unsupported() {
    let tokens: Vec<u64> = (0..32).collect();
    let salted = {
        let options = Options {
            salt: Some("tenant-a".to_owned()),
            ..Options::default()
        };
        let h = BlockHasher::new(16, Profile::Native, options).expect("hasher");
        let mut out = Vec::new();
        h.hash_into(&tokens[..16], &ChainState::Root, &[], &mut out)
            .expect("hash");
        out
    };
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let store = |hash: u64, tokens: &[u64], extra: &dyn Fn(&mut W)| {
        batch(|w| {
            w.map(6).s("type").s("BlockStored");
            w.s("block_hashes").ints(&[hash]);
            w.s("parent_block_hash").nil();
            w.s("token_ids").ints(tokens);
            w.s("block_size").u(16);
            w.s("extra_keys");
            extra(w);
            1
        })
    };
    let salt = store(1, &tokens[..16], &|w| {
        w.arr(1).arr(1).fs("tenant-a");
    });
    a.apply("w", &salt).expect("apply");
    assert_eq!(matched(&index, &salted, "w"), 1);
    assert_eq!(matched(&index, &own_hashes(&tokens[..16], 16), "w"), 0);
    let image = store(2, &tokens[16..], &|w| {
        w.arr(1).arr(1).arr(2).s("img-1").u(0);
    });
    a.apply("w", &image).expect("apply");
    assert_eq!(matched(&index, &own_hashes(&tokens[16..], 16), "w"), 0);
    let c = a.counters("w").expect("counters");
    assert_eq!((c.blocks_stored, c.skipped_unsupported), (1, 1));
}

/// `field_of` against a plain comparison with [`KEYS`], for every key, its one-byte edits,
/// every truncation and its extensions by 1 to 40 bytes, read both far from the payload's end
/// (the table) and at its end (the fallback).
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
        for n in 0..key.len() {
            candidates.push(key[..n].to_vec());
        }
        // Past the table's 24-byte window too: a key of another length in the same slot
        // (length mod 32), NUL-padded, equals the padded entry in the window.
        for tail in [0u8, b's', b'_'] {
            for n in 1..=40 {
                let mut longer = key.to_vec();
                longer.extend(std::iter::repeat_n(tail, n));
                candidates.push(longer);
            }
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

#[test]
fn event_mode_names_round_trip() {
    // Router.config()["event_mode"] and the applier's `mode` show these names, and a router
    // built again from a saved config passes them back: each must parse to the same mode.
    for (mode, name) in [(Mode::Rehash, "rehash"), (Mode::Direct, "direct")] {
        assert_eq!(mode.name(), name);
        assert_eq!(mode.to_string(), name);
        assert_eq!(name.parse::<Mode>().ok(), Some(mode));
    }
    let err = "Rehash"
        .parse::<Mode>()
        .expect_err("names are case-sensitive");
    assert!(err.to_string().contains("\"Rehash\""), "{err}");
}

#[test]
fn removing_a_worker_forgets_its_blocks_tiers_and_counters() {
    // The router calls this when a worker leaves the fleet: its GPU blocks and its blocks in
    // every tier must stop matching, its counters go, and the other workers keep theirs.
    let tokens: Vec<u64> = (0..32).collect();
    let own = own_hashes(&tokens, 16);
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let p = batch(|w| {
        for medium in [None, Some("CPU")] {
            stored(
                w,
                &Ev {
                    hashes: &[1, 2],
                    parent: None,
                    tokens: &tokens,
                    block_size: 16,
                    medium,
                },
            );
        }
        2
    });
    a.apply("gone", &p).expect("apply");
    a.apply("kept", &p).expect("apply");
    let cpu = a.tier_index("CPU").expect("CPU tier");
    assert_eq!(matched(&cpu, &own, "gone"), 2);

    assert!(a.remove_worker("gone"));
    assert_eq!(matched(&index, &own, "gone"), 0);
    assert_eq!(matched(&cpu, &own, "gone"), 0);
    assert_eq!(cpu.read().worker_id("gone"), None, "still in the CPU tier");
    assert!(a.counters("gone").is_none());
    assert_eq!(a.workers(), ["kept"]);
    assert_eq!(matched(&index, &own, "kept"), 2);
    assert_eq!(matched(&cpu, &own, "kept"), 2);
    // Only a known worker is removed.
    assert!(!a.remove_worker("gone"));
    assert!(!a.remove_worker("never-seen"));
    assert_eq!(matched(&index, &own, "kept"), 2);
}

#[test]
fn a_value_ending_the_payload_is_read_whole() {
    // Batches without a data-parallel rank ([ts, events]) end with the last event's last value:
    // an unknown field from a newer engine (skipped) or the token ids (map order is free).
    let tokens: Vec<u64> = (0..16).collect();
    let unknown_last = |w: &mut W| {
        w.map(5).s("type").s("BlockStored");
        w.s("block_hashes").ints(&[7]);
        w.s("block_size").u(16);
        w.s("token_ids").ints(&tokens);
        w.s("future_field").s("some text");
    };
    let tokens_last = |w: &mut W| {
        w.map(4).s("type").s("BlockStored");
        w.s("block_hashes").ints(&[7]);
        w.s("block_size").u(16);
        w.s("token_ids").ints(&tokens);
    };
    for (i, event) in [&unknown_last as &dyn Fn(&mut W), &tokens_last]
        .into_iter()
        .enumerate()
    {
        let mut w = W::default();
        w.arr(2).f(2.5).arr(1);
        event(&mut w);
        let mut b = Batch::default();
        Decoder::new()
            .decode(&w.0, &mut b)
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let e = b.events(&w.0).next().expect("one event");
        assert_eq!(e.block_hashes, &[7], "case {i}");
        assert_eq!(e.token_ids, (0..16).collect::<Vec<u32>>(), "case {i}");
        assert_eq!(b.dp_rank, None);
    }
}

#[test]
fn events_of_another_kv_cache_group_are_skipped() {
    // Hybrid models (full + sliding-window attention) publish each block group's events with
    // its group_idx; the applier follows one group and counts the others.
    let tokens: Vec<u64> = (0..32).collect();
    let own = own_hashes(&tokens, 16);
    let in_group = |w: &mut W, group: u64, hashes: &[u64], tokens: &[u64]| {
        w.map(5).s("type").s("BlockStored");
        w.s("block_hashes").ints(hashes);
        w.s("token_ids").ints(tokens);
        w.s("block_size").u(16);
        w.s("group_idx").u(group);
    };
    let p = batch(|w| {
        in_group(w, 0, &[1], &tokens[..16]);
        in_group(w, 1, &[11, 12], &tokens);
        2
    });
    let mut b = Batch::default();
    Decoder::new().decode(&p, &mut b).expect("decode");
    let groups: Vec<i64> = b.events(&p).map(|e| e.group_idx).collect();
    assert_eq!(groups, [0, 1]);

    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    a.apply("w", &p).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 1);
    assert_eq!(a.counters("w").expect("c").skipped_other_group, 1);

    let index = shared();
    let config = Config {
        group_idx: 1,
        ..Config::default()
    };
    let mut a = Applier::new(index.clone(), config).expect("applier");
    a.apply("w", &p).expect("apply");
    assert_eq!(matched(&index, &own, "w"), 2);
    assert_eq!(a.counters("w").expect("c").skipped_other_group, 1);
}

#[test]
fn unknown_fields_of_any_shape_are_skipped_whole() {
    // A newer engine may add fields of any msgpack type before the ones the router reads; each
    // must be skipped exactly, or the fields after it are misread.
    let tokens: Vec<u64> = (0..16).collect();
    let mut big_map = W::default(); // map16: 17 entries of (str, [int, nil])
    big_map.0.push(0xde);
    big_map.0.extend_from_slice(&17u16.to_be_bytes());
    for i in 0..17 {
        big_map.s(&format!("k{i}")).arr(2).u(i).nil();
    }
    let mut big_array = W::default(); // array16: 20 small maps
    big_array.0.push(0xdc);
    big_array.0.extend_from_slice(&20u16.to_be_bytes());
    for i in 0..20 {
        big_array.map(1).u(i).s("v");
    }
    let mut small = W::default();
    small
        .map(2)
        .s("a")
        .ints(&[1, 2, 3])
        .s("b")
        .map(1)
        .s("c")
        .f(0.5);
    // ext8 / ext16 / ext32 (cargo-mutants survivor, shard 0/40): length, type byte, 3 data bytes.
    let ext = |marker: u8, len: &[u8]| [&[marker][..], len, &[5, 0xaa, 0xbb, 0xcc]].concat();
    let (ext8, ext16, ext32) = (
        ext(0xc7, &[3]),
        ext(0xc8, &[0, 3]),
        ext(0xc9, &[0, 0, 0, 3]),
    );
    let cases = [big_map.0, big_array.0, small.0, ext8, ext16, ext32];
    for (i, value) in cases.into_iter().enumerate() {
        let mut w = W::default();
        w.arr(3).f(2.5).arr(1);
        w.map(5).s("type").s("BlockStored");
        w.s("future_field");
        w.0.extend_from_slice(&value);
        w.s("block_hashes").ints(&[7]);
        w.s("block_size").u(16);
        w.s("token_ids").ints(&tokens);
        w.u(3); // data-parallel rank
        let mut b = Batch::default();
        Decoder::new()
            .decode(&w.0, &mut b)
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let e = b.events(&w.0).next().expect("one event");
        assert_eq!(
            (e.block_hashes, e.block_size),
            (&[7u64][..], 16),
            "case {i}"
        );
        assert_eq!(e.token_ids.len(), 16, "case {i}");
        assert_eq!(b.dp_rank, Some(3), "case {i}");
    }
}

/// cargo-mutants survivors (shards 2/40, 3/40): fields only the general decoder reads (a
/// `lora_name` or `cache_salt` written as str8, `lookahead_token_ids`), an empty `block_hashes` array (the fast path must
/// pass over it, not divide by its length), and `Batch::num_hashes` over every event.
#[test]
fn general_fields_and_an_empty_hash_array() {
    let name = "tenant-a";
    let payload = batch(|w| {
        w.map(7).s("type").s("BlockStored").s("block_size").u(4);
        w.s("cache_salt").s("salt-1"); // str8: the general decoder
        w.s("block_hashes").ints(&[11, 12]);
        w.s("token_ids").ints(&(0..8).collect::<Vec<u64>>());
        w.s("lora_name").s(name); // str8 (0xd9), not a fixstr
        w.s("lookahead_token_ids").arr(2).nil().ints(&[5, 6]);
        removed(w, &[], None); // block_hashes: the empty fixarray 0x90
        w.map(5).s("type").s("BlockStored").s("block_size").u(4);
        w.s("block_hashes")
            .ints(&[13])
            .s("token_ids")
            .ints(&[1, 2, 3, 4]);
        w.s("lookahead_token_ids").arr(1).ints(&[]);
        3
    });
    let mut b = Batch::default();
    Decoder::new().decode(&payload, &mut b).expect("decode");
    let events: Vec<Event<'_>> = b.events(&payload).collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[0].block_hashes, &[11, 12]);
    assert_eq!(events[0].lora_name, Some(name));
    assert_eq!(events[0].cache_salt, Some("salt-1"));
    assert!(events[0].has_lookahead);
    assert_eq!(events[1].kind, EventKind::Removed);
    assert!(events[1].block_hashes.is_empty());
    assert_eq!(
        (events[2].lora_name, events[2].has_lookahead),
        (None, false)
    );
    assert_eq!(b.num_hashes(), 3);
}

/// cargo-mutants survivors (shard 0/40): a `lora_id` past a positive fixint (uint16 300, and a
/// negative one) is read by the general decoder; `block_hashes: nil` is refused like any other
/// non-array (the fast path takes only a fixarray of uint64); `Batch::is_empty` tells a batch of
/// no event from one with events.
#[test]
fn wide_lora_ids_nil_hashes_and_empty_batches() {
    let stored = |lora_id: &dyn Fn(&mut W)| {
        batch(|w| {
            w.map(5).s("type").fs("BlockStored");
            w.s("block_hashes").ints(&[21]);
            w.s("token_ids").ints(&(0..4).collect::<Vec<u64>>());
            w.s("block_size").u(4);
            w.s("lora_id");
            lora_id(w);
            1
        })
    };
    let mut b = Batch::default();
    for (payload, want) in [
        (
            stored(&|w| {
                w.u(300);
            }),
            Some(300),
        ),
        (
            stored(&|w| {
                w.i(-2);
            }),
            Some(-2),
        ),
        (
            stored(&|w| {
                w.u(7);
            }),
            Some(7),
        ),
        (
            stored(&|w| {
                w.nil();
            }),
            None,
        ),
    ] {
        Decoder::new().decode(&payload, &mut b).expect("decode");
        assert!(!b.is_empty());
        let e = b.events(&payload).next().expect("one event");
        assert_eq!((e.lora_id, e.block_hashes), (want, &[21u64][..]));
    }
    let empty = batch(|_| 0);
    Decoder::new().decode(&empty, &mut b).expect("decode");
    assert!(b.is_empty());
    assert_eq!(b.len(), 0);
    for hashes in [0xc0u8, 0xa0] {
        // nil, then the empty fixstr "": neither is an array of hashes.
        let payload = batch(|w| {
            w.map(2).s("type").fs("BlockRemoved").s("block_hashes");
            w.0.push(hashes);
            1
        });
        let err = Decoder::new().decode(&payload, &mut b).unwrap_err();
        assert!(err.to_string().contains("block_hashes"), "{err}");
    }
}

/// Tests written for cargo-mutants survivors since shard 5/40 (`tests_mutants.rs`).
#[path = "tests_mutants.rs"]
mod mutants;

/// The decoder against every msgpack encoding of every field (`tests_encodings.rs`).
#[path = "tests_encodings.rs"]
mod encodings;

/// Every per-worker counter, in each mode, read back whole (`tests_counters.rs`).
#[path = "tests_counters.rs"]
mod counters;

/// Engine pages smaller than the router's block, against an engine emitting SGLang's events
/// (`tests_pages.rs`).
#[path = "tests_pages.rs"]
mod pages;

/// A batch's events apply as if each came in a batch of its own (`tests_batching.rs`).
#[path = "tests_batching.rs"]
mod batching;

/// `ExtraKeys::summary` against its rule, on every shape of key list (`tests_extra.rs`).
#[path = "tests_extra.rs"]
mod extra;

/// The per-worker maps hold one entry per engine block held, against an engine model
/// (`tests_memory.rs`).
#[path = "tests_memory.rs"]
mod memory;

/// Every non-string marker where a string is needed (and non-array where an array is), and
/// every truncation, refused at its byte (`tests_strings.rs`).
#[path = "tests_strings.rs"]
mod strings;

/// The pages' token arena: each live page's tokens kept, compaction by its rule, and the
/// test-only padding that takes an insert to the arena's `u32` bound (`tests_arena.rs`).
#[path = "tests_arena.rs"]
mod arena;
