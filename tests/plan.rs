//! The planner's memory model against the allocator: each rank's predicted peak (a metered run
//! of the same task lists) equals what a real run measures, for every scheme.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use gems::backend::meter::ConvWorkspace;
use gems::backend::DeviceKind;
use gems::plan::Layout;
use gems::schemes::{Kind, Order, Scheme};
use gems::{models, Dataset, Graph, MemoryStats, RunConfig, Session, TrainConfig};

/// A run on its model: what the planner's entry points take.
#[derive(Clone, Debug)]
struct Run {
    g: Arc<Graph>,
    c: RunConfig,
}

impl Deref for Run {
    type Target = RunConfig;
    fn deref(&self) -> &RunConfig {
        &self.c
    }
}

impl DerefMut for Run {
    fn deref_mut(&mut self) -> &mut RunConfig {
        &mut self.c
    }
}

/// The planner's exact answers (`gems::fit`) on a [`Run`].
mod memory {
    use super::Run;
    use gems::{fit, MemoryStats, Result};

    pub fn per_rank(r: &Run) -> Result<Vec<MemoryStats>> {
        fit::per_rank(&r.g, &r.c)
    }
    pub fn per_task(r: &Run) -> Result<Vec<Vec<gems::memory::Held>>> {
        fit::per_task(&r.g, &r.c)
    }
    pub fn fits(r: &Run, cap: u64) -> Result<bool> {
        fit::fits(&r.g, &r.c, cap)
    }
    pub fn largest_batch(r: &Run, cap: u64, limit: usize) -> Result<usize> {
        fit::largest_batch(&r.g, &r.c, cap, limit)
    }
    pub fn check_fits(r: &Run) -> Result<()> {
        fit::check_fits(&r.g, &r.c)
    }
    pub fn choose_replicas(r: &Run, cap: u64) -> Result<Run> {
        let c = fit::choose_replicas(&r.g, &r.c, cap)?;
        Ok(Run { g: r.g.clone(), c })
    }
    pub fn choose_split(r: &Run, cap: u64) -> Result<Run> {
        let c = fit::choose_split(&r.g, &r.c, cap)?;
        Ok(Run { g: r.g.clone(), c })
    }
}

/// What each rank measured over a real run of `r`'s steps: its memory and the last step's
/// timeline.
struct Measured {
    memory: MemoryStats,
    timeline: Vec<gems::schemes::schedule::Timed>,
    held: Vec<gems::memory::Held>,
}

fn run_local(r: &Run) -> gems::Result<Vec<Measured>> {
    let data = Dataset::synthetic(r.g.image_size(), r.g.classes(), r.c.train.seed);
    let mut s = Session::new(&r.g, r.c.clone(), data)?;
    let mut last = None;
    for _ in 0..r.c.train.steps {
        last = Some(s.step()?);
    }
    let last = last.expect("at least one step");
    Ok(last
        .ranks
        .into_iter()
        .map(|k| Measured {
            memory: k.memory,
            timeline: k.timeline,
            held: k.held,
        })
        .collect())
}

fn layout_of(r: &Run) -> Layout {
    Layout::new(&r.g, &r.c).unwrap()
}

fn config(
    model: &str,
    image: usize,
    batch: usize,
    scheme: Scheme,
    max_in_flight: Option<usize>,
) -> Run {
    let mut c = RunConfig::new(
        TrainConfig {
            seed: 5,
            ..TrainConfig::new(batch, 2)
        },
        scheme,
    );
    c.max_in_flight = max_in_flight;
    let g = Arc::new(models::build(model, image, 4).unwrap());
    Run { g, c }
}

#[test]
fn predicted_peak_per_rank_matches_the_allocator() {
    let cases = [
        (Scheme::new(Kind::Single, 1, 1, 1, 1, Order::GPipe), None),
        (Scheme::new(Kind::Single, 1, 2, 1, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mp, 3, 3, 1, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mp, 3, 3, 1, 1, Order::OneFOneB), None),
        (Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe), Some(2)),
        (Scheme::new(Kind::Mast, 3, 1, 2, 1, Order::GPipe), None),
        (Scheme::new(Kind::Master, 2, 1, 4, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe), None),
    ];
    for (model, image) in [("resnet20v2", 32), ("amoebanet_d_3x8", 64)] {
        for (s, bound) in cases {
            let c = config(model, image, 2 * s.parts, s, bound);
            let predicted = memory::per_rank(&c).unwrap();
            let measured: Vec<_> = run_local(&c)
                .unwrap()
                .into_iter()
                .map(|r| r.memory)
                .collect();
            for (rank, (p, m)) in predicted.iter().zip(&measured).enumerate() {
                let ratio = p.peak as f64 / m.peak as f64;
                assert!(
                    (0.95..=1.05).contains(&ratio),
                    "{model} {s:?} bound {bound:?} rank {rank}: predicted {} vs measured {}",
                    p.peak,
                    m.peak
                );
                assert_eq!(
                    p.at_peak, m.at_peak,
                    "{model} {s:?} rank {rank}: by category"
                );
            }
        }
    }
}

