//! `BlockHasher`'s public entry points, accessors and token check against the references
//! (`mod.rs`).
//!
//! cargo-mutants, the whole-module run at a6570e8: `BlockHasher::root_state` → `None`,
//! `num_blocks` → 0, 1, `%`, `*`, and three mutants of `check_tokens`' one-pass fast check
//! passed every Rust test — no Rust test read `root_state` or `num_blocks` back (Python reads the
//! root through the bindings' `root`; the core calls `num_blocks` only to reserve capacity),
//! and every refused token list held a valid id, which sends the fast check to the slow path
//! whatever it answers. For the classes: every entry point (`hash_into`, `hash_with_states_into`,
//! `hash_each`, `hash_block`) and accessor of each profile — native unsalted and salted with a
//! LoRA, vLLM `sha256_cbor` 0.33 and `sha256` 0.30 with a salt and a LoRA, SGLang unsalted and
//! salted — against `tests/test_blocks.py`'s reference models (`native_ref`/`native_root` with
//! xxhash, `vllm_ref_digests` with `cbor2`/CPython's `pickle`, `sglang_ref_digests` with
//! `hashlib`; the script is [`cases`]' comment); and every token list of one to three ids from
//! each dtype's edge values, for each profile, against a reference model of the documented check
//! (the first negative id, or for `native` the first above `u32::MAX`, is named).

use super::*;

fn digest(hex: &str) -> ChainState {
    let mut d = [0u8; 32];
    for (i, b) in d.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    ChainState::Digest(d)
}

fn vllm(algo: &str, version: &str) -> Profile {
    Profile::Vllm(super::vllm::Flavor::default())
        .with_vllm(Some(algo), Some(version))
        .expect("profile")
}

fn salted(lora: bool) -> Options {
    Options {
        salt: Some("tenant-a".into()),
        lora_name: lora.then(|| "sql-lora".into()),
        lora_path: lora.then(|| "/adapters/sql-lora".into()),
        seed: None,
    }
}

/// A profile and options, the root state, and the (value, state) of the two full blocks of
/// `TOKENS` in blocks of 4.
type Case = (Profile, Options, Option<ChainState>, [(u64, ChainState); 2]);

const TOKENS: [u32; 10] = [
    0,
    1,
    255,
    256,
    65535,
    65536,
    2_147_483_647,
    2_147_483_648,
    7,
    9,
];

/// ```python
/// toks = [0, 1, 255, 256, 65535, 65536, 2147483647, 2147483648, 7, 9]
/// lora = dict(lora_name="sql-lora", lora_path="/adapters/sql-lora")
/// native_root(), native_ref(toks, 4)
/// native_root(salt="tenant-a", **lora), native_ref(toks, 4, salt="tenant-a", **lora)
/// vllm_ref_digests(toks, 4, salt="tenant-a", algo="sha256_cbor", tagged=True, **lora)
/// vllm_ref_digests(toks, 4, salt="tenant-a", algo="sha256", tagged=False, **lora)
/// sglang_ref_digests(toks, 4), sglang_ref_digests(toks, 4, salt="tenant-a")
/// ```
/// (vLLM's root: SHA-256 of `"vllm-none-hash"` serialized; SGLang's salted root: SHA-256 of
/// `b"sglang-cache-salt-v1\0tenant-a"`; values by `vllm_value` / `sglang_value`.)
fn cases() -> [Case; 6] {
    let native = |v: u64| (v, ChainState::Native(v));
    [
        (
            Profile::Native,
            Options::default(),
            Some(ChainState::Native(16_849_070_267_734_827_113)),
            [
                native(7_816_043_922_519_342_629),
                native(6_974_145_693_774_875_720),
            ],
        ),
        (
            Profile::Native,
            salted(true),
            Some(ChainState::Native(6_379_964_157_435_807_307)),
            [
                native(5_970_352_583_694_714_601),
                native(9_691_378_713_786_736_712),
            ],
        ),
        (
            vllm("sha256_cbor", "0.33"),
            salted(true),
            Some(digest(
                "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
            )),
            [
                (
                    18_107_384_912_251_374_419,
                    digest("ae0ed171b6c8f8a2d5e7f8ddea4213b68a3190fa44bdbb1ffb4a5aa40202cb53"),
                ),
                (
                    6_189_416_655_025_806_544,
                    digest("ebd814435e26fe08bb0c9a598ec95c1b393c5404a51180e755e539a7a1b31cd0"),
                ),
            ],
        ),
        (
            vllm("sha256", "0.30"),
            salted(true),
            Some(digest(
                "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
            )),
            [
                (
                    1_412_141_145_258_535_285,
                    digest("5041b5534470f75b187cea758900c2e6854e96cf76ea4f7c1398eee3c7d92975"),
                ),
                (
                    4_373_858_771_478_103_622,
                    digest("dfe5c899d4a77588c61a0e5a2e7a2480baca0f27e4134b803cb3116103adc646"),
                ),
            ],
        ),
        (
            Profile::Sglang,
            Options::default(),
            None,
            [
                (
                    16_170_658_480_232_285_970,
                    digest("e069b836426747126b045524fc9482c31335c86955292eea69b3732c69df7a54"),
                ),
                (
                    2_242_400_489_054_831_933,
                    digest("1f1e9b5d3246853d645bfc3f8933d6d0a910c788166789abfa5342d83a1a1ec5"),
                ),
            ],
        ),
        (
            Profile::Sglang,
            salted(false),
            Some(digest(
                "f5d0f785efe6042a4e4b0297a4d712917e1763c850835e93df58b373fd47fd2c",
            )),
            [
                (
                    14_663_322_768_143_072_902,
                    digest("cb7e965e3610be86e782a161a96ba78e1474efed89b4564d1ad098e2f7805760"),
                ),
                (
                    17_387_636_091_550_952_170,
                    digest("f14d4ae6d0a7eaea162418a9e80f159fa271099dbdd588b617b83f64cc484131"),
                ),
            ],
        ),
    ]
}

