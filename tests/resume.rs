//! Checkpoints are independent of the scheme that wrote them: for every scheme, a run of k
//! steps equals a run of k/2 steps checkpointed and resumed with the same scheme to the last
//! bit, and resumed as `single` (the same micro-batches) or as `mp` over another number of
//! stages within the schemes' own equivalence tolerance (f64: 1e-9 relative). Under MPI the
//! same through the command line: one file written by one rank, resumed locally as `single`.

use std::collections::HashMap;
use std::path::PathBuf;

mod common;

use gems::optim::schedule::{Decay, LrSchedule};
use gems::optim::{AdamConfig, CustomOptimizer, OptimizerKind, SgdConfig};
use gems::{models, DType, Dataset, Graph, Kind, Order, RunConfig, Scheme, Session, TrainConfig};

const STEPS: usize = 4;
const IMAGE: usize = 32;
const CLASSES: usize = 4;

fn graph() -> Graph {
    models::build("resnet20v2", IMAGE, CLASSES).unwrap()
}

fn config(scheme: Scheme, batch: usize) -> RunConfig {
    let train = TrainConfig {
        schedule: LrSchedule {
            base: 0.05,
            decay: Decay::Cosine,
            warmup: 1,
            total: STEPS,
        },
        sgd: SgdConfig {
            momentum: 0.9,
            weight_decay: 1e-3,
            nesterov: true,
        },
        seed: 5,
        dtype: DType::F64,
        ..TrainConfig::new(batch, STEPS)
    };
    RunConfig::new(train, scheme)
}

fn session(g: &Graph, scheme: Scheme, batch: usize) -> Session {
    session_of(g, config(scheme, batch))
}

fn session_of(g: &Graph, c: RunConfig) -> Session {
    let data = Dataset::synthetic(IMAGE, CLASSES, 5);
    let scheme = c.scheme;
    Session::new(g, c, data).unwrap_or_else(|e| panic!("{scheme:?}: {e}"))
}

/// The whole model's values by parameter id, from the orientation-0 copies (each stage's
/// copies are held bit-identical by the schemes' own tests).
fn parameters(s: &mut Session) -> HashMap<usize, Vec<f64>> {
    s.parameters()
        .unwrap()
        .into_iter()
        .flatten()
        .filter(|(orientation, _, _)| *orientation == 0)
        .map(|(_, id, v)| (id, v))
        .collect()
}

fn steps(s: &mut Session, n: usize) {
    for _ in 0..n {
        s.step().unwrap();
    }
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gems-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Largest difference relative to the tensor's largest value (absolute 1e-12 for tensors at
/// rounding noise), over every parameter.
fn assert_close(what: &str, got: &HashMap<usize, Vec<f64>>, want: &HashMap<usize, Vec<f64>>) {
    assert_eq!(got.len(), want.len(), "{what}: every parameter is held");
    for (id, w) in want {
        let g = &got[id];
        let diff = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
        assert!(
            diff <= 1e-9 * scale + 1e-12,
            "{what}: param {id} differs by {:e} relative",
            diff / scale
        );
    }
}

fn assert_identical(what: &str, got: &HashMap<usize, Vec<f64>>, want: &HashMap<usize, Vec<f64>>) {
    assert_eq!(got.len(), want.len(), "{what}: every parameter is held");
    for (id, w) in want {
        let same = got[id]
            .iter()
            .zip(w)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: param {id} is not bit-identical");
    }
}

/// `scheme` (B images per replica pass) for STEPS steps, against STEPS/2 steps, a checkpoint,
/// and STEPS/2 more steps as the same scheme, as single and as mp over `other_p` stages.
fn check(scheme: Scheme, batch: usize, other_p: usize) {
    check_with(scheme, batch, other_p, |c| c)
}

/// [`check`] for runs configured by `tweak` of the usual configuration.
fn check_with(scheme: Scheme, batch: usize, other_p: usize, tweak: fn(RunConfig) -> RunConfig) {
    let g = graph();
    let name = format!("{scheme:?}");
    let session =
        |g: &Graph, scheme: Scheme, batch: usize| session_of(g, tweak(config(scheme, batch)));
    let mut whole = session(&g, scheme, batch);
    steps(&mut whole, STEPS);
    let want = parameters(&mut whole);

    // One file per scheme and optimizer: tests run at once.
    let optimizer = tweak(config(scheme, batch)).train.optimizer;
    let file = temp(&format!(
        "{}-{}-{}-{}-{}.safetensors",
        scheme.kind,
        scheme.stages,
        scheme.replicas,
        scheme.dp,
        optimizer.name()
    ));
    let mut first = session(&g, scheme, batch);
    steps(&mut first, STEPS / 2);
    first.save(&file).unwrap();
    drop(first);

    let resume = |scheme: Scheme, batch: usize| {
        let mut s = session(&g, scheme, batch);
        s.restore(&file).unwrap();
        assert_eq!(s.steps_done(), STEPS / 2);
        steps(&mut s, STEPS - STEPS / 2);
        parameters(&mut s)
    };
    assert_identical(
        &format!("{name} resumed as itself"),
        &resume(scheme, batch),
        &want,
    );

    // The reference's micro-batches: M = D·η·m of B/m images each, in one step.
    let m = scheme.micro_batches_per_step();
    let micro = batch / scheme.parts;
    let single = Scheme::single(m);
    assert_close(
        &format!("{name} resumed as single"),
        &resume(single, m * micro),
        &want,
    );
    let mp = Scheme::new(Kind::Mp, other_p, m, 1, 1, Order::OneFOneB);
    assert_close(
        &format!("{name} resumed as mp over {other_p}"),
        &resume(mp, m * micro),
        &want,
    );
}

#[test]
fn single_resumes_as_itself_and_as_a_pipeline() {
    check(Scheme::single(2), 4, 2);
}

#[test]
fn mp_gpipe_and_1f1b_resume_under_any_scheme() {
    check(Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe), 4, 3);
    check(Scheme::new(Kind::Mp, 3, 3, 1, 1, Order::OneFOneB), 3, 2);
}