#[test]
fn replicas_auto_follows_the_memory_mast_needs() {
    let mast = config(
        "resnet20v2",
        32,
        4,
        Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe),
        None,
    );
    // The least capacity a variant fits, over the splits a capacity makes the partitioner
    // choose.
    let least = |r: &Run| {
        let uncapped = memory::per_rank(r).unwrap().iter().map(|m| m.peak).max();
        let (mut lo, mut hi) = (0, uncapped.unwrap());
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            match memory::fits(r, mid).unwrap() {
                true => hi = mid,
                false => lo = mid,
            }
        }
        hi
    };
    let variant = |replicas: usize, max_in_flight: Option<usize>| {
        let mut r = mast.clone();
        r.c.scheme.replicas = replicas;
        r.c.max_in_flight = max_in_flight;
        if replicas == 1 {
            r.c.scheme.kind = Kind::Mp;
        }
        r
    };
    let packed = least(&mast);
    let counted = least(&variant(2, Some(2)));
    let one = least(&variant(1, None));
    eprintln!("least capacity: packed pair {packed}, counted pair {counted}, one replica {one}");
    // Just enough: the pair, packed by bytes.
    let chosen = memory::choose_replicas(&mast, packed).unwrap();
    assert_eq!((chosen.scheme.replicas, chosen.max_in_flight), (2, None));
    // Just under: a variant that holds less, and whose real run fits.
    for cap in [packed - 1, one] {
        let mut chosen = memory::choose_replicas(&mast, cap).unwrap();
        assert!(
            chosen.scheme.replicas == 1 || chosen.max_in_flight.is_some(),
            "cap {cap}: {:?}",
            chosen.scheme
        );
        chosen.train.device_memory = Some(cap);
        memory::check_fits(&chosen).unwrap();
        run_local(&chosen).unwrap_or_else(|e| panic!("cap {cap}: the chosen plan must run: {e}"));
    }
}

#[test]
fn batch_size_max_fits_and_one_more_is_refused() {
    let mp = config(
        "resnet20v2",
        32,
        2,
        Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::OneFOneB),
        None,
    );
    let cap = 24 << 20;
    let b = memory::largest_batch(&mp, cap, 1 << 20).unwrap();
    assert!(b >= 4 && b.is_multiple_of(2), "{b}");
    let mut fits = mp.clone();
    fits.train.batch_size = b;
    fits.train.device_memory = Some(cap);
    memory::check_fits(&fits).unwrap();
    run_local(&fits).unwrap();
    let mut over = fits.clone();
    over.train.batch_size = b + 2;
    let e = memory::check_fits(&over).unwrap_err();
    assert!(
        matches!(e, gems::Error::DoesNotFit { what_fits: gems::WhatFits::Batch(fits), .. } if fits == b),
        "{e}"
    );
    assert!(e.to_string().contains("the plan does not fit"), "{e}");
}

#[test]
fn simulated_weak_scaling_and_the_mast_gain() {
    use gems::plan::simulate::{self, Profile};
    let c = config(
        "resnet110v2",
        128,
        1,
        Scheme::new(Kind::Master, 4, 1, 4, 1, Order::GPipe),
        None,
    );
    for profile in [Profile::V100_IB, Profile::H100_NVLINK_IB] {
        let points = simulate::weak_scaling(&c.g, &c.c, &profile, 1024).unwrap();
        assert_eq!(points.len(), 9); // 4, 8, …, 1024 GPUs
        assert_eq!(points.last().unwrap().gpus, 1024);
        let eff: Vec<f64> = points
            .iter()
            .map(|p| p.images_per_s / (points[0].images_per_s * p.groups as f64))
            .collect();
        assert_eq!(eff[0], 1.0);
        assert!(
            eff.windows(2).all(|w| w[1] <= w[0] + 1e-12),
            "{profile}: efficiency rises: {eff:?}"
        );
        assert!(eff[8] > 0.5 && eff[8] < 1.0, "{profile}: {eff:?}");
    }
    // MAST over MP-Basic with balanced stages approaches 2× (two samples in P(f+b) instead of
    // 2P(f+b)), less the imbalance of real stage costs.
    for p in [2, 4, 8] {
        let mast = config(
            "resnet110v2",
            128,
            1,
            Scheme::new(Kind::Mast, p, 1, 2, 1, Order::GPipe),
            None,
        );
        let mp = config(
            "resnet110v2",
            128,
            1,
            Scheme::new(Kind::Mp, p, 1, 1, 1, Order::GPipe),
            None,
        );
        let rate = |c: &Run| {
            simulate::step(c, &layout_of(c), &Profile::V100_IB, 1)
                .unwrap()
                .images_per_s
        };
        let gain = rate(&mast) / rate(&mp);
        assert!(
            gain > 1.5 && gain <= 2.0 + 1e-9,
            "P = {p}: MAST gain {gain}"
        );
    }
}

