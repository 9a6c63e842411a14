//! `gems eval`: a checkpoint scored on held-out samples or another data set.

use std::sync::Arc;

use gems::data::{DataConfig, SourceSpec};
use gems::runtime::Checkpoint;
use gems::{models, RunConfig, Scheme, Session};

use crate::cli::EvalArgs;
use crate::train::report_skipped;

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    if a.batch_size == 0 {
        anyhow::bail!("evaluation needs a batch of at least 1");
    }
    let ckpt = Checkpoint::read(&a.checkpoint)?;
    let (model, side, classes) = ckpt.model()?;
    let graph = models::build(&model, side, classes)?;
    let mut c = ckpt.config()?;
    (a.on.for_checkpoint()?)(&mut c);
    c.data.skip_bad = a.skip_bad;
    c.conv = a.conv;
    c.batch_size = a.batch_size;
    let run = RunConfig::new(c.clone(), Scheme::single(1));
    // Classes are matched by name: the checkpoint's names number the labels (checkpoints from
    // before names were recorded match by position).
    let names = ckpt.class_names()?;
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
    let mut t = Session::new(&graph, run, data)?;
    t.restore(&a.checkpoint)?;
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