#[test]
fn every_entry_point_gives_each_profiles_reference_chain() {
    for (profile, options, root, blocks) in cases() {
        let h = BlockHasher::new(4, profile, options).expect("hasher");
        let what = format!("{profile} {:?}", h.options());
        assert_eq!(h.block_size(), 4, "{what}");
        assert_eq!(h.profile(), profile, "{what}");
        assert_eq!(h.root_state(), root, "{what}");
        // As many blocks as the reference hashes for each prefix: [0, 0, 0, 0, 1, 1, 1, 1, 2, …].
        for (n, want) in [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2].into_iter().enumerate() {
            assert_eq!(h.num_blocks(n), want, "{what}: {n} tokens");
        }
        let values: Vec<u64> = blocks.iter().map(|b| b.0).collect();
        let states: Vec<ChainState> = blocks.iter().map(|b| b.1).collect();
        let last = states[1];

        // Each entry point appends (never replaces) and returns the state after the last block.
        let mut out = vec![42];
        let got = h.hash_into(&TOKENS, &ChainState::Root, &[], &mut out);
        assert_eq!((got, &out[..]), (Ok(last), &[42, values[0], values[1]][..]));
        let (mut out, mut st) = (vec![42], vec![ChainState::Native(42)]);
        let got = h.hash_with_states_into(&TOKENS, &ChainState::Root, &[], &mut out, &mut st);
        assert_eq!(got, Ok(last), "{what}");
        assert_eq!(out, [42, values[0], values[1]], "{what}");
        assert_eq!(st, [ChainState::Native(42), states[0], states[1]], "{what}");
        let mut seen = Vec::new();
        let got = h.hash_each(&TOKENS, &ChainState::Root, &[], |v, s| seen.push((v, *s)));
        assert_eq!((got, &seen[..]), (Ok(last), &blocks[..]), "{what}");
        let first = h.hash_block(&TOKENS[..4], &ChainState::Root, &[]);
        assert_eq!(first, Ok(blocks[0]), "{what}");
        let second = h.hash_block(&TOKENS[4..8], &states[0], &[]);
        assert_eq!(second, Ok(blocks[1]), "{what}");
        // Continuing from the first block's state gives the second block (the tail dropped).
        let mut out = Vec::new();
        let got = h.hash_into(&TOKENS[4..], &states[0], &[], &mut out);
        assert_eq!((got, &out[..]), (Ok(last), &values[1..]), "{what}");

        // Fewer tokens than a block: nothing written, the parent handed back.
        let (mut out, mut st) = (Vec::new(), Vec::new());
        let short = &TOKENS[4..7];
        assert_eq!(h.hash_into(short, &states[0], &[], &mut out), Ok(states[0]));
        let got = h.hash_with_states_into(short, &states[0], &[], &mut out, &mut st);
        assert_eq!(got, Ok(states[0]), "{what}");
        let got = h.hash_each(short, &states[0], &[], |v, s| seen.push((v, *s)));
        assert_eq!(got, Ok(states[0]), "{what}");
        assert!(out.is_empty() && st.is_empty() && seen.len() == 2, "{what}");

        // The explicit root continues as `Root` does, except for a salted vLLM hasher: its salt
        // is an extra key of the sequence's first block, not part of NONE_HASH.
        if let Some(root) = root {
            let mut out = Vec::new();
            h.hash_into(&TOKENS, &root, &[], &mut out)
                .expect("from root");
            let salted_vllm = profile.vllm_flavor().is_some() && h.options().salt.is_some();
            assert_eq!(out == values, !salted_vllm, "{what}");
        }
    }
}