/// A predicted step counts each stage's REDUCE as the all-reduce of its gradients over its
/// holders (two data-parallel groups here, MAST's mirrored pair) and each rank's STEP as the
/// optimizer over its copies' share of the parameters, once: the step ends with the last STEP.
#[test]
fn reductions_and_steps_cost_the_all_reduce_and_the_optimizer_once() {
    use gems::plan::cost::{reduce_costs, Link};
    use gems::schemes::schedule::{Pass, Task};
    for scheme in [
        Scheme::new(Kind::Mp, 2, 2, 1, 2, Order::OneFOneB),
        Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe),
    ] {
        let r = config("resnet20v2", 32, 4, scheme, None);
        let layout = layout_of(&r);
        let stages = &layout.partition.stages;
        let dtype = r.train.dtype;
        let want = reduce_costs(&r.g, &scheme, stages, dtype, scheme.dp, &Link::CPU);
        let total = r.g.params.len() as f64;
        for (rank, tasks) in layout.schedule.ranks.iter().enumerate() {
            let seconds = |task: Task| {
                let t = tasks.iter().find(|t| t.task == task).unwrap();
                t.end - t.start
            };
            for s in scheme.holds(rank) {
                assert!(want[s] > 0.0);
                let got = seconds(Task::reduce(s));
                assert!((got - want[s]).abs() <= 1e-9 * want[s], "{scheme:?}: {got}");
            }
            // Each copy's parameters: MAST's ranks hold two.
            let held: usize = (0..scheme.replicas)
                .flat_map(|replica| scheme.stages_at(replica, rank))
                .map(|s| layout.param_ids(s).len())
                .sum();
            let step = seconds(Task::step());
            let share = layout.optimizer * held as f64 / total;
            assert!(
                (step - share).abs() <= 1e-9 * share,
                "{step} against {share}"
            );
            assert_eq!(tasks.last().unwrap().task.pass, Pass::Step);
        }
        assert_eq!(layout.predicted_step(false), layout.schedule.makespan());
    }
}

#[test]
fn timeline_svg_is_valid_and_shows_every_task() {
    use gems::plan::timeline;
    let c = config(
        "resnet20v2",
        32,
        4,
        Scheme::new(Kind::Mast, 3, 2, 2, 1, Order::GPipe),
        None,
    );
    let layout = layout_of(&c);
    let tasks = &layout.schedule.ranks;
    let held = memory::per_task(&c).unwrap();
    let svg = timeline::svg("mast <P=3> & more", tasks, &timeline::curve(tasks, &held));
    let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
    let boxes = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("task"))
        .count();
    let computed = tasks.iter().flatten().filter(|t| t.task.pass.computes());
    assert_eq!(boxes, computed.count());
    assert_eq!(boxes, 3 * 2 * 2 * 2); // stages · replicas · micro-batches · (F, B)
                                      // Every message between two stages: a send posted, and its receive.
    let sends = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("send"))
        .count();
    assert_eq!(sends, 2 * 2 * 2 * 2); // boundaries · replicas · micro-batches · (F, B)
    let curves = doc.descendants().filter(|n| n.has_tag_name("path")).count();
    assert_eq!(curves, 3, "one memory curve per rank");
    // Each rank's REDUCEs (MAST: both stages it holds) and its STEP, boxes of their own.
    let count = |class| {
        (doc.descendants())
            .filter(|n| n.attribute("class") == Some(class))
            .count()
    };
    assert_eq!((count("reduce"), count("step")), (3 * 2 - 1, 3)); // the middle holds 1 stage
    assert!([
        "F forward",
        "B/BW backward",
        "W weight gradients",
        "RECV waiting",
        "SEND posted",
        "REDUCE gradient sums",
        "STEP optimizer"
    ]
    .iter()
    .all(|l| svg.contains(l)));
    // A zero-bubble schedule draws its W passes apart from its B passes.
    let zb = config(
        "resnet20v2",
        32,
        4,
        Scheme::new(Kind::Mp, 3, 4, 1, 1, Order::ZbH1),
        None,
    );
    let ranks = &layout_of(&zb).schedule.ranks;
    let curve = timeline::curve(ranks, &memory::per_task(&zb).unwrap());
    let svg = timeline::svg("zbh1", ranks, &curve);
    let faded = roxmltree::Document::parse(&svg)
        .unwrap()
        .descendants()
        .filter(|n| {
            n.attribute("class") == Some("task") && n.attribute("fill-opacity") == Some("0.45")
        })
        .count();
    assert_eq!(faded, 3 * 4, "a W per stage and micro-batch");
    // The measured timeline of a real run draws the same way.
    let reports = run_local(&c).unwrap();
    let measured: Vec<_> = reports.iter().map(|r| r.timeline.clone()).collect();
    let held: Vec<_> = reports.iter().map(|r| r.held.clone()).collect();
    assert!(measured.iter().flatten().all(|t| t.start <= t.end));
    let svg = timeline::svg("measured", &measured, &timeline::curve(&measured, &held));
    let doc = roxmltree::Document::parse(&svg).unwrap();
    assert_eq!(
        doc.descendants()
            .filter(|n| n.attribute("class") == Some("task"))
            .count(),
        boxes
    );
}

