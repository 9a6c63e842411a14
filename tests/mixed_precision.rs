//! Mixed precision on the reference backend: bf16 and fp16 activations with f32 master
//! weights compute the f32 gradients to within their rounding, learn, halve activation memory
//! as the planner predicts, and fp16's loss scale skips exactly the steps that overflow, on
//! every rank together.

use gems::runtime::executor::{run_local, RunConfig};
use gems::runtime::optim::{LossScale, SgdConfig};
use gems::runtime::schedule::{Decay, LrSchedule};
use gems::schemes::{Kind, Order, Scheme};
use gems::train::{TrainConfig, Trainer};
use gems::{Category, DType, Error, Precision};

fn config(precision: Precision, batch: usize, steps: usize) -> TrainConfig {
    TrainConfig {
        schedule: LrSchedule {
            base: 0.1,
            decay: Decay::Cosine,
            warmup: 5,
            total: steps,
        },
        sgd: SgdConfig {
            momentum: 0.9,
            weight_decay: 5e-4,
            nesterov: false,
        },
        precision,
        ..TrainConfig::new("resnet20v2", 32, 10, batch, steps)
    }
}

/// Every parameter gradient after one step, divided by the loss scale they carry.
fn gradients(precision: Precision) -> Vec<Vec<f64>> {
    let mut t = Trainer::new(config(precision, 8, 1)).unwrap();
    let r = t.step().unwrap();
    assert!(!r.skipped, "{precision}: the first step overflowed");
    let scale = r.loss_scale.unwrap_or(1.0);
    t.params
        .grads
        .iter()
        .flatten()
        .map(|g| g.to_f64_vec().unwrap().iter().map(|v| v / scale).collect())
        .collect()
}

/// ‖a − b‖ / ‖b‖ over all elements.
fn relative_error(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        diff += (x - y) * (x - y);
        norm += y * y;
    }
    (diff / norm).sqrt()
}

#[test]
fn gradients_match_f32_to_within_the_activation_type() {
    let reference = gradients(Precision::Fp32);
    // Unit roundoff: 2⁻⁸ for bf16 (8 significant bits), 2⁻¹¹ for f16. Every activation and
    // activation gradient of the 20 layers is rounded once where it is stored; their errors
    // add up roughly as a random walk, so a few units over the whole model.
    for (precision, unit) in [
        (Precision::Bf16, 2f64.powi(-8)),
        (Precision::Fp16, 2f64.powi(-11)),
    ] {
        let err = relative_error(&gradients(precision), &reference);
        eprintln!(
            "{precision}: gradients within {err:.2e} of f32 ({:.1} units)",
            err / unit
        );
        assert!(err < 8.0 * unit, "{precision}: relative error {err:e}");
        // Not the f32 gradients themselves: the activations really were rounded.
        assert!(err > unit / 16.0, "{precision}: relative error {err:e}");
    }
}

#[test]
fn bf16_and_fp16_learn() {
    let steps = 60;
    for precision in [Precision::Bf16, Precision::Fp16] {
        let mut t = Trainer::new(config(precision, 32, steps)).unwrap();
        let reports: Vec<_> = (0..steps).map(|_| t.step().unwrap()).collect();
        let first = reports[0].loss;
        let last = reports[steps - 10..].iter().map(|r| r.loss).sum::<f64>() / 10.0;
        let skipped = reports.iter().filter(|r| r.skipped).count();
        eprintln!("{precision}: loss {first:.3} -> {last:.3}, {skipped} steps skipped");
        assert!(
            (first - 10f64.ln()).abs() < 0.5,
            "{precision}: first loss {first}"
        );
        assert!(
            last < 0.5 * 10f64.ln(),
            "{precision}: loss after {steps} steps: {last}"
        );
        assert!(skipped <= 1, "{precision}: {skipped} steps skipped");
    }
}

#[test]
fn activations_take_half_the_bytes() {
    let peak = |precision| {
        let mut t = Trainer::new(config(precision, 16, 1)).unwrap();
        t.step().unwrap();
        t.memory().at_peak.get(Category::Activations)
    };
    let (full, half) = (peak(Precision::Fp32), peak(Precision::Bf16));
    let ratio = half as f64 / full as f64;
    // Batch statistics and the softmax probabilities stay f32: a little over one half.
    assert!((0.5..0.52).contains(&ratio), "bf16 {half} vs fp32 {full}");
}

