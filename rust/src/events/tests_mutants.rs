//! Event tests written for cargo-mutants survivors (`make mutants`): each asserts behaviour a
//! user relies on that `tests.rs` left unchecked. A child module of `tests`, so it shares its
//! payload writer and helpers.

use super::*;
use crate::error::Error;

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

/// Left from shard 11/40: `Decoder::decode`'s size check `len > u32::MAX` → `==` accepted every
/// payload over 4 GiB and refused one of exactly `u32::MAX` bytes — which only such a payload
/// shows. The check is `check_payload_len`, tested here at its bound: a batch keeps strings as
/// `u32` offsets and lengths into the payload (`Span`), so the longest payload whose every span
/// fits is `u32::MAX` bytes (the last byte at offset `u32::MAX - 1`, a span of the whole payload
/// `u32::MAX` long); one byte more is refused, with the size named.
#[cfg(target_pointer_width = "64")]
#[test]
fn a_payload_is_refused_exactly_when_its_spans_cannot_reach_every_byte() {
    let longest = usize::try_from(u32::MAX).expect("64-bit");
    let whole = Span {
        start: 0,
        len: u32::MAX,
    };
    assert_eq!(whole.len as usize, longest);
    assert_eq!(decode::MAX_PAYLOAD_BYTES, longest);
    for len in [0, 1, longest - 1, longest] {
        assert_eq!(decode::check_payload_len(len), Ok(()), "{len}");
    }
    for len in [longest + 1, longest + 2, usize::MAX] {
        assert_eq!(
            decode::check_payload_len(len),
            Err(Error::Value(format!(
                "KV event payload of {len} bytes is too large"
            ))),
            "{len}"
        );
    }
}

/// cargo-mutants survivor (shard 17/40): `Applier::tiers` → `vec![]`. The tier names an applier
/// has seen, in the order first seen, the GPU tier (the main index) not among them.
#[test]
fn tiers_lists_each_offload_tier_once_in_order_seen() {
    let tokens: Vec<u64> = (0..16).collect();
    let mut a = Applier::new(shared(), Config::default()).expect("applier");
    assert!(a.tiers().is_empty());
    for (i, medium) in ["CPU", "GPU", "DISK", "CPU"].iter().enumerate() {
        let p = batch(|w| {
            let e = Ev {
                hashes: &[i as u64 + 1],
                parent: None,
                tokens: &tokens,
                block_size: 16,
                medium: Some(medium),
            };
            stored(w, &e);
            1
        });
        a.apply("w", &p).expect("apply");
    }
    let tiers = a.tiers();
    let names: Vec<&str> = tiers.iter().map(|t| &**t).collect();
    assert_eq!(names, ["CPU", "DISK"]);
}

/// cargo-mutants survivor (shard 17/40): direct mode's `blocks_stored += n` → `*=`. Every
/// engine block a direct-mode store applies is counted, across stores.
#[test]
fn direct_mode_counts_every_block_stored() {
    let tokens: Vec<u64> = (0..48).collect();
    let config = Config {
        mode: Mode::Direct,
        ..Config::default()
    };
    let mut a = Applier::new(shared(), config).expect("applier");
    a.apply("w", &stored_batch(&[1, 2], None, &tokens[..32]))
        .expect("apply");
    a.apply("w", &stored_batch(&[3], Some(2), &tokens[32..]))
        .expect("apply");
    let c = a.counters("w").expect("counters");
    assert_eq!((c.stored_events, c.blocks_stored), (2, 3));
}

/// cargo-mutants survivor (shard 17/40): `store_rehash`'s `!firsts.is_empty()` → `is_empty()`.
/// An engine hash stored again with one router block per engine block (its size changed from
/// 32 to 16 tokens) must forget the first router block recorded for its earlier, 32-token
/// store: a removal of that engine hash then drops the block it now stands for.
#[test]
fn an_engine_block_stored_again_at_one_router_block_is_removed_whole() {
    let index = shared();
    let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
    let old: Vec<u64> = (0..32).collect();
    let new: Vec<u64> = (100..116).collect();
    let store = |hash: u64, tokens: &[u64], block_size: u64| {
        batch(|w| {
            let e = Ev {
                hashes: &[hash],
                parent: None,
                tokens,
                block_size,
                medium: None,
            };
            stored(w, &e);
            1
        })
    };
    a.apply("w", &store(7, &old, 32)).expect("apply");
    assert_eq!(matched(&index, &own_hashes(&old, 16), "w"), 2);
    a.apply("w", &store(7, &new, 16)).expect("apply");
    assert_eq!(matched(&index, &own_hashes(&new, 16), "w"), 1);
    a.apply(
        "w",
        &batch(|w| {
            removed(w, &[7], None);
            1
        }),
    )
    .expect("apply");
    assert_eq!(
        matched(&index, &own_hashes(&new, 16), "w"),
        0,
        "the block 7 stands for now"
    );
}

