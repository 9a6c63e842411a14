//! `gems eval`: a checkpoint (or plain weights) scored on held-out samples or another data set;
//! `gems export`: weights out as a plain state_dict.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gems::backend::cuda::ConvImpl;
use gems::data::maps::{self, ClassMap};
use gems::data::slide::{self, Slide};
use gems::data::transform::Transform;
use gems::data::{DataConfig, Pipeline, SourceSpec};
use gems::ops::tiles::Grid;
use gems::runtime::Checkpoint;
use gems::{models, DType, Model, RunConfig, Scheme, Session, TrainConfig};

use crate::cli::{DataSource, DeviceArgs, EvalArgs, ExportArgs, SlideArgs};
use crate::train::report_skipped;

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    if a.batch_size == 0 {
        anyhow::bail!("evaluation needs a batch of at least 1");
    }
    // Plain weights hold no held-out split: they are scored on synthetic data unless told.
    let data = match (&a.data, &a.init) {
        (None, Some(_)) => Some(DataSource::Synthetic),
        (data, _) => data.clone(),
    };
    let model = match (&a.checkpoint, &a.init) {
        (Some(file), _) => Model::load(file)?,
        (None, _) => {
            let source = data.as_ref().expect("--init has data");
            let spec = a.slides.spec(source, a.image_size)?;
            let classes = match gems::data::pipeline::class_names(&spec, models::task(&a.model)?)? {
                Some(names) => names.len(),
                None => a.classes.unwrap_or(10),
            };
            let graph = models::build(&a.model, a.image_size, classes)?;
            let file = a
                .init
                .as_ref()
                .expect("clap requires --checkpoint or --init");
            Model::from_state_dict(file, graph)?.prepare(Transform {
                normalize: a.normalize,
                resize: a.resize,
                ..Transform::default()
            })
        }
    };
    let mut model = configured(
        model,
        &a.on,
        a.dtype,
        a.conv,
        a.skip_bad,
        Some(a.batch_size),
        a.spatial,
    )?;
    if let Some(weights) = &a.class_weights {
        let classes = model.graph().classes();
        if weights.len() != classes {
            anyhow::bail!(
                "--class-weights gives {} weights for the model's {classes} classes",
                weights.len()
            );
        }
        model = model.configure(|c| c.class_weights = Some(weights.clone()));
        model.config().check()?;
    }
    let (order, samples, what) = match &data {
        Some(source) => {
            let (order, samples) = samples_of(&model, source, &a.slides, a.samples)?;
            (order, samples, "samples")
        }
        None => {
            let c = model.config();
            let (side, classes) = (model.graph().image_size(), model.graph().classes());
            let held_out = gems::data::open(&c.data, side, classes, c.seed)?.val;
            let order = held_out.ok_or_else(|| {
                anyhow::anyhow!(
                    "nothing is held out: give --data to evaluate on, or train with --val"
                )
            })?;
            let samples = match c.data.source {
                SourceSpec::Synthetic => Some(a.samples.unwrap_or(1000)),
                _ => a.samples,
            };
            (order, samples, "held-out samples")
        }
    };
    refuse_overwriting_inputs(&a, &order)?;
    let map_every = match &a.predictions {
        Some(_) => map_every(&order, a.map_level)?,
        None => 0,
    };
    let e = model.evaluate(&order, samples, map_every)?;
    if let Some(path) = &a.per_sample {
        write_per_sample(path, &e, &order)?;
    }
    if let Some(dir) = &a.predictions {
        write_predictions(dir, &e, &order, a.map_level, map_every)?;
    }
    let pixels = e.per_pixel;
    println!(
        "{} at step {} ({}{}): loss {:.4}, {}accuracy {:.1}% on {} {what}",
        model.graph().name,
        model.steps(),
        model.config().dtype.name(),
        on_tiles(&model),
        e.loss,
        if pixels { "pixel " } else { "" },
        100.0 * e.accuracy,
        e.samples
    );
    let names: Vec<String> = e
        .classes
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{i} {c}"))
        .collect();
    let width = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(0)
        .max(5);
    if pixels {
        println!("mean IoU {:.3}", e.mean_iou());
        println!(
            "{:<width$} {:>12} {:>6} {:>6}",
            "class", "pixels", "IoU", "Dice"
        );
        let shown = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.3}"));
        for (((name, n), iou), dice) in names.iter().zip(e.per_class()).zip(e.iou()).zip(e.dice()) {
            println!(
                "{name:<width$} {n:>12} {:>6} {:>6}",
                shown(iou),
                shown(dice)
            );
        }
    }
    let what = if pixels { "pixels" } else { "samples" };
    println!("confusion matrix (rows: true class, columns: predicted):");
    print!("{:<width$} {what:>12}", "class");
    for i in 0..names.len() {
        print!(" {i:>8}");
    }
    println!("  recall");
    for (i, ((name, row), n)) in names
        .iter()
        .zip(&e.confusion)
        .zip(e.per_class())
        .enumerate()
    {
        print!("{name:<width$} {n:>12}");
        for v in row {
            print!(" {v:>8}");
        }
        let recall = match n {
            0 => 0.0,
            n => 100.0 * row[i] as f64 / n as f64,
        };
        println!("  {recall:5.1}%");
    }
    Ok(())
}

