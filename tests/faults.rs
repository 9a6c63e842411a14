//! Runs that would go wrong stop with a clear error and lose nothing: a diverging run stops
//! at its first bad step under every scheme and leaves only finite checkpoints; hyper-parameters
//! no run can train with are refused before any work. (The start of issue 16's fault suite.)

use std::path::Path;
use std::process::Command;

/// (success, stderr) of `gems args`.
fn gems(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    (out.status.success(), err)
}

/// Every f32 tensor of every checkpoint in `dir` is finite; returns how many files there are.
fn finite_checkpoints(dir: &Path) -> usize {
    let mut files = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue; // the run's manifest
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            if t.dtype() == safetensors::Dtype::F32 {
                let finite = t
                    .data()
                    .chunks(4)
                    .all(|c| f32::from_le_bytes(c.try_into().unwrap()).is_finite());
                assert!(finite, "{}: {name} is not finite", path.display());
            }
        }
        files += 1;
    }
    files
}

#[test]
fn a_diverging_run_stops_at_its_first_bad_step_and_keeps_only_finite_checkpoints() {
    let mast: &[&str] = &["--scheme", "mast", "--split", "2", "--batch-size", "8"];
    for (name, scheme) in [("single", &[][..]), ("mast", mast)] {
        let dir = std::env::temp_dir().join(format!("gems-faults-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let common = [
            "train",
            "--lr",
            "1e30",
            "--steps",
            "10",
            "--checkpoint-every",
            "1",
            "--checkpoint",
            dir.to_str().unwrap(),
        ];
        let (ok, err) = gems(&[&common[..], scheme].concat());
        assert!(!ok, "{name}: a diverging run exited 0");
        assert!(err.contains("training diverged at step"), "{name}: {err}");
        let step: usize = err
            .split("training diverged at step ")
            .nth(1)
            .and_then(|r| r.split(':').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no step in {err}"));
        // Every step before the bad one was checkpointed, and each checkpoint is finite.
        assert_eq!(finite_checkpoints(&dir), step - 1, "{name}");
        std::fs::remove_dir_all(&dir).ok();
        // Without checkpoints to write, the step itself stops the run, at the same step.
        let (ok, bare) = gems(&[&common[..5], scheme].concat());
        assert!(!ok, "{name}: a diverging run without checkpoints exited 0");
        let at = format!("training diverged at step {step}:");
        assert!(bare.contains(&at), "{name}: {bare}");
    }
}

#[test]
fn hyper_parameters_no_run_can_train_with_are_refused_before_work() {
    for (args, want) in [
        (&["--lr", "-1"][..], "the learning rate is -1"),
        (&["--lr", "nan"], "the learning rate is NaN"),
        (&["--lr", "inf"], "the learning rate is inf"),
        (&["--momentum", "1.5"], "the momentum is 1.5"),
        (&["--weight-decay", "-0.1"], "the weight decay is -0.1"),
        (&["--schedule", "step:5:nan"], "factor is NaN"),
        (
            &["--loss-scale", "0", "--precision", "fp16"],
            "loss scale is 0",
        ),
        (&["--warmup", "20"], "--warmup 20 is longer"),
        (&["--batch-size", "0"], "the batch size must be at least 1"),
    ] {
        let started = std::time::Instant::now();
        let (ok, err) = gems(&[&["train", "--steps", "5"][..], args].concat());
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        // Refused before any training step (a step of the default run takes ~0.1 s).
        assert!(started.elapsed().as_secs_f64() < 5.0, "{args:?}");
    }
}