/// The documented token check, written out: the first id that is negative, or for `native`
/// above `u32::MAX`, is named; every id counts, the partial tail's too.
fn reference(profile: Profile, tokens: &[i128]) -> Result<()> {
    for (i, &t) in tokens.iter().enumerate() {
        if t < 0 {
            return value_err!("tokens[{i}] = {t} is negative");
        }
        if profile == Profile::Native && t > i128::from(u32::MAX) {
            return value_err!(
                "tokens[{i}] = {t} does not fit in 32 bits (profile 'native' hashes token ids \
                 as u32)"
            );
        }
    }
    Ok(())
}

/// Every list of one to three of `T`'s edge values, checked by `validate` and by a hashing call
/// (which must leave its buffers as they were on a refusal) against [`reference`].
fn every_short_list<T: TokenId + TryFrom<i128>>(h: &BlockHasher) -> usize {
    let edges = [
        0,
        1,
        i128::from(u32::MAX),
        i128::from(u32::MAX) + 1,
        i128::from(u64::MAX),
        -1,
        i128::from(i32::MIN),
        i128::from(i64::MIN),
    ];
    let values: Vec<i128> = edges
        .into_iter()
        .filter(|&v| T::try_from(v).is_ok())
        .collect();
    let mut refused = 0;
    for len in 1..=3u32 {
        for mut code in 0..values.len().pow(len) {
            let mut list = Vec::new();
            for _ in 0..len {
                list.push(values[code % values.len()]);
                code /= values.len();
            }
            let tokens: Vec<T> = list
                .iter()
                .map(|&v| T::try_from(v).ok().expect("an edge value of T"))
                .collect();
            let want = reference(h.profile(), &list);
            let what = format!("{} {list:?}", h.profile());
            assert_eq!(h.validate(&tokens, &ChainState::Root, &[]), want, "{what}");
            let (mut out, mut st) = (vec![7], vec![ChainState::Native(7)]);
            let got = h.hash_with_states_into(&tokens, &ChainState::Root, &[], &mut out, &mut st);
            assert_eq!(got.is_ok(), want.is_ok(), "{what}");
            if want.is_err() {
                refused += 1;
                assert_eq!(got.map(|_| ()), want, "{what}");
                assert_eq!((out, st), (vec![7], vec![ChainState::Native(7)]), "{what}");
            }
        }
    }
    refused
}

#[test]
fn each_token_check_names_the_reference_models_first_offender() {
    for profile in [Profile::Native, vllm("sha256", "0.33"), Profile::Sglang] {
        let h = BlockHasher::new(2, profile, Options::default()).expect("hasher");
        let refused = every_short_list::<u32>(&h)
            + every_short_list::<u64>(&h)
            + every_short_list::<i32>(&h)
            + every_short_list::<i64>(&h);
        // Lists refused, of the 677 checked: every list holding a negative id (i32's and
        // i64's), and for native every list holding an id above u32::MAX too.
        let want = if profile == Profile::Native { 546 } else { 385 };
        assert_eq!(refused, want, "{profile}");
    }
}
