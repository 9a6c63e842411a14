//! The command line: bad input gets one line on stderr and a non-zero exit.

#[path = "common/cli.rs"]
mod cli;
use cli::gems;

#[test]
fn bad_input_gets_one_line_and_a_failure() {
    for (args, expect) in [
        (vec!["train", "--model", "resnet18v9"], "unknown model"),
        (vec!["train", "--model", "resnet21v2"], "9n+2"),
        (vec!["train", "--image-size", "16"], "at least 32"),
        (vec!["train", "--batch-size", "0"], "batch size"),
        (vec!["train", "--steps", "0"], "--steps"),
        (vec!["train", "--device-memory", "lots"], "not a size"),
        (vec!["train", "--dtype", "f16"], "use --precision fp16"),
        (
            vec!["train", "--dtype", "f64", "--precision", "bf16"],
            "needs f32 parameters",
        ),
        (
            vec![
                "train",
                "--device",
                "cuda",
                "--conv",
                "cudnn",
                "--precision",
                "fp16",
            ],
            "use the native kernels",
        ),
        (vec!["train", "--val", "0.1"], "endless stream"),
        (vec!["train", "--conv", "cuddn"], "unknown convolution path"),
        (
            vec!["train", "--conv", "cudnn", "--device", "cpu"],
            "cudnn convolutions run on a GPU",
        ),
        (
            vec!["bench", "kernels", "--conv", "sideways"],
            "unknown convolution path",
        ),
        // Refused before any work: single-device runs are planned like every scheme.
        (
            vec!["train", "--device-memory", "1MiB", "--steps", "1"],
            "the plan does not fit: rank 0",
        ),
        (vec!["models", "--graph", "alexnet9"], "unknown model"),
        // A classifier's class weights would weigh nothing under the default reduction.
        (
            vec!["train", "--class-weights", "1,2,1,1,1,1,1,1,1,1"],
            "--class-weights change nothing for a classifier",
        ),
        (
            vec![
                "train",
                "--scheme",
                "master",
                "--replicas",
                "3",
                "--split",
                "2",
            ],
            "even number of replicas",
        ),
        (
            vec![
                "train",
                "--scheme",
                "mp",
                "--split",
                "2",
                "--parts",
                "3",
                "--batch-size",
                "4",
            ],
            "3 equal micro-batches",
        ),
        (
            vec!["train", "--scheme", "mp", "--split", "500"],
            "at most 50 stages",
        ),
        (
            vec!["train", "--scheme", "mast", "--split", "2", "--ranks", "3"],
            "is not P·D",
        ),
        (
            vec![
                "train",
                "--scheme",
                "mp",
                "--split",
                "2",
                "--balance",
                "1,1",
            ],
            "adds up to 2",
        ),
        (vec!["train", "--scheme", "warp"], "unknown scheme"),
        (
            vec!["--cpu-costs", "Cargo.toml", "plan"],
            "Cargo.toml: not a CPU cost fit",
        ),
        (
            vec!["--cpu-costs", "no-such-fit.json", "plan"],
            "no-such-fit.json",
        ),
        (
            vec![
                "train",
                "--scheme",
                "mp",
                "--split",
                "2",
                "--batch-size",
                "64",
                "--device-memory",
                "30MiB",
            ],
            "the plan does not fit: rank",
        ),
    ] {
        let (ok, _, err) = gems(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(
            err.contains(expect),
            "{args:?}: stderr {err:?} should mention {expect:?}"
        );
        let lines = err.trim().lines().count();
        assert!(lines <= 3, "{args:?}: error should be short, got:\n{err}");
    }
}

#[test]
fn models_lists_and_shows_graphs() {
    let (ok, out, _) = gems(&["models", "--image-size", "32"]);
    assert!(ok);
    assert!(
        out.contains("resnet110v2") && out.contains("1146842"),
        "{out}"
    );
    let (ok, out, _) = gems(&["models", "--graph", "resnet20v2", "--image-size", "32"]);
    assert!(ok);
    assert!(
        out.contains("adjacency list") && out.contains("PreActBottleneck"),
        "{out}"
    );
}

#[test]
fn plan_shows_stages_and_memory_per_rank() {
    let (ok, out, err) = gems(&[
        "plan",
        "--scheme",
        "mast",
        "--split",
        "2",
        "--batch-size",
        "4",
        "--parts",
        "2",
        "--device-memory",
        "1GiB",
    ]);
    assert!(ok, "{err}");
    for want in [
        "stage",
        "saved/micro-batch",
        "predicted step",
        "rank 0:",
        "rank 1:",
        "fits 1.00 GiB",
    ] {
        assert!(out.contains(want), "{want} missing from:\n{out}");
    }
    // What the refusal proposes does fit.
    let (ok, _, err) = gems(&[
        "train",
        "--scheme",
        "mp",
        "--split",
        "2",
        "--batch-size",
        "64",
        "--device-memory",
        "30MiB",
        "--steps",
        "1",
    ]);
    assert!(!ok);
    let b = err
        .split("--batch-size ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("a batch that fits");
    let (ok, _, err) = gems(&[
        "train",
        "--scheme",
        "mp",
        "--split",
        "2",
        "--batch-size",
        b,
        "--device-memory",
        "30MiB",
        "--steps",
        "1",
    ]);
    assert!(ok, "--batch-size {b}: {err}");
}

#[test]
fn train_writes_metrics() {
    let dir = std::env::temp_dir().join(format!("gems-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let metrics = dir.join("m.jsonl");
    let (ok, out, err) = gems(&[
        "train",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("peak memory") && out.contains("images/s"),
        "{out}"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert!(lines[2]["loss"].as_f64().unwrap().is_finite());
    assert_eq!(lines[2]["step"], 2);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn devices_are_chosen_and_reported() {
    let (ok, out, err) = gems(&["info"]);
    assert!(ok, "{err}");
    for line in [
        "CUDA libraries",
        "nvrtc",
        "kernel cache",
        "--device auto picks:",
    ] {
        assert!(out.contains(line), "gems info should show {line:?}:\n{out}");
    }
    let gpu = !out.contains("auto picks: cpu");
    let (ok, out, err) = gems(&[
        "train",
        "--device",
        "cuda",
        "--steps",
        "1",
        "--batch-size",
        "2",
    ]);
    assert!(!err.contains("panicked"), "{err}");
    if gpu {
        assert!(ok && out.contains("cuda:0"), "{out}\n{err}");
    } else {
        assert!(!ok && err.contains("no usable CUDA driver"), "{err}");
        assert!(err.trim().lines().count() <= 3, "{err}");
    }
    let (ok, _, err) = gems(&["train", "--device", "tpu"]);
    assert!(!ok && err.contains("unknown device 'tpu'"), "{err}");
    let (ok, _, err) = gems(&["train", "--precision", "fp8"]);
    assert!(!ok && err.contains("unknown precision"), "{err}");
}

/// Runs everywhere: `--conv cudnn` trains and reports cuDNN's algorithms where a GPU and cuDNN 9
/// are usable, and is otherwise a short error naming what is missing; so is `gems bench kernels
/// --conv both`, which otherwise times both paths side by side.
#[test]
fn conv_cudnn_runs_or_says_why_not() {
    // What the binary finds (the test binaries also find the emulated driver on their run
    // path; the binary does not).
    let (_, info, _) = gems(&["info"]);
    let gpu = info.lines().any(|l| l.starts_with("cuda:"));
    let cudnn = info.contains("runs --conv cudnn");
    let small = ["--model", "resnet20v2", "--image-size", "32"];
    let train = [
        &[
            "train",
            "--device",
            "cuda",
            "--conv",
            "cudnn",
            "--precision",
            "tf32",
        ][..],
        &small,
        &["--batch-size", "2", "--steps", "1"],
    ]
    .concat();
    let bench = [
        &["bench", "kernels", "--device", "cuda", "--conv", "both"][..],
        &small,
        &["--batch", "2", "--repeats", "1"],
    ]
    .concat();
    for (args, done) in [
        (&train, "cuDNN algorithms per convolution shape"),
        (&bench, "native time / cuDNN time"),
    ] {
        let (ok, out, err) = gems(args);
        match (gpu, cudnn) {
            (true, true) => {
                assert!(ok, "{args:?}: {err}");
                assert!(out.contains(done) && out.contains("FWD_ALGO_"), "{out}");
            }
            _ => {
                assert!(!ok, "{args:?} ran without a GPU and cuDNN:\n{out}");
                let want = if gpu { "cuDNN" } else { "CUDA" };
                assert!(err.contains(want), "{args:?}: unclear error {err:?}");
                assert_eq!(err.trim().lines().count(), 1, "{err}");
            }
        }
    }
}

/// `--optimizer adamw` with clipping: the checkpoint records the settings and holds Adam's
/// state by PyTorch's names, and a run resumed from it takes them up.
#[test]
fn adamw_checkpoints_its_settings_and_state_and_resumes() {
    let dir = std::env::temp_dir().join(format!("gems-cli-adamw-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let ckpt = dir.join("run");
    let (ok, _, err) = gems(&[
        "train",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--optimizer",
        "adamw",
        "--betas",
        "0.8,0.99",
        "--clip-grad-norm",
        "1",
        "--no-decay-norm-bias",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let file = ckpt.join("step-000002.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta = &header["__metadata__"];
    assert_eq!(meta["optimizer"], "adamw");
    assert_eq!(meta["beta1"], "0.8");
    assert_eq!(meta["clip_grad_norm"], "1");
    assert_eq!(meta["no_decay_norm_bias"], "true");
    for name in ["exp_avg", "exp_avg_sq", "step"] {
        let key = format!("optimizer.conv1.weight.{name}");
        assert!(header.get(&key).is_some(), "{key} missing");
    }
    assert!(header
        .get("optimizer.conv1.weight.momentum_buffer")
        .is_none());
    let (ok, out, err) = gems(&["train", "--resume", file.to_str().unwrap(), "--steps", "3"]);
    assert!(ok, "{err}");
    assert!(out.contains("images/s"), "{out}");
    std::fs::remove_dir_all(dir).ok();
}

/// A command run again with `--resume` added continues the run: flags that repeat the
/// checkpoint's values are accepted, a different value is refused naming both.
#[test]
fn resume_accepts_the_checkpoints_values_and_refuses_others() {
    let dir = std::env::temp_dir().join(format!("gems-cli-rerun-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let ckpt = dir.join("run");
    let ckpt = ckpt.to_str().unwrap();
    let command = [
        "train",
        "--model",
        "resnet20v2",
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--lr",
        "0.05",
        "--optimizer",
        "adamw",
        "--betas",
        "0.8,0.99",
        "--nesterov",
        "--seed",
        "3",
        "--loss-reduction",
        "pytorch",
        "--normalize",
        "0.5,0.5,0.5/0.25,0.25,0.25",
        "--resize",
        "--data",
        "synthetic",
        "--checkpoint",
        ckpt,
    ];
    let (ok, _, err) = gems(&[&command[..], &["--steps", "1"]].concat());
    assert!(ok, "{err}");
    let file = dir.join("run/step-000001.safetensors");
    let resume = ["--resume", file.to_str().unwrap(), "--steps", "2"];
    let (ok, out, err) = gems(&[&command[..], &resume].concat());
    assert!(ok, "{err}");
    assert!(out.contains("images/s"), "{out}");
    for (flag, ours, theirs) in [
        ("--lr", "0.1", "0.05"),
        ("--betas", "0.9,0.999", "0.8,0.99"),
        ("--image-size", "64", "32"),
        ("--optimizer", "sgd", "adamw"),
        ("--loss-reduction", "sample-mean", "pytorch"),
        ("--normalize", "unit", "0.5,0.5,0.5/0.25,0.25,0.25"),
    ] {
        let (ok, _, err) = gems(&[&["train", flag, ours][..], &resume].concat());
        assert!(!ok);
        let expect = format!("{flag} {ours} differs from the checkpoint's {theirs}");
        assert!(err.contains(&expect), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// `gems fit-costs` fits the fastest of a configuration's calibrations and reports each model
/// against it: a second calibration of the same model, every op twice as slow (a busy
/// neighbour), is named the slowest and moves nothing.
#[test]
fn fit_costs_keeps_the_fastest_calibration_of_a_configuration() {
    use gems::plan::calibrate::Calibration;
    let dir = tempfile::tempdir().unwrap();
    let (fast, slow, out) = (
        dir.path().join("fast.json"),
        dir.path().join("slow.json"),
        dir.path().join("costs.json"),
    );
    let (ok, _, err) = gems(&[
        "--threads",
        "1",
        "calibrate",
        "--model",
        "resnet20v2",
        "--batch-size",
        "2",
        "--repeats",
        "1",
        "--out",
        fast.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let mut cal = Calibration::load(&fast).unwrap();
    let ms = |c: &Calibration| 1e3 * c.forward.iter().chain(&c.backward).sum::<f64>();
    let fastest = ms(&cal);
    for t in cal.forward.iter_mut().chain(&mut cal.backward) {
        *t *= 2.0;
    }
    cal.save(&slow).unwrap();
    let fit = |profiles: &[&std::path::Path]| {
        let mut args = vec!["fit-costs", "--out", out.to_str().unwrap()];
        args.extend(profiles.iter().map(|p| p.to_str().unwrap()));
        let (ok, text, err) = gems(&args);
        assert!(ok, "{err}");
        (text, std::fs::read_to_string(&out).unwrap())
    };
    let (text, both) = fit(&[&slow, &fast]);
    let line = (text.lines())
        .find(|l| l.trim_start().starts_with("resnet20v2"))
        .unwrap_or_else(|| panic!("no resnet20v2 line in:\n{text}"));
    assert!(
        line.contains(&format!("{fastest:.1} ms (slowest {:.1})", ms(&cal))),
        "{line}"
    );
    assert_eq!(both, fit(&[&fast]).1, "the slow calibration moved the fit");
    // Planned with a fit of the slow calibration alone instead of the built-in one, a step
    // costs about what that calibration measured.
    fit(&[&slow]);
    let (ok, text, err) = gems(&[
        "--threads",
        "1",
        "--cpu-costs",
        out.to_str().unwrap(),
        "plan",
        "--model",
        "resnet20v2",
        "--batch-size",
        "2",
    ]);
    assert!(ok, "{err}");
    let step: f64 = (text.lines())
        .find_map(|l| l.strip_prefix("predicted step "))
        .and_then(|l| l.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no predicted step in:\n{text}"));
    let ratio = 1e3 * step / ms(&cal);
    assert!(
        (0.8..1.25).contains(&ratio),
        "{step} s against {} ms",
        ms(&cal)
    );
}
