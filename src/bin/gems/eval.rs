//! `gems eval`: a checkpoint (or plain weights) scored on held-out samples or another data set;
//! `gems export`: weights out as a plain state_dict.

use std::sync::Arc;

use gems::data::{DataConfig, SourceSpec, Task};
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
            let classes = match gems::data::pipeline::class_names(&spec, Task::Classify)? {
                Some(names) => names.len(),
                None => a.classes.unwrap_or(10),
            };
            let graph = models::build(&a.model, a.image_size, classes)?;
            (graph, TrainConfig::new(a.batch_size, 1), None)
        }
    };
    let (model, side, classes) = (graph.name.clone(), graph.image_size(), graph.classes());
    (a.on.for_checkpoint()?)(&mut c);
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
    let e = match (&a.data, finite) {
        // The first epoch of the (shuffled) training order holds every sample once.
        (Some(_), true) => t.evaluate(&train, a.samples)?,
        (Some(_), false) => t.evaluate_held_out(Some(a.samples.unwrap_or(1000)))?,
        (None, _) => {
            let samples = match c.data.source {
                SourceSpec::Synthetic => Some(a.samples.unwrap_or(1000)),
                _ => a.samples,
            };
            t.evaluate_held_out(samples)?
        }
    };
    if let Some(path) = &a.per_sample {
        // The samples' order: the data given, else the held-out split.
        let order = match (&a.data, finite) {
            (Some(_), true) => Some(&train),
            _ => held_out.as_ref(),
        };
        write_per_sample(path, &e, order)?;
    }
    println!(
        "{} at step {}: loss {:.4}, accuracy {:.1}% on {} {what}",
        model,
        t.steps_done(),
        e.loss,
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
    println!("confusion matrix (rows: true class, columns: predicted):");
    print!("{:<width$} {:>8}", "class", "samples");
    for i in 0..names.len() {
        print!(" {i:>6}");
    }
    println!("  recall");
    for (i, ((name, row), n)) in names
        .iter()
        .zip(&e.confusion)
        .zip(e.per_class())
        .enumerate()
    {
        print!("{name:<width$} {n:>8}");
        for v in row {
            print!(" {v:>6}");
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

/// Each sample's result as CSV rows: where it comes from (when `order` is the data evaluated),
/// its true and predicted classes, its loss.
fn write_per_sample(
    path: &std::path::Path,
    e: &gems::Evaluation,
    order: Option<&Arc<gems::data::Pipeline>>,
) -> anyhow::Result<()> {
    use std::io::Write;
    let file = std::fs::File::create(path)
        .map_err(|err| anyhow::anyhow!("cannot write {}: {err}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    writeln!(out, "sample,true,predicted,loss")?;
    let quoted = |s: String| match s.contains([',', '"', '\n']) {
        true => format!("\"{}\"", s.replace('"', "\"\"")),
        false => s,
    };
    for s in &e.per_sample {
        let sample = order.map_or(s.position.to_string(), |p| p.describe(s.position));
        writeln!(
            out,
            "{},{},{},{}",
            quoted(sample),
            quoted(e.classes[s.label as usize].clone()),
            quoted(e.classes[s.predicted as usize].clone()),
            s.loss
        )?;
    }
    out.flush()?;
    Ok(())
}
