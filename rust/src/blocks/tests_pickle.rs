//! The pickler's size bounds against CPython's own bytes (`vllm/pickle.rs`).
//!
//! cargo-mutants survivor (shard 12/40): `FRAME_TARGET = 64 * 1024` → `64 + 1024` passed every
//! Rust test — each pickle the Rust tests wrote was under 1,088 bytes, so no frame was ever
//! closed early (the 64 KiB frames were checked from Python only, `tests/test_blocks.py`). For
//! the class — every size at which the protocol-5 pickle changes form — each bound is crossed
//! here: frames closed at 64 KiB mid-tuple, a payload of 65,535 bytes inside a frame and one of
//! 65,536 outside any, a closed frame of 2 bytes losing its header and one of 4 keeping it, the
//! short and long opcodes of `bytes` and `str` at 255 / 256 bytes, `BINGET` / `LONG_BINGET` at
//! memo 255 / 256, and every `int` opcode. Expected values: the length and SHA-256 of
//! `pickle.dumps(x, protocol=5)` in CPython 3.11 (the script is in each test's comment), and for
//! whole blocks vLLM's definition as `tests/test_blocks.py`'s `vllm_ref_digests` writes it.

use super::vllm::pickle::{Memo, Pickler, StrId};
use super::*;
use sha2::{Digest, Sha256};

fn digest_of(f: impl FnOnce(&mut Pickler<'_>)) -> (usize, String) {
    let (mut out, mut memo) = (Vec::new(), Memo::default());
    let mut p = Pickler::new(&mut out, &mut memo);
    f(&mut p);
    let bytes = p.finish();
    let hex = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    (bytes.len(), hex)
}

/// ```python
/// ints = tuple(range(0, 40000)) + tuple(range(70000, 100000)) \
///     + tuple(-v for v in range(1, 2000)) + (2**40, -2**40, 2**63)
/// ```
/// 279,817 bytes in five frames (65,538, 65,537, 65,540, 65,540, 17,615 bytes): each closed
/// before the first item once it holds ≥ 64 KiB.
#[test]
fn a_long_tuple_of_ints_is_framed_as_cpython_frames_it() {
    let mut ints: Vec<i128> = (0..40_000).chain(70_000..100_000).collect();
    ints.extend((1..2000).map(|v| -v));
    ints.extend([1 << 40, -(1 << 40), 1 << 63]);
    let got = digest_of(|p| {
        p.begin_tuple(ints.len());
        for &v in &ints {
            p.int(v);
        }
        p.end_tuple(ints.len());
    });
    assert_eq!(
        got,
        (
            279_817,
            "8625f010026ca503833e6720ab600b09ebcefde4ccaca60696c9e5dfddf48482".into()
        )
    );
}

/// ```python
/// def s(c, n): return "".join([c] * n)  # a new object each call
/// B = (b"q" * 255, b"q" * 256, s("s", 255), s("s", 256), s("\u00e9", 128), b"x" * 65535, 1,
///      b"y" * 65536, 2, s("z", 65535), None, s("w", 65536), (), s("v", 65536))
/// ```
/// 329,049 bytes: a frame of 66,844 holding the 65,535-byte payload, closed before `1`; `1` (2
/// bytes, no header) closed by `y`, written outside; a frame of 65,544 to `z`; `None` (1 byte)
/// before `w` and `MEMOIZE` + `EMPTY_TUPLE` (2 bytes) before `v`, both without a header; and a
/// last frame of exactly 4 bytes, with its header.
#[test]
fn payloads_at_each_size_bound_are_written_as_cpython_writes_them() {
    let got = digest_of(|p| {
        p.begin_tuple(14);
        p.bytes(&[b'q'; 255]);
        p.bytes(&[b'q'; 256]);
        p.str(&"s".repeat(255), StrId::Value);
        p.str(&"s".repeat(256), StrId::Value);
        p.str(&"\u{e9}".repeat(128), StrId::Value);
        p.bytes(&vec![b'x'; 65_535]);
        p.int(1);
        p.bytes(&vec![b'y'; 65_536]);
        p.int(2);
        p.str(&"z".repeat(65_535), StrId::Value);
        p.none();
        p.str(&"w".repeat(65_536), StrId::Value);
        p.begin_tuple(0);
        p.end_tuple(0);
        p.str(&"v".repeat(65_536), StrId::Value);
        p.end_tuple(14);
    });
    assert_eq!(
        got,
        (
            329_049,
            "88dd3ed1edcb8e354de2d8c72e56a55a4b8a32c05191178c3bcada3a83985c13".into()
        )
    );
}

/// ```python
/// C = tuple(f"s{i}" for i in range(255)) + ("a", "\u00e9", "a", "\u00e9", "")
/// ```
/// The singletons `"a"` and `"é"` are memo entries 255 and 256: hit as `BINGET 255` and
/// `LONG_BINGET 256`.
#[test]
fn memo_hits_past_255_use_long_binget_as_cpython() {
    let names: Vec<String> = (0..255).map(|i| format!("s{i}")).collect();
    let got = digest_of(|p| {
        p.begin_tuple(260);
        for name in &names {
            p.str(name, StrId::Value);
        }
        for s in ["a", "\u{e9}", "a", "\u{e9}", ""] {
            p.str(s, StrId::Value);
        }
        p.end_tuple(260);
    });
    assert_eq!(
        got,
        (
            1_709,
            "cbd6f44e35efbabbc9bb887ae7ca00a06a4ecbedaa5637a3675743a7874f4929".into()
        )
    );
}

/// Whole `sha256` blocks of 20,000 token ids (~98 KiB pre-images, two frames each), plain, with a
/// 70,000-byte cache salt (written outside any frame) and with a 300-byte LoRA name, as
/// `tests/test_blocks.py`'s `test_vllm_sha256_blocks_larger_than_a_pickle_frame` checks them from
/// Python; expected values from its `vllm_ref_digests(tokens, 20_000, algo="sha256", **opts)`
/// with `tokens = [(i * 2654435761) % 2**31 for i in range(40_000)]`.
#[test]
fn blocks_larger_than_a_pickle_frame_hash_as_vllm() {
    let tokens: Vec<u32> = (0..40_000u64)
        .map(|i| ((i * 2_654_435_761) % (1 << 31)) as u32)
        .collect();
    type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, [u64; 2]);
    let cases: [Case<'_>; 3] = [
        (
            None,
            None,
            None,
            [2_897_023_098_508_586_692, 11_451_155_900_673_760_866],
        ),
        (
            Some("s"),
            None,
            None,
            [18_341_146_100_877_326_509, 1_354_325_928_554_060_237],
        ),
        (
            None,
            Some("l"),
            Some("p"),
            [8_128_304_353_975_430_980, 10_710_148_321_578_578_778],
        ),
    ];
    for (salt, lora_name, lora_path, want) in cases {
        let profile = Profile::Vllm(super::vllm::Flavor::default())
            .with_vllm(Some("sha256"), None)
            .expect("profile");
        let options = Options {
            salt: salt.map(|s| s.repeat(70_000)),
            lora_name: lora_name.map(|s| s.repeat(300)),
            lora_path: lora_path.map(String::from),
            seed: None,
        };
        let h = BlockHasher::new(20_000, profile, options).expect("hasher");
        let mut out = Vec::new();
        h.hash_into(&tokens, &ChainState::Root, &[], &mut out)
            .expect("hash");
        assert_eq!(out, want, "salt {salt:?}, lora {lora_name:?}");
    }
}