#[test]
fn the_plan_predicts_mixed_precision_memory() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        let c = RunConfig::new(config(precision, 16, 1), Scheme::single(1));
        let predicted = gems::plan::memory::per_rank(&c).unwrap()[0].peak;
        let mut t = Trainer::new(config(precision, 16, 1)).unwrap();
        t.step().unwrap();
        let measured = t.memory().peak;
        let err = (predicted as f64 - measured as f64).abs() / measured as f64;
        assert!(
            err <= 0.05,
            "{precision}: predicted {predicted} measured {measured}"
        );
    }
}

#[test]
fn an_overflow_skips_the_step_and_halves_the_scale() {
    // 2⁴⁰ overflows f16 in the loss gradient itself: steps are skipped, the weights untouched,
    // until the scale has halved far enough.
    let mut c = config(Precision::Fp16, 8, 40);
    c.loss_scale = 2f64.powi(40);
    let mut t = Trainer::new(c).unwrap();
    let initial: Vec<Vec<f64>> = t
        .params
        .values
        .iter()
        .map(|v| v.to_f64_vec().unwrap())
        .collect();
    let mut scale = 2f64.powi(40);
    let mut first_applied = None;
    for step in 0..40 {
        let r = t.step().unwrap();
        assert_eq!(r.loss_scale, Some(scale), "step {step}");
        if r.skipped {
            assert!(
                first_applied.is_none(),
                "step {step} skipped after one was applied"
            );
            let now: Vec<Vec<f64>> = t
                .params
                .values
                .iter()
                .map(|v| v.to_f64_vec().unwrap())
                .collect();
            assert!(now == initial, "skipped step {step} changed the weights");
            scale /= 2.0;
        } else {
            first_applied.get_or_insert(step);
        }
    }
    let first = first_applied.expect("a step applied within 40");
    assert!(
        first >= 10,
        "2^40 should overflow for a while, applied at {first}"
    );
    assert_eq!(t.loss_scale.as_ref().unwrap().skipped(), first);
    let now: Vec<Vec<f64>> = t
        .params
        .values
        .iter()
        .map(|v| v.to_f64_vec().unwrap())
        .collect();
    assert!(now != initial, "applied steps change the weights");
}

#[test]
fn the_loss_scale_survives_a_checkpoint() {
    let mut c = config(Precision::Fp16, 8, 4);
    c.loss_scale = 2f64.powi(40);
    let mut t = Trainer::new(c).unwrap();
    t.step().unwrap();
    let dir = std::env::temp_dir().join(format!("gems-mp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("fp16.safetensors");
    gems::checkpoint::save(&t, &path).unwrap();
    let resumed = Trainer::resume(&path, |_| {}).unwrap();
    assert_eq!(resumed.config.precision, Precision::Fp16);
    assert_eq!(
        resumed.loss_scale.as_ref().map(LossScale::factor),
        Some(2f64.powi(39))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_spread_run_equals_the_trainer_in_mixed_precision() {
    for precision in [Precision::Bf16, Precision::Fp16] {
        let mut c = RunConfig::new(config(precision, 8, 3), Scheme::single(1));
        c.return_params = true;
        let r = run_local(&c).unwrap();
        let mut t = Trainer::new(config(precision, 8, 3)).unwrap();
        for (step, want) in r[0].losses.iter().enumerate() {
            let got = t.step().unwrap().loss;
            assert_eq!(got.to_bits(), want.to_bits(), "{precision} step {step}");
        }
        for (_, id, v) in &r[0].params {
            assert_eq!(
                v,
                &t.params.values[*id].to_f64_vec().unwrap(),
                "{precision} param {id}"
            );
        }
    }
}

#[test]
fn every_rank_skips_an_overflowing_step() {
    // Only the last stage's loss gradient overflows at first, yet both stages skip.
    let mut train = config(Precision::Fp16, 4, 3);
    train.loss_scale = 2f64.powi(40);
    let mut c = RunConfig::new(train, Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe));
    c.return_params = true;
    let reports = run_local(&c).unwrap();
    let t = Trainer::new(config(Precision::Fp16, 4, 3)).unwrap();
    for r in &reports {
        assert_eq!(r.skipped_steps, 3, "rank {}", r.rank);
        for (_, id, v) in &r.params {
            assert_eq!(
                v,
                &t.params.values[*id].to_f64_vec().unwrap(),
                "param {id} moved"
            );
        }
    }
}

#[test]
fn mixed_precision_needs_f32_parameters() {
    let mut c = config(Precision::Bf16, 8, 1);
    c.dtype = DType::F64;
    match Trainer::new(c) {
        Err(Error::Config(e)) => assert!(e.contains("--precision bf16 needs f32"), "{e}"),
        Err(e) => panic!("expected a configuration error, got {e}"),
        Ok(_) => panic!("bf16 with f64 parameters was accepted"),
    }
}