/// ", on RxC tiles" where `model` runs each sample on tiles, else nothing: for summaries.
pub fn on_tiles(model: &Model) -> String {
    let grid = model.scheme().spatial;
    match grid.is_split() {
        true => format!(", on {grid} tiles"),
        false => String::new(),
    }
}

/// `model` computing where `on` says, in `dtype` (default: the checkpoint's), with `conv`
/// convolutions, in micro-batches of `batch` (default: the checkpoint's), leaving unreadable
/// samples out with `skip_bad`, each sample split into `spatial`'s tiles.
pub fn configured(
    model: Model,
    on: &DeviceArgs,
    dtype: Option<DType>,
    conv: ConvImpl,
    skip_bad: bool,
    batch: Option<usize>,
    spatial: Grid,
) -> anyhow::Result<Model> {
    let on = on.for_checkpoint()?;
    let task = models::task(&model.graph().name)?;
    let model = model.configure(|c| {
        c.dtype = dtype.unwrap_or(c.dtype);
        on(c);
        c.data.task = task;
        c.data.skip_bad = skip_bad;
        c.conv = conv;
        c.batch_size = batch.unwrap_or(c.batch_size);
    });
    Ok(match spatial.is_split() {
        true => model.spread(Scheme::single(1).with_spatial(spatial)),
        false => model,
    })
}

/// The samples of `source` to score with `model`, prepared as it prepares images, in order,
/// and how many: every sample of a finite data set (the first epoch of its order holds each
/// once), at most `samples`; of an endless stream, `samples` (default 1000) of its held-out
/// stream. A data set's classes are matched to the checkpoint's by name (plain weights, and
/// checkpoints from before names were recorded, match by position).
pub fn samples_of(
    model: &Model,
    source: &DataSource,
    slides: &SlideArgs,
    samples: Option<usize>,
) -> anyhow::Result<(Arc<Pipeline>, Option<usize>)> {
    let c = model.config();
    let (side, classes) = (model.graph().image_size(), model.graph().classes());
    let prepared = model.transform();
    let config = DataConfig {
        source: slides.spec(source, side)?,
        augment: false,
        val: 0.0,
        normalize: prepared.normalize,
        resize: prepared.resize,
        ..c.data.clone()
    };
    let mut data = gems::data::open(&config, side, classes, c.seed)?;
    report_skipped(&data.skipped);
    if data.train.samples().is_none() {
        let held_out = data
            .val
            .ok_or_else(|| anyhow::anyhow!("{source:?} holds nothing out"))?;
        return Ok((held_out, Some(samples.unwrap_or(1000))));
    }
    if let Some(names) = model.class_names().filter(|n| *n != data.classes) {
        let renamed = data.train.by_class_names(names);
        data.train = Arc::new(renamed.map_err(|e| anyhow::anyhow!("{}: {e}", config.source))?);
    }
    Ok((data.train, samples))
}

