//! `gems train`: one loop for every scheme, over a [`Session`] on local ranks or MPI.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

use gems::data::slide::TileConfig;
use gems::data::{Pipeline, SourceSpec, Task};
use gems::fit::{self, Auto};
use gems::graph::policy::{Keep, SavePolicy};
use gems::memory::human_bytes;
use gems::optim::schedule::LrSchedule;
use gems::optim::{AdamConfig, OptimizerKind, SgdConfig};
use gems::runtime::folder::checkpoint_path;
use gems::runtime::{Checkpoint, CheckpointFolder, FolderRules};
use gems::{models, Evaluation, Graph, RunConfig, Session, StepReport, TrainConfig};

use crate::cli::{Choice, DataSource, Offload, OrderChoice, Tiling, TrainArgs, Transport};

/// The model and the run the training flags describe (or a checkpoint, with `--resume`),
/// with `auto` and `max` resolved against the capacity by metered runs; what was chosen is
/// printed.
pub fn setup(a: &TrainArgs) -> anyhow::Result<(Graph, RunConfig)> {
    let (graph, train) = match &a.resume {
        Some(file) => {
            let ckpt = Checkpoint::read(file)?;
            let (model, side, classes) = ckpt.model()?;
            let mut t = ckpt.config()?;
            check_repeated(a, (&model, side, classes), &t)?;
            (a.on.for_checkpoint()?)(&mut t);
            // --steps is the run's new total, which the schedule spans (a cosine that ended at
            // the old total would otherwise train on at a rate of 0).
            t.steps = a.steps.unwrap_or(t.steps);
            t.schedule.total = t.steps;
            if let Some(Choice::Fixed(b)) = a.batch_size {
                t.batch_size = b;
            }
            t.offload_copy = a.offload_copy;
            t.device_memory = a.device_memory;
            t.host_memory = a.host_memory;
            t.conv = a.conv;
            t.data.skip_bad = a.input.skip_bad;
            t.data.workers = a.input.workers;
            t.data.prefetch = a.input.prefetch;
            (models::build(&model, side, classes)?, t)
        }
        None => {
            let data = a.input.config(a.image_size, models::task(&a.model)?)?;
            let classes = match (
                gems::data::pipeline::class_names(&data.source, data.task)?,
                a.classes,
            ) {
                (None, given) => given.unwrap_or(10),
                (Some(names), Some(given)) if given != names.len() => anyhow::bail!(
                    "--classes {given}, but the data has {} classes ({})",
                    names.len(),
                    names.join(", ")
                ),
                (Some(names), _) => names.len(),
            };
            let steps = a.steps.unwrap_or(150);
            if let Some(w) = a.warmup.filter(|&w| w > steps) {
                anyhow::bail!("--warmup {w} is longer than the run's {steps} steps");
            }
            let train = TrainConfig {
                batch_size: match a.batch_size {
                    None => 32,
                    Some(Choice::Fixed(b)) => b,
                    Some(Choice::Auto) => a.spread.parts,
                },
                steps,
                schedule: LrSchedule {
                    base: a.lr,
                    decay: a.schedule,
                    warmup: a.warmup.unwrap_or(10.min(steps)),
                    total: steps,
                },
                sgd: SgdConfig {
                    momentum: a.momentum,
                    weight_decay: a.weight_decay,
                    nesterov: a.nesterov,
                },
                optimizer: match a.optimizer.as_str() {
                    "sgd" => OptimizerKind::Sgd,
                    adam => OptimizerKind::Adam(AdamConfig {
                        betas: a.betas,
                        eps: a.eps,
                        weight_decay: a.weight_decay,
                        decoupled: adam == "adamw",
                    }),
                },
                clip_grad_norm: a.clip_grad_norm,
                no_decay_norm_bias: a.no_decay_norm_bias,
                seed: a.seed,
                dtype: a.dtype,
                device_memory: a.device_memory,
                host_memory: a.host_memory,
                offload_copy: a.offload_copy,
                data,
                device: a.on.kind(a.dtype)?,
                precision: a.on.precision(),
                conv: a.conv,
                loss_scale: a.loss_scale,
                class_weights: a.class_weights.clone(),
                loss_reduction: a.loss_reduction,
                ..TrainConfig::new(1, steps)
            };
            let graph = models::build(&a.model, a.image_size, classes)?;
            let uneven =
                (train.class_weights.as_deref()).is_some_and(|w| w.iter().any(|&x| x != w[0]));
            if uneven
                && graph.positions() == 1
                && train.loss_reduction == gems::ops::loss::Reduction::SampleMean
            {
                anyhow::bail!(
                    "--class-weights change nothing for a classifier under --loss-reduction \
                     sample-mean (each image's one label weighs itself); add --loss-reduction \
                     pytorch to weigh them as CrossEntropyLoss(weight=) does"
                );
            }
            (graph, train)
        }
    };
    let mut c = RunConfig::new(train, a.spread.scheme()?);
    c.balance = a.spread.balance.clone();
    c.max_in_flight = a.spread.max_in_flight;
    c.schedule = a.spread.schedule()?.map(std::sync::Arc::new);
    if let Some(p) = &a.calibration {
        c.calibration = Some(Arc::new(gems::plan::calibrate::Calibration::load(p)?));
    }
    let nodes = graph.nodes.len();
    c.train.saves = match &a.offload {
        Offload::None | Offload::Auto => SavePolicy::keep_all(),
        Offload::All => SavePolicy::all(nodes, Keep::Host, a.offload_ahead),
        Offload::Recompute => SavePolicy::checkpointed(nodes),
        Offload::File(path) => SavePolicy::load(path, nodes)?,
    };
    let auto = Auto {
        split: a.spread.split == Choice::Auto,
        replicas: a.spread.replicas == Some(Choice::Auto),
        batch: a.batch_size == Some(Choice::Auto),
        offload: (a.offload == Offload::Auto).then_some(a.offload_ahead),
        spatial: a.spread.spatial == Tiling::Auto,
    };
    let resolved = fit::resolve(&graph, c, auto)?;
    let c = resolved.config;
    if auto.spatial {
        println!("--spatial auto: {} tiles", c.scheme.spatial);
    }
    if auto.split {
        println!("--split auto: {} stages", c.scheme.stages);
    }
    if auto.replicas {
        let variant = match (c.scheme.replicas, c.max_in_flight) {
            (1, _) => "one replica (mp)".to_string(),
            (_, None) => "the MAST pair, packed by bytes".to_string(),
            (_, Some(n)) => format!("the MAST pair, at most {n} micro-batches per rank"),
        };
        println!("--replicas auto: {variant}");
    }
    if auto.batch {
        println!("--batch-size max: {}", c.train.batch_size);
    }
    if let Some(chosen) = &resolved.offload {
        let (_, host, recompute) = chosen.policy.counts();
        println!(
            "--offload auto: {host} nodes offloaded, {recompute} recomputed ({} per micro-batch off the device, {:.3} s per step predicted exposed)",
            human_bytes(chosen.bytes),
            chosen.exposed
        );
    }
    Ok((graph, c))
}

