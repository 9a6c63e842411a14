//! `gems plan`, `gems simulate` and `gems calibrate`: questions about a run answered without
//! training it.

use std::time::Instant;

use gems::fit;
use gems::graph::policy::Keep;
use gems::memory::human_bytes;
use gems::plan::Layout;
use gems::schemes::admission::Admission;
use gems::schemes::{Kind, Order};

use crate::cli::{CalibrateArgs, FitCostsArgs, OrderChoice, SimulateArgs, TrainArgs};
use crate::train::{measure_op_times, setup};

/// Where the op times a plan predicts with come from.
fn costs_source(c: &gems::RunConfig) -> String {
    match &c.calibration {
        Some(cal) => format!("op times measured on {}", cal.device),
        None => "the fitted CPU model".into(),
    }
}

/// The schedule `gems train` would run with these flags, as JSON on standard output.
pub fn export_schedule(a: TrainArgs) -> anyhow::Result<()> {
    if a.spread.order == OrderChoice::All {
        anyhow::bail!("--order all: export one order at a time");
    }
    let (graph, mut c) = setup(&a)?;
    measure_op_times(&a, &graph, &mut c, false)?;
    let layout = Layout::new(&graph, &c)?;
    print!("{}", layout.schedule.schedule(&c.scheme).to_json());
    Ok(())
}

