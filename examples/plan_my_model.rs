//! The exact planner on a model of your own: each rank's memory by category, the largest
//! batch and the fewest pipeline stages under a cap, a simulated weak-scaling curve; then a
//! real run of the same plan, whose measured peak per rank equals the plan's.
//!
//! Run: `cargo run --release --example plan_my_model`

#[path = "common/my_model.rs"]
mod my_model;

use gems::memory::human_bytes;
use gems::plan::simulate::{self, Profile};
use gems::{fit, Dataset, Order, RunConfig, Scheme, Session, TrainConfig};

fn main() -> gems::Result<()> {
    let (image, classes) = (128, 4);
    let graph = my_model::my_model(image, classes)?;
    let single = RunConfig::new(TrainConfig::new(8, 10), Scheme::single(1));
    let pipeline = RunConfig::new(
        TrainConfig::new(8, 10),
        Scheme::mp()
            .stages(2)
            .micro_batches(2)
            .order(Order::OneFOneB),
    );
    for (name, c) in [
        ("single", &single),
        ("mp over 2, 2 micro-batches", &pipeline),
    ] {
        println!("{name} at {image}², batch 8:");
        for (rank, m) in fit::per_rank(&graph, c)?.iter().enumerate() {
            println!("  rank {rank}: peak {}: {}", human_bytes(m.peak), m.at_peak);
        }
    }

    let cap = 48 << 20;
    let largest = fit::largest_batch(&graph, &single, cap, 1 << 16)?;
    println!(
        "largest batch on one device in {}: {largest}",
        human_bytes(cap)
    );
    let mut big = single.clone();
    big.train.batch_size = largest + 4;
    let split = fit::choose_split(&graph, &big, cap)?;
    println!(
        "a batch of {} in {} needs {} pipeline stages",
        big.train.batch_size,
        human_bytes(cap),
        split.scheme.stages
    );

    let points = simulate::weak_scaling(&graph, &pipeline, &Profile::V100_IB, 64)?;
    for p in points.iter().step_by(2) {
        println!(
            "  simulated on {:>2} V100s: {:>8.1} images/s",
            p.gpus, p.images_per_s
        );
    }

    // The plan is exact: a real run of the pipeline holds, per rank, what it predicted.
    let predicted = fit::per_rank(&graph, &pipeline)?;
    let mut session = Session::new(&graph, pipeline, Dataset::synthetic(image, classes, 0))?;
    let measured = session.step()?;
    for (rank, (p, m)) in predicted.iter().zip(&measured.ranks).enumerate() {
        println!(
            "rank {rank}: predicted peak {}, measured {}",
            human_bytes(p.peak),
            human_bytes(m.memory.peak)
        );
        assert_eq!(p.peak, m.memory.peak, "the plan is exact");
    }
    Ok(())
}