/// The timeline's memory curve is the metered run's device bytes task by task: the same as a
/// real run's, task for task, whatever tiles, offloads or recomputes; its top is the rank's
/// metered peak; a rank of a 2x2 grid holds a fraction of what the whole image's rank holds.
#[test]
fn the_timeline_memory_is_the_metered_bytes_under_tiling_and_offload() {
    use gems::graph::policy::{Keep, SavePolicy};
    let top = |held: &[gems::memory::Held]| held.iter().map(|h| h.peak).max().unwrap();
    let mp = Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::OneFOneB);
    let plain = config("resnet20v2", 64, 4, mp, None);
    let tiled = config("resnet20v2", 64, 4, mp.with_spatial(grid(2, 2)), None);
    let mut offloaded = plain.clone();
    let n = offloaded.g.nodes.len();
    offloaded.train.saves = SavePolicy::all(n, Keep::Host, 2);
    let mut recomputed = plain.clone();
    recomputed.train.saves = SavePolicy::checkpointed(n);
    let mut tops = Vec::new();
    for (name, r) in [
        ("plain", &plain),
        ("2x2 tiles", &tiled),
        ("offloaded", &offloaded),
        ("recomputed", &recomputed),
    ] {
        let metered = memory::per_task(r).unwrap();
        let peaks = memory::per_rank(r).unwrap();
        let real = run_local(r).unwrap();
        for (p, held) in metered.iter().enumerate() {
            let first = r.scheme.first_rank(p);
            assert_eq!(held, &real[first].held, "{name}, position {p}");
            assert_eq!(top(held), peaks[first].peak, "{name}, position {p}");
        }
        tops.push(top(&metered[0]));
    }
    let [plain, tiled, offloaded, recomputed] = tops[..] else {
        unreachable!()
    };
    eprintln!(
        "first stage's peak: {plain} whole, {tiled} on a 2x2 tile, {offloaded} offloaded, {recomputed} recomputed"
    );
    assert!(2 * tiled < plain, "{tiled} of {plain}");
    assert!(offloaded < plain && recomputed < plain);
}

