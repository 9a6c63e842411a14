//! Offload and recompute on the CPU, where the host tier is a second allocator and copies are
//! memory copies: results do not change by a bit, device memory falls exactly as the metered
//! plan says, the planner's choice fits a tight cap, and a full host tier is a clear error.

use gems::backend::CopyMode;
use gems::fit::{choose_offload, per_rank};
use gems::graph::policy::{Keep, SavePolicy};
use gems::plan::offload::HostLink;
use gems::schemes::{Kind, Order, Scheme};
use gems::{models, Dataset, Graph, RunConfig, Session, TrainConfig};

fn config(saves: SavePolicy) -> TrainConfig {
    TrainConfig {
        saves,
        ..TrainConfig::new(8, 3)
    }
}

fn graph() -> Graph {
    models::build("resnet20v2", 32, 10).unwrap()
}

fn nodes() -> usize {
    graph().nodes.len()
}

/// resnet20v2 on synthetic data under `scheme`.
fn session(c: TrainConfig, scheme: Scheme) -> gems::Result<Session> {
    let data = Dataset::synthetic(32, 10, c.seed);
    Session::new(&graph(), RunConfig::new(c, scheme), data)
}

/// `c` on one device.
fn trainer(c: TrainConfig) -> gems::Result<Session> {
    session(c, Scheme::single(1))
}

/// Parameters (as bits) and the device and host peaks after three steps.
fn train(saves: SavePolicy) -> (Vec<Vec<u64>>, u64, u64) {
    let mut t = trainer(config(saves)).unwrap();
    for _ in 0..3 {
        t.step().unwrap();
    }
    let host = t.device_summary().unwrap().host.peak;
    (bits(&mut t), t.memory().unwrap()[0].peak, host)
}

