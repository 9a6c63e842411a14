//! A model of your own, trained by your own loop under a device-memory cap.
//!
//! The graph comes from `GraphBuilder`; the planner says, before any work, whether the run
//! fits the cap (a typed error says by how much it does not, and what would), and the
//! session's allocator holds every step to it.
//!
//! Run: `cargo run --release --example custom_model`

#[path = "common/my_model.rs"]
mod my_model;

use gems::memory::human_bytes;
use gems::{fit, Dataset, RunConfig, Scheme, Session, TrainConfig, WhatFits};

fn main() -> gems::Result<()> {
    let (image, classes) = (64, 4);
    let graph = my_model::my_model(image, classes)?;
    println!(
        "{}: {} parameters, {:.1} MFLOPs per image",
        graph.name,
        graph.parameter_count(),
        graph.flops_per_sample() as f64 / 1e6
    );
    let cap = 24 << 20;
    let mut train = TrainConfig::new(64, 40);
    train.device_memory = Some(cap);
    let mut config = RunConfig::new(train, Scheme::single(1));

    // 64 images do not fit 24 MiB: the planner says so before any work, and what fits.
    let batch = match fit::check_fits(&graph, &config) {
        Err(gems::Error::DoesNotFit {
            rank,
            needed,
            what_fits: WhatFits::Batch(b),
            ..
        }) => {
            println!(
                "a batch of 64 does not fit {}: rank {rank} would need {}; a batch of {b} fits",
                human_bytes(cap),
                human_bytes(needed)
            );
            b
        }
        other => panic!("expected the plan not to fit, got {other:?}"),
    };
    config.train.batch_size = batch;
    fit::check_fits(&graph, &config)?;

    let mut session = Session::new(&graph, config, Dataset::synthetic(image, classes, 0))?;
    let mut first = None;
    for _ in 0..40 {
        let r = session.step()?;
        first.get_or_insert(r.loss);
        if (r.step + 1) % 10 == 0 {
            let peak = r.ranks[0].memory.peak;
            println!(
                "step {:>3}: loss {:.4}, {:.0} images/s, peak {} of {}",
                r.step + 1,
                r.loss,
                r.images_per_second(),
                human_bytes(peak),
                human_bytes(cap)
            );
            assert!(peak <= cap, "the allocator holds the cap");
        }
    }
    let e = session.evaluate_held_out(Some(256))?;
    println!(
        "held out: loss {:.4} (from {:.4} at the first step), accuracy {:.1}%",
        e.loss,
        first.unwrap_or(f64::NAN),
        100.0 * e.accuracy
    );
    Ok(())
}
