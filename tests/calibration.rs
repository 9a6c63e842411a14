//! With a profile calibrated on this machine, the predicted step time of single and mp runs is
//! within 25% of the measured one. This VM is shared and its speed drifts by tens of percent
//! over a minute, so calibration and measurement alternate in rounds (each round calibrates,
//! then runs every configuration a few steps) and both sides are medians over all rounds: a
//! slower stretch of time slows both alike. That holds up beside a compile (errors +1% to -23%
//! over three runs), but not beside a process that keeps a core busy: an op timed for a
//! millisecond runs at full speed between the other process's time slices while a step gets
//! its share, and in two runs of three a single-device step came out 36% and 47% slower than
//! predicted. So it is run by hand on a quiet machine — `cargo test --release --test
//! calibration -- --ignored` — and its figures are in docs/PERFORMANCE.md.

use std::sync::Arc;

use gems::plan::calibrate::{calibrate, Calibration};
use gems::plan::Layout;
use gems::schemes::{Kind, Order, Scheme};
use gems::{models, DType, Dataset, Device, Graph, RunConfig, Session, TrainConfig};

const ROUNDS: usize = 3;
/// Steps per run; the first warms up and is not counted.
const STEPS: usize = 6;
const MICRO: usize = 16;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run(stages: usize, parts: usize, cal: &Calibration) -> RunConfig {
    let kind = if stages == 1 { Kind::Single } else { Kind::Mp };
    let mut c = RunConfig::new(
        TrainConfig {
            seed: 1,
            ..TrainConfig::new(MICRO * parts, STEPS)
        },
        Scheme::new(kind, stages, parts, 1, 1, Order::GPipe),
    );
    c.calibration = Some(Arc::new(cal.clone()));
    c
}

/// Wall seconds of each step of `c` after the first.
fn step_seconds(g: &Graph, c: RunConfig) -> Vec<f64> {
    let mut s = Session::new(g, c, Dataset::synthetic(32, 10, 1)).unwrap();
    (0..STEPS)
        .map(|_| s.step().unwrap().seconds)
        .skip(1)
        .collect()
}

#[test]
#[ignore = "timing: a process keeping a core busy makes steps up to 47% slower than predicted"]
fn calibrated_step_time_predictions_hold() {
    let g = models::build("resnet20v2", 32, 10).unwrap();
    let configs = [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4)];
    let device = Device::cpu("cpu", None);
    let mut cals = Vec::new();
    let mut measured = vec![Vec::new(); configs.len()];
    for _ in 0..ROUNDS {
        let cal = calibrate(&g, MICRO, (DType::F32, DType::F32), &device, 3).unwrap();
        for (i, &(stages, parts)) in configs.iter().enumerate() {
            measured[i].extend(step_seconds(&g, run(stages, parts, &cal)));
        }
        cals.push(cal);
    }
    // Each op's median over the rounds.
    let per_op = |of: fn(&Calibration) -> &Vec<f64>| -> Vec<f64> {
        (0..g.nodes.len())
            .map(|n| median(cals.iter().map(|c| of(c)[n]).collect()))
            .collect()
    };
    let cal = Calibration {
        forward: per_op(|c| &c.forward),
        backward: per_op(|c| &c.backward),
        input: per_op(|c| &c.input),
        weight: per_op(|c| &c.weight),
        data: median(cals.iter().map(|c| c.data).collect()),
        loss: (0..g.outputs.len())
            .map(|o| median(cals.iter().map(|c| c.loss[o]).collect()))
            .collect(),
        optimizer: median(cals.iter().map(|c| c.optimizer).collect()),
        ..cals[0].clone()
    };
    for (&(stages, parts), steps) in configs.iter().zip(measured) {
        let predicted = Layout::new(&g, &run(stages, parts, &cal))
            .unwrap()
            .predicted_step(true);
        let measured = median(steps);
        let error = predicted / measured - 1.0;
        eprintln!(
            "P={stages} m={parts}: predicted {predicted:.4} s, measured {measured:.4} s ({:+.1}%)",
            100.0 * error
        );
        assert!(
            error.abs() <= 0.25,
            "P={stages} m={parts}: predicted {predicted:.4} s, measured {measured:.4} s"
        );
    }
}
