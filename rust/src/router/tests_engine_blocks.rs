//! A worker's matches in whole blocks of its engine's size (`Worker::engine_block_size`): the
//! conversion against a token-by-token count, and the router's match, tier and in-flight credit
//! in events and approx mode.

use super::decision::whole_engine_blocks;
use super::tests::tokens;
use super::*;

/// `[ts, [BlockStored{prompt in blocks of engine tokens, engine hashes from first, medium}],
/// dp_rank]`: the msgpack of vLLM's KVEventBatch.
pub(super) fn stored(prompt: &[u32], engine: u64, first: u64, medium: &str) -> Vec<u8> {
    use rmp::encode::{
        write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint,
    };
    let n = prompt.len() as u64 / engine;
    let mut p = Vec::new();
    write_array_len(&mut p, 3).unwrap();
    write_f64(&mut p, 1.0).unwrap();
    write_array_len(&mut p, 1).unwrap();
    write_map_len(&mut p, 6).unwrap();
    write_str(&mut p, "type").unwrap();
    write_str(&mut p, "BlockStored").unwrap();
    write_str(&mut p, "block_hashes").unwrap();
    write_array_len(&mut p, n as u32).unwrap();
    for h in first..first + n {
        write_uint(&mut p, h).unwrap();
    }
    write_str(&mut p, "parent_block_hash").unwrap();
    write_nil(&mut p).unwrap();
    write_str(&mut p, "token_ids").unwrap();
    write_array_len(&mut p, (n * engine) as u32).unwrap();
    for &t in prompt.iter().take((n * engine) as usize) {
        write_uint(&mut p, t.into()).unwrap();
    }
    write_str(&mut p, "block_size").unwrap();
    write_uint(&mut p, engine).unwrap();
    write_str(&mut p, "medium").unwrap();
    match medium {
        "" => write_nil(&mut p).unwrap(), // vLLM before 0.9 names no medium: the GPU
        m => write_str(&mut p, m).unwrap(),
    }
    write_nil(&mut p).unwrap();
    p
}

fn events_router(block_size: usize, names: &[&str]) -> Router {
    let config = Config {
        block_size,
        mode: IndexMode::Events,
        ..Config::default()
    };
    Router::new(names.iter().map(|&n| (n, 1.0)), config).unwrap()
}

/// The tokens of `prefix` followed by `n` tokens no other prompt has.
fn diverging(prefix: &[u32], n: u32) -> Vec<u32> {
    prefix.iter().copied().chain(tokens(999, n)).collect()
}

#[test]
fn whole_engine_blocks_are_counted_token_by_token() {
    for router in 1..=8usize {
        for engine in 1..=40u32 {
            for blocks in 0..=24u64 {
                // Whole engine blocks laid one after another within the prefix's tokens.
                let tokens = blocks as usize * router;
                let mut held = 0;
                while held + engine as usize <= tokens {
                    held += engine as usize;
                }
                let want = (held / router) as u64;
                let got = whole_engine_blocks(blocks, router, Some(engine));
                assert_eq!(got, want, "{blocks} blocks of {router}, engine {engine}");
                assert_eq!(whole_engine_blocks(blocks, router, None), blocks);
            }
        }
    }
    assert_eq!(
        whole_engine_blocks(u64::MAX, usize::MAX, Some(7)),
        u64::MAX - 1
    );
}

/// Worker `a`'s engine caches 64-token blocks, `b`'s 16-token ones; both store the same
/// 256-token prompt. A request sharing its first 100 tokens finds 96 of them (6 router blocks)
/// on `b`, and one 64-token block (4 router blocks) on `a`: the router predicts each, and
/// `kv_aware` prefers `b`.
#[test]
fn events_mode_counts_each_workers_prefix_in_its_engines_blocks() {
    let mut r = events_router(16, &["a", "b"]);
    let mut applier = r.new_event_applier().unwrap();
    let prompt = tokens(1, 256);
    applier.apply("a", &stored(&prompt, 64, 1, "GPU")).unwrap();
    applier.apply("b", &stored(&prompt, 16, 1, "GPU")).unwrap();
    assert_eq!(r.engine_block_size("a").unwrap(), Some(64));
    assert_eq!(r.engine_block_size("b").unwrap(), Some(16));
    let query = diverging(&prompt[..100], 100);
    let on_a = r.route_tokens(&query, None, None, 0.0).unwrap();
    assert_eq!((&*on_a.worker, on_a.cached_blocks), ("b", 6));
    let exclude = ["b"];
    let req = RouteRequest {
        exclude: &exclude,
        ..r.tokens_request(&query, None, None, 0.0).unwrap()
    };
    let d = r.route(req).unwrap();
    assert_eq!((&*d.worker, d.cached_blocks, d.matched_blocks), ("a", 4, 4));
    // The whole prompt: every engine block of it on both.
    let whole = r.route_tokens(&prompt, None, None, 0.0).unwrap();
    assert_eq!(whole.cached_blocks, 16);
}