#[test]
fn split_auto_picks_the_fewest_stages_that_fit() {
    let single = config(
        "resnet20v2",
        32,
        16,
        Scheme::new(Kind::Single, 1, 1, 1, 1, Order::GPipe),
        None,
    );
    let need = memory::per_rank(&single).unwrap()[0].peak;
    let cap = need * 2 / 3;
    let mut chosen = memory::choose_split(&single, cap).unwrap();
    let p = chosen.scheme.stages;
    assert!(
        p >= 2 && chosen.scheme.kind == Kind::Mp,
        "{:?}",
        chosen.scheme
    );
    // The split the capacity chose, as a balance list the run takes as it is.
    let balance = chosen.balance.clone().expect("the chosen split");
    assert_eq!(balance.len(), p, "{balance:?}");
    let mut fewer = chosen.clone();
    fewer.balance = None;
    fewer.scheme.stages = p - 1;
    if p - 1 == 1 {
        fewer.scheme.kind = Kind::Single;
    }
    assert!(
        !memory::fits(&fewer, cap).unwrap(),
        "{} stages would have fit",
        p - 1
    );
    chosen.train.device_memory = Some(cap);
    run_local(&chosen).unwrap();
    // A capacity nothing fits is refused with the rank and the excess.
    let e = memory::choose_split(&single, 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the plan does not fit: rank"), "{e}");
}

/// The analytic model the partitioner searches with, against the metered run, rank by rank,
/// with the moments of the run's own schedule: within 0.01% for every scheme (exact in all of
/// these cases).
#[test]
fn analytic_memory_matches_the_metered_run() {
    use gems::plan::footprint::{self, Footprint, StageMemory};
    let cases = [
        (Scheme::new(Kind::Mp, 4, 4, 1, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mp, 4, 4, 1, 1, Order::OneFOneB), None),
        (Scheme::new(Kind::Mast, 4, 2, 2, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mast, 4, 2, 2, 1, Order::GPipe), Some(2)),
        (Scheme::new(Kind::Mast, 3, 3, 2, 1, Order::OneFOneB), None),
        (Scheme::new(Kind::Master, 4, 2, 4, 1, Order::GPipe), None),
        (Scheme::new(Kind::Mast, 2, 2, 2, 2, Order::GPipe), None),
    ];
    let mut worst: f64 = 0.0;
    // A GPU run's plan reserves the native CUDA kernels' workspace instead of the CPU's.
    let gpu = DeviceKind::Cuda { ordinal: 0 };
    for (model, image, device) in [
        ("resnet56v2", 64, DeviceKind::Cpu),
        ("amoebanet_d_3x8", 64, DeviceKind::Cpu),
        // Group norm's per-sample statistics, kept in the compute type.
        ("resnet50_gn", 32, DeviceKind::Cpu),
        ("resnet56v2", 64, gpu),
    ] {
        for (s, bound) in cases {
            let mut c = config(model, image, 2 * s.parts, s, bound);
            c.train.device = device;
            let layout = layout_of(&c);
            let workspace = ConvWorkspace::of(device);
            let fp = Footprint::new(
                &layout.graph,
                2,
                c.train.dtype,
                c.train.activations(),
                workspace,
            )
            .unwrap();
            let stages: Vec<_> = layout
                .partition
                .stages
                .iter()
                .map(|r| fp.stage(r.clone()))
                .collect();
            let moments = footprint::moments(&layout.schedule);
            let predicted = footprint::rank_bytes(&s, &moments, &stages);
            let metered = memory::per_rank(&c).unwrap();
            for (rank, m) in metered.iter().enumerate() {
                let p = predicted[rank % s.stages];
                let error = p as f64 / m.peak as f64 - 1.0;
                assert!(
                    error.abs() <= 1e-4,
                    "{model} {s:?} bound {bound:?} rank {rank}: analytic {p} vs metered {}",
                    m.peak
                );
                worst = worst.max(error.abs());
            }
        }
    }
    eprintln!("analytic vs metered: worst {:.4}%", 100.0 * worst);
}

/// Under a capacity that the split balanced by cost alone exceeds, the split chosen fits (by
/// the metered run, and really runs) and is the fastest that fits: no split into three stages
/// (all of them tried, each with the analytic model under its own schedule, which matches the
/// metered run exactly as above) has a faster slowest stage and fits. A capacity nothing fits
/// is refused with the rank, the excess and what would fit.
#[test]
fn capped_split_fits_and_is_the_fastest_that_does() {
    use gems::plan::cuts;
    use gems::plan::footprint::{self, Footprint, StageMemory};
    use gems::schemes::schedule;
    let need = |c: &Run| {
        memory::per_rank(c)
            .unwrap()
            .iter()
            .map(|m| m.peak)
            .max()
            .unwrap()
    };
    // MAST first absorbs a cap by admitting fewer of the second replica's micro-batches at a
    // time (by bytes); only below what that saves must the split move.
    for (s, percent) in [
        (Scheme::new(Kind::Mp, 3, 2, 1, 1, Order::OneFOneB), 90),
        (Scheme::new(Kind::Mast, 3, 2, 2, 1, Order::GPipe), 75),
    ] {
        let free = config("resnet20v2", 32, 4, s, None);
        let cap = need(&free) * percent / 100;
        let mut capped = free.clone();
        capped.train.device_memory = Some(cap);
        assert!(need(&capped) <= cap, "{s:?}: the chosen split must fit");
        run_local(&capped).unwrap();
        let layout = layout_of(&capped);
        let costs = layout.costs.total();
        let slowest = |stages: &[std::ops::Range<usize>]| {
            stages
                .iter()
                .map(|r| costs[r.clone()].iter().sum::<f64>())
                .fold(0.0, f64::max)
        };
        let fp = Footprint::new(
            &layout.graph,
            2,
            capped.train.dtype,
            capped.train.activations(),
            ConvWorkspace::Cpu,
        )
        .unwrap();
        let cuts = cuts::cut_points(&layout.graph);
        let n = layout.graph.nodes.len();
        let mut fastest = f64::INFINITY;
        for (i, &a) in cuts.iter().enumerate() {
            for &b in &cuts[i + 1..] {
                let stages = [0..a, a..b, b..n];
                let bytes: Vec<_> = stages.iter().map(|r| fp.stage(r.clone())).collect();
                // Each split with its own schedule, MAST's replicas packed by its own bytes.
                let admission = capped.c.admission(Some(&bytes));
                let sched =
                    schedule::build(&s, &layout.costs.stage_costs(&stages), &admission).unwrap();
                let ranks = footprint::rank_bytes(&s, &footprint::moments(&sched), &bytes);
                if ranks.iter().all(|&r| r <= cap) {
                    fastest = fastest.min(slowest(&stages));
                }
            }
        }
        let chosen = slowest(&layout.partition.stages);
        let balanced = slowest(&layout_of(&free).partition.stages);
        assert!(chosen > balanced, "{s:?}: the cap must cost speed");
        assert_eq!(chosen, fastest, "{s:?}");
        eprintln!(
            "{:?}: {percent}% of the memory, slowest stage {:.3} ms vs {:.3} ms balanced by cost alone",
            s.kind,
            1e3 * chosen,
            1e3 * balanced
        );
    }
    // Nothing fits two stages even at one image per micro-batch: the refusal names the rank,
    // the excess, and the fewest stages that fit, which do.
    let two = config(
        "resnet56v2",
        64,
        2,
        Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe),
        None,
    );
    let cap = memory::per_rank(&two)
        .unwrap()
        .iter()
        .map(|m| m.peak)
        .max()
        .unwrap()
        * 3
        / 5;
    let mut tight = two.clone();
    tight.train.device_memory = Some(cap);
    let e = memory::check_fits(&tight).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("the plan does not fit: rank")
            && text.contains("that needs least still needs"),
        "{text}"
    );
    let gems::Error::DoesNotFit {
        what_fits: gems::WhatFits::Stages(p),
        ..
    } = e
    else {
        panic!("no stages that fit in {text}")
    };
    let mut more = tight.clone();
    more.scheme.stages = p;
    memory::check_fits(&more).unwrap();
    more.scheme.stages = p - 1;
    assert!(!memory::fits(&more, cap).unwrap(), "{} stages fit", p - 1);
}

