//! Where the decoder needs a string — an event map's keys, the `type` tag of a map or legacy
//! array event, and `medium`, `lora_name` and `cache_salt` (strings or nil) — or an array
//! (`block_hashes`, `token_ids`), every msgpack marker that is not one is refused, with the
//! position's message; and a payload cut anywhere is refused at a byte inside it. A child module
//! of `tests`, sharing its payload writer.

use super::*;
use crate::error::Error;

/// The offset a decoding error names (`malformed KV event payload at byte N: …`).
fn offset(err: &Error) -> usize {
    let text = err.to_string();
    let rest = text
        .split_once("at byte ")
        .unwrap_or_else(|| panic!("no offset: {text}"))
        .1;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no offset: {text}"))
}

/// msgpack's string markers: fixstr, str8, str16, str32.
fn is_string_marker(b: u8) -> bool {
    matches!(b, 0xa0..=0xbf | 0xd9..=0xdb)
}

#[test]
fn every_non_string_marker_where_a_string_is_needed_is_refused_at_its_byte() {
    let all: Vec<u64> = (0..16).collect();
    let tokens = &all[..];
    // (what is written before the value, whether nil is allowed, the message)
    type Head<'a> = Box<dyn Fn(&mut W) + 'a>;
    let stored_head = move |field: &'static str| -> Head<'_> {
        Box::new(move |w: &mut W| {
            w.arr(3).f(1.0).arr(1).map(5);
            w.fs("type").fs("BlockStored").fs("block_hashes").ints(&[1]);
            w.fs("block_size").u(16).fs("token_ids").ints(tokens);
            w.fs(field);
        })
    };
    let positions: Vec<(&str, Head<'_>, bool, String)> = vec![
        (
            "map key",
            Box::new(|w: &mut W| {
                w.arr(3).f(1.0).arr(1).map(2);
                w.fs("type").fs("BlockRemoved");
            }),
            false,
            "an event map key is not a string".into(),
        ),
        (
            "map tag",
            Box::new(|w: &mut W| {
                w.arr(3).f(1.0).arr(1).map(1).fs("type");
            }),
            false,
            "the event type tag is not a string".into(),
        ),
        (
            "array tag",
            Box::new(|w: &mut W| {
                w.arr(3).f(1.0).arr(1).arr(2);
            }),
            false,
            "the event type tag is not a string".into(),
        ),
        (
            "medium",
            stored_head("medium"),
            true,
            "medium is neither a string nor nil".into(),
        ),
        (
            "lora_name",
            stored_head("lora_name"),
            true,
            "lora_name is neither a string nor nil".into(),
        ),
        (
            "cache_salt",
            stored_head("cache_salt"),
            true,
            "cache_salt is neither a string nor nil".into(),
        ),
    ];
    let mut b = Batch::default();
    let mut refused = 0;
    for (name, head, nil_ok, what) in &positions {
        for m in 0..=255u8 {
            if is_string_marker(m) || (*nil_ok && m == 0xc0) {
                continue;
            }
            let mut w = W::default();
            head(&mut w);
            let at = w.0.len();
            // The marker, then bytes any fixed-size body or element would read.
            w.0.push(m);
            w.0.extend_from_slice(&[0x01; 40]);
            Decoder::new()
                .decode(&stored_batch(&[9], None, tokens), &mut b)
                .expect("a good batch first");
            let err = Decoder::new()
                .decode(&w.0, &mut b)
                .expect_err(&format!("{name}: marker {m:#04x} accepted"));
            let want = format!("malformed KV event payload at byte {at}: {what}");
            assert!(
                err.to_string().starts_with(&want),
                "{name}: marker {m:#04x}: {err} (want {want})"
            );
            assert!(
                b.is_empty(),
                "{name}: marker {m:#04x}: the batch is left empty"
            );
            refused += 1;
        }
    }
    assert_eq!(refused, 3 * (256 - 35) + 3 * (256 - 36));
}