/// One row per order the scheme can run: the pipeline's bubble, each rank's metered peak,
/// the predicted step and, with --measure, the measured one.
fn compare_orders(a: &TrainArgs) -> anyhow::Result<()> {
    if a.spread.schedule_file.is_some() {
        anyhow::bail!("--order all compares the built-in orders; a schedule file is one schedule");
    }
    let (graph, mut c) = setup(a)?;
    measure_op_times(a, &graph, &mut c, false)?;
    let s = &c.scheme;
    println!(
        "orders for {} at {}², {} with P={} m={} η={} D={}, B={} ({}):",
        graph.name,
        graph.image_size(),
        s.kind,
        s.stages,
        s.parts,
        s.replicas,
        s.dp,
        c.train.batch_size,
        costs_source(&c)
    );
    println!(
        "{:<12} {:>7} {:>22} {:>22} {:>15}  peak per rank (metered)",
        "order", "bubble", "step, a device a rank", "step, a shared device", "measured step"
    );
    for order in Order::ALL {
        let mut c = c.clone();
        c.scheme.order = order;
        if let Err(e) = c.scheme.validate(c.train.batch_size) {
            println!("{order:<12} not for this scheme: {e}");
            continue;
        }
        let layout = Layout::new(&graph, &c)?;
        let peaks = fit::per_rank(&graph, &c)?;
        let measured = match a.measure {
            Some(steps) => format!("{:.3} s", measured_step(&graph, &c, steps)?),
            None => "-".into(),
        };
        println!(
            "{:<12} {:>6.1}% {:>20.3} s {:>21.3} s {:>15}  {}",
            order.to_string(),
            100.0 * layout.schedule.bubble(),
            layout.predicted_step(false),
            layout.predicted_step(true),
            measured,
            peaks
                .iter()
                .map(|m| human_bytes(m.peak))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    Ok(())
}

/// Trains `steps` steps (at least 2) of the plan on local ranks: the median step after the
/// first, which fills the loader and the memory pools.
fn measured_step(
    graph: &gems::graph::Graph,
    c: &gems::RunConfig,
    steps: usize,
) -> anyhow::Result<f64> {
    let data = crate::train::open_data(graph, c, false, true)?;
    let mut session = gems::Session::new(graph, c.clone(), data)?;
    let mut times = Vec::new();
    for _ in 0..steps.max(2) {
        times.push(session.step()?.seconds);
    }
    times.remove(0);
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The partition, the predicted schedule, and each rank's memory by category against capacity.
pub fn plan(a: TrainArgs) -> anyhow::Result<()> {
    if a.spread.order == OrderChoice::All {
        return compare_orders(&a);
    }
    let (graph, mut c) = setup(&a)?;
    measure_op_times(&a, &graph, &mut c, false)?;
    let layout = Layout::new(&graph, &c)?;
    let (g, s) = (&layout.graph, &c.scheme);
    let micro = c.train.batch_size / s.parts;
    let tiles = match s.spatial.is_split() {
        true => format!(", samples in {} tiles where marked", s.spatial),
        false => String::new(),
    };
    println!(
        "plan: {} at {}², {} with P={} m={} η={} D={}{tiles}, B={} ({micro} per micro-batch), {}",
        g.name,
        g.image_size(),
        s.kind,
        s.stages,
        s.parts,
        s.replicas,
        s.dp,
        c.train.batch_size,
        c.train.numerics()
    );
    println!(
        "{:<6} {:>12} {:>12} {:>20} {:>22}",
        "stage", "nodes", "parameters", "saved/micro-batch", "fwd+bwd/micro-batch"
    );
    let saved = layout.saved_per_micro_batch(c.train.activations(), micro);
    for (i, r) in layout.partition.stages.iter().enumerate() {
        let params = g.trainable_in(r.clone());
        let saved = saved[i];
        // A stage on tiles: what the whole stage saves, and what each of its ranks computes
        // and exchanges.
        let secs: f64 = layout.tiles.of_stage(&layout.costs, i).total()[r.clone()]
            .iter()
            .sum();
        let on_tiles = match s.tiled(i) {
            true => format!("  on {} tiles (per tile rank)", s.spatial),
            false => String::new(),
        };
        println!(
            "{i:<6} {:>12} {params:>12} {:>20} {:>20.2} ms{on_tiles}",
            format!("{}..{}", r.start, r.end),
            human_bytes(saved),
            1e3 * secs
        );
    }
    if s.spatial.is_split() {
        let (halo, sums) = layout.tiles.exchanges(&layout.partition.stages);
        println!(
            "tiles: {} grid, stages {} on tiles; per micro-batch on a tile rank: halo exchange \
             {:.3} ms, statistics' all-reduces {:.3} ms (forward and backward)",
            s.spatial,
            (0..s.stages)
                .filter(|&i| s.tiled(i))
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(" and "),
            1e3 * halo,
            1e3 * sums
        );
        match &layout.tiled {
            Some(r) if r.too_fine() => println!("warning: {r} (a coarser grid keeps more)"),
            Some(r) => println!("tiled region: {r}"),
            None => {}
        }
    }
    // Local ranks share this machine's device.
    let step = layout.predicted_step(true);
    let images = (s.replicas * c.train.batch_size * s.dp) as f64;
    println!(
        "predicted step {:.3} s, {:.1} images/s ({}; rank busy: {})",
        step,
        images / step,
        costs_source(&c),
        layout
            .schedule
            .busy()
            .iter()
            .map(|b| format!("{:.0}%", 100.0 * b / step))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "predicted step with a device per rank {:.3} s, {:.2} images/s (bubble {:.1}%)",
        layout.predicted_step(false),
        images / layout.predicted_step(false),
        100.0 * layout.schedule.bubble()
    );
    if let Some(steps) = a.measure {
        let measured = measured_step(&graph, &c, steps)?;
        println!(
            "measured step {measured:.3} s, {:.1} images/s ({} steps on local ranks, the median \
             after the first; predicted {:+.1}%)",
            images / measured,
            steps.max(2),
            100.0 * (step / measured - 1.0)
        );
    }
    let rule = match &layout.admission {
        Admission::Count(n) => format!("at most {n} by count"),
        Admission::Bytes(_) => format!(
            "admitted when the free bytes of {} hold a forward",
            human_bytes(c.train.device_memory.unwrap_or(0))
        ),
        Admission::Free => "not bounded".into(),
    };
    println!(
        "micro-batches in flight per rank (most held at once): {} ({rule})",
        layout
            .schedule
            .most_held()
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let saves = &c.train.saves;
    let (_, host, recompute) = saves.counts();
    if host + recompute > 0 {
        let link = fit::host_link(c.train.device, c.train.precision)?;
        let (bytes, exposed) = gems::plan::offload::cost_of(
            g,
            &layout.costs,
            micro,
            c.train.activations(),
            &link,
            saves,
        );
        println!(
            "saved tensors: {host} nodes offloaded to the host tier (fetched {} nodes ahead), {recompute} recomputed; {} per micro-batch off the device, {:.3} s per micro-batch predicted exposed (host link {:.1} GB/s{})",
            saves.prefetch,
            human_bytes(bytes),
            exposed,
            link.bytes_per_s / 1e9,
            if link.overlaps { ", copies overlap compute" } else { ", copies are compute" }
        );
        for (i, r) in layout.partition.stages.iter().enumerate() {
            let count = |k| r.clone().filter(|&n| saves.of(n) == k).count();
            println!(
                "  stage {i}: {} on the device, {} offloaded, {} recomputed",
                count(Keep::Device),
                count(Keep::Host),
                count(Keep::Recompute)
            );
        }
    }
    if let Some(path) = &a.timeline {
        let held = fit::per_task(&graph, &c)?;
        let title = format!(
            "{} {} P={} m={} η={}: predicted times, metered memory",
            g.name, s.kind, s.stages, s.parts, s.replicas
        );
        let svg = gems::plan::timeline::svg(
            &title,
            &layout.schedule.ranks,
            &gems::plan::timeline::curve(&layout.schedule.ranks, &held),
        );
        gems::core::files::write_output(path, svg.as_bytes())?;
        println!("timeline: {}", path.display());
    }
    let mem = fit::per_rank(&graph, &c)?;
    println!("memory per rank (a metered run of the same tasks):");
    for (r, m) in mem.iter().enumerate() {
        let verdict = match c.train.device_memory {
            Some(cap) if m.peak > cap => format!(
                "  exceeds {} by {}",
                human_bytes(cap),
                human_bytes(m.peak - cap)
            ),
            Some(cap) => format!(
                "  fits {} ({:.0}%)",
                human_bytes(cap),
                100.0 * m.peak as f64 / cap as f64
            ),
            None => String::new(),
        };
        println!(
            "  rank {r}: {}: {}{verdict}",
            human_bytes(m.peak),
            m.at_peak
        );
    }
    Ok(())
}

pub fn calibrate(a: CalibrateArgs) -> anyhow::Result<()> {
    let (g, c) = setup(&a.train)?;
    // Its micro-batch is run for real: it must fit like a training step's.
    fit::check_fits(&g, &c)?;
    let t = &c.train;
    let micro = c.micro_batch();
    let device = gems::Device::open(t.device, t.precision, t.conv, "calibration", 0, None)?;
    let started = Instant::now();
    let cal = gems::plan::calibrate::calibrate(
        &g,
        micro,
        (t.dtype, t.activations()),
        &device,
        a.repeats.max(1),
    )?;
    cal.save(&a.out)?;
    let f: f64 = cal.forward.iter().sum();
    let (b, split) = cal.backward_sums();
    let loss: f64 = cal.loss.iter().sum();
    println!(
        "calibrated {} ops of {} at {}², micro-batch {micro}, {} in {:.1} s: forward {:.2} ms, backward {:.2} ms, loss {:.2} ms per micro-batch; wrote {}",
        g.nodes.len(), g.name, g.image_size(), t.numerics(), started.elapsed().as_secs_f64(), 1e3 * f, 1e3 * b, 1e3 * loss, a.out.display()
    );
    println!(
        "backward split as zero-bubble orders run it (B, then W): {:.2} ms ({:+.1}% against one call)",
        1e3 * split,
        100.0 * (split / b - 1.0)
    );
    Ok(())
}

/// Fits the CPU cost model to calibration profiles, one fit per thread count.
pub fn fit_costs(a: FitCostsArgs) -> anyhow::Result<()> {
    use gems::plan::calibrate::Calibration;
    use gems::plan::fitted::{self, FittedCosts};
    let mut by_threads: std::collections::BTreeMap<usize, Vec<_>> = Default::default();
    for path in &a.profiles {
        let cal = Calibration::load(path)?;
        let threads = fitted::cpu_threads(&cal.device).ok_or_else(|| {
            anyhow::anyhow!("{}: not a CPU profile ({})", path.display(), cal.device)
        })?;
        let g = gems::models::build(&cal.model, cal.image_size, cal.classes)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        by_threads.entry(threads).or_default().push((g, cal));
    }
    let machine = gems::bench::cpu_model();
    let fits = by_threads
        .iter()
        .map(|(&threads, runs)| FittedCosts::fit(&machine, threads, runs))
        .collect::<gems::Result<Vec<_>>>()?;
    let text = serde_json::to_string_pretty(&fits)?;
    gems::core::files::write_atomically(&a.out, text.as_bytes())?;
    for f in &fits {
        let runs = &by_threads[&f.threads];
        println!(
            "{} threads: {} op families from {} profiles; each model's ops, fitted against measured (the fastest of its profiles, which the fit keeps, and the slowest):",
            f.threads,
            f.families.len(),
            runs.len()
        );
        // A model calibrated more than once: its times, fitted and measured, by profile.
        let mut by_model: std::collections::BTreeMap<_, (f64, Vec<f64>)> = Default::default();
        for (g, cal) in runs {
            let fitted: f64 = (g.nodes.iter())
                .filter_map(|n| f.node(g, n, cal.micro_batch, cal.dtype))
                .map(|(f, b)| f + b)
                .sum();
            let key = (cal.model.clone(), cal.image_size, cal.micro_batch);
            let entry = by_model.entry(key).or_insert((fitted, Vec::new()));
            entry.1.push(cal.forward.iter().chain(&cal.backward).sum());
        }
        for ((model, side, micro), (fitted, mut measured)) in by_model {
            measured.sort_by(f64::total_cmp);
            let fastest = measured[0];
            println!(
                "  {model:<16} {side:>5}² micro-batch {micro:<3} {:>9.1} ms (slowest {:.1}) {:>+7.1}%",
                1e3 * fastest,
                1e3 * measured[measured.len() - 1],
                100.0 * (fitted / fastest - 1.0)
            );
        }
    }
    println!("wrote {}", a.out.display());
    Ok(())
}

pub fn simulate(a: SimulateArgs) -> anyhow::Result<()> {
    use gems::plan::simulate;
    if a.train.spread.order == OrderChoice::All {
        anyhow::bail!(
            "--order all: simulate one order at a time (`gems plan --order all` compares them)"
        );
    }
    let (g, c) = setup(&a.train)?;
    let s = &c.scheme;
    println!(
        "simulate: {} at {}², {} with P={} m={} η={}, B={} per replica pass, {} on {}",
        g.name,
        g.image_size(),
        s.kind,
        s.stages,
        s.parts,
        s.replicas,
        c.train.batch_size,
        c.train.numerics(),
        a.profile
    );
    let points = simulate::weak_scaling(&g, &c, &a.profile, a.gpus)?;
    let base = points.first().ok_or_else(|| {
        anyhow::anyhow!(
            "--gpus {} is fewer than a group's {} ranks",
            a.gpus,
            s.group_size()
        )
    })?;
    println!(
        "{:>6} {:>7} {:>12} {:>7} {:>13} {:>11} {:>11} {:>13}",
        "gpus",
        "groups",
        "step s",
        "bubble",
        "all-reduce s",
        "images/s",
        "efficiency",
        "halo+sums ms"
    );
    for p in &points {
        let eff = p.images_per_s / (base.images_per_s * p.groups as f64);
        println!(
            "{:>6} {:>7} {:>12.4} {:>6.1}% {:>13.4} {:>11.2} {:>10.2}% {:>13.3}",
            p.gpus,
            p.groups,
            p.pipeline,
            100.0 * p.bubble,
            p.all_reduce,
            p.images_per_s,
            100.0 * eff,
            1e3 * (p.halo + p.sums)
        );
    }
    println!(
        "each step ends with the optimizer (STEP): {:.3} ms on the slowest rank, its memory \
         traffic over its copies' parameters at {:.0} GB/s",
        1e3 * base.optimizer,
        a.profile.device.bytes_per_s / 1e9
    );
    let peak = fit::per_rank(&g, &c)?
        .iter()
        .map(|m| m.peak)
        .max()
        .unwrap_or(0);
    println!(
        "largest rank memory {} (metered, with the CPU backend's workspace)",
        human_bytes(peak)
    );
    if s.replicas >= 2 {
        let mut mp = c.clone();
        mp.scheme.kind = Kind::Mp;
        mp.scheme.replicas = 1;
        mp.max_in_flight = None;
        let layout = Layout::new(&g, &mp)?;
        let one = simulate::step(&mp, &layout, &a.profile, 1)?;
        println!(
            "{} over MP-Basic on {} GPUs: {:.2}× images/s",
            s.kind,
            s.stages,
            base.images_per_s / one.images_per_s
        );
    }
    Ok(())
}