pub fn export(a: ExportArgs) -> anyhow::Result<()> {
    gems::core::files::refuse_overwriting(std::slice::from_ref(&a.out), a.checkpoint.as_slice())?;
    let what = match &a.checkpoint {
        Some(file) => {
            let ckpt = Checkpoint::read(file)?;
            let (model, side, classes) = ckpt.model()?;
            let graph = models::build(&model, side, classes)?;
            let dtype = ckpt.config()?.dtype;
            let state = ckpt.state(&graph, dtype)?;
            gems::runtime::checkpoint::save_weights(&graph, dtype, &state, &a.out)?;
            format!("{model}'s weights at step {}", state.step)
        }
        None => {
            let graph = models::build(&a.model, a.image_size, a.classes)?;
            let train = TrainConfig {
                seed: a.seed,
                ..TrainConfig::new(1, 1)
            };
            // The session never steps; its data only has to be of the model's task (synthetic
            // scenes for a segmentation model, images for a classifier).
            let task = models::task(&a.model)?;
            let synthetic = DataConfig {
                task,
                ..DataConfig::default()
            };
            let data = gems::data::open(&synthetic, a.image_size, a.classes, a.seed)?;
            let mut session = Session::new(&graph, RunConfig::new(train, Scheme::single(1)), data)?;
            session.save_weights(&a.out)?;
            format!("{}'s initial weights (seed {})", a.model, a.seed)
        }
    };
    println!("wrote {what} to {}", a.out.display());
    Ok(())
}

/// Refuses, before any work, a `--predictions` folder or `--per-sample` file whose outputs
/// (`tiles.csv`, each slide's `<stem>.png` and `<stem>.tiff`) would replace what the run reads
/// (a slide, the labels, the checkpoint or the initial weights) or are not files gems may
/// write (see [`gems::core::files::check_output`]).
fn refuse_overwriting_inputs(a: &EvalArgs, order: &Pipeline) -> anyhow::Result<()> {
    let mut inputs: Vec<PathBuf> = [&a.checkpoint, &a.init, &a.slides.labels]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    let mut slides: Vec<PathBuf> = (0..order.positions() as u64)
        .filter_map(|pos| order.place(pos).map(|p| p.slide.path().to_path_buf()))
        .collect();
    slides.sort();
    slides.dedup();
    inputs.extend(slides.iter().cloned());
    let mut outputs: Vec<PathBuf> = a.per_sample.iter().cloned().collect();
    if let Some(dir) = &a.predictions {
        outputs.push(dir.join("tiles.csv"));
        for slide in &slides {
            let stem = slide::slide_name(slide);
            outputs.push(dir.join(format!("{stem}.png")));
            outputs.push(dir.join(format!("{stem}.tiff")));
        }
    }
    gems::core::files::refuse_overwriting(&outputs, &inputs)?;
    for out in &outputs {
        gems::core::files::check_output(out)?;
    }
    Ok(())
}

/// A CSV field, quoted when it must be.
pub fn quoted(s: &str) -> String {
    match s.contains([',', '"', '\n']) {
        true => format!("\"{}\"", s.replace('"', "\"\"")),
        false => s.to_string(),
    }
}

/// A class's name, or `unlabelled`.
pub fn class_name(e: &gems::Evaluation, c: u32) -> &str {
    e.classes
        .get(c as usize)
        .map_or("unlabelled", String::as_str)
}

pub fn create(path: &Path) -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
    Ok(std::io::BufWriter::new(gems::core::files::create_output(
        path,
    )?))
}

/// Each sample's result as CSV rows: where it comes from, its true and predicted classes (for
/// a segmented sample, the class most of its pixels have), its loss.
fn write_per_sample(path: &Path, e: &gems::Evaluation, order: &Pipeline) -> anyhow::Result<()> {
    let mut out = create(path)?;
    writeln!(out, "sample,true,predicted,loss")?;
    for s in &e.per_sample {
        writeln!(
            out,
            "{},{},{},{}",
            quoted(&order.describe(s.position)),
            quoted(class_name(e, s.label)),
            quoted(class_name(e, s.predicted)),
            s.loss
        )?;
    }
    out.flush()?;
    Ok(())
}

/// The map level of `slide`: `chosen`, or the finest whose longer side is at most 2048.
fn map_level(slide: &Slide, chosen: Option<usize>) -> anyhow::Result<usize> {
    if let Some(level) = chosen {
        slide.level(level)?;
        return Ok(level);
    }
    let levels = slide.levels();
    Ok((0..levels.len())
        .find(|&k| levels[k].width.max(levels[k].height) <= 2048)
        .unwrap_or(levels.len() - 1))
}

