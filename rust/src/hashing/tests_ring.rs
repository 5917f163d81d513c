//! Hashing tests of the hash ring: its points (`ketama.rs`: libketama's MD5 points, the
//! many-lane MD5) and its lookups (`ring.rs`). A child module of `tests`, split from it when it
//! reached 952 lines; the tests are unchanged.

/// `ketama.rs`.
mod ketama {
    use crate::hashing::ketama::*;
    use crate::hashing::*;
    use md5::{Digest, Md5};

    fn reference(msg: &[u8]) -> u32 {
        let d = Md5::digest(msg);
        u32::from_le_bytes([d[0], d[1], d[2], d[3]])
    }

    #[test]
    fn libketama_published_hash() {
        // libketama test.sh / python_ketama tests: ketama_hashi("test") == 3446378249.
        assert_eq!(ketama_hash(Key::Bytes(b"test")), 3_446_378_249);
    }

    #[test]
    fn ring_batch_gives_get_of_every_key_in_order() {
        // The reference: `md5` for a ketama position, `get` (scalar) for every owner. Keys of
        // every length to past one MD5 block, and integers.
        let data: Vec<u8> = (0..200u32).map(|i| (i * 53 + 7) as u8).collect();
        let mut keys: Vec<Key<'_>> = (0..=130).map(|n| Key::Bytes(&data[..n])).collect();
        keys.extend((0..75u64).map(|i| Key::Int(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))));
        if let Key::Bytes(b) = keys[9] {
            let ring = HashRing::new([("a", 1.0)], 160, RingHash::Ketama).unwrap();
            assert_eq!(ring.key_hash(keys[9]), u64::from(reference(b)));
        }
        for kind in [RingHash::Ketama, RingHash::Xxh3] {
            let ring = HashRing::new((0..40).map(|i| (format!("n{i}"), 1.0)), 160, kind).unwrap();
            let want: Vec<NodeId> = keys.iter().map(|&k| ring.get(k).unwrap()).collect();
            let mut batch = RingBatch::new(&ring).unwrap();
            let mut ids = vec![7; 3];
            for &k in &keys {
                batch.push(k, &mut ids);
            }
            batch.finish(&mut ids);
            assert_eq!(ids[..3], [7; 3], "{kind:?}: appended after what `out` held");
            assert_eq!(ids[3..], want[..], "{kind:?}");
        }
        let empty = HashRing::new(Vec::<(&str, f64)>::new(), 160, RingHash::Ketama).unwrap();
        assert!(RingBatch::new(&empty).is_err());
    }

    #[test]
    fn lanes_match_scalar_md5_for_every_length() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 37 + 11) as u8).collect();
        let keys: Vec<&[u8]> = (0..=130).map(|n| &data[..n]).collect();
        let mut got = Vec::new();
        ketama_hash_many(keys.iter().map(|k| Key::Bytes(k)), |h| got.push(h));
        let want: Vec<u32> = keys.iter().map(|k| reference(k)).collect();
        assert_eq!(got, want);
        for k in &keys {
            assert_eq!(ketama_hash(Key::Bytes(k)), reference(k));
        }
    }

    /// Random byte strings of length 0..200 (SplitMix64), short and long keys mixed so that
    /// every lane position sees both.
    fn random_keys(n: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        (0..n)
            .map(|_| {
                let len = (next() % 200) as usize;
                (0..len).map(|_| next() as u8).collect()
            })
            .collect()
    }

    #[test]
    fn lanes_match_md5_on_random_keys() {
        for seed in 0..4 {
            let keys = random_keys(3_001, seed);
            let mut got = Vec::new();
            ketama_hash_many(keys.iter().map(|k| Key::Bytes(k)), |h| got.push(h));
            let want: Vec<u32> = keys.iter().map(|k| reference(k)).collect();
            assert_eq!(got, want, "seed {seed}");
            for k in keys.iter().take(300) {
                assert_eq!(ketama_hash(Key::Bytes(k)), reference(k));
            }
        }
    }

    /// Both one-key MD5s (general registers, and AVX-512's 128-bit vectors where the CPU has
    /// them), whichever `ketama_hash` dispatches to, on every one-block length and random keys.
    #[test]
    fn both_scalar_md5s_match_md5() {
        let data: Vec<u8> = (0..56u32).map(|i| (i * 91 + 5) as u8).collect();
        let mut keys: Vec<Vec<u8>> = (0..=55).map(|n| data[..n].to_vec()).collect();
        keys.extend(random_keys(400, 21).into_iter().map(|mut k| {
            k.truncate(k.len() % 56);
            k
        }));
        for k in &keys {
            let mut m: Block<1> = [[0]; 16];
            pad_lane(&mut m, 0, k);
            assert_eq!(md5_word0_by::<1, 1, 14>(&m)[0], reference(k), "{k:?}");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                // SAFETY: the CPU supports AVX-512F and VL (checked just above).
                assert_eq!(unsafe { md5_word0_xmm(&m) }, reference(k), "{k:?}");
            }
        }
    }

    /// Every compiled variant (not only the one this CPU dispatches to) on one-block keys, for
    /// each message-word variant: keys of up to `4 * w - 1` bytes use words `0..w` and 14.
    #[test]
    fn every_lane_variant_matches_md5() {
        for (seed, w) in WORD_VARIANTS.into_iter().enumerate() {
            let keys: Vec<Vec<u8>> = random_keys(4 * LANES, 9 + seed as u64)
                .into_iter()
                .map(|mut k| {
                    k.truncate(k.len() % (4 * w));
                    k
                })
                .collect();
            assert!(keys.iter().any(|k| k.len() / 4 + 1 == w), "w = {w}");
            for chunk in keys.chunks_exact(LANES) {
                let mut m: Block<LANES> = [[0; LANES]; 16];
                let used = chunk
                    .iter()
                    .enumerate()
                    .map(|(lane, k)| pad_lane(&mut m, lane, k))
                    .max()
                    .unwrap();
                assert!(used <= w);
                let want: Vec<u32> = chunk.iter().map(|k| reference(k)).collect();
                assert_eq!(md5_word0_by::<LANES, BASE_GROUP, 14>(&m).to_vec(), want);
                #[cfg(target_arch = "x86_64")]
                assert_eq!(md5_word0_by::<LANES, 24, 14>(&m).to_vec(), want);
                assert_eq!(md5_word0_by::<LANES, LANES, 14>(&m).to_vec(), want);
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU supports AVX2 (checked just above).
                        assert_eq!(unsafe { md5_word0_lanes_avx2(&m, used) }.to_vec(), want);
                    }
                    if std::arch::is_x86_feature_detected!("avx512f")
                        && std::arch::is_x86_feature_detected!("avx512vl")
                    {
                        // SAFETY: the CPU supports AVX-512F and VL (checked just above).
                        let got = unsafe { md5_word0_lanes_avx512(&m, used) };
                        assert_eq!(got.to_vec(), want, "w = {w}");
                    }
                }
            }
        }
    }

    /// A group of short keys after a group of long ones: the words the long keys wrote must be
    /// cleared, or the short keys' skipped additions would be wrong.
    #[test]
    fn short_keys_after_long_keys_in_the_same_lanes() {
        let long: Vec<Vec<u8>> = (0..LANES).map(|i| vec![b'x' + (i % 3) as u8; 55]).collect();
        let short: Vec<Vec<u8>> = (0..LANES + 3).map(|i| i.to_string().into_bytes()).collect();
        let keys: Vec<&Vec<u8>> = long.iter().chain(&short).chain(&long).collect();
        let mut got = Vec::new();
        ketama_hash_many(keys.iter().map(|k| Key::Bytes(k)), |h| got.push(h));
        let want: Vec<u32> = keys.iter().map(|k| reference(k)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn integer_keys_hash_as_decimal_text() {
        for k in [0u64, 7, 10, 99_999, u64::MAX] {
            let text = k.to_string();
            assert_eq!(ketama_hash(Key::Int(k)), reference(text.as_bytes()));
            let mut got = Vec::new();
            ketama_hash_many([Key::Int(k)], |h| got.push(h));
            assert_eq!(got, vec![reference(text.as_bytes())]);
        }
    }

    #[test]
    fn points_are_the_digest_words() {
        let d = Md5::digest(b"10.0.1.1:11211-3");
        let p = ketama_points("10.0.1.1:11211", 3);
        assert_eq!(p[0], u32::from_le_bytes([d[0], d[1], d[2], d[3]]));
        assert_eq!(p[3], u32::from_le_bytes([d[12], d[13], d[14], d[15]]));
    }
}

/// `ring.rs`.
mod ring {
    use crate::hashing::ring::*;
    use crate::hashing::*;
    use crate::Error;

    fn ring(nodes: &[(&str, f64)], hash: RingHash) -> HashRing {
        HashRing::new(nodes.iter().copied(), 160, hash).unwrap()
    }

    /// Lookup by plain binary search, the definition the bucket table must reproduce.
    fn reference_owner(r: &HashRing, h: u64) -> NodeId {
        let pts: Vec<(u64, NodeId)> = r.points().collect();
        let i = pts.partition_point(|&(p, _)| p < h);
        pts[if i == pts.len() { 0 } else { i }].1
    }

    #[test]
    fn libketama_two_server_vectors() {
        // RJ/ketama ketama.two.servers: 600/400 MB, 320 points; "test" -> point 3454255383.
        let r = ring(
            &[("127.0.0.1:11211", 600.0), ("127.0.0.1:11212", 400.0)],
            RingHash::Ketama,
        );
        assert_eq!(r.num_points(), 320);
        let h = r.key_hash(Key::Bytes(b"test"));
        assert_eq!(h, 3_446_378_249);
        let pos = r.position(h);
        assert_eq!(r.points[pos], 3_454_255_383);
        assert_eq!(r.get(Key::Bytes(b"test")).unwrap(), 0);
    }

    #[test]
    fn bucket_table_agrees_with_binary_search() {
        let names: Vec<String> = (0..37).map(|i| format!("n{i}")).collect();
        for hash in [RingHash::Ketama, RingHash::Xxh3] {
            let r = HashRing::new(names.iter().map(|n| (n.as_str(), 1.0)), 8, hash).unwrap();
            let mut probes: Vec<u64> = r
                .points()
                .flat_map(|(p, _)| [p, p.wrapping_sub(1), p + 1])
                .collect();
            probes.extend([0, u64::from(u32::MAX), u64::MAX]);
            for k in 0..2000u64 {
                probes.push(r.key_hash(Key::Int(k)));
            }
            for h in probes {
                if hash == RingHash::Ketama && h > u64::from(u32::MAX) {
                    continue;
                }
                assert_eq!(r.owner_of(h), reference_owner(&r, h), "{hash:?} {h}");
            }
        }
    }

    /// cargo-mutants survivors (shard 1/40): `vnodes` is what the ring was built with, and the
    /// bucket table is what its definition says: about two buckets per point over the whole hash
    /// space, each the index of the first point `>=` its lowest hash. (An empty table still gives
    /// the right owners, by a scan from the first point: only this check sees it.)
    #[test]
    fn vnodes_and_the_bucket_table() {
        let names: Vec<String> = (0..37).map(|i| format!("n{i}")).collect();
        for (vnodes, hash, bits) in [(8, RingHash::Ketama, 32), (5, RingHash::Xxh3, 64)] {
            let r = HashRing::new(names.iter().map(|n| (n.as_str(), 1.0)), vnodes, hash).unwrap();
            assert_eq!(r.vnodes(), vnodes);
            let buckets = r.table.len();
            assert!(
                buckets >= r.num_points() && buckets <= 4 * r.num_points(),
                "{buckets}"
            );
            assert_eq!((buckets as u128) << r.shift, 1u128 << bits);
            for (t, &first) in r.table.iter().enumerate() {
                let lo = (t as u64) << r.shift;
                assert_eq!(first as usize, r.points.partition_point(|&p| p < lo), "{t}");
            }
        }
    }

    /// cargo-mutants survivor (shard 2/40): a point exactly at a bucket's lowest hash is that
    /// bucket's first point (`>=`, not `>`: else `owner_of`, which only walks forward, would skip
    /// it). Ring points are hashes of names, so the table is built here from chosen points.
    #[test]
    fn a_point_on_a_bucket_boundary_starts_its_bucket() {
        let points = [0, 1 << 30, (1 << 30) + 1, 3 << 30, u64::MAX];
        let (table, shift) = bucket_table(&points[..4], 32);
        assert_eq!(shift, 29);
        for (t, &first) in table.iter().enumerate() {
            let lo = (t as u64) << shift;
            assert_eq!(
                first as usize,
                points.partition_point(|&p| p < lo),
                "bucket {t}"
            );
        }
        assert_eq!(table[..3], [0, 1, 1]);
    }

    /// cargo-mutants survivors (shard 3/40): a batch lookup gives every key the node `get` gives
    /// it, on a ring whose tables fit in cache (no prefetching) and on one past 512 KiB
    /// (prefetching), for both hashes; and a ketama ring past `MAX_POINTS` is refused.
    #[test]
    fn get_many_agrees_with_get_on_small_and_large_rings() {
        for hash in [RingHash::Ketama, RingHash::Xxh3] {
            for n in [3, 200] {
                let names: Vec<String> = (0..n)
                    .map(|i| format!("10.0.{}.{}:80", i / 250, i % 250))
                    .collect();
                let r = HashRing::new(names.iter().map(|s| (s.as_str(), 1.0)), 160, hash).unwrap();
                let mut out = Vec::new();
                r.get_many_into((0..3000u64).map(Key::Int), &mut out)
                    .unwrap();
                assert_eq!(out.len(), 3000);
                for (k, &node) in (0..3000u64).zip(&out) {
                    assert_eq!(
                        node,
                        r.get(Key::Int(k)).unwrap(),
                        "{hash:?} {n} nodes, key {k}"
                    );
                }
            }
        }
        let over = (MAX_POINTS as u32) / 2 + 4; // two nodes: MAX_POINTS + 8 points
        assert!(matches!(
            HashRing::new([("a", 1.0), ("b", 1.0)], over, RingHash::Ketama),
            Err(Error::Value(_))
        ));
    }

    #[test]
    fn colliding_points_go_to_the_first_name() {
        // 2000 ketama nodes put 320k points in 2^32: a dozen collisions are expected.
        let names: Vec<String> = (0..2000)
            .map(|i| format!("10.1.{}.{}:11211", i / 250, i % 250))
            .collect();
        let r = HashRing::new(
            names.iter().map(|n| (n.as_str(), 1.0)),
            160,
            RingHash::Ketama,
        )
        .unwrap();
        let pts: Vec<(u64, NodeId)> = r.points().collect();
        let mut ties = 0;
        for w in pts.windows(2) {
            let ((p, a), (q, b)) = (w[0], w[1]);
            if p == q && a != b {
                ties += 1;
                assert!(r.nodes.name(a).unwrap() < r.nodes.name(b).unwrap());
                assert_eq!(r.owner_of(p), a);
            }
        }
        assert!(ties > 0, "expected at least one collision");
    }

    #[test]
    fn preference_starts_with_get_and_is_distinct() {
        let r = ring(
            &[("a", 1.0), ("b", 2.0), ("c", 1.0), ("d", 1.0)],
            RingHash::Ketama,
        );
        let mut out = Vec::new();
        for k in 0..200u64 {
            r.preference_into(Key::Int(k), 10, &mut out).unwrap();
            assert_eq!(out.len(), 4);
            assert_eq!(out[0], r.get(Key::Int(k)).unwrap());
            let mut sorted = out.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), 4);
        }
        assert!(matches!(
            r.preference_into(Key::Int(1), 0, &mut out),
            Err(Error::Value(_))
        ));
    }

    #[test]
    fn bad_configurations_are_refused() {
        let nodes = [("a", 1.0)];
        assert!(HashRing::new(nodes, 0, RingHash::Xxh3).is_err());
        assert!(HashRing::new(nodes, 10, RingHash::Ketama).is_err());
        assert!(HashRing::new([("a", 1.5)], 160, RingHash::Ketama).is_err());
        assert!(HashRing::new([("a", 1e9)], 160, RingHash::Xxh3).is_err());
        let mut r = HashRing::new(nodes, 160, RingHash::Ketama).unwrap();
        assert!(r.add("b", 0.5).is_err());
        assert!(r.add("a", 1.0).is_err());
        assert!(matches!(r.remove("zz"), Err(Error::Key(_))));
        assert_eq!(r.len(), 1);
        assert_eq!(r.num_points(), 160);
    }

    #[test]
    fn xxh3_changes_move_keys_only_to_or_from_the_changed_node() {
        let names: Vec<String> = (0..10).map(|i| format!("w{i}")).collect();
        let r =
            HashRing::new(names.iter().map(|n| (n.as_str(), 1.0)), 160, RingHash::Xxh3).unwrap();
        let mut grown = r.clone();
        grown.add("new", 1.0).unwrap();
        let new_id = grown.nodes.id("new").unwrap();
        for k in 0..5000u64 {
            let before = r.get(Key::Int(k)).unwrap();
            let after = grown.get(Key::Int(k)).unwrap();
            assert!(after == before || after == new_id);
        }
    }
}

