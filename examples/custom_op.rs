//! An op of your own (examples/common/scaled_swish.rs: a Swish with a learnable slope per
//! channel) checked against finite differences in one line, used in a graph like a built-in
//! op, planned by the metered run, and trained under MP-Basic (2 stages, 1F1B) with exactly
//! the losses of single-device training.
//!
//! Run: `cargo run --release --example custom_op`

#[path = "common/scaled_swish.rs"]
mod scaled_swish;

use gems::graph::Output;
use gems::memory::human_bytes;
use gems::ops::conv::Conv2d;
use gems::ops::{check_gradients, Custom};
use gems::{fit, Dataset, Graph, GraphBuilder, Order, RunConfig, Scheme, Session, TrainConfig};
use gems::{DType, Shape};
use scaled_swish::ScaledSwish;

/// conv → BN → scaled Swish, twice (the second halving the map), then a pooled classifier.
fn model(image: usize, classes: usize) -> gems::Result<Graph> {
    let (mut b, x) = GraphBuilder::new("swish_cnn", "SwishCnn", Shape::new([3, image, image]));
    let swish = Custom::new("scaled-swish", ScaledSwish);
    let x = b.conv("conv1", x, Conv2d::new(8, 3, 1, 1))?;
    let x = b.batchnorm("bn1", x)?;
    let x = b.custom("act1", swish.clone(), &[x])?;
    let x = b.conv("conv2", x, Conv2d::new(16, 3, 2, 1))?;
    let x = b.batchnorm("bn2", x)?;
    let x = b.custom("act2", swish, &[x])?;
    let x = b.global_avg_pool("pool", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    b.finish(vec![Output::new(logits)])
}

/// The losses of `steps` steps of `scheme` in f64 on the same synthetic images.
fn losses(graph: &Graph, scheme: Scheme, steps: usize) -> gems::Result<Vec<f64>> {
    let train = TrainConfig {
        dtype: DType::F64,
        ..TrainConfig::new(8, steps)
    };
    let data = Dataset::synthetic(graph.image_size(), graph.classes(), 0);
    let mut session = Session::new(graph, RunConfig::new(train, scheme), data)?;
    (0..steps).map(|_| Ok(session.step()?.loss)).collect()
}

fn main() -> gems::Result<()> {
    let check = check_gradients(&ScaledSwish, &[Shape::new([3, 5, 4])], 2, 1)?;
    println!("{check}");
    assert!(check.passed(), "the scaled swish's backward is wrong");

    let (image, classes) = (16, 3);
    let graph = model(image, classes)?;
    print!("{}", graph.adjacency_list());
    let pipeline = Scheme::mp()
        .stages(2)
        .micro_batches(2)
        .order(Order::OneFOneB);
    let config = RunConfig::new(TrainConfig::new(8, 1), pipeline);
    for (rank, m) in fit::per_rank(&graph, &config)?.iter().enumerate() {
        println!(
            "planned rank {rank}: peak {}: {}",
            human_bytes(m.peak),
            m.at_peak
        );
    }

    let steps = 3;
    let single = losses(&graph, Scheme::single(2), steps)?;
    let mp = losses(&graph, pipeline, steps)?;
    for (step, (s, p)) in single.iter().zip(&mp).enumerate() {
        println!("step {}: single loss {s:.12}, mp loss {p:.12}", step + 1);
        assert!(
            (s - p).abs() <= 1e-9 * s.abs(),
            "step {}: mp's loss {p} is not single's {s}",
            step + 1
        );
    }
    println!("mp over 2 stages (1F1B) trains the custom op exactly as one device does");
    Ok(())
}