#[test]
fn mast_and_master_resume_under_any_scheme() {
    check(Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe), 4, 3);
    check(Scheme::new(Kind::Master, 2, 1, 4, 1, Order::GPipe), 2, 3);
}

/// AdamW's state (moments and each parameter's steps) and clipping resume bit for bit.
#[test]
fn adamw_with_clipping_resumes_under_mast_bit_for_bit() {
    let adamw = |mut c: RunConfig| {
        c.train.optimizer = OptimizerKind::Adam(AdamConfig {
            weight_decay: 0.05,
            ..AdamConfig::new(true)
        });
        c.train.schedule.base = 1e-3;
        c.train.clip_grad_norm = Some(0.5);
        c.train.no_decay_norm_bias = true;
        c
    };
    check_with(
        Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe),
        4,
        3,
        adamw,
    );
}

#[test]
fn a_custom_optimizer_resumes_under_mast_bit_for_bit() {
    // Its state goes to the checkpoint under its own names and comes back by them.
    let own = |mut c: RunConfig| {
        c.train.optimizer =
            OptimizerKind::Custom(CustomOptimizer::new("heavy-ball", common::HeavyBall));
        c
    };
    check_with(Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe), 4, 3, own);
}

#[test]
fn hybrid_and_dp_resume_under_any_scheme() {
    check(Scheme::new(Kind::Mast, 2, 1, 2, 2, Order::GPipe), 2, 3);
    check(Scheme::new(Kind::Dp, 1, 1, 1, 2, Order::GPipe), 2, 2);
}

#[test]
fn a_checkpoint_of_another_model_is_refused_by_name() {
    let g = graph();
    let file = temp("other-model.safetensors");
    let mut s = session(&g, Scheme::single(1), 2);
    s.save(&file).unwrap();
    let other = models::build("resnet20v2", 64, CLASSES).unwrap();
    let mut t = Session::new(
        &other,
        config(Scheme::single(1), 2),
        Dataset::synthetic(64, CLASSES, 5),
    )
    .unwrap();
    let e = t.restore(&file).unwrap_err();
    assert!(
        matches!(&e, gems::Error::BadInput { path, why } if path == &file && why.contains("32² images") && why.contains("64²")),
        "{e}"
    );
}

/// Tensors of a checkpoint by name (the file's metadata is not compared).
#[cfg(feature = "mpi")]
fn tensors(path: &std::path::Path) -> HashMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect()
}