/// `ring_split.rs`: the split table against the definition of a ring's owner, on synthetic
/// rings built to reach every case (empty buckets, points at a bucket's first and last hash,
/// equal points, runs of three and more points in one bucket, a point in the last bucket).
mod split {
    use crate::hashing::ring::bucket_table;
    use crate::hashing::ring_split::SplitTable;
    use crate::hashing::*;

    /// SplitMix64.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut state = seed;
        move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
    }

    /// The owner of `h` by definition: that of the first point `>= h`; the sentinel (`u64::MAX`,
    /// last) owns the wrap-around.
    fn owner(points: &[u64], owners: &[NodeId], h: u64) -> NodeId {
        owners[points.iter().position(|&p| p >= h).unwrap()]
    }

    /// A ring's points (sorted, 32-bit, with the sentinel), owners (ids below `nodes`, with the
    /// wrap-around) and bucket table, as `HashRing` lays them out: `n` random points plus
    /// crowded buckets.
    fn ring(n: usize, nodes: u64, seed: u64) -> (Vec<u64>, Vec<NodeId>, Vec<u32>, u32) {
        let mut next = rng(seed);
        let mut points: Vec<u64> = (0..n).map(|_| next() >> 32).collect();
        if let Some(&p) = points.first() {
            let (_, shift) = bucket_table(&points, 32);
            let lo = (p >> shift) << shift;
            let last = lo + (1 << shift) - 1;
            // A bucket's first and last hash, a duplicate, runs of 3 and 5 in one bucket, and the
            // ring's last hash.
            points.extend([lo, last, p, lo + 1, lo + 2, lo + 3, last - 4, last - 3]);
            points.extend([
                last - 2,
                last - 1,
                u64::from(u32::MAX) - 3,
                u64::from(u32::MAX),
            ]);
            points.retain(|&q| q <= u64::from(u32::MAX));
        }
        points.sort_unstable();
        let owners: Vec<NodeId> = points.iter().map(|_| (next() % nodes) as NodeId).collect();
        let (table, shift) = bucket_table(&points, 32);
        let wrap = owners.first().copied();
        points.push(u64::MAX);
        let owners = [owners, wrap.into_iter().collect()].concat();
        (points, owners, table, shift)
    }

    /// Whether this CPU runs the split table (AVX-512F).
    fn gathers() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    #[test]
    fn owners_are_the_first_point_at_or_after_each_hash() {
        let gathers = gathers();
        let mut scanned = 0;
        // The last: two offsets of 15 bits and three owners of 11, the most an entry holds.
        let cases = [
            (1, 1),
            (2, 2),
            (3, 3),
            (40, 5),
            (640, 64),
            (10_240, 64),
            (40_000, 2048),
        ];
        for (seed, (n, nodes)) in (1..).zip(cases) {
            let (points, owners, table, shift) = ring(n, nodes, seed);
            let Some(split) = SplitTable::build(&points, &owners, &table, shift) else {
                assert!(!gathers, "{n} points: no split table on a CPU with AVX-512");
                continue;
            };
            let mut next = rng(seed + 100);
            let mut hashes: Vec<u64> = vec![0, 1, u64::from(u32::MAX), 1 << 32, u64::MAX];
            for &p in points.iter().filter(|&&p| p != u64::MAX) {
                hashes.extend([p.saturating_sub(1), p, p + 1]);
            }
            for _ in 0..5_000 {
                let t = next() % table.len() as u64;
                let lo = t << shift;
                hashes.extend([
                    lo,
                    lo + (1 << shift) - 1,
                    lo + (next() & ((1 << shift) - 1)),
                ]);
                hashes.push(next() >> 32);
            }
            hashes.extend((0..20).map(|_| next() | 1 << 40));
            hashes.push(7); // not a multiple of 8: the remainder's path too
                            // Shuffled, so a hash that takes the scan sits at every lane of a gather.
            for i in (1..hashes.len()).rev() {
                hashes.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            let want: Vec<NodeId> = hashes.iter().map(|&h| owner(&points, &owners, h)).collect();
            let mut out = vec![9];
            let scans = std::cell::Cell::new(0);
            split.owners_into(&hashes, &mut out, |h| {
                scans.set(scans.get() + 1);
                owner(&points, &owners, h)
            });
            assert_eq!(out[0], 9, "{n} points: appended");
            assert_eq!(out[1..], want[..], "{n} points");
            // Only hashes above 32 bits, in crowded buckets, or in the remainder are scanned.
            assert!(
                scans.get() < hashes.len() / 5,
                "{n} points: {} scans",
                scans.get()
            );
            scanned += scans.get();
        }
        assert!(!gathers || scanned > 0);
    }

    /// A ketama ring's batches take the split table wherever the CPU can run it; an XXH3 ring's
    /// 64-bit positions never do (and nor does an empty ring).
    #[test]
    fn ketama_rings_build_a_split_table_where_the_cpu_has_avx512() {
        let names: Vec<String> = (0..64).map(|i| format!("10.0.0.{i}:8000")).collect();
        for (hash, want) in [(RingHash::Ketama, gathers()), (RingHash::Xxh3, false)] {
            let ring = HashRing::new(names.iter().map(|s| (s.as_str(), 1.0)), 160, hash).unwrap();
            assert_eq!(ring.split.is_some(), want, "{hash:?}");
        }
        let empty = HashRing::new(Vec::<(&str, f64)>::new(), 160, RingHash::Ketama).unwrap();
        assert!(empty.split.is_none());
    }

    /// A bucket's two offsets and three owners must fit an entry: a ring of many nodes with few
    /// points each has no split table, and looks its batches up with the bucket table's scan.
    #[test]
    fn rings_whose_entries_would_not_fit_look_up_without() {
        let (points, owners, table, shift) = ring(8_000, 2_000, 9);
        assert!(SplitTable::build(&points, &owners, &table, shift).is_none());
        // Two offsets of 17 bits and three owners of 10: one bit too many.
        let (points, owners, table, shift) = ring(10_240, 1024, 9);
        assert_eq!(shift, 17);
        assert!(SplitTable::build(&points, &owners, &table, shift).is_none());
        // A table that does not cover the 32-bit hashes in buckets of `2^shift`: none either.
        let (points, owners, table, shift) = ring(8_000, 200, 9);
        let half = &table[..table.len() / 2];
        assert!(SplitTable::build(&points, &owners, half, shift).is_none());
        assert!(SplitTable::build(&points, &owners, &table, shift + 1).is_none());
        let (points, owners, table, shift) = ring(8_000, 200, 9);
        let gathers = gathers();
        assert_eq!(
            SplitTable::build(&points, &owners, &table, shift).is_some(),
            gathers
        );
        let names: Vec<String> = (0..2_000)
            .map(|i| format!("10.1.{}.{}:80", i / 250, i % 250))
            .collect();
        let ring = HashRing::new(names.iter().map(|s| (s.as_str(), 1.0)), 4, RingHash::Ketama);
        let ring = ring.unwrap();
        let mut out = Vec::new();
        ring.get_many_into((0..5_000u64).map(Key::Int), &mut out)
            .unwrap();
        for (k, &node) in (0..5_000u64).zip(&out) {
            assert_eq!(node, ring.get(Key::Int(k)).unwrap(), "key {k}");
        }
    }
}