/// A prefix held only in a slower tier is credited in whole engine blocks too: `a` (engine
/// blocks of 8, as its GPU stores say) and `b` (of 4) hold the same 6 router blocks in `"CPU"`;
/// a request sharing 5 of them earns `a` credit for 4 and `b` for 5, so `b` costs less.
#[test]
fn tier_credit_counts_whole_engine_blocks() {
    let mut r = events_router(4, &["a", "b"]);
    let mut applier = r.new_event_applier().unwrap();
    let prompt = tokens(2, 24);
    applier
        .apply("a", &stored(&tokens(5, 8), 8, 100, "GPU"))
        .unwrap();
    applier
        .apply("b", &stored(&tokens(5, 8), 4, 100, "GPU"))
        .unwrap();
    applier.apply("a", &stored(&prompt, 8, 1, "CPU")).unwrap();
    applier.apply("b", &stored(&prompt, 4, 1, "CPU")).unwrap();
    let d = r
        .route_tokens(&diverging(&prompt[..20], 20), None, None, 0.0)
        .unwrap();
    let cost = |name: &str| d.scores().find(|(n, _)| &***n == name).unwrap().1;
    assert_eq!(&*d.worker, "b");
    assert!(cost("a") > cost("b"), "{} vs {}", cost("a"), cost("b"));
}

/// Approx mode models a routed prompt as cached where it was sent; with the engine's block size
/// set, a repeat counts its whole engine blocks (40 tokens, engine blocks of 12: 36 tokens, 9
/// router blocks of 4), without it every router block.
#[test]
fn approx_mode_counts_whole_engine_blocks_once_told_the_size() {
    let mut r = super::tests::router(Policy::KvAware, &["a", "b"]);
    let prompt = tokens(3, 40);
    let first = r.route_tokens(&prompt, None, None, 0.0).unwrap();
    let w = first.worker.clone();
    assert_eq!(
        r.route_tokens(&prompt, None, None, 1.0)
            .unwrap()
            .cached_blocks,
        10
    );
    r.set_engine_block_size(&w, 12).unwrap();
    let again = r.route_tokens(&prompt, None, None, 2.0).unwrap();
    assert_eq!((&again.worker, again.cached_blocks), (&w, 9));
    // A worker added later under the name is a new engine: its size unknown (the other
    // worker's kept), its repeats counted in router blocks until told its own.
    let other = if &*w == "a" { "b" } else { "a" };
    r.set_engine_block_size(other, 8).unwrap();
    r.remove_worker(&w).unwrap();
    r.add_worker(&w, 1.0).unwrap();
    assert_eq!(r.workers().named(&w).unwrap().engine_block_size, None);
    assert_eq!(r.engine_block_size(&w).unwrap(), None);
    assert_eq!(r.engine_block_size(other).unwrap(), Some(8));
    let exclude = [other];
    for at in [3.0, 4.0] {
        let req = RouteRequest {
            exclude: &exclude,
            ..r.tokens_request(&prompt, None, None, at).unwrap()
        };
        let d = r.route(req).unwrap();
        assert_eq!(&d.worker, &w);
        if at == 4.0 {
            assert_eq!(d.cached_blocks, 10);
        }
    }
    assert_eq!(r.workers().named(other).unwrap().engine_block_size, Some(8));
}

/// In events mode a request in flight on a worker credits the next one with its prompt, in whole
/// engine blocks: 20 tokens in flight on both workers, engine blocks of 8 on `a` (16 tokens, 4
/// router blocks of 4) and of 4 on `b` (5 blocks), so `b` is credited more and chosen.
#[test]
fn in_flight_credit_counts_whole_engine_blocks() {
    let mut r = events_router(4, &["a", "b"]);
    r.set_engine_block_size("a", 8).unwrap();
    r.set_engine_block_size("b", 4).unwrap();
    let prompt = tokens(4, 20);
    for (w, other) in [("a", "b"), ("b", "a")] {
        let exclude = [other];
        let req = RouteRequest {
            exclude: &exclude,
            ..r.tokens_request(&prompt, None, None, 0.0).unwrap()
        };
        let d = r.route(req).unwrap();
        assert_eq!(&*d.worker, w);
        r.begin(&d).unwrap();
    }
    let next = r.route_tokens(&prompt, None, None, 0.0).unwrap();
    let cost = |name: &str| next.scores().find(|(n, _)| &***n == name).unwrap().1;
    assert_eq!(
        (&*next.worker, next.cached_blocks, next.inflight_blocks),
        ("b", 0, 5)
    );
    assert!(cost("a") > cost("b"), "{} vs {}", cost("a"), cost("b"));
}