/// Under mpirun (one process per rank) every scheme writes one checkpoint from one rank;
/// resumed over MPI it ends bit-identical to the uninterrupted run, and resumed locally as
/// `mp` over 3 ranks with the same micro-batches, within 1e-9 (on the written weights).
#[cfg(feature = "mpi")]
#[test]
fn every_scheme_over_mpi_checkpoints_one_file_that_resumes_locally() {
    // (name, ranks, scheme flags, micro-batches per step M = D·η·m); B = 2 images per replica
    // pass, so B/m images per micro-batch.
    let schemes: [(&str, usize, &[&str], usize); 6] = [
        (
            "mp-gpipe",
            2,
            &["--scheme", "mp", "--split", "2", "--parts", "2"],
            2,
        ),
        (
            "mp-1f1b",
            2,
            &[
                "--scheme", "mp", "--split", "2", "--parts", "2", "--order", "1f1b",
            ],
            2,
        ),
        (
            "mast",
            2,
            &["--scheme", "mast", "--split", "2", "--parts", "2"],
            4,
        ),
        (
            "master",
            2,
            &["--scheme", "master", "--split", "2", "--parts", "2"],
            8,
        ),
        (
            "hybrid",
            4,
            &[
                "--scheme", "mast", "--split", "2", "--parts", "2", "--dp", "2",
            ],
            8,
        ),
        ("dp", 2, &["--scheme", "dp", "--dp", "2", "--parts", "2"], 4),
    ];
    for (name, np, scheme, m) in schemes {
        over_mpi(name, np, scheme, m);
    }
}

#[cfg(feature = "mpi")]
fn over_mpi(name: &str, np: usize, scheme: &[&str], m: usize) {
    use std::process::Command;
    let gems = env!("CARGO_BIN_EXE_gems");
    let dir = temp(&format!("mpi-{name}"));
    let run = |mut c: Command, args: &[&str]| {
        let out = c.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let mpirun = || {
        let mut c = Command::new("mpirun");
        c.args(["--oversubscribe", "-np", &np.to_string(), gems])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    };
    let common = [
        "train",
        "--dtype",
        "f64",
        "--classes",
        "4",
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--seed=3",
        "--transport",
        "mpi",
    ];
    let (whole, half, again, local) = (
        dir.join("whole"),
        dir.join("half"),
        dir.join("again"),
        dir.join("local"),
    );
    let path = |p: &PathBuf| p.to_str().unwrap().to_string();
    run(
        mpirun(),
        &[
            &common[..],
            scheme,
            &["--steps", "4", "--checkpoint", &path(&whole)],
        ]
        .concat(),
    );
    let every = [
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--checkpoint",
        &path(&half),
    ];
    run(mpirun(), &[&common[..], scheme, &every].concat());
    let step2 = path(&half.join("step-000002.safetensors"));
    let resume = [
        "train",
        "--resume",
        &step2,
        "--transport",
        "mpi",
        "--checkpoint",
        &path(&again),
    ];
    run(mpirun(), &[&resume[..], scheme].concat());
    let want = tensors(&whole.join("step-000004.safetensors"));
    assert_eq!(
        tensors(&again.join("step-000004.safetensors")),
        want,
        "{name}: resumed over MPI"
    );
    // Locally as mp over 3 stages with the same M micro-batches of 1 image each (m = 2).
    let (m, parts) = (m.to_string(), m.to_string());
    let as_mp = [
        "train",
        "--resume",
        &step2,
        "--checkpoint",
        &path(&local),
        "--scheme",
        "mp",
        "--split",
        "3",
        "--parts",
        &parts,
        "--batch-size",
        &m,
    ];
    run(Command::new(gems), &as_mp);
    let got = tensors(&local.join("step-000004.safetensors"));
    let f64s = |b: &[u8]| -> Vec<f64> {
        b.chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    for (tensor, w) in &want {
        if tensor.ends_with("num_batches_tracked") {
            assert_eq!(&got[tensor], w, "{name}: {tensor}");
            continue;
        }
        let (g, w) = (f64s(&got[tensor]), f64s(w));
        let diff = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let scale = w.iter().map(|x| x.abs()).fold(0.0, f64::max);
        assert!(
            diff <= 1e-9 * scale + 1e-12,
            "{name}: {tensor}: {:e} relative",
            diff / scale
        );
    }
}
