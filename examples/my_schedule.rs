//! A pipeline schedule of your own: 1F1B with every weight-gradient pass (W) deferred to the
//! end of the step, written in a few lines from the built-in 1F1B, checked, planned (each
//! rank's metered memory, the predicted bubble) and trained, against 1F1B itself and 1F1B
//! with the first stage's activations offloaded as tasks (OFFLOAD after each F, PREFETCH just
//! before its backward).
//!
//! Run: `cargo run --release --example my_schedule`

use gems::plan::Layout;
use gems::schemes::schedule::{Pass, Schedule, Task};
use gems::{models, DType, Dataset, Kind, Order, RunConfig, Scheme, Session, TrainConfig};

/// `schedule` with each BW split into its B, in place, and its W, at the end of the rank's
/// passes: its gradient sums (REDUCE) and optimizer step (STEP) follow the last W.
fn defer_weights(schedule: &Schedule) -> Schedule {
    let mut late = schedule.clone();
    for tasks in &mut late.ranks {
        let ws: Vec<Task> = (tasks.iter())
            .filter(|t| t.pass == Pass::Backward)
            .map(|t| Task::weight(t.stage, t.micro))
            .collect();
        for t in tasks.iter_mut().filter(|t| t.pass == Pass::Backward) {
            t.pass = Pass::Input;
        }
        let (closing, mut passes): (Vec<Task>, Vec<Task>) =
            tasks.iter().partition(|t| t.pass.is_collective());
        passes.extend(ws);
        passes.extend(closing);
        *tasks = passes;
    }
    late
}

fn main() -> gems::Result<()> {
    let graph = models::build("resnet20v2", 32, 4)?;
    let scheme = Scheme::new(Kind::Mp, 2, 4, 1, 1, Order::OneFOneB);
    let mut train = TrainConfig::new(8, 3);
    train.dtype = DType::F64;
    let config = RunConfig::new(train, scheme);

    let one_f = Layout::new(&graph, &config)?.schedule.schedule(&scheme);
    let mine = defer_weights(&one_f);
    mine.validate(&scheme)?;
    print!("{}", mine.to_json());
    // Back just before its backward: the least memory; a PREFETCH a pass or more ahead
    // overlaps its copies with that pass on a GPU but holds the tensors during it.
    let offloaded = one_f.offloading(|f| f.stage == 0, 0);
    offloaded.validate(&scheme)?;

    // What each schedule costs, before training either.
    let mut runs = Vec::new();
    for (name, schedule) in [
        ("1f1b", one_f),
        ("W at the end", mine),
        ("1f1b, stage 0 offloaded", offloaded),
    ] {
        let mut c = config.clone();
        c.schedule = Some(std::sync::Arc::new(schedule.clone()));
        let bubble = Layout::new(&graph, &c)?.schedule.bubble();
        let peaks: Vec<String> = gems::fit::per_rank(&graph, &c)?
            .iter()
            .map(|m| gems::memory::human_bytes(m.peak))
            .collect();
        println!(
            "{name}: predicted bubble {:.1}%, peak per rank {}",
            100.0 * bubble,
            peaks.join(", ")
        );
        let data = Dataset::synthetic(32, 4, 0);
        let mut session = Session::with_schedule(&graph, config.clone(), schedule, data)?;
        let losses: Vec<f64> = (0..3)
            .map(|_| session.step().map(|r| r.loss))
            .collect::<gems::Result<_>>()?;
        println!("{name}: losses {losses:?}");
        runs.push(losses);
    }
    // Deferring W changes when gradients are summed, not what they sum to; an offload moves
    // tensors, not values.
    for run in &runs[1..] {
        for (a, b) in runs[0].iter().zip(run) {
            assert!((a - b).abs() <= 1e-9 * b.abs(), "{a} against {b}");
        }
    }
    println!("the same losses to 1e-9: a schedule changes memory and time, not the result");
    Ok(())
}