fn grid(rows: usize, cols: usize) -> gems::ops::tiles::Grid {
    gems::ops::tiles::Grid { rows, cols }
}

/// The most any rank of `r` needs, by its metered run.
fn fullest(r: &Run) -> u64 {
    memory::per_rank(r)
        .unwrap()
        .iter()
        .map(|m| m.peak)
        .max()
        .unwrap()
}

/// With 2x2 tiles on the first of two stages, the partitioner gives that stage the work and
/// memory its four ranks share: more nodes than without tiles, a faster predicted step, and
/// under a cap a larger batch than the split that ignores the tiles.
#[test]
fn partitioner_gives_the_tiled_stage_its_share() {
    let mp = Scheme::new(Kind::Mp, 2, 1, 1, 1, Order::GPipe);
    let plain = config("resnet56v2", 64, 2, mp, None);
    let tiled = config("resnet56v2", 64, 2, mp.with_spatial(grid(2, 2)), None);
    let (one, four) = (layout_of(&plain), layout_of(&tiled));
    let first = |l: &Layout| l.partition.stages[0].len();
    assert!(
        first(&four) > first(&one) * 3 / 2,
        "stage 0: {} nodes on 2x2 tiles vs {} on one rank",
        first(&four),
        first(&one)
    );
    // The split that ignores the tiles, given explicitly.
    let mut blind = tiled.clone();
    blind.balance = Some(one.partition.balance(&one.graph));
    let step = |r: &Run| layout_of(r).predicted_step(false);
    assert!(
        step(&tiled) < 0.8 * step(&blind),
        "{} vs {}",
        step(&tiled),
        step(&blind)
    );
    // A cap the blind split just holds at B = 2: the tile-aware one holds more images.
    let cap = fullest(&blind);
    let mut capped = tiled.clone();
    capped.train.device_memory = Some(cap);
    let (aware, ignoring) = (
        memory::largest_batch(&capped, cap, 64).unwrap(),
        memory::largest_batch(&blind, cap, 64).unwrap(),
    );
    assert!(
        aware > ignoring,
        "B {aware} vs {ignoring} ignoring the tiles"
    );
    eprintln!(
        "2x2 + mp on 2 stages: stage 0 {} vs {} nodes, step {:.4} vs {:.4} s, largest B {aware} vs {ignoring}",
        first(&four),
        first(&one),
        step(&tiled),
        step(&blind)
    );
}

