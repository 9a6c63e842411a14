//! Single-device training: it learns, it repeats bit for bit, and memory is exactly accounted.

use gems::optim::schedule::{Decay, LrSchedule};
use gems::optim::SgdConfig;
use gems::{models, Category, DType, Dataset, Error, RunConfig, Scheme, Session, TrainConfig};

fn config(steps: usize) -> TrainConfig {
    TrainConfig {
        schedule: LrSchedule {
            base: 0.1,
            decay: Decay::Cosine,
            warmup: 10.min(steps),
            total: steps,
        },
        sgd: SgdConfig {
            momentum: 0.9,
            weight_decay: 5e-4,
            nesterov: false,
        },
        ..TrainConfig::new(32, steps)
    }
}

/// resnet20v2 on synthetic 32² images of 10 classes, on one device.
fn trainer(c: TrainConfig) -> gems::Result<Session> {
    let g = models::build("resnet20v2", 32, 10)?;
    let data = Dataset::synthetic(32, 10, c.seed);
    Session::new(&g, RunConfig::new(c, Scheme::single(1)), data)
}

#[test]
fn resnet20v2_learns_synthetic_data() {
    let steps = 160;
    let mut t = trainer(config(steps)).unwrap();
    let reports: Vec<_> = (0..steps).map(|_| t.step().unwrap()).collect();
    let first = reports[0].loss;
    let last = &reports[steps - 10..];
    let loss = last.iter().map(|r| r.loss).sum::<f64>() / 10.0;
    let acc = last.iter().map(|r| r.correct).sum::<usize>() as f64 / (10 * 32) as f64;
    let chance = (10f64).ln();
    assert!(
        (first - chance).abs() < 0.5,
        "initial loss {first} should be near ln 10 = {chance}"
    );
    assert!(loss < 0.35 * chance, "loss after {steps} steps: {loss}");
    assert!(acc > 0.9, "training accuracy after {steps} steps: {acc}");
}

#[test]
fn same_seed_same_losses_to_the_last_bit() {
    let run = |seed: u64| {
        let mut c = config(4);
        c.seed = seed;
        let mut t = trainer(c).unwrap();
        (0..4)
            .map(|_| t.step().unwrap().loss.to_bits())
            .collect::<Vec<_>>()
    };
    let a = run(3);
    assert_eq!(a, run(3));
    assert_ne!(a, run(4));
}

#[test]
fn capacity_is_enforced_exactly_at_the_peak() {
    let mut c = config(2);
    c.batch_size = 8;
    let mut t = trainer(c.clone()).unwrap();
    t.step().unwrap();
    t.step().unwrap();
    let m = t.memory().unwrap()[0];
    let peak = m.peak;
    assert_eq!(m.at_peak.total(), peak);
    assert!(m.at_peak.get(Category::Activations) > m.at_peak.get(Category::Weights));
    // Nothing but the model's state stays between steps.
    assert_eq!(
        m.live.get(Category::Activations) + m.live.get(Category::Workspace),
        0
    );

    // The high-water mark is exact: a capacity of the peak fits, one byte less does not.
    c.device_memory = Some(peak);
    let mut fits = trainer(c.clone()).unwrap();
    fits.step().unwrap();
    fits.step().unwrap();
    c.device_memory = Some(peak - 1);
    let mut short = trainer(c).unwrap();
    let err = short
        .step()
        .and_then(|_| short.step())
        .expect_err("one byte short must fail");
    match &err {
        Error::OutOfMemory(oom) => {
            assert_eq!(oom.capacity, peak - 1);
            assert!(oom.live.total() + oom.requested > peak - 1);
            assert!(err.to_string().contains("cpu:0: out of memory"), "{err}");
        }
        other => panic!("expected a typed out-of-memory error, got {other}"),
    }
}

#[test]
fn activation_memory_matches_the_graph() {
    // What the graph says forward saves, per image, is what the allocator holds at the end
    // of forward (plus per-batch BN statistics and the logits): the most activation bytes
    // ever live (the step's overall peak may come later in backward, where gradients have
    // taken the place of some activations).
    let mut c = config(1);
    c.batch_size = 16;
    c.dtype = DType::F64;
    let mut t = trainer(c).unwrap();
    t.step().unwrap();
    let predicted = 16 * t.graph().saved_bytes_per_sample(DType::F64);
    let measured = t.memory().unwrap()[0]
        .category_peaks
        .get(Category::Activations);
    let ratio = measured as f64 / predicted as f64;
    assert!(
        (1.0..1.05).contains(&ratio),
        "measured {measured} vs predicted {predicted}"
    );
}

#[test]
fn zero_batch_is_refused() {
    let mut c = config(1);
    c.batch_size = 0;
    assert!(trainer(c).err().unwrap().to_string().contains("batch size"));
}

#[test]
fn the_largest_batch_that_fits_fits_and_one_more_does_not() {
    let cap = 48 << 20;
    let g = models::build("resnet20v2", 32, 10).unwrap();
    let one = RunConfig::new(TrainConfig::new(1, 1), Scheme::single(1));
    let b = gems::fit::largest_batch(&g, &one, cap, 1 << 20).unwrap();
    assert!(b >= 8, "{b}");
    let run = |batch: usize| {
        let mut c = config(1);
        c.batch_size = batch;
        c.device_memory = Some(cap);
        trainer(c).and_then(|mut t| t.step())
    };
    run(b).unwrap();
    assert!(
        matches!(run(b + 1), Err(Error::OutOfMemory(_))),
        "batch {} should not fit",
        b + 1
    );
}