/// Model-input pixels between the kept predictions of a segmented tile: about one map pixel
/// (from the first sample's slide; every tile of a run is cut alike).
pub fn map_every(order: &Pipeline, chosen: Option<usize>) -> anyhow::Result<usize> {
    let place = order.place(0).ok_or_else(|| not_a_slide(order))?;
    let (tile, map) = (
        maps::downsample(place.slide, place.level)?.0,
        maps::downsample(place.slide, map_level(place.slide, chosen)?)?.0,
    );
    let model_pixels_per_tile_pixel = order.image_size() as f64 / place.side as f64;
    Ok(((map / tile) * model_pixels_per_tile_pixel)
        .round()
        .max(1.0) as usize)
}

fn not_a_slide(order: &Pipeline) -> anyhow::Error {
    anyhow::anyhow!(
        "--predictions draws maps of slides; {} is not a slide's tile (use --data slides:DIR)",
        order.describe(0)
    )
}

/// Every slide's map (PNG overlay and tiled TIFF) and tiles.csv into `dir`.
pub fn write_predictions(
    dir: &Path,
    e: &gems::Evaluation,
    order: &Pipeline,
    chosen: Option<usize>,
    every: usize,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|err| anyhow::anyhow!("cannot create {}: {err}", dir.display()))?;
    let mut csv = create(&dir.join("tiles.csv"))?;
    let scores: Vec<String> = e.classes.iter().map(|c| quoted(c)).collect();
    writeln!(
        csv,
        "slide,level,x,y,side,true,predicted,loss,{}",
        scores.join(",")
    )?;
    // Tiles in reading order (the evaluation's order is an epoch's shuffle).
    let mut placed = e
        .per_sample
        .iter()
        .map(|s| {
            Ok((
                order.place(s.position).ok_or_else(|| not_a_slide(order))?,
                s,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    placed.sort_by_key(|(p, _)| (p.slide.path().to_path_buf(), p.y, p.x));
    // Maps by slide, in the order slides first appear.
    let mut maps: Vec<(&Slide, ClassMap)> = Vec::new();
    for (place, s) in placed {
        let at = match maps
            .iter()
            .position(|(m, _)| m.path() == place.slide.path())
        {
            Some(at) => at,
            None => {
                let level = map_level(place.slide, chosen)?;
                maps.push((place.slide, ClassMap::new(place.slide, level)?));
                maps.len() - 1
            }
        };
        let xy = (place.x, place.y);
        let map = &mut maps[at].1;
        match s.map.is_empty() {
            true => map.paint(
                place.slide,
                place.level,
                xy,
                place.side,
                place.side as f64,
                1,
                &[s.predicted],
            )?,
            false => {
                let side = order.image_size();
                let cols = (every / 2..side).step_by(every).count();
                let cell = every as f64 * place.side as f64 / side as f64;
                map.paint(place.slide, place.level, xy, place.side, cell, cols, &s.map)?
            }
        }
        let scores: Vec<String> = s.scores.iter().map(f32::to_string).collect();
        writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{}",
            quoted(
                &place
                    .slide
                    .path()
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
            ),
            place.level,
            place.x,
            place.y,
            place.side,
            quoted(class_name(e, s.label)),
            quoted(class_name(e, s.predicted)),
            s.loss,
            scores.join(",")
        )?;
    }
    csv.flush()?;
    for (slide, map) in &maps {
        let stem = slide::slide_name(slide.path());
        let (png, tiff) = (
            dir.join(format!("{stem}.png")),
            dir.join(format!("{stem}.tiff")),
        );
        map.write_overlay(slide, &png)?;
        let about = format!("gems predictions of {stem} at level {}", map.level);
        map.write_tiff(&tiff, 256, &about)?;
        println!(
            "wrote {} and {} ({}×{}, level {})",
            png.display(),
            tiff.display(),
            map.width,
            map.height,
            map.level
        );
    }
    let legend: Vec<String> = e
        .classes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let [r, g, b] = maps::colour(i as u8);
            format!("{c} #{r:02x}{g:02x}{b:02x}")
        })
        .collect();
    println!(
        "colours: {}; wrote {}",
        legend.join(", "),
        dir.join("tiles.csv").display()
    );
    Ok(())
}