/// Halo exchanges follow each op's geometry: none without tiles, exactly one column from one
/// neighbour for a 3x3 convolution on 1x2 tiles, none for a strided 1x1 convolution (its
/// windows read only rows a tile owns); over a whole model, more for finer grids, and the
/// statistics' sums cost more hops too.
#[test]
fn halo_cost_follows_the_ops_geometry_and_grows_with_the_grid() {
    use gems::ops::Op;
    use gems::plan::cost::{Exchange, Link};
    use gems::tensor::DType;
    let g = models::build("resnet20v2", 64, 4).unwrap();
    let link = Link::CPU;
    let (micro, f32) = (2, DType::F32);
    let of = |rows, cols| Exchange::new(&g, grid(rows, cols), micro, f32, &link);
    let none = of(1, 1);
    let n = g.nodes.len();
    assert_eq!(none.halo_in(0..n) + none.sums_in(0..n), 0.0);
    let halves = of(1, 2);
    let conv = |k, s| {
        g.nodes
            .iter()
            .position(|node| {
                matches!(&node.op, Op::Conv2d(c) if c.kernel == (k, k) && c.stride == (s, s))
            })
            .unwrap()
    };
    let (c3, c1) = (conv(3, 1), conv(1, 2));
    let d = g.values[g.nodes[c3].inputs[0]].shape.dims().to_vec();
    let column = (d[0] * d[1] * micro * f32.size()) as f64;
    assert_eq!(halves.halo[c3], link.send(1, column), "{:?}", d);
    assert_eq!(halves.halo[c1], 0.0);
    let (halo, sums): (Vec<f64>, Vec<f64>) = [(1, 2), (2, 2), (4, 4)]
        .into_iter()
        .map(|(r, c)| {
            let e = of(r, c);
            (e.halo_in(0..n), e.sums_in(0..n))
        })
        .unzip();
    assert!(
        halo[0] > 0.0 && halo[0] < halo[1] && halo[1] < halo[2],
        "{halo:?}"
    );
    assert!(
        sums[0] > 0.0 && sums[0] < sums[1] && sums[1] < sums[2],
        "{sums:?}"
    );
    // A tile rank of a planned run spends its share of the compute and the exchanges, and
    // the first stage makes the micro-batch.
    let r = config(
        "resnet20v2",
        64,
        micro,
        Scheme::single(1).with_spatial(grid(2, 2)),
        None,
    );
    let layout = layout_of(&r);
    let share: f64 = (layout.costs.total().iter().enumerate())
        .map(
            |(i, t)| match gems::graph::runs_on_tiles(&g, grid(2, 2), i) {
                true => t / 4.0,
                false => *t,
            },
        )
        .sum();
    let (halo, sums) = layout.tiles.exchanges(&layout.partition.stages);
    let busy = layout.schedule.busy()[0];
    assert!(halo > 0.0 && sums > 0.0);
    let data = layout.costs.data;
    assert!(
        (busy - (share + halo + sums + data)).abs() < 1e-9 * busy,
        "busy {busy} vs share {share} + halo {halo} + sums {sums} + data {data}"
    );
}

/// `--spatial auto` weighs predicted steps: where local ranks share the CPU more tiles only add
/// halo exchanges and sums, so the fewest that fit win; on separate devices the compute a
/// tile rank sheds outweighs them here, and a finer grid that fits wins.
#[test]
fn spatial_auto_takes_the_fastest_grid_that_fits() {
    use gems::fit;
    let single = config("resnet20v2", 64, 8, Scheme::single(1), None);
    let cap = fullest(&single) * 3 / 4;
    let choose = |r: &Run| fit::choose_spatial(&r.g, &r.c, cap).unwrap().scheme.spatial;
    let with = |r: &Run, g| {
        let mut t = r.clone();
        t.scheme.spatial = g;
        t.train.device_memory = Some(cap);
        t
    };
    assert!(!memory::fits(&single, cap).unwrap());
    assert!(memory::fits(&with(&single, grid(1, 2)), cap).unwrap());
    assert_eq!(choose(&single), grid(1, 2));
    let shared = |r: &Run| layout_of(r).predicted_step(true);
    assert!(
        shared(&with(&single, grid(1, 2))) < shared(&with(&single, grid(2, 2))),
        "more tiles on one CPU must cost more"
    );
    let mut gpus = single.clone();
    gpus.train.device = DeviceKind::Cuda { ordinal: 0 };
    let cap = fullest(&gpus) * 3 / 4;
    let chosen = fit::choose_spatial(&gpus.g, &gpus.c, cap).unwrap();
    let tiles = chosen.scheme.spatial.tiles();
    assert!(tiles > 2, "{}", chosen.scheme.spatial);
    let step = |r: &Run| layout_of(r).predicted_step(false);
    let chosen_run = with(&gpus, chosen.scheme.spatial);
    assert!(step(&chosen_run) < step(&with(&gpus, grid(1, 2))));
    assert!(memory::fits(&chosen_run, cap).unwrap());
    // Even 8x8 tiles cannot hold a cap below the weights: the refusal names the rank.
    let e = fit::choose_spatial(&single.g, &single.c, 1 << 16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not fit"), "{e}");
}

/// A U-Net's decoder runs on tiles, the loss too: on a 2x2 grid at 1024² (metered, nothing
/// computed), each rank holds at most 0.28 of the activations one device holds (at most 0.25
/// with no halo and no transient buffer).
#[test]
fn unet_activations_on_2x2_tiles_are_a_quarter_and_a_halo() {
    let single = config("unet", 1024, 1, Scheme::single(1), None);
    let tiled = config(
        "unet",
        1024,
        1,
        Scheme::single(1).with_spatial(grid(2, 2)),
        None,
    );
    let activations = |r: &Run| {
        let ranks = memory::per_rank(r).unwrap();
        let most = ranks
            .iter()
            .map(|m| m.at_peak.get(gems::Category::Activations));
        most.max().unwrap() as f64
    };
    let ratio = activations(&tiled) / activations(&single);
    assert!(ratio <= 0.28, "{ratio}");
    let layout = Layout::new(&tiled.g, &tiled.c).unwrap();
    let region = layout.tiled.expect("a spatial stage");
    assert!(region.end.is_none(), "{region}");
}

/// Where a spatial stage's tiles stop is named with the op and why; a grid so fine that most
/// of the stage would run as gathered copies on every tile rank is refused before any work.
#[test]
fn tiles_say_where_they_stop_and_a_grid_too_fine_is_refused() {
    let mp = Scheme::new(Kind::Mp, 1, 1, 1, 1, Order::GPipe);
    let region = |model: &str, image: usize, g: gems::ops::tiles::Grid| {
        let c = config(model, image, 2, mp.with_spatial(g), None);
        Layout::new(&c.g, &c.c).map(|l| l.tiled.expect("a spatial stage"))
    };
    let whole = region("resnet20v2", 32, grid(2, 2)).unwrap();
    // Tiled to the global pooling; the classifier after it is whole everywhere (and tiny).
    assert!(whole.end.is_none() && whole.share > 0.999, "{whole}");
    // 2x2-pixel tiles: layer3's 8x8 maps are smaller than the grid.
    let fine = region("resnet20v2", 32, grid(16, 16)).unwrap();
    let text = fine.to_string();
    assert!(fine.too_fine() && !fine.stops_paying(), "{text}");
    assert!(
        text.contains("layer3.0") && text.contains("([256, 8, 8]) has fewer rows or columns"),
        "{text}"
    );
    // A U-Net's decoder (transposed convolutions) stays on tiles: tiled to the logits.
    let unet = region("unet_d3_w8", 64, grid(2, 2)).unwrap();
    assert!(unet.end.is_none() && unet.share > 0.999, "{unet}");
    // Bilinear resizing and dropout run on tiles; group normalization has no tile rule: it
    // ends the region, named, not the grid's fault.
    let resized = |norm: bool| {
        let shape = gems::Shape::new([3, 16, 16]);
        let (mut b, x) = gems::GraphBuilder::new("resized", "Resized", shape);
        let conv = gems::ops::conv::Conv2d::new(4, 3, 1, 1);
        let mut x = b.conv("conv1", x, conv.clone()).unwrap();
        if norm {
            x = b.group_norm("norm", x, 2).unwrap();
        }
        let x = b.dropout("drop", x, 0.2).unwrap();
        let x = b.upsample_bilinear("up", x, 2, false).unwrap();
        let x = b.conv("conv2", x, conv).unwrap();
        let g = b.finish(vec![gems::graph::Output::new(x)]).unwrap();
        let c = RunConfig::new(TrainConfig::new(2, 2), mp.with_spatial(grid(2, 2)));
        Layout::new(&g, &c).unwrap().tiled.expect("a spatial stage")
    };
    let tiled = resized(false);
    assert!(tiled.end.is_none(), "{tiled}");
    assert_eq!(tiled.to_string(), "2x2 tiles to the end of the first stage");
    let normed = resized(true);
    assert!(!normed.too_fine(), "{normed}");
    assert!(
        normed.to_string().contains("norm (groupnorm 2)"),
        "{normed}"
    );
    // Most of the work gathered on every one of 1,024 ranks: refused, naming the op.
    let e = region("resnet20v2", 32, grid(32, 32))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--spatial 32x32 stops paying on resnet20v2 at 32px") && e.contains("layer2.0"),
        "{e}"
    );
}

