//! `load` against the image layout documented in `codec.rs`, written here by hand (an encoder of
//! its own, not `dump`): a valid image loads as the index it describes, and each refusal of
//! `load`, broken alone on that image (the checksum recomputed), is reported with its whole
//! message; each bound on a claimed count is taken at the bound and one past it. A child module
//! of `tests`.

use super::*;

/// One node of a hand-written image: its parent's number (0 = root), last use, worker indices
/// and block hashes; the run length written is `hashes.len()` unless patched.
struct Node {
    parent: u32,
    tick: u64,
    workers: Vec<u32>,
    hashes: Vec<u64>,
}

fn node(parent: u32, tick: u64, workers: &[u32], hashes: &[u64]) -> Node {
    Node {
        parent,
        tick,
        workers: workers.to_vec(),
        hashes: hashes.to_vec(),
    }
}

/// An image's body (everything before the checksum): magic, version 1, the workers (count, then
/// each name's length and bytes), the nodes (count, then each one's parent, run length, last
/// use, worker count, worker indices and hashes), little-endian.
fn body(names: &[&[u8]], nodes: &[Node]) -> Vec<u8> {
    let mut out = b"KVRIDX\0\0".to_vec();
    out.extend(1u32.to_le_bytes());
    out.extend((names.len() as u32).to_le_bytes());
    for name in names {
        out.extend((name.len() as u32).to_le_bytes());
        out.extend_from_slice(name);
    }
    out.extend((nodes.len() as u32).to_le_bytes());
    for n in nodes {
        out.extend(n.parent.to_le_bytes());
        out.extend((n.hashes.len() as u32).to_le_bytes());
        out.extend(n.tick.to_le_bytes());
        out.extend((n.workers.len() as u32).to_le_bytes());
        for w in &n.workers {
            out.extend(w.to_le_bytes());
        }
        for h in &n.hashes {
            out.extend(h.to_le_bytes());
        }
    }
    out
}

/// `body` followed by its checksum: XXH3-64 (seed 0) of every byte before it.
fn seal(mut body: Vec<u8>) -> Vec<u8> {
    let sum = xxhash_rust::xxh3::xxh3_64(&body);
    body.extend(sum.to_le_bytes());
    body
}

/// `body` with the u32 at byte `at` replaced by `v`.
fn patched(mut body: Vec<u8>, at: usize, v: u32) -> Vec<u8> {
    body[at..at + 4].copy_from_slice(&v.to_le_bytes());
    body
}

/// The message of `load`'s `Error::Value` for `image`.
fn refusal(image: &[u8], max_bytes: Option<usize>) -> String {
    match PrefixIndex::load(image, max_bytes) {
        Err(Error::Value(msg)) => msg,
        Err(e) => panic!("not a value error: {e:?}"),
        Ok(_) => panic!("accepted"),
    }
}

/// Workers a and b; blocks 1, 2 held by both, then 3 by a and 9 by b.
fn valid_nodes() -> Vec<Node> {
    vec![
        node(0, 5, &[0, 1], &[1, 2]),
        node(1, 6, &[0], &[3]),
        node(1, 7, &[1], &[9]),
    ]
}

/// Byte offsets in `body(&[b"a", b"b"], &valid_nodes())`, from the layout: magic 8, version 4,
/// worker count 4, then each name 4 + 1; the node count 4; node 1 (2 workers, 2 blocks) 44
/// bytes, node 2 (1 worker, 1 block) 32, node 3 the same.
const WORKER_COUNT: usize = 12;
const NAME_B_LEN: usize = 21;
const NODE_COUNT: usize = 26;
const NODE_1: usize = 30;
const NODE_2: usize = NODE_1 + 44;
const NODE_3: usize = NODE_2 + 32;
const BODY_LEN: usize = NODE_3 + 32;

