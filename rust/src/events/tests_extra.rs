//! `ExtraKeys::summary` — what a store's `extra_keys` mean for re-hashing — against the rule its
//! docs state, over every shape of key list. A child module of `tests`, so it shares its payload
//! writer and helpers.

use super::*;

/// One key of a block's `extra_keys` list, as vLLM writes them (`KV_EVENTS_SPEC.md` §2a): the
/// LoRA name, multimodal items `[identifier, offset]`, the cache salt, prompt-embedding digests.
#[derive(Clone, Copy, Debug)]
enum Key {
    /// A string (the LoRA name, a salt, or another).
    Str(&'static str),
    /// A multimodal item.
    Item,
    /// A prompt-embedding digest.
    Digest,
}

const LORA: &str = "ad";
const KINDS: [Key; 5] = [
    Key::Str(LORA),
    Key::Str("salt"),
    Key::Str("pepper"),
    Key::Item,
    Key::Digest,
];

/// Every block's key list of up to 3 keys (and nil).
fn block_shapes() -> Vec<Option<Vec<Key>>> {
    let mut out = vec![None, Some(vec![])];
    let mut lists: Vec<Vec<Key>> = vec![vec![]];
    for _ in 0..3 {
        lists = lists
            .iter()
            .flat_map(|l| {
                KINDS.iter().map(move |&k| {
                    let mut l = l.clone();
                    l.push(k);
                    l
                })
            })
            .collect();
        out.extend(lists.iter().cloned().map(Some));
    }
    out
}

fn write_keys(w: &mut W, blocks: &[Option<Vec<Key>>]) {
    w.arr(blocks.len());
    for block in blocks {
        match block {
            None => {
                w.nil();
            }
            Some(keys) => {
                w.arr(keys.len());
                for key in keys {
                    match key {
                        Key::Str(s) => w.fs(s),
                        Key::Item => w.arr(2).s("img-1").u(300),
                        Key::Digest => w.bin(&[7; 32]),
                    };
                }
            }
        }
    }
}

/// The rule of `ExtraKeys::summary`'s docs: on each block a string equal to `lora_name` is the
/// LoRA key (once per block); on block 0 one other string is the cache salt (the first); any
/// other key is unsupported.
fn reference(blocks: &[Option<Vec<Key>>], lora: Option<&str>) -> (Option<&'static str>, bool) {
    let (mut salt, mut unsupported) = (None, false);
    for (i, keys) in blocks.iter().enumerate() {
        let mut lora_seen = false;
        for key in keys.iter().flatten() {
            match *key {
                Key::Str(s) if Some(s) == lora && !lora_seen => lora_seen = true,
                Key::Str(s) if i == 0 && salt.is_none() => salt = Some(s),
                _ => unsupported = true,
            }
        }
    }
    (salt, unsupported)
}

/// Events 10/40 at a6570e8: `lora_name == Some(s) && !lora_seen` → `&& lora_seen` in
/// `ExtraKeys::summary` passed every events test — no test had `extra_keys` naming a LoRA (the
/// mutant takes a LoRA request's adapter for its cache salt, and skips its later blocks as
/// unsupported). For the class, each branch of the classification against the documented
/// rule: one and two blocks, each nil or a list of up to three keys of every kind (the LoRA
/// name, two other strings, a multimodal item, a digest), with and without a `lora_name`.
#[test]
fn extra_keys_summary_follows_its_rule_on_every_shape() {
    let shapes = block_shapes();
    let mut checked = 0;
    for lora in [None, Some(LORA)] {
        for first in &shapes {
            let mut cases = vec![vec![first.clone()]];
            cases.extend(
                shapes
                    .iter()
                    .map(|second| vec![first.clone(), second.clone()]),
            );
            for blocks in cases {
                let mut w = W::default();
                write_keys(&mut w, &blocks);
                let got = ExtraKeys(Some(&w.0)).summary(lora);
                let (salt, unsupported) = reference(&blocks, lora);
                assert_eq!(
                    (got.salt, got.unsupported),
                    (salt, unsupported),
                    "{blocks:?}, LoRA {lora:?}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2 * 157 * 158);
    // Absent or nil: nothing; not a list of lists: unsupported.
    assert_eq!(ExtraKeys(None).summary(None), ExtraSummary::default());
    assert_eq!(
        ExtraKeys(Some(&[0xc0])).summary(None),
        ExtraSummary::default()
    );
    for bad in [&[0x05][..], &[0x91, 0x05], &[0x91, 0x91], &[]] {
        assert_eq!(
            ExtraKeys(Some(bad)).summary(None),
            ExtraSummary {
                salt: None,
                unsupported: true
            },
            "{bad:?}"
        );
    }
}

/// The same through the applier: a LoRA request's store names its adapter on every block (and
/// its salt on the first); it is the router's LoRA (and salted) chain.
#[test]
fn a_lora_store_naming_its_adapter_on_every_block_is_the_lora_chain() {
    let tokens: Vec<u64> = (0..48).collect();
    for salt in [None, Some("tenant-a")] {
        let options = Options {
            salt: salt.map(str::to_owned),
            lora_name: Some(LORA.to_owned()),
            ..Options::default()
        };
        let h = BlockHasher::new(16, Profile::Native, options).expect("hasher");
        let mut want = Vec::new();
        h.hash_into(&tokens, &ChainState::Root, &[], &mut want)
            .expect("hash");
        let index = shared();
        let mut a = Applier::new(index.clone(), Config::default()).expect("applier");
        let payload = batch(|w| {
            w.map(8).s("type").s("BlockStored");
            w.s("block_hashes").ints(&[1, 2, 3]);
            w.s("parent_block_hash").nil();
            w.s("token_ids").ints(&tokens);
            w.s("block_size").u(16);
            w.s("lora_id").u(1);
            w.s("lora_name").fs(LORA);
            w.s("extra_keys");
            let mut first = vec![Key::Str(LORA)];
            first.extend(salt.map(Key::Str));
            write_keys(
                w,
                &[
                    Some(first),
                    Some(vec![Key::Str(LORA)]),
                    Some(vec![Key::Str(LORA)]),
                ],
            );
            1
        });
        a.apply("w", &payload).expect("apply");
        assert_eq!(matched(&index, &want, "w"), 3, "salt {salt:?}");
        let c = a.counters("w").expect("counters");
        assert_eq!((c.blocks_stored, c.skipped_unsupported), (3, 0));
    }
}