/// Every prefix of a payload is refused, at a byte of the prefix: a string, key or tag cut
/// short (among them each fixstr key, read on the fast path when whole) is reported where its
/// bytes would begin, never past the end.
#[test]
fn every_truncation_is_refused_at_a_byte_inside_the_payload() {
    let tokens: Vec<u64> = (0..16).collect();
    let every_field = batch(|w| {
        stored_with(
            w,
            &Ev {
                hashes: &[1, 2],
                parent: Some(7),
                tokens: &tokens,
                block_size: 8,
                medium: Some("CPU"),
            },
            |more| {
                more.fs("lora_name")
                    .fs("sql-lora")
                    .fs("cache_salt")
                    .fs("salt");
                more.fs("lora_id")
                    .u(3)
                    .fs("group_idx")
                    .u(0)
                    .fs("future")
                    .fs("value");
                5
            },
        );
        w.map(2)
            .fs("type")
            .fs("BlockRemoved")
            .fs("block_hashes")
            .ints(&[1]);
        w.map(1).fs("type").fs("AllBlocksCleared");
        // vLLM <= 0.23's tagged arrays.
        w.arr(6)
            .fs("BlockStored")
            .ints(&[3])
            .nil()
            .ints(&tokens)
            .u(16)
            .nil();
        w.arr(2).fs("BlockRemoved").ints(&[3]);
        5
    });
    for payload in [unhex(STORED_STORED), every_field] {
        let mut b = Batch::default();
        Decoder::new().decode(&payload, &mut b).expect("whole");
        for cut in 0..payload.len() {
            let err = Decoder::new()
                .decode(&payload[..cut], &mut b)
                .expect_err(&format!("a prefix of {cut} bytes decoded"));
            assert!(offset(&err) <= cut, "a prefix of {cut} bytes: {err}");
            assert!(b.is_empty());
        }
    }
}

/// Where the decoder needs an array — `block_hashes` and `token_ids` — every msgpack marker that
/// is not one is refused with the field's message, at the byte after the marker (where the
/// reader stands once it has read it); among them the positive fixint 96 (`0x60`), which the
/// fast path of `block_hashes` once took for an empty fixarray (`m & 0xf0` → `m ^ 0xf0`).
#[test]
fn every_non_array_marker_where_an_array_is_needed_is_refused() {
    let all: Vec<u64> = (0..16).collect();
    let tokens = &all[..];
    let mut b = Batch::default();
    let mut refused = 0;
    for field in ["block_hashes", "token_ids"] {
        for m in 0..=255u8 {
            if matches!(m, 0x90..=0x9f | 0xdc | 0xdd) {
                continue;
            }
            let mut w = W::default();
            w.arr(3).f(1.0).arr(1).map(5);
            w.fs("type").fs("BlockStored").fs("block_size").u(16);
            match field {
                "block_hashes" => w.fs("token_ids").ints(tokens),
                _ => w.fs("block_hashes").ints(&[1]),
            };
            w.fs("parent_block_hash").nil().fs(field);
            let at = w.0.len();
            w.0.push(m);
            w.0.extend_from_slice(&[0x01; 40]);
            Decoder::new()
                .decode(&stored_batch(&[9], None, tokens), &mut b)
                .expect("a good batch first");
            let err = Decoder::new()
                .decode(&w.0, &mut b)
                .expect_err(&format!("{field}: marker {m:#04x} accepted"));
            let want = format!(
                "malformed KV event payload at byte {}: {field} is not an array",
                at + 1
            );
            assert!(
                err.to_string().starts_with(&want),
                "{field}: marker {m:#04x}: {err} (want {want})"
            );
            assert!(
                b.is_empty(),
                "{field}: marker {m:#04x}: the batch is left empty"
            );
            refused += 1;
        }
    }
    assert_eq!(refused, 2 * (256 - 18));
}
