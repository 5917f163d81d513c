//! Every name the router gives a value of its enums, in every form it gives it (`name`,
//! `Display`, `FromStr` and its refusal), against the names the Python stub publishes.

use super::*;
use crate::error::Error;

/// The Python stub (`kvroute/_core.pyi`): the names it promises are the reference.
const STUB: &str = include_str!("../../../python/kvroute/_core.pyi");

/// `names`, in order, as a `Literal[...]` list of the stub.
fn in_stub(names: &[&str]) {
    let list = names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    assert!(STUB.contains(&list), "the stub has no list {list}");
}

/// The parse of `name` refused with `message` (whole).
fn refused<T: std::str::FromStr<Err = Error> + std::fmt::Debug>(name: &str, message: String) {
    match name.parse::<T>() {
        Err(Error::Value(m)) => assert_eq!(m, message),
        other => panic!("{name:?} parsed to {other:?}"),
    }
}

/// Router 23/40: `Display for Policy` → `Ok(())` wrote nothing — no test formatted a policy
/// (the `kv_aware` name reaches logs and the Python `Router.policy` through it). The class: each
/// named enum of the router (`Policy`, `Reason`, `Role`, `Phase`, `Stage`, `Half`, `PdReason`,
/// `IndexMode`) — every value's `name`, its `Display` and `FromStr` where it has them (each name
/// parses back to its value; a name in another case, an empty one, a near one and another
/// enum's name refused with the message whole), against the stub's `Literal` lists.
#[test]
fn every_router_enum_is_named_as_the_stub_names_it() {
    let policies = [
        (Policy::Random, "random"),
        (Policy::RoundRobin, "round_robin"),
        (Policy::LeastLoaded, "least_loaded"),
        (Policy::PowerOfTwo, "power_of_two"),
        (Policy::Hash, "hash"),
        (Policy::KvAware, "kv_aware"),
    ];
    in_stub(&policies.map(|p| p.1));
    assert_eq!(Policy::ALL, policies.map(|p| p.0));
    for (p, name) in policies {
        assert_eq!((p.name(), p.to_string()), (name, name.to_string()));
        assert_eq!(name.parse::<Policy>().unwrap(), p);
    }
    for bad in ["KV_AWARE", "", "kv-aware", "prefill", "round_robin "] {
        refused::<Policy>(
            bad,
            format!(
                "policy must be one of 'random', 'round_robin', 'least_loaded', 'power_of_two', \
                 'hash', 'kv_aware', got {bad:?}"
            ),
        );
    }

    let roles = [
        (Role::Prefill, "prefill"),
        (Role::Decode, "decode"),
        (Role::Both, "both"),
    ];
    in_stub(&roles.map(|r| r.1));
    for (r, name) in roles {
        assert_eq!((r.name(), r.to_string()), (name, name.to_string()));
        assert_eq!(name.parse::<Role>().unwrap(), r);
    }
    for bad in ["Both", "", "prefil", "whole", "kv_aware"] {
        refused::<Role>(
            bad,
            format!("role must be 'prefill', 'decode' or 'both', got {bad:?}"),
        );
    }

    let phases = [(Phase::Prefill, "prefill"), (Phase::Decode, "decode")];
    in_stub(&phases.map(|p| p.1));
    assert_eq!(Phase::BOTH, phases.map(|p| p.0));
    for (p, name) in phases {
        assert_eq!(p.name(), name);
        assert_eq!(name.parse::<Phase>().unwrap(), p);
    }
    for bad in ["Decode", "", "decoder", "both"] {
        refused::<Phase>(
            bad,
            format!("phase must be 'prefill' or 'decode', got {bad:?}"),
        );
    }

    let modes = [(IndexMode::Approx, "approx"), (IndexMode::Events, "events")];
    in_stub(&modes.map(|m| m.1));
    for (m, name) in modes {
        assert_eq!(m.name(), name);
        assert_eq!(name.parse::<IndexMode>().unwrap(), m);
    }
    for bad in ["APPROX", "", "event", "exact", "hash"] {
        refused::<IndexMode>(
            bad,
            format!("index must be 'approx' or 'events', got {bad:?}"),
        );
    }

    let stages = [
        (Stage::Routed, "routed"),
        (Stage::Active, "active"),
        (Stage::Finished, "finished"),
        (Stage::Withdrawn, "withdrawn"),
    ];
    in_stub(&stages.map(|s| s.1));
    let halves = [
        (Half::Whole, "whole"),
        (Half::Prefill, "prefill"),
        (Half::Decode, "decode"),
    ];
    in_stub(&halves.map(|h| h.1));
    let pd_reasons = [
        (PdReason::Remote, "remote"),
        (PdReason::Short, "short"),
        (PdReason::Saturated, "saturated"),
        (PdReason::SameWorker, "same_worker"),
        (PdReason::NoPrefill, "no_prefill"),
    ];
    in_stub(&pd_reasons.map(|r| r.1));
    let names: Vec<&str> = stages.iter().map(|(s, _)| s.name()).collect();
    assert_eq!(names, stages.map(|s| s.1));
    let names: Vec<&str> = halves.iter().map(|(h, _)| h.name()).collect();
    assert_eq!(names, halves.map(|h| h.1));
    let names: Vec<&str> = pd_reasons.iter().map(|(r, _)| r.name()).collect();
    assert_eq!(names, pd_reasons.map(|r| r.1));

    // `Decision.reason`: the stub says "prefix / load (kv_aware), hash / hash_bounded, or the
    // policy name".
    assert!(STUB.contains("prefix / load (kv_aware), hash / hash_bounded, or the policy name"));
    let reasons = [
        (Reason::Prefix, "prefix"),
        (Reason::Load, "load"),
        (Reason::Random, "random"),
        (Reason::RoundRobin, "round_robin"),
        (Reason::LeastLoaded, "least_loaded"),
        (Reason::PowerOfTwo, "power_of_two"),
        (Reason::Hash, "hash"),
        (Reason::HashBounded, "hash_bounded"),
    ];
    for (r, name) in reasons {
        assert_eq!(r.name(), name);
    }
}