/// The session's parameters as bits.
fn bits(t: &mut Session) -> Vec<Vec<u64>> {
    t.parameters()
        .unwrap()
        .swap_remove(0)
        .into_iter()
        .map(|(_, _, v)| v.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A random mix of the three choices.
fn mixed(seed: u64, prefetch: usize) -> SavePolicy {
    let n = nodes();
    SavePolicy {
        nodes: (0..n)
            .map(|i| match gems::core::rng::splitmix64(seed ^ i as u64) % 3 {
                0 => Keep::Device,
                1 => Keep::Host,
                _ => Keep::Recompute,
            })
            .collect(),
        prefetch,
    }
}

#[test]
fn weights_are_bit_identical_under_every_policy() {
    let n = nodes();
    let (reference, base_peak, base_host) = train(SavePolicy::keep_all());
    assert_eq!(base_host, 0);
    for (name, policy) in [
        (
            "all offloaded, fetched just in time",
            SavePolicy::all(n, Keep::Host, 0),
        ),
        ("all offloaded, 4 ahead", SavePolicy::all(n, Keep::Host, 4)),
        ("checkpointed", SavePolicy::checkpointed(n)),
        (
            "one long recomputed run",
            SavePolicy::all(n, Keep::Recompute, 0),
        ),
        ("mixed", mixed(1, 2)),
        ("mixed", mixed(2, 0)),
    ] {
        let (bits, peak, host) = train(policy.clone());
        assert!(
            bits == reference,
            "{name}: parameters differ from keeping everything"
        );
        let (_, offloaded, _) = policy.counts();
        assert_eq!(host > 0, offloaded > 0, "{name}: host tier peak {host}");
        if name.starts_with("all offloaded") || name == "checkpointed" {
            assert!(
                peak < base_peak,
                "{name}: peak {peak} not below {base_peak}"
            );
        }
    }
}

#[test]
fn every_copy_mode_gives_the_same_weights_and_pinned_blocks_are_reused() {
    let n = nodes();
    let (reference, _, _) = train(SavePolicy::keep_all());
    for mode in [
        CopyMode::Naive,
        CopyMode::Pinned,
        CopyMode::Async,
        CopyMode::PinnedAsync,
    ] {
        let mut t = trainer(TrainConfig {
            offload_copy: mode,
            ..config(SavePolicy::all(n, Keep::Host, 2))
        })
        .unwrap();
        t.step().unwrap();
        let first = t.device_summary().unwrap().pool;
        for _ in 0..2 {
            t.step().unwrap();
        }
        assert!(
            bits(&mut t) == reference,
            "{mode}: parameters differ from keeping everything"
        );
        let device = t.device_summary().unwrap();
        let pool = device.pool;
        if mode.pinned() {
            // The first step fills the pool; later steps only reuse it.
            assert!(first.allocated > 0, "{mode}: {first:?}");
            assert_eq!(
                pool.allocated, first.allocated,
                "{mode}: allocated after step 1"
            );
            assert!(pool.reused >= 2 * first.allocated, "{mode}: {pool:?}");
            assert_eq!(pool.bytes, device.host.peak, "{mode}: pool vs host peak");
        } else {
            assert_eq!(pool.allocated + pool.reused, 0, "{mode} took pinned blocks");
        }
        assert_eq!(device.host.live.total(), 0, "{mode}: host tier not empty");
    }
}

#[test]
fn fetching_further_ahead_holds_more() {
    let n = nodes();
    let peak = |ahead| train(SavePolicy::all(n, Keep::Host, ahead)).1;
    let (near, far) = (peak(0), peak(12));
    assert!(near < far, "prefetch 0: {near}, prefetch 12: {far}");
}

#[test]
fn device_peak_falls_as_the_metered_plan_predicts() {
    let n = nodes();
    for policy in [
        SavePolicy::keep_all(),
        SavePolicy::all(n, Keep::Host, 2),
        SavePolicy::checkpointed(n),
        mixed(3, 1),
    ] {
        let c = RunConfig::new(config(policy.clone()), Scheme::single(1));
        let predicted = per_rank(&graph(), &c).unwrap()[0].peak;
        let (_, measured, _) = train(policy);
        let err = (predicted as f64 - measured as f64).abs() / measured as f64;
        assert!(err <= 0.05, "predicted {predicted} measured {measured}");
    }
}

#[test]
fn auto_fits_a_cap_40_percent_below_the_baseline_and_trains() {
    let base = RunConfig::new(config(SavePolicy::keep_all()), Scheme::single(1));
    let g = graph();
    let baseline = per_rank(&g, &base).unwrap()[0].peak;
    let cap = baseline * 6 / 10;
    let chosen = choose_offload(&g, &base, cap, &HostLink::CPU, 2).unwrap();
    let (_, host, recompute) = chosen.policy.counts();
    assert!(host + recompute > 0);
    let mut c = config(chosen.policy.clone());
    c.device_memory = Some(cap);
    let mut t = trainer(c).unwrap();
    for _ in 0..3 {
        t.step().unwrap();
    }
    assert!(t.memory().unwrap()[0].peak <= cap);
    let (reference, _, _) = train(SavePolicy::keep_all());
    assert!(bits(&mut t) == reference);
    // Nothing moves when the run fits; a cap nothing can meet is refused with a reason.
    let roomy = choose_offload(&g, &base, baseline, &HostLink::CPU, 2).unwrap();
    assert_eq!(roomy.policy.counts().0, nodes());
    let err = choose_offload(&g, &base, baseline / 50, &HostLink::CPU, 2)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("even with every saved tensor"), "{err}");
}

#[test]
fn a_full_host_tier_is_a_clear_error() {
    let mut c = config(SavePolicy::all(nodes(), Keep::Host, 0));
    c.host_memory = Some(1 << 20);
    let err = trainer(c).unwrap().step().err().unwrap().to_string();
    assert!(
        err.contains("host") && err.contains("out of memory"),
        "{err}"
    );
}

#[test]
fn pipeline_stages_offload_and_recompute_with_the_same_results() {
    let run = |saves: SavePolicy| {
        let c = TrainConfig {
            saves,
            ..TrainConfig::new(4, 2)
        };
        let mut s = session(c, Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe)).unwrap();
        for _ in 0..2 {
            s.step().unwrap();
        }
        let mut params: Vec<(usize, usize, Vec<u64>)> = s
            .parameters()
            .unwrap()
            .into_iter()
            .flatten()
            .map(|(o, id, v)| (o, id, v.iter().map(|x| x.to_bits()).collect()))
            .collect();
        params.sort();
        params
    };
    let reference = run(SavePolicy::keep_all());
    assert!(run(mixed(4, 1)) == reference);
    assert!(run(SavePolicy::checkpointed(nodes())) == reference);
}