/// Found beside events shard 20/40 (whose `m & 0xf0` → `m | 0xf0` in the same check is
/// equivalent): the fast path of `block_hashes` reads a fixarray to the count its marker gives
/// (`m & 0x0f`), as the fixstr test above for strings. Another count shows only when `uint64`
/// values follow the array, 9 bytes apart — the batch's rank and trailing elements (skipped) may
/// be; with them a count of 159 (`m | 0x0f`) took them as hashes and the batch was refused. Each
/// length a fixarray can have (0 to 15), as the last field of the last event.
#[test]
fn a_fast_path_hash_array_ends_where_its_marker_says_before_uint64_values() {
    for k in 0..=15u64 {
        let hashes: Vec<u64> = (0..k).map(|i| (1 << 40) + i).collect();
        let mut w = W::default();
        w.arr(3 + 200).f(1.0).arr(1).map(2);
        w.fs("type").fs("BlockRemoved").fs("block_hashes");
        w.arr(hashes.len());
        for &h in &hashes {
            w.u(h); // uint64 (0xcf): the fast path's encoding
        }
        w.u(1 << 33); // the rank, a uint64
        for i in 0..200 {
            w.u((1 << 35) + i);
        }
        let mut b = Batch::default();
        Decoder::new()
            .decode(&w.0, &mut b)
            .unwrap_or_else(|e| panic!("{k} hashes: {e}"));
        let events: Vec<Event<'_>> = b.events(&w.0).collect();
        assert_eq!(events.len(), 1, "{k} hashes");
        assert_eq!(events[0].block_hashes, &hashes[..], "{k} hashes");
        assert_eq!(b.dp_rank, Some(1 << 33), "{k} hashes");
    }
}