/// ```python
/// pickle.dumps((chr(255), chr(255), chr(256), chr(256), chr(0x20ac), chr(0x20ac),
///               chr(0x1f600), chr(0x1f600)), protocol=5).hex()
/// ```
/// CPython's one-character singletons end at U+00FF (`chr` makes a new object for each call
/// above it): `"ÿ"` again is `BINGET 0`, while `"Ā"`, `"€"` and `"😀"` — one character of 2, 3
/// and 4 UTF-8 bytes — are written out again. cargo-mutants, the whole-module run at a6570e8:
/// the singleton guard `u32::from(c) < 256` → `true` and → `<=` passed every Rust test (the
/// singletons tested were `"a"`, `"é"` and `""`); here the bound is crossed at both sides.
#[test]
fn one_character_strings_are_singletons_up_to_u_00ff_only() {
    let (mut out, mut memo) = (Vec::new(), Memo::default());
    let mut p = Pickler::new(&mut out, &mut memo);
    p.begin_tuple(8);
    for s in [
        "\u{ff}", "\u{ff}", "\u{100}", "\u{100}", "€", "€", "😀", "😀",
    ] {
        p.str(s, StrId::Value);
    }
    p.end_tuple(8);
    let hex: String = p.finish().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        hex,
        "8005952f00000000000000288c02c3bf9468008c02c480948c02c480948c03e282ac948c03e282ac948c04f0\
         9f9880948c04f09f98809474942e"
    );
}
