//! With a profile calibrated on this machine, the predicted step time of single and mp runs is
//! within 25% of the measured one. A measurement, not a check of logic: it needs the machine to
//! itself (a compile running beside it made one run predict 2.6× the measured time), so it is
//! run by hand — `cargo test --release --test calibration -- --ignored` — and its figures are
//! in docs/PERFORMANCE.md.

use std::sync::Arc;

use gems::plan::calibrate::calibrate;
use gems::runtime::executor::{run_local, Layout, RunConfig};
use gems::schemes::{Kind, Order, Scheme};
use gems::train::TrainConfig;
use gems::{models, DType, Device};

#[test]
#[ignore = "timing: needs an otherwise idle machine"]
fn calibrated_step_time_predictions_hold() {
    let micro = 16;
    let g = models::build("resnet20v2", 32, 10).unwrap();
    for (stages, parts) in [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4)] {
        // Calibrated right before each measurement: this shared VM's speed drifts by tens of
        // percent over a minute, more than the model's error.
        let device = Device::cpu("cpu", None);
        let cal =
            Arc::new(calibrate(&g, "resnet20v2", 32, 10, micro, DType::F32, &device, 5).unwrap());
        let kind = if stages == 1 { Kind::Single } else { Kind::Mp };
        let scheme = Scheme::new(kind, stages, parts, 1, 1, Order::GPipe);
        let mut c = RunConfig::new(
            TrainConfig {
                seed: 1,
                ..TrainConfig::new("resnet20v2", 32, 10, micro * parts, 13)
            },
            scheme,
        );
        c.calibration = Some(cal);
        let predicted = Layout::new(&c).unwrap().predicted_step(true);
        let reports = run_local(&c).unwrap();
        let mut steps: Vec<f64> = reports[0].step_seconds[1..].to_vec();
        steps.sort_by(f64::total_cmp);
        let measured = steps[steps.len() / 2];
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