/// vLLM and SGLang compute at least a prompt's last token, so a prompt held whole is served up
/// to its last whole engine block before that token: 256 tokens in engine blocks of 64 → 192
/// tokens (12 router blocks of 16), not 240.
#[test]
fn the_last_token_is_computed_in_whole_engine_blocks() {
    let config = Config {
        block_size: 16,
        mode: IndexMode::Events,
        profile: crate::blocks::Profile::Sglang,
        ..Config::default()
    };
    let mut r = Router::new([("a", 1.0)], config).unwrap();
    let mut applier = r.new_event_applier().unwrap();
    let prompt = tokens(5, 256);
    applier.apply("a", &stored(&prompt, 64, 1, "GPU")).unwrap();
    let d = r.route_tokens(&prompt, None, None, 0.0).unwrap();
    assert_eq!((d.cached_blocks, d.matched_blocks), (12, 16));
}

#[test]
fn an_engine_block_size_is_refused_for_an_unknown_worker_or_out_of_range() {
    let mut r = events_router(4, &["a"]);
    assert!(matches!(
        r.set_engine_block_size("nope", 8),
        Err(Error::Key(m)) if m.contains("nope")
    ));
    for bad in [0, u64::from(u32::MAX) + 1] {
        let err = r.set_engine_block_size("a", bad).unwrap_err().to_string();
        assert!(
            err.contains(&bad.to_string()) && err.contains("\"a\""),
            "{err}"
        );
    }
    assert_eq!(r.engine_block_size("a").unwrap(), None);
    assert!(r.engine_block_size("nope").is_err());
    r.set_engine_block_size("a", u64::from(u32::MAX)).unwrap();
    assert_eq!(r.engine_block_size("a").unwrap(), Some(u32::MAX));
}

/// `EngineBlockSizes` (the applier → router channel): a size is never 0 (an event claiming 0
/// tokens, or more than `u32::MAX`, leaves the last real size), and its version moves exactly
/// when a size changes (a reader re-reads only then).
#[test]
fn engine_block_sizes_change_only_on_a_new_nonzero_size() {
    let sizes = crate::events::EngineBlockSizes::default();
    let v0 = sizes.version();
    sizes.set("a", 64);
    let v1 = sizes.version();
    assert!(v1 != v0);
    sizes.set("a", 0);
    sizes.set("a", 64);
    assert_eq!((sizes.get("a"), sizes.version()), (Some(64), v1));
    sizes.set("a", 32);
    assert_eq!(sizes.get("a"), Some(32));
    assert!(sizes.version() != v1);
    assert_eq!(sizes.get("b"), None);
    sizes.set("b", 0);
    assert_eq!(sizes.get("b"), None);
    // Forgetting a size is a change; forgetting one not known is not.
    sizes.set("b", 8);
    let v2 = sizes.version();
    sizes.forget("a");
    assert_eq!((sizes.get("a"), sizes.get("b")), (None, Some(8)));
    let v3 = sizes.version();
    assert!(v3 != v2);
    sizes.forget("a");
    sizes.forget("zz");
    assert_eq!(sizes.version(), v3);
}

/// An engine's block size is the largest of its GPU stores since it was last cleared: a store
/// in another tier (a KV connector's CPU or storage blocks, of their own size) or a vLLM 0.33
/// partial-window entry (its `block_size` the window's length) changes neither the size nor the
/// prediction; a GPU store without a medium counts as GPU; after a clear (a restart, a gap) the
/// next GPU store names the size again, smaller or not.
#[test]
fn the_engine_block_size_comes_from_whole_gpu_stores_only() {
    let mut r = events_router(16, &["a"]);
    let mut applier = r.new_event_applier().unwrap();
    let prompt = tokens(6, 128);
    let size = |r: &Router, applier: &crate::events::Applier| {
        let counted = applier.counters("a").map(|c| c.engine_block_size);
        (r.engine_block_size("a").unwrap(), counted)
    };
    applier
        .apply("a", &stored(&prompt[..112], 16, 1, ""))
        .unwrap();
    assert_eq!(size(&r, &applier), (Some(16), Some(16)));
    applier.apply("a", &stored(&prompt, 64, 50, "GPU")).unwrap();
    assert_eq!(size(&r, &applier), (Some(64), Some(64)));
    for medium in ["CPU", "STORAGE", "CPU_PINNED"] {
        applier
            .apply("a", &stored(&prompt, 128, 200, medium))
            .unwrap();
        applier
            .apply("a", &stored(&prompt, 16, 300, medium))
            .unwrap();
    }
    applier
        .apply("a", &stored(&prompt[..32], 32, 400, "GPU"))
        .unwrap(); // a partial window
    assert_eq!(size(&r, &applier), (Some(64), Some(64)));
    // 100 tokens shared: one whole 64-token block on the GPU (4 router blocks), not 96 tokens.
    let d = r
        .route_tokens(&diverging(&prompt[..100], 28), None, None, 0.0)
        .unwrap();
    assert_eq!(d.cached_blocks, 4);
    applier.clear_worker("a");
    assert_eq!(size(&r, &applier), (Some(64), Some(0))); // until the next store names it
    applier
        .apply("a", &stored(&prompt, 16, 500, "GPU"))
        .unwrap();
    assert_eq!(size(&r, &applier), (Some(16), Some(16)));
}