/// A GPU run of threads plans with its GPU's op times, measured at first use and kept (the
/// processes of an MPI run would each measure their own: they take --calibration). Where the GPU
/// cannot be opened, a plan (`strict` false) is made with the fitted CPU model and says so; a
/// run that trains stops there.
pub fn measure_op_times(
    a: &TrainArgs,
    graph: &Graph,
    c: &mut RunConfig,
    strict: bool,
) -> anyhow::Result<()> {
    if a.spread.transport != Transport::Local || c.calibration.is_some() {
        return Ok(());
    }
    let cache = gems::plan::calibrate::cache_dir();
    match gems::plan::calibrate::on_first_use(graph, c, cache.as_deref()) {
        Ok(cal) => c.calibration = cal.map(Arc::new),
        Err(e) if !strict => eprintln!("op times from the fitted CPU model: {e}"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

pub fn train(a: TrainArgs) -> anyhow::Result<()> {
    if a.steps == Some(0) || a.checkpoint_every == Some(0) {
        anyhow::bail!("--steps and --checkpoint-every must be at least 1");
    }
    if a.input.val_every == Some(0) {
        anyhow::bail!("--val-every must be at least 1");
    }
    if a.spread.order == OrderChoice::All {
        anyhow::bail!("--order all compares the orders in `gems plan`; a run trains one");
    }
    let (graph, mut c) = setup(&a)?;
    measure_op_times(&a, &graph, &mut c, true)?;
    fit::check_fits(&graph, &c)?;
    match a.spread.transport {
        Transport::Local => {
            let data = open_data(&graph, &c, true, a.input.allow_empty_class)?;
            let train = data.train.clone();
            let session = Session::new(&graph, c, data)?;
            run(&a, session, &train, true)
        }
        Transport::Mpi => run_mpi(&a, &graph, c),
    }
}

/// Opens the run's data for `graph`; where `speaks`, warns of samples left out and prints the
/// samples of each class (when segmenting, the share of labelled pixels of each) (a class the
/// data lacks is refused when the source is opened). Segmenting, masks without a labelled
/// pixel are refused, and a class without one unless `allow_empty_class` (then warned of).
pub fn open_data(
    graph: &Graph,
    c: &RunConfig,
    speaks: bool,
    allow_empty_class: bool,
) -> anyhow::Result<gems::Dataset> {
    let t = &c.train;
    let data = gems::data::open(&t.data, graph.image_size(), graph.classes(), t.seed)?;
    if !speaks {
        return Ok(data);
    }
    report_skipped(&data.skipped);
    let train_counts = data.train.class_counts()?;
    if let (Task::Segment, Some(counts)) = (data.train.task(), &train_counts) {
        let empty = data.train.classes_without_pixels(counts)?.join(", ");
        match (empty.is_empty(), allow_empty_class) {
            (true, _) => {}
            (false, true) => eprintln!(
                "warning: no pixel of the training masks is labelled {empty}: the model cannot \
                 learn it"
            ),
            (false, false) => anyhow::bail!(
                "no pixel of the training masks is labelled {empty}: the model could not learn \
                 it; pass --allow-empty-class to train anyway"
            ),
        }
    }
    let split = |p: &Pipeline, counts: Option<Vec<usize>>, what: &str| -> Option<String> {
        let counts = counts?;
        let total: usize = counts.iter().sum();
        let per_class = |each: &dyn Fn(usize) -> String| -> String {
            let named = p.classes().iter().zip(&counts);
            let parts: Vec<String> = named.map(|(c, &n)| format!("{c} {}", each(n))).collect();
            parts.join(", ")
        };
        Some(match p.task() {
            Task::Classify => format!("{total} {what} ({})", per_class(&|n| n.to_string())),
            // Segmenting: the samples, and the class balance over their labelled pixels.
            Task::Segment => format!(
                "{} {what}; pixels: {}",
                p.samples().unwrap_or(0),
                per_class(&|n| format!("{:.1}%", 100.0 * n as f64 / total.max(1) as f64))
            ),
        })
    };
    let mut parts: Vec<String> = split(&data.train, train_counts, "for training")
        .into_iter()
        .collect();
    if let Some(val) = &data.val {
        parts.extend(split(val, val.class_counts()?, "held out"));
    }
    if !parts.is_empty() {
        println!("data: {}", parts.join("; "));
    }
    Ok(data)
}

/// This process's rank under mpirun; the job ends on any rank's error (the others would wait
/// for it forever).
#[cfg(feature = "mpi")]
fn run_mpi(a: &TrainArgs, graph: &Graph, c: RunConfig) -> anyhow::Result<()> {
    use gems::comm::Comm;
    let universe = mpi::initialize().ok_or_else(|| anyhow::anyhow!("MPI was initialized twice"))?;
    let comm = gems::comm::mpi::MpiComm::world(&universe);
    let rank = comm.rank();
    let abort = |e: anyhow::Error| -> ! {
        eprintln!("error: rank {rank}: {}", crate::cli::explain(&e));
        gems::comm::mpi::MpiComm::world(&universe).abort(1)
    };
    if rank == 0 && matches!(c.train.device, gems::backend::DeviceKind::Cuda { .. }) {
        println!("{}", gems::comm::mpi::DevicePath::describe());
    }
    let data =
        open_data(graph, &c, rank == 0, a.input.allow_empty_class).unwrap_or_else(|e| abort(e));
    let train = data.train.clone();
    let session = Session::on(graph, c, data, Box::new(comm)).unwrap_or_else(|e| abort(e.into()));
    run(a, session, &train, rank == 0).unwrap_or_else(|e| abort(e));
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &TrainArgs, _: &Graph, _: RunConfig) -> anyhow::Result<()> {
    anyhow::bail!("this gems was built without MPI: build it with `cargo build --release --features mpi` and start it with mpirun")
}

/// Opens the run's checkpoint folder under the flags' rules, saying what it removed.
fn open_folder(a: &TrainArgs, dir: &Path, session: &Session) -> anyhow::Result<CheckpointFolder> {
    let rules = FolderRules {
        resumed_from: a.resume.clone(),
        overwrite: a.overwrite,
        keep_last: a.keep_last,
    };
    let run = &session.lineage().run;
    let f = CheckpointFolder::open(dir, run, &session.graph().name, &rules)?;
    if let Some(holder) = &f.recovered_lock {
        println!(
            "note: took over {}'s lock, left by a run that ended without releasing it ({holder})",
            dir.display()
        );
    }
    for path in &f.removed {
        println!("removed {}", path.display());
    }
    Ok(f)
}

/// With `--resume`, the flags that describe the run may repeat the checkpoint's values (so a
/// command runs again with `--resume` added); a different value is refused, naming both.
fn check_repeated(
    a: &TrainArgs,
    (model, side, classes): (&str, usize, usize),
    t: &TrainConfig,
) -> anyhow::Result<()> {
    let on = |b: bool| if b { "on" } else { "off" }.to_string();
    let none = || "none".to_string();
    let (labels, tiles) = match &t.data.source {
        SourceSpec::Slides { labels, tiles, .. } => (Some(labels), Some(tiles)),
        _ => (None, None),
    };
    let tile = |f: fn(&TileConfig) -> String| tiles.map_or_else(none, f);
    let mut flags = vec![
        ("model", a.model.clone(), model.to_string()),
        ("image_size", a.image_size.to_string(), side.to_string()),
        (
            "classes",
            a.classes.unwrap_or_default().to_string(),
            classes.to_string(),
        ),
        ("lr", a.lr.to_string(), t.schedule.base.to_string()),
        (
            "momentum",
            a.momentum.to_string(),
            t.sgd.momentum.to_string(),
        ),
        (
            "weight_decay",
            a.weight_decay.to_string(),
            t.sgd.weight_decay.to_string(),
        ),
        ("nesterov", on(a.nesterov), on(t.sgd.nesterov)),
        (
            "optimizer",
            a.optimizer.clone(),
            t.optimizer.name().to_string(),
        ),
        (
            "clip_grad_norm",
            a.clip_grad_norm.unwrap_or_default().to_string(),
            t.clip_grad_norm.map_or_else(none, |x| x.to_string()),
        ),
        (
            "no_decay_norm_bias",
            on(a.no_decay_norm_bias),
            on(t.no_decay_norm_bias),
        ),
        (
            "schedule",
            a.schedule.to_string(),
            t.schedule.decay.to_string(),
        ),
        (
            "warmup",
            a.warmup.unwrap_or_default().to_string(),
            t.schedule.warmup.to_string(),
        ),
        ("seed", a.seed.to_string(), t.seed.to_string()),
        (
            "dtype",
            a.dtype.name().to_string(),
            t.dtype.name().to_string(),
        ),
        (
            "loss_scale",
            a.loss_scale.to_string(),
            t.loss_scale.to_string(),
        ),
        (
            "class_weights",
            weights(a.class_weights.as_deref()),
            weights(t.class_weights.as_deref()),
        ),
        (
            "loss_reduction",
            a.loss_reduction.to_string(),
            t.loss_reduction.to_string(),
        ),
        (
            "data",
            a.input.data.to_string(),
            DataSource::of(&t.data.source).to_string(),
        ),
        ("augment", on(a.input.augment), on(t.data.augment)),
        (
            "normalize",
            a.input.normalize.to_string(),
            t.data.normalize.to_string(),
        ),
        ("resize", on(a.input.resize), on(t.data.resize)),
        ("val", a.input.val.to_string(), t.data.val.to_string()),
        (
            "labels",
            path(a.input.slides.labels.as_deref()),
            path(labels.map(|l| l.as_path())),
        ),
        (
            "level",
            a.input.slides.level.to_string(),
            tile(|t| t.level.to_string()),
        ),
        (
            "tile_size",
            a.input.slides.tile_size.unwrap_or_default().to_string(),
            tile(|t| t.tile.to_string()),
        ),
        (
            "stride",
            a.input.slides.stride.unwrap_or_default().to_string(),
            tile(|t| t.stride.to_string()),
        ),
        (
            "tissue",
            a.input.slides.tissue.unwrap_or_default().to_string(),
            tile(|t| t.tissue_threshold.map_or("none".into(), |b| b.to_string())),
        ),
    ];
    // Adam's settings are no part of an SGD run (a new run ignores them too).
    if let OptimizerKind::Adam(c) = &t.optimizer {
        let (b1, b2) = a.betas;
        flags.push((
            "betas",
            format!("{b1},{b2}"),
            format!("{},{}", c.betas.0, c.betas.1),
        ));
        flags.push(("eps", a.eps.to_string(), c.eps.to_string()));
    }
    for (id, ours, theirs) in flags {
        if a.given.iter().any(|g| g == id) && ours != theirs {
            let flag = id.replace('_', "-");
            anyhow::bail!(
                "--{flag} {ours} differs from the checkpoint's {theirs}: a resumed run keeps \
                 the checkpoint's; leave --{flag} out, or start a new run from its weights \
                 (gems export, then --init)"
            );
        }
    }
    Ok(())
}

fn weights(w: Option<&[f64]>) -> String {
    w.map_or_else(
        || "none".into(),
        |w| w.iter().map(f64::to_string).collect::<Vec<_>>().join(","),
    )
}

fn path(p: Option<&Path>) -> String {
    p.map_or_else(|| "none".into(), |p| p.display().to_string())
}

/// The training loop: resumes, steps, validates and checkpoints as the flags say, printing
/// progress and the summary where `speaks` (world rank 0).
fn run(a: &TrainArgs, mut session: Session, data: &Pipeline, speaks: bool) -> anyhow::Result<()> {
    if let Some(file) = &a.resume {
        session.restore(file)?;
        if speaks {
            println!(
                "resuming from {} at step {}",
                file.display(),
                session.steps_done()
            );
        }
    }
    if let Some(file) = &a.init {
        session.load_weights(file)?;
        if speaks {
            println!("starting from the weights in {}", file.display());
        }
    }
    // Only the rank that writes checkpoints keeps the folder; it refuses before any step.
    let mut folder = match (&a.checkpoint, speaks) {
        (Some(dir), true) => Some(open_folder(a, dir, &session)?),
        _ => None,
    };
    let c = session.config().clone();
    let (total, first) = (c.train.steps, session.steps_done());
    if first >= total {
        anyhow::bail!("the checkpoint is at step {first}; ask for more --steps than that");
    }
    let mut metrics = match (&a.metrics, speaks) {
        (Some(p), true) => Some(std::io::BufWriter::new(gems::core::files::create_output(
            p,
        )?)),
        _ => None,
    };
    let device = session.device_summary()?;
    if speaks {
        header(&session, &device.name, a, total);
    }
    let bar = (speaks && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new((total - first) as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("static template"),
        );
        b
    });
    let say = |line: String| match &bar {
        Some(b) => b.println(line),
        None if speaks => println!("{line}"),
        None => {}
    };
    let started = Instant::now();
    let totals = Arc::new(Mutex::new(Totals::default()));
    session.on_step(progress(bar.clone(), totals.clone(), speaks, total));
    let validates = c.train.data.val > 0.0;
    for _ in first..total {
        let r = session.step()?;
        let done = session.steps_done();
        if validates
            && a.input
                .val_every
                .is_some_and(|n| done.is_multiple_of(n) && done < total)
        {
            let e = session.evaluate_held_out(None)?;
            say(validation_line(done, total, &e));
        }
        if let Some(dir) = &a.checkpoint {
            if done == total || a.checkpoint_every.is_some_and(|n| done.is_multiple_of(n)) {
                session.save(checkpoint_path(dir, done))?;
                if let Some(f) = folder.as_mut() {
                    for old in f.written(done)? {
                        say(format!("removed {} (--keep-last)", old.display()));
                    }
                }
            }
        }
        if let Some(m) = metrics.as_mut() {
            let mut line = serde_json::json!({
                "step": r.step, "loss": r.loss, "correct": r.correct, "batch": r.scored,
                "images": r.images, "lr": r.lr, "seconds": r.seconds, "data_wait": r.data_wait,
                "halo_wait": r.halo_wait, "loss_scale": r.loss_scale, "skipped": r.skipped,
            });
            line["images_per_s"] = r.images_per_second().into();
            writeln!(m, "{line}")?;
            // Flushed every step: a run that stops keeps what it measured.
            m.flush()?;
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let totals = std::mem::take(&mut *lock(&totals));
    let secs = started.elapsed().as_secs_f64();
    let validation = match validates {
        true => Some(session.evaluate_held_out(None)?),
        false => None,
    };
    let loss_scale = session.loss_scale()?;
    let device = session.device_summary()?;
    if !speaks {
        return Ok(());
    }
    let images = totals.images;
    let (loss, acc) = window_stats(totals.recent.iter());
    println!(
        "done: {} steps, {images} images in {secs:.1} s",
        totals.steps
    );
    let pixel = if session.graph().positions() > 1 {
        "pixel "
    } else {
        ""
    };
    println!(
        "  loss {loss:.4}, {pixel}accuracy {:.1}% (mean of the last {} steps; chance is {:.1}%)",
        100.0 * acc,
        totals.recent.len(),
        100.0 / session.graph().classes() as f64
    );
    println!("  throughput {:.1} images/s", images as f64 / secs);
    if let Some(s) = &loss_scale {
        println!(
            "  loss scale {} ({} steps skipped: their gradients overflowed f16)",
            s.factor(),
            s.skipped()
        );
    }
    let waited = totals.data_wait;
    println!(
        "  waited for data {waited:.2} s ({:.1}% of the loop); the loader holds up to {} of host memory per loading rank ({} micro-batches ahead)",
        100.0 * waited / secs,
        human_bytes(c.loader_bytes(session.graph().image_size())),
        c.train.data.prefetch
    );
    let (bad, last_bad) = data.bad();
    if bad > 0 {
        println!(
            "  {bad} unreadable samples skipped (blank inputs), the last {}",
            last_bad.unwrap_or_default()
        );
    }
    if let Some(e) = &validation {
        print_validation(e);
    }
    let last = totals.recent.back().expect("at least one step ran");
    if last.ranks.len() == 1 {
        let mem = &last.ranks[0].memory;
        println!("  peak memory {}: {}", human_bytes(mem.peak), mem.at_peak);
        if let Some(cap) = mem.capacity {
            println!(
                "  capacity {} ({:.0}% used at peak)",
                human_bytes(cap),
                100.0 * mem.peak as f64 / cap as f64
            );
        }
    } else {
        // Spatial runs also say how long each rank waited for the other tiles' halos.
        let tiled = c.scheme.spatial.is_split();
        let halo_header = if tiled { "   halo wait s" } else { "" };
        println!("  rank   busy s   idle s   data wait s{halo_header}   peak memory");
        for rank in 0..last.ranks.len() {
            let [busy, wall, waited, halo] = totals.per_rank[rank];
            let mem = &last.ranks[rank].memory;
            let halo = if tiled {
                format!(" {halo:>13.2}")
            } else {
                String::new()
            };
            println!(
                "  {rank:>4} {busy:>8.2} {:>8.2} {:>13.2}{halo}   {}: {}",
                (wall - busy).max(0.0),
                waited,
                human_bytes(mem.peak),
                mem.at_peak
            );
        }
    }
    if device.host.peak > 0 {
        println!(
            "  host tier peak {}{} ({} copies; pinned pool: {} blocks allocated, {} reused, {})",
            human_bytes(device.host.peak),
            device
                .host
                .capacity
                .map(|c| format!(" of {}", human_bytes(c)))
                .unwrap_or_default(),
            c.train.offload_copy,
            device.pool.allocated,
            device.pool.reused,
            human_bytes(device.pool.bytes)
        );
    }
    if !device.conv_algorithms.is_empty() {
        println!("  cuDNN algorithms per convolution shape:");
        for l in &device.conv_algorithms {
            println!("    {l}");
        }
    }
    if let Some(path) = &a.timeline {
        timeline(&session, last, path)?;
    }
    Ok(())
}

/// The step hook that keeps the summary's totals and shows progress: the bar's message, or
/// where there is no bar and `speaks`, a line every tenth of the run's `total` steps.
fn progress(
    bar: Option<ProgressBar>,
    totals: Arc<Mutex<Totals>>,
    speaks: bool,
    total: usize,
) -> impl FnMut(&StepReport) + Send + 'static {
    move |r| {
        let mut totals = lock(&totals);
        totals.add(r.clone());
        let (loss, acc) = window_stats(totals.recent.iter());
        let msg = format!(
            "loss {loss:.4}  acc {:.1}%  {:.1} img/s  lr {:.4}",
            100.0 * acc,
            r.images_per_second(),
            r.lr
        );
        match &bar {
            Some(b) => {
                b.set_message(msg);
                b.inc(1);
            }
            None if speaks && (r.step + 1) % (total / 10).max(1) == 0 => {
                println!("step {:>5}/{total}  {msg}", r.step + 1)
            }
            None => {}
        }
    }
}

/// The totals, even after a hook panicked holding them (what they hold stays whole).
fn lock(totals: &Mutex<Totals>) -> std::sync::MutexGuard<'_, Totals> {
    totals.lock().unwrap_or_else(|p| p.into_inner())
}

/// What is trained, how, and where.
fn header(session: &Session, device: &str, a: &TrainArgs, total: usize) {
    let (g, c) = (session.graph(), session.config());
    let (s, t) = (&c.scheme, &c.train);
    println!(
        "training {} ({} parameters, {:.2} GFLOPs/image) on {}², {} classes, batch {}, {total} steps, {} on {}",
        g.name,
        g.parameter_count(),
        g.flops_per_sample() as f64 / 1e9,
        g.image_size(),
        g.classes(),
        t.batch_size,
        t.numerics(),
        device,
    );
    if s.world() > 1 || s.parts > 1 {
        let tiles = match s.spatial.is_split() {
            true => format!(", samples of the first stage in {} tiles", s.spatial),
            false => String::new(),
        };
        println!(
            "  {}: P={} stages, m={} micro-batches, η={} replicas, D={} groups{tiles} on {} ranks ({}); {} images per step",
            s.kind, s.stages, s.parts, s.replicas, s.dp, s.world(), a.spread.transport, c.images_per_step()
        );
        for (i, r) in session.layout().partition.stages.iter().enumerate() {
            let (first, last) = (&g.nodes[r.start].name, &g.nodes[r.end - 1].name);
            println!(
                "  stage {i}: nodes {}..{} ({first} … {last})",
                r.start, r.end
            );
        }
        match session.layout().tiled.as_ref() {
            Some(r) if r.too_fine() => println!("  warning: {r} (a coarser grid keeps more)"),
            Some(r) if r.end.is_some() => println!("  tiles: {r}"),
            _ => {}
        }
    }
}

/// The last step's tasks as measured, drawn per rank.
fn timeline(session: &Session, last: &StepReport, path: &Path) -> anyhow::Result<()> {
    let (g, c) = (session.graph(), session.config());
    let s = &c.scheme;
    let first = |p| &last.ranks[s.first_rank(p)];
    let tasks: Vec<_> = (0..s.stages).map(|p| first(p).timeline.clone()).collect();
    let held: Vec<_> = (0..s.stages).map(|p| first(p).held.clone()).collect();
    let title = format!(
        "{} {} P={} m={} η={}: measured, last step",
        g.name, s.kind, s.stages, s.parts, s.replicas
    );
    let svg =
        gems::plan::timeline::svg(&title, &tasks, &gems::plan::timeline::curve(&tasks, &held));
    gems::core::files::write_output(path, svg.as_bytes())?;
    println!("  timeline: {}", path.display());
    Ok(())
}

/// A line of validation during training, after `done` of `total` steps.
pub fn validation_line(done: usize, total: usize, e: &Evaluation) -> String {
    format!("step {done:>5}/{total}  validation {}", scores(e))
}

/// The summary's line of the evaluation after the last step.
pub fn print_validation(e: &Evaluation) {
    println!(
        "  validation: {} on {} held-out samples",
        scores(e),
        e.samples
    );
}

/// `loss 0.1234, accuracy 95.0%`; per pixel, the pixel accuracy and the mean IoU.
fn scores(e: &Evaluation) -> String {
    match e.per_pixel {
        false => format!("loss {:.4}, accuracy {:.1}%", e.loss, 100.0 * e.accuracy),
        true => format!(
            "loss {:.4}, pixel accuracy {:.1}%, mean IoU {:.3}",
            e.loss,
            100.0 * e.accuracy,
            e.mean_iou()
        ),
    }
}

/// Mean loss and accuracy over reports.
/// What the summary needs of the steps run, in memory that does not grow with the run.
#[derive(Default)]
struct Totals {
    steps: usize,
    images: usize,
    data_wait: f64,
    /// Per rank: busy seconds, wall seconds, seconds waiting for data, for halos.
    per_rank: Vec<[f64; 4]>,
    /// The last [`WINDOW`] steps, oldest first.
    recent: std::collections::VecDeque<StepReport>,
}

/// Steps the progress line's and the summary's loss and accuracy are the mean of.
const WINDOW: usize = 10;

impl Totals {
    fn add(&mut self, r: StepReport) {
        self.steps += 1;
        self.images += r.images;
        self.data_wait += r.data_wait;
        self.per_rank.resize(r.ranks.len(), [0.0; 4]);
        for (sum, rank) in self.per_rank.iter_mut().zip(&r.ranks) {
            sum[0] += rank.busy;
            sum[1] += rank.seconds;
            sum[2] += rank.data_wait;
            sum[3] += rank.halo_wait;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(r);
    }
}

fn window_stats<'a>(rs: impl Iterator<Item = &'a StepReport>) -> (f64, f64) {
    let (mut loss, mut correct, mut seen, mut n) = (0.0, 0, 0, 0);
    for r in rs {
        loss += r.loss;
        correct += r.correct;
        seen += r.scored;
        n += 1;
    }
    (loss / n.max(1) as f64, correct as f64 / seen.max(1) as f64)
}
/// Warns of samples left out when the data was opened.
pub fn report_skipped(skipped: &[(String, String)]) {
    for (what, why) in skipped {
        eprintln!("warning: skipping {what}: {why}");
    }
    if !skipped.is_empty() {
        println!("{} unreadable samples left out", skipped.len());
    }
}