/// Ranks sharing the CPU: two data-parallel ranks of one stage compute at once the whole step,
/// so on two threads (where the committed fits were made at 1 and 2) each runs every pass at
/// the one-thread fit's time, `at_once` times over.
#[test]
fn two_ranks_at_once_on_two_threads_run_at_the_one_thread_fit() {
    use gems::plan::cost::{DeviceProfile, NodeCosts};
    use gems::plan::fitted;
    use gems::schemes::schedule::Pass;
    let run = config(
        "resnet20v2",
        32,
        8,
        Scheme::new(Kind::Mp, 1, 2, 1, 2, Order::GPipe),
        None,
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let layout = pool.install(|| layout_of(&run));
    let one = NodeCosts::fitted(
        &layout.graph,
        run.micro_batch(),
        run.train.activations(),
        fitted::cpu_for(1),
        &DeviceProfile::CPU,
    )
    .stage_costs(&layout.partition.stages);
    let passes = |rank: &[gems::schemes::schedule::Timed]| -> f64 {
        (rank.iter())
            .filter(|t| matches!(t.task.pass, Pass::Forward | Pass::Backward))
            .map(|t| t.end - t.start)
            .sum()
    };
    let expected = 2.0 * (one.forward[0] + one.backward[0]) * fitted::cpu_for(2).at_once;
    let shared = passes(&layout.shared.ranks[0]);
    assert!(
        (shared - expected).abs() < 1e-9 * expected,
        "{shared} s of passes against {expected} s"
    );
    // Alone on the two threads, the same passes cost the two-thread fit's time.
    let alone = passes(&layout.schedule.ranks[0]);
    assert!(alone < shared, "{alone} s alone against {shared} s at once");
}
