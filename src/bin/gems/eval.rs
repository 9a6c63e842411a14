//! `gems eval`: a checkpoint (or plain weights) scored on held-out samples or another data set;
//! `gems export`: weights out as a plain state_dict.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use gems::data::maps::{self, ClassMap};
use gems::data::slide::Slide;
use gems::data::{DataConfig, Pipeline, SourceSpec};
use gems::runtime::Checkpoint;
use gems::{models, RunConfig, Scheme, Session, TrainConfig};

use crate::cli::{EvalArgs, ExportArgs};
use crate::train::report_skipped;

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    if a.batch_size == 0 {
        anyhow::bail!("evaluation needs a batch of at least 1");
    }
    // The model and its configuration, with the class names that number its labels
    // (checkpoints from before names were recorded, and plain weights, match by position).
    let (graph, mut c, names) = match (&a.checkpoint, &a.init) {
        (Some(file), _) => {
            let ckpt = Checkpoint::read(file)?;
            let (model, side, classes) = ckpt.model()?;
            let graph = models::build(&model, side, classes)?;
            (graph, ckpt.config()?, ckpt.class_names()?)
        }
        (None, _) => {
            let source = a.data.as_ref().expect("clap requires --data with --init");
            let spec = a.slides.spec(source, a.image_size)?;
            let classes = match gems::data::pipeline::class_names(&spec, models::task(&a.model)?)? {
                Some(names) => names.len(),
                None => a.classes.unwrap_or(10),
            };
            let graph = models::build(&a.model, a.image_size, classes)?;
            (graph, TrainConfig::new(a.batch_size, 1), None)
        }
    };
    let (model, side, classes) = (graph.name.clone(), graph.image_size(), graph.classes());
    (a.on.for_checkpoint()?)(&mut c);
    c.data.task = models::task(&model)?;
    c.data.skip_bad = a.skip_bad;
    c.conv = a.conv;
    c.batch_size = a.batch_size;
    let run = RunConfig::new(c.clone(), Scheme::single(1));
    let (data, what) = match &a.data {
        Some(source) => {
            let config = DataConfig {
                source: a.slides.spec(source, side)?,
                augment: false,
                val: 0.0,
                ..c.data.clone()
            };
            let mut data = gems::data::open(&config, side, classes, c.seed)?;
            report_skipped(&data.skipped);
            if let Some(names) = names.filter(|n| *n != data.classes) {
                if data.train.samples().is_some() {
                    let renamed = data.train.by_class_names(&names);
                    let renamed = renamed.map_err(|e| anyhow::anyhow!("{}: {e}", config.source))?;
                    data.train = Arc::new(renamed);
                    data.classes = names;
                }
            }
            (data, "samples")
        }
        None => (
            gems::data::open(&c.data, side, classes, c.seed)?,
            "held-out samples",
        ),
    };
    let (finite, train) = (data.train.samples().is_some(), data.train.clone());
    let held_out = data.val.clone();
    let mut t = Session::new(&graph, run, data)?;
    match (&a.checkpoint, &a.init) {
        (Some(file), _) => t.restore(file)?,
        (None, Some(file)) => t.load_weights(file)?,
        (None, None) => unreachable!("clap requires --checkpoint or --init"),
    }
    // What is scored, in which order: the data given (the first epoch of its shuffled order
    // holds every sample once), else the held-out split or stream.
    let (order, samples) = match (&a.data, finite) {
        (Some(_), true) => (Some(train), a.samples),
        (Some(_), false) => (held_out, Some(a.samples.unwrap_or(1000))),
        (None, _) => match c.data.source {
            SourceSpec::Synthetic => (held_out, Some(a.samples.unwrap_or(1000))),
            _ => (held_out, a.samples),
        },
    };
    let order = order.ok_or_else(|| {
        anyhow::anyhow!("nothing is held out: give --data to evaluate on, or train with --val")
    })?;
    let map_every = match &a.predictions {
        Some(_) => map_every(&order, a.map_level)?,
        None => 0,
    };
    let e = t.predict(&order, samples, map_every)?;
    if let Some(path) = &a.per_sample {
        write_per_sample(path, &e, &order)?;
    }
    if let Some(dir) = &a.predictions {
        write_predictions(dir, &e, &order, a.map_level, map_every)?;
    }
    let pixels = e.per_pixel;
    println!(
        "{} at step {}: loss {:.4}, {}accuracy {:.1}% on {} {what}",
        model,
        t.steps_done(),
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

pub fn export(a: ExportArgs) -> anyhow::Result<()> {
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
            let data = gems::Dataset::synthetic(a.image_size, a.classes, a.seed);
            let mut session = Session::new(&graph, RunConfig::new(train, Scheme::single(1)), data)?;
            session.save_weights(&a.out)?;
            format!("{}'s initial weights (seed {})", a.model, a.seed)
        }
    };
    println!("wrote {what} to {}", a.out.display());
    Ok(())
}

/// A CSV field, quoted when it must be.
fn quoted(s: &str) -> String {
    match s.contains([',', '"', '\n']) {
        true => format!("\"{}\"", s.replace('"', "\"\"")),
        false => s.to_string(),
    }
}

/// A class's name, or `unlabelled`.
fn class_name(e: &gems::Evaluation, c: u32) -> &str {
    e.classes
        .get(c as usize)
        .map_or("unlabelled", String::as_str)
}

fn create(path: &Path) -> anyhow::Result<std::io::BufWriter<std::fs::File>> {
    let file = std::fs::File::create(path)
        .map_err(|err| anyhow::anyhow!("cannot write {}: {err}", path.display()))?;
    Ok(std::io::BufWriter::new(file))
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
fn map_every(order: &Pipeline, chosen: Option<usize>) -> anyhow::Result<usize> {
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
fn write_predictions(
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
        let stem = slide
            .path()
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy();
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