/// Events 7/40, 9/40 and 10/40 at a6570e8: `fields & field::HASHES == 0` → `fields ^ ...` (a
/// `BlockStored` without `block_hashes`), `fields & field::TOKENS == 0` → `|` and `^` (one
/// without `token_ids`) and the `BlockRemoved` check's `&` → `|` passed every events test: no
/// test left a field out. For the class, each field of each event kind left out in turn (the
/// always-present fields of `KV_EVENTS_SPEC.md` §2a, as vLLM 0.33 writes them), after 0 to 2
/// other events so the offset moves: the fields the decoder needs (`type`, `block_hashes`,
/// `token_ids`, `block_size` of a store; `type`, `block_hashes` of a removal) are refused with
/// the whole message naming the event's first byte, and the others are read as absent. The
/// legacy arrays (§2b) are refused by their length, at the byte after the array's marker.
#[test]
fn each_field_an_event_needs_is_refused_when_left_out() {
    let tokens: Vec<u64> = (0..32).collect();
    type Field<'a> = (&'a str, &'a dyn Fn(&mut W));
    let stored_fields: [Field<'_>; 8] = [
        ("type", &|w| {
            w.fs("BlockStored");
        }),
        ("block_hashes", &|w| {
            w.ints(&[1 << 40, 2]);
        }),
        ("parent_block_hash", &|w| {
            w.u(7);
        }),
        ("token_ids", &|w| {
            w.ints(&tokens);
        }),
        ("block_size", &|w| {
            w.u(16);
        }),
        ("lora_id", &|w| {
            w.u(3);
        }),
        ("medium", &|w| {
            w.fs("CPU");
        }),
        ("lora_name", &|w| {
            w.fs("ad");
        }),
    ];
    let removed_fields: [Field<'_>; 3] = [
        ("type", &|w| {
            w.fs("BlockRemoved");
        }),
        ("block_hashes", &|w| {
            w.ints(&[5]);
        }),
        ("medium", &|w| {
            w.fs("CPU");
        }),
    ];
    let needed = |kind: &str, name: &str| match (kind, name) {
        (_, "type") => Some("\"type\""),
        (_, "block_hashes") => Some("block_hashes"),
        ("stored", "token_ids") => Some("token_ids"),
        ("stored", "block_size") => Some("block_size"),
        _ => None,
    };
    let mut b = Batch::default();
    for (kind, fields) in [
        ("stored", &stored_fields[..]),
        ("removed", &removed_fields[..]),
    ] {
        for left_out in 0..fields.len() {
            for before in 0..3 {
                let mut w = W::default();
                w.arr(3).f(1.0).arr(before + 1);
                for _ in 0..before {
                    w.map(2).fs("type").fs("BlockRemoved").fs("block_hashes");
                    w.ints(&[9]);
                }
                let at = w.0.len();
                w.map(fields.len() - 1);
                for (i, (name, value)) in fields.iter().enumerate() {
                    if i != left_out {
                        w.fs(name);
                        value(&mut w);
                    }
                }
                w.nil();
                let name = fields[left_out].0;
                let got = Decoder::new().decode(&w.0, &mut b);
                match needed(kind, name) {
                    Some(what) => {
                        let want = format!(
                            "malformed KV event payload: the event at byte {at} has no {what}"
                        );
                        assert_eq!(
                            got.map_err(|e| e.to_string()),
                            Err(want),
                            "{kind} without {name}"
                        );
                    }
                    None => {
                        got.unwrap_or_else(|e| panic!("{kind} without {name}: {e}"));
                        let e = b.events(&w.0).last().expect("the event");
                        let stored = kind == "stored";
                        assert_eq!(
                            (e.parent, e.lora_id, e.medium, e.lora_name),
                            (
                                (stored && name != "parent_block_hash").then_some(7),
                                (stored && name != "lora_id").then_some(3),
                                (name != "medium").then_some("CPU"),
                                (stored && name != "lora_name").then_some("ad"),
                            ),
                            "{kind} without {name}"
                        );
                    }
                }
            }
        }
    }
    // Legacy arrays: a store needs its first 4 fields after the tag, a removal its first.
    for (tag, items, want) in [
        ("BlockStored", 5, None),
        (
            "BlockStored",
            4,
            Some("a BlockStored array has 4 elements, fewer than 5"),
        ),
        (
            "BlockStored",
            3,
            Some("a BlockStored array has 3 elements, fewer than 5"),
        ),
        (
            "BlockStored",
            2,
            Some("a BlockStored array has 2 elements, fewer than 5"),
        ),
        (
            "BlockStored",
            1,
            Some("a BlockStored array has 1 elements, fewer than 5"),
        ),
        ("BlockRemoved", 2, None),
        (
            "BlockRemoved",
            1,
            Some("a BlockRemoved array has no block_hashes"),
        ),
        ("", 0, Some("an event array is empty (no tag)")),
    ] {
        let mut w = W::default();
        w.arr(3).f(1.0).arr(1).arr(items);
        let at = w.0.len();
        let values: [&dyn Fn(&mut W); 4] = [
            &|w| {
                w.ints(&[4]);
            },
            &|w| {
                w.nil();
            },
            &|w| {
                w.ints(&tokens[..16]);
            },
            &|w| {
                w.u(16);
            },
        ];
        if items > 0 {
            w.fs(tag);
        }
        for value in values.iter().take(items.saturating_sub(1)) {
            value(&mut w);
        }
        w.nil();
        let got = Decoder::new().decode(&w.0, &mut b);
        match want {
            None => {
                got.unwrap_or_else(|e| panic!("{tag} of {items}: {e}"));
                let e = b.events(&w.0).next().expect("the event");
                assert_eq!(e.block_hashes, &[4][..], "{tag} of {items}");
            }
            Some(what) => assert_eq!(
                got.map_err(|e| e.to_string()),
                Err(format!("malformed KV event payload at byte {at}: {what}")),
                "{tag} of {items}"
            ),
        }
    }
}