/// cargo-mutants survivor (shard 17/40): `w >= num_workers || last >= w` → `&&` in `load`'s
/// worker-index check accepted an index past the worker count (no test refused any image by a
/// named rule: the garbage test only checks that what loads is sound). For the class, every
/// refusal of `load`, each on its own field of a hand-written image, with its whole message.
#[test]
fn each_refusal_of_load_is_reported_at_its_field_with_its_whole_message() {
    let names: [&[u8]; 2] = [b"a", b"b"];
    let good = body(&names, &valid_nodes());
    assert_eq!(good.len(), BODY_LEN);
    let ix = PrefixIndex::load(&seal(good.clone()), None).unwrap();
    ix.check_invariants().unwrap();
    assert_eq!(m(&ix, &[1, 2, 3]), pairs(&[("a", 3), ("b", 2)]));
    assert_eq!(m(&ix, &[1, 2, 9]), pairs(&[("a", 2), ("b", 3)]));
    assert_eq!((ix.len(), ix.num_nodes(), ix.num_workers()), (4, 3, 2));
    assert_eq!((ix.num_blocks("a"), ix.num_blocks("b")), (Ok(3), Ok(3)));

    let with_nodes = |f: &dyn Fn(&mut Vec<Node>)| {
        let mut nodes = valid_nodes();
        f(&mut nodes);
        seal(body(&names, &nodes))
    };
    let claims = |n: u32, what: &str| {
        format!("index image claims {n} {what}, more than its remaining bytes hold")
    };
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        (
            "7 bytes",
            seal(good.clone())[..7].to_vec(),
            "index image too short (7 bytes)".into(),
        ),
        (
            "only a checksum",
            seal(Vec::new()),
            "index image truncated at byte 0".into(),
        ),
        (
            "magic",
            seal(patched(good.clone(), 4, 1)),
            "not a kvroute index image (bad magic)".into(),
        ),
        (
            "version 2",
            seal(patched(good.clone(), 8, 2)),
            "unsupported index image version 2 (expected 1)".into(),
        ),
        (
            "version 0",
            seal(patched(good.clone(), 8, 0)),
            "unsupported index image version 0 (expected 1)".into(),
        ),
        (
            "checksum",
            {
                let mut image = seal(good.clone());
                *image.last_mut().unwrap() ^= 1;
                image
            },
            "index image checksum mismatch (corrupted or truncated)".into(),
        ),
        (
            "worker count",
            seal(patched(good.clone(), WORKER_COUNT, 1 << 20)),
            claims(1 << 20, "workers"),
        ),
        // b's name claims exactly the bytes left (accepted, and UTF-8: every byte below 0x80),
        // then one more.
        (
            "name length at the bound",
            seal(patched(
                good.clone(),
                NAME_B_LEN,
                (BODY_LEN - NAME_B_LEN - 4) as u32,
            )),
            format!("index image truncated at byte {BODY_LEN}"),
        ),
        (
            "name length past the bound",
            seal(patched(
                good.clone(),
                NAME_B_LEN,
                (BODY_LEN - NAME_B_LEN - 3) as u32,
            )),
            claims((BODY_LEN - NAME_B_LEN - 3) as u32, "worker name bytes"),
        ),
        (
            "name not UTF-8",
            seal(body(&[b"a", b"\xff"], &valid_nodes())),
            "worker 1: name is not UTF-8".into(),
        ),
        (
            "name twice",
            seal(body(&[b"a", b"a"], &valid_nodes())),
            "worker name \"a\" appears twice".into(),
        ),
        // 4 nodes of at least 24 bytes fit in the 108 bytes left; 5 do not.
        (
            "node count at the bound",
            seal(patched(good.clone(), NODE_COUNT, 4)),
            format!("index image truncated at byte {BODY_LEN}"),
        ),
        (
            "node count past the bound",
            seal(patched(good.clone(), NODE_COUNT, 5)),
            claims(5, "nodes"),
        ),
        (
            "node 1's parent",
            with_nodes(&|n| n[0].parent = 1),
            "node 1: parent 1 does not precede it".into(),
        ),
        (
            "node 2's parent",
            with_nodes(&|n| n[1].parent = 2),
            "node 2: parent 2 does not precede it".into(),
        ),
        (
            "empty run",
            with_nodes(&|n| n[1].hashes.clear()),
            "node 2: empty run".into(),
        ),
        // Node 3's run claims the 24 bytes after its length (accepted), then 32.
        (
            "run length at the bound",
            seal(patched(good.clone(), NODE_3 + 4, 3)),
            format!("index image truncated at byte {}", NODE_3 + 24),
        ),
        (
            "run length past the bound",
            seal(patched(good.clone(), NODE_3 + 4, 4)),
            claims(4, "blocks"),
        ),
        // Node 3's worker count claims the 12 bytes after it (accepted: its hash's low word, 9,
        // is read as an index), then 16.
        (
            "worker count at the bound",
            seal(patched(good.clone(), NODE_3 + 16, 3)),
            "node 3: bad worker index 9".into(),
        ),
        (
            "worker count past the bound",
            seal(patched(good.clone(), NODE_3 + 16, 4)),
            claims(4, "worker indices"),
        ),
        (
            "a worker past the count",
            with_nodes(&|n| n[1].workers = vec![2]),
            "node 2: bad worker index 2".into(),
        ),
        (
            "workers past the count, increasing",
            with_nodes(&|n| n[0].workers = vec![0, 1, 2]),
            "node 1: bad worker index 2".into(),
        ),
        (
            "a worker twice",
            with_nodes(&|n| n[0].workers = vec![0, 0]),
            "node 1: bad worker index 0".into(),
        ),
        (
            "workers decreasing",
            with_nodes(&|n| n[0].workers = vec![1, 0]),
            "node 1: bad worker index 0".into(),
        ),
        (
            "no worker",
            with_nodes(&|n| n[2].workers.clear()),
            "node 3: no worker holds it".into(),
        ),
        (
            "a worker its parent lacks",
            with_nodes(&|n| n[0].workers = vec![1]),
            "node 2: holds workers its parent does not".into(),
        ),
        (
            "a block in two nodes",
            with_nodes(&|n| n[2].hashes = vec![2]),
            "node 3: block 0x0000000000000002 is stored twice".into(),
        ),
        (
            "a block twice in a run",
            with_nodes(&|n| n[1].hashes = vec![3, 3]),
            "node 2: block 0x0000000000000003 is stored twice".into(),
        ),
        (
            "trailing bytes",
            seal([good.clone(), vec![0; 3]].concat()),
            "3 trailing bytes after the last node".into(),
        ),
    ];
    for (what, image, want) in &cases {
        assert_eq!(&refusal(image, None), want, "{what}");
    }
    // The budget: the image's own size is accepted. (One too small for the workers' table is
    // refused only in a release build: in a test build it trips `enforce_budget`'s debug
    // assertion that an empty index fits, which `load`, unlike `add_worker`, does not ensure.)
    let fits = ix.memory_bytes();
    PrefixIndex::load(&seal(good), Some(fits)).unwrap();
}

/// A budget too small for the image's worker table is refused before anything is evicted (it
/// tripped `enforce_budget`'s "an empty index exceeds its budget" assertion in test builds), and
/// one that holds the table keeps the workers, evicting blocks to fit.
#[test]
fn a_budget_smaller_than_the_worker_table_is_refused_not_evicted_into() {
    let mut src = PrefixIndex::new(None).unwrap();
    src.store("a", &[1, 2, 3], None).unwrap();
    src.store("b", &[1, 7], None).unwrap();
    let image = src.dump();
    for max in [PrefixIndex::min_budget(), PrefixIndex::min_budget() + 8] {
        assert_eq!(
            refusal(&image, Some(max)),
            format!("max_bytes = {max} cannot hold the table of 2 workers")
        );
    }
    let mut fits = PrefixIndex::new(None).unwrap();
    fits.add_worker("a").unwrap();
    fits.add_worker("b").unwrap();
    let table = PrefixIndex::min_budget() + fits.workers.heap_bytes() + 64;
    let loaded = PrefixIndex::load(&image, Some(table)).unwrap();
    assert_eq!(loaded.num_workers(), 2);
    assert!(loaded.memory_bytes() <= table);
}
