//! The fault-injection suite: runs that would go wrong stop with a clear error and lose
//! nothing. Each class of bad input or fault runs through the binary and must end with a
//! non-zero exit and a message saying what is wrong, no panic or allocation abort, within a
//! bounded time, with earlier checkpoints byte for byte as they were: a diverging run, sizes no
//! machine holds, mistyped flags, another run's checkpoint folder, a killed parallel run, data
//! whose classes would train or score the wrong thing, files that are not files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
        (
            &["--optimizer", "adamw", "--eps", "0"],
            "the epsilon (--eps) is 0",
        ),
        (
            &["--optimizer", "adam", "--betas", "0.9,1"],
            "the beta (--betas) is 1",
        ),
        (
            &["--optimizer", "adam", "--betas", "-0.1,0.9"],
            "the beta (--betas) is -0.1",
        ),
        (
            &["--clip-grad-norm", "-1"],
            "the clipping norm (--clip-grad-norm) is -1",
        ),
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

/// What a bounded run of the binary did.
struct Ran {
    ok: bool,
    out: String,
    err: String,
}

/// Runs `gems args`, killing it (and failing) if it runs longer than `limit` seconds; fails on
/// a panic or an allocation abort.
fn run(args: &[&str], limit: u64) -> Ran {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let read = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            r.read_to_string(&mut s).ok();
            s
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(limit) {
            child.kill().ok();
            panic!("{args:?} hung (over {limit} s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let r = Ran {
        ok: status.success(),
        out: out.join().unwrap(),
        err: err.join().unwrap(),
    };
    for sign in [
        "panicked",
        "memory allocation of",
        "stack backtrace",
        "core dumped",
    ] {
        assert!(!r.err.contains(sign), "{args:?}: {}", r.err);
    }
    assert!(
        status.code().is_some(),
        "{args:?} was killed by a signal: {}",
        r.err
    );
    r
}

/// `args` are refused, before or instead of training, with a message containing `want`.
fn refused(args: &[&str], want: &str) -> String {
    let r = run(args, 120);
    assert!(!r.ok, "{args:?} was accepted:\n{}", r.out);
    assert!(r.err.contains(want), "{args:?}: {}", r.err);
    r.err
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-faults-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every file of `dir` by name, with its bytes (the folder's lock file left out).
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != ".gems-lock"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// The tensors of a checkpoint by name (its metadata, which names the run, left out).
fn tensors(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| (name, t.data().to_vec()))
        .collect()
}

#[test]
fn sizes_no_machine_holds_are_refused_without_aborting() {
    refused(
        &["train", "--batch-size", "100000000000", "--steps", "1"],
        "the plan does not fit",
    );
    refused(
        &["train", "--image-size", "100000", "--steps", "1"],
        "the plan does not fit",
    );
    refused(
        &["plan", "--batch-size", "100000000000"],
        "more than this machine can hold",
    );
    refused(
        &["train", "--prefetch", "100000000", "--steps", "1"],
        "more than this machine's",
    );
    refused(
        &[
            "train",
            "--image-size",
            "100000",
            "--device-memory",
            "1GiB",
            "--steps",
            "1",
        ],
        "the plan does not fit",
    );
    refused(
        &["train", "--classes", "1000000000", "--steps", "1"],
        "a model takes at most 1048576 classes",
    );
    refused(
        &["train", "--threads", "100000"],
        "a thread count is 1 to 1024",
    );
    refused(
        &["train", "--workers", "100000"],
        "a thread count is 1 to 1024",
    );
    // A run as long as a u64 counts reserves nothing per step up front: it trains.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args([
            "train",
            "--steps",
            "18446744073709551615",
            "--batch-size",
            "2",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let alive = child.try_wait().unwrap().is_none();
    child.kill().ok();
    let out = child.wait_with_output().unwrap();
    assert!(alive, "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn mistyped_flags_are_refused_in_their_own_words() {
    refused(
        &["train", "--offload", "recompte"],
        "'recompte' is not none, all, recompute, auto, or an existing policy file",
    );
    refused(
        &["train", "--tissue=-1"],
        "a brightness is a number from 0 to 1, not -1",
    );
    refused(
        &["train", "--tissue", "0.8"],
        "--tissue cuts slides into tiles",
    );
    refused(&["train", "--resume", "/dev/null"], "not a regular file");
    refused(
        &["train", "--normalize", "0.5,0.5/0.2,0.2,0.2"],
        "the normalization's mean takes 3 values (R, G, B), not 2",
    );
    refused(
        &[
            "eval",
            "--init",
            "w.safetensors",
            "--normalize",
            "0,0,0/0.2,0,0.2",
        ],
        "the normalization's standard deviations are positive, not 0",
    );
}

#[test]
fn a_checkpoint_folder_belongs_to_one_run() {
    let d = scratch("folder");
    let ck = d.join("ck");
    let ck_s = ck.to_str().unwrap();
    let first = [
        "train",
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--checkpoint-every",
        "1",
        "--checkpoint",
        ck_s,
    ];
    assert!(run(&first, 120).ok);
    let before = files(&ck);
    assert!(before.contains_key("gems-run.json") && before.contains_key("step-000002.safetensors"));
    // Another run may not write into it: refused before any step, nothing changed.
    let err = refused(&first, "of another run");
    assert!(
        err.contains("--resume") && err.contains("--overwrite"),
        "{err}"
    );
    assert_eq!(files(&ck), before);
    // An interrupted write's temporary file goes when the run resumes there; --keep-last 2
    // prunes the oldest.
    std::fs::write(
        ck.join(".step-000003.safetensors.4242.tmp"),
        vec![0u8; 1000],
    )
    .unwrap();
    let step2 = ck.join("step-000002.safetensors");
    let resume = [
        "train",
        "--resume",
        step2.to_str().unwrap(),
        "--steps",
        "3",
        "--checkpoint-every",
        "1",
        "--keep-last",
        "2",
        "--checkpoint",
        ck_s,
    ];
    assert!(run(&resume, 120).ok);
    let after = files(&ck);
    let names: Vec<&str> = after.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "gems-run.json",
            "step-000002.safetensors",
            "step-000003.safetensors"
        ]
    );
    assert_eq!(
        after["step-000002.safetensors"],
        before["step-000002.safetensors"]
    );
    // --overwrite removes the other run's checkpoints first.
    let r = run(&[&first[..], &["--overwrite"]].concat(), 120);
    assert!(r.ok && r.out.contains("removed"), "{}", r.err);
    assert!(!ck.join("step-000003.safetensors").exists());
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_killed_parallel_run_resumes_to_the_weights_of_an_uninterrupted_one() {
    let d = scratch("killed");
    let (killed, whole) = (d.join("killed"), d.join("whole"));
    // How the run is spread (a resumed run says it again), and its schedule (from the
    // checkpoint when resuming): constant, so a run's total steps do not change its steps.
    let spread = [
        "train",
        "--scheme",
        "mast",
        "--split",
        "2",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "1",
    ];
    let schedule = ["--schedule", "constant", "--warmup", "0"];
    let common = [&spread[..], &schedule[..]].concat();
    // Long enough to be killed mid-run: SIGKILL once a few checkpoints are down.
    let mut child = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(&common)
        .args([
            "--steps",
            "100000",
            "--checkpoint",
            killed.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !killed.join("step-000004.safetensors").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoints"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let last = std::fs::read_dir(&killed)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .max()
        .unwrap();
    let steps = "40";
    let r = run(
        &[
            &spread[..],
            &[
                "--resume",
                killed.join(&last).to_str().unwrap(),
                "--steps",
                steps,
                "--checkpoint",
                killed.to_str().unwrap(),
            ],
        ]
        .concat(),
        300,
    );
    assert!(r.ok, "{}", r.err);
    let r = run(
        &[
            &common[..],
            &["--steps", steps, "--checkpoint", whole.to_str().unwrap()],
        ]
        .concat(),
        300,
    );
    assert!(r.ok, "{}", r.err);
    let name = "step-000040.safetensors";
    assert!(
        tensors(&killed.join(name)) == tensors(&whole.join(name)),
        "resumed from {last}"
    );
    std::fs::remove_dir_all(&d).ok();
}

fn png(path: &Path, rgb: [u8; 3]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    image::RgbImage::from_pixel(8, 8, image::Rgb(rgb))
        .save(path)
        .unwrap();
}

#[test]
fn data_that_would_train_or_score_the_wrong_thing_is_refused_by_name() {
    let d = scratch("data");
    let folder = |dir: &Path| format!("folder:{}", dir.display());
    // Two classes, counted before step 1.
    let train = d.join("train");
    for (i, class) in ["a", "b"].iter().enumerate() {
        for j in 0..=i + 1 {
            png(
                &train.join(class).join(format!("{j}.png")),
                [40 * j as u8, 90, 200],
            );
        }
    }
    let ck = d.join("ck");
    let r = run(
        &[
            "train",
            "--data",
            &folder(&train),
            "--image-size",
            "32",
            "--batch-size",
            "2",
            "--steps",
            "2",
            "--checkpoint",
            ck.to_str().unwrap(),
        ],
        120,
    );
    assert!(r.ok, "{}", r.err);
    assert!(
        r.out.contains("data: 5 for training (a 2, b 3)"),
        "{}",
        r.out
    );
    // An empty class folder would be a class with nothing to learn.
    std::fs::create_dir_all(train.join("c")).unwrap();
    refused(
        &[
            "train",
            "--data",
            &folder(&train),
            "--image-size",
            "32",
            "--steps",
            "1",
        ],
        "c: is an empty class folder",
    );
    std::fs::remove_dir(train.join("c")).unwrap();
    // A pipe among the images is refused, not read (which would block).
    let fifo = train.join("a/pipe.png");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    refused(
        &[
            "train",
            "--data",
            &folder(&train),
            "--image-size",
            "32",
            "--steps",
            "1",
        ],
        "pipe.png: is not a regular file",
    );
    std::fs::remove_file(&fifo).unwrap();
    // Evaluation matches classes by name: other names are refused, a subset is scored as the
    // classes the model knows.
    let ckpt = ck.join("step-000002.safetensors");
    let other = d.join("other");
    png(&other.join("cat/0.png"), [1, 2, 3]);
    png(&other.join("dog/0.png"), [3, 2, 1]);
    refused(
        &[
            "eval",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--data",
            &folder(&other),
        ],
        "classes the model was not trained on (cat, dog)",
    );
    let subset = d.join("subset");
    png(&subset.join("b/0.png"), [1, 2, 3]);
    let r = run(
        &[
            "eval",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--data",
            &folder(&subset),
        ],
        120,
    );
    assert!(r.ok, "{}", r.err);
    let row = r
        .out
        .lines()
        .find(|l| l.starts_with("1 b"))
        .unwrap_or_else(|| panic!("{}", r.out));
    assert!(
        row.split_whitespace().nth(2) == Some("1"),
        "one sample of b: {}",
        r.out
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    // Every reduction of the CPU backend has a fixed order, so a run resumed with another
    // --threads continues the same computation: the weights agree bit for bit.
    let d = scratch("threads");
    let weights = |threads: &str, model: &[&str]| {
        let ck = d.join(format!("t{threads}"));
        let args = [
            &[
                "train",
                "--threads",
                threads,
                "--steps",
                "2",
                "--checkpoint",
            ][..],
            &[ck.to_str().unwrap()],
            model,
        ]
        .concat();
        let r = run(&args, 300);
        assert!(r.ok, "{}", r.err);
        tensors(&ck.join("step-000002.safetensors"))
    };
    for model in [
        &["--batch-size", "8"][..],
        &[
            "--model",
            "resnet50",
            "--image-size",
            "64",
            "--batch-size",
            "2",
        ],
    ] {
        let one = weights("1", model);
        assert!(
            weights("3", model) == one,
            "{model:?}: 1 and 3 threads differ"
        );
        std::fs::remove_dir_all(&d).ok();
    }
}

#[test]
fn a_run_extended_by_resuming_spans_its_schedule_over_the_new_total() {
    // A cosine that ended at the first run's last step would train on at a rate of 0.
    let d = scratch("extend");
    let ck = d.join("ck");
    let first = [
        "train",
        "--steps",
        "4",
        "--batch-size",
        "4",
        "--checkpoint",
        ck.to_str().unwrap(),
    ];
    assert!(run(&first, 120).ok);
    let metrics = d.join("m.jsonl");
    let step4 = ck.join("step-000004.safetensors");
    let more = [
        "train",
        "--resume",
        step4.to_str().unwrap(),
        "--steps",
        "8",
        "--metrics",
        metrics.to_str().unwrap(),
    ];
    let r = run(&more, 120);
    assert!(r.ok, "{}", r.err);
    let rates: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["lr"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(rates.len(), 4);
    assert!(rates.iter().all(|&lr| lr > 0.01), "{rates:?}");
    assert!(
        rates.windows(2).all(|w| w[1] < w[0]),
        "a cosine falls: {rates:?}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn a_checkpoint_folder_belongs_to_one_live_run() {
    let d = scratch("lock");
    let ck = d.join("ck");
    let ck_s = ck.to_str().unwrap();
    let long = [
        "train",
        "--steps",
        "100000",
        "--checkpoint-every",
        "1000",
        "--checkpoint",
        ck_s,
    ];
    let mut first = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(long)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The first run holds the folder once its lock names it.
    let lock = ck.join(".gems-lock");
    let started = Instant::now();
    while std::fs::read_to_string(&lock).map_or(true, |s| s.is_empty()) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the first run never locked"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let holder = format!("pid {}", first.id());
    // A second run into it is refused, naming the first, and writes nothing.
    let before = files(&ck);
    let err = refused(
        &["train", "--steps", "2", "--checkpoint", ck_s],
        "in use by another run",
    );
    assert!(err.contains(&holder), "{err}");
    assert_eq!(files(&ck), before);
    // Killed, the first leaves its name in the lock; the next run takes the folder over and
    // says whose lock it was.
    first.kill().unwrap();
    first.wait().unwrap();
    let r = run(
        &["train", "--steps", "2", "--checkpoint", ck_s, "--overwrite"],
        120,
    );
    assert!(r.ok, "{}", r.err);
    assert!(
        r.out.contains("took over") && r.out.contains(&holder),
        "{}",
        r.out
    );
    // A run that ended cleanly leaves the lock empty: no note for the next one.
    let r = run(
        &["train", "--steps", "2", "--checkpoint", ck_s, "--overwrite"],
        120,
    );
    assert!(r.ok && !r.out.contains("took over"), "{}", r.out);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn outputs_replace_neither_devices_nor_the_run_inputs() {
    let d = scratch("outputs");
    let fifo = d.join("pipe");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let f = fifo.to_str().unwrap();
    let is_fifo = |p: &Path| {
        use std::os::unix::fs::FileTypeExt;
        std::fs::symlink_metadata(p).unwrap().file_type().is_fifo()
    };
    let ck = d.join("ck");
    assert!(
        run(
            &[
                "train",
                "--steps",
                "1",
                "--checkpoint",
                ck.to_str().unwrap()
            ],
            120
        )
        .ok
    );
    let step1 = ck.join("step-000001.safetensors");
    let step1_s = step1.to_str().unwrap();
    for args in [
        &["export", "--out", f][..],
        &["export", "--checkpoint", step1_s, "--out", f],
        &["train", "--steps", "1", "--metrics", f],
        &["train", "--steps", "1", "--timeline", f],
        &["plan", "--timeline", f],
        &[
            "train",
            "--steps",
            "1",
            "--checkpoint",
            d.to_str().unwrap(),
            "--timeline",
            d.to_str().unwrap(),
        ],
    ] {
        refused(args, "not a file gems may write");
        assert!(is_fifo(&fifo), "{args:?} replaced the pipe");
    }
    // An export over the checkpoint it reads is refused, the checkpoint unchanged.
    let before = std::fs::read(&step1).unwrap();
    refused(
        &["export", "--checkpoint", step1_s, "--out", step1_s],
        "which this run reads",
    );
    assert_eq!(std::fs::read(&step1).unwrap(), before);
    std::fs::remove_dir_all(&d).ok();
}

/// A slide (slides/a.tiff), its region labels and a model's initial weights for its classes:
/// what `eval --init … --data slides:… --predictions DIR` reads.
fn slide_and_weights(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let slides = d.join("slides");
    std::fs::create_dir_all(&slides).unwrap();
    let (labels, init) = (d.join("labels.csv"), d.join("init.safetensors"));
    let tiff = slides.join("a.tiff");
    let make = [
        "data",
        "make-slide",
        "--out",
        tiff.to_str().unwrap(),
        "--width",
        "256",
        "--height",
        "192",
        "--tile",
        "64",
        "--levels",
        "2",
        "--classes",
        "3",
        "--region",
        "128",
        "--seed",
        "3",
        "--labels",
        labels.to_str().unwrap(),
    ];
    let r = run(&make, 120);
    assert!(r.ok, "{}", r.err);
    let r = run(
        &["export", "--classes", "3", "--out", init.to_str().unwrap()],
        120,
    );
    assert!(r.ok, "{}", r.err);
    (slides, labels, init)
}

/// `gems eval` of [`slide_and_weights`]'s slide with its maps and tiles.csv into `maps`.
fn eval_predictions(d: &Path, maps: &Path) -> Vec<String> {
    let (slides, labels, init) = (
        d.join("slides"),
        d.join("labels.csv"),
        d.join("init.safetensors"),
    );
    [
        "eval",
        "--init",
        init.to_str().unwrap(),
        "--data",
        &format!("slides:{}", slides.display()),
        "--labels",
        labels.to_str().unwrap(),
        "--tile-size",
        "64",
        "--predictions",
        maps.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `eval --predictions` into the slides' own folder is refused before work, the slide as it
/// was; a pipe where tiles.csv or a map would go is refused and left a pipe.
#[test]
fn predictions_replace_neither_the_slide_nor_a_pipe() {
    let d = scratch("predictions");
    let (slides, _, _) = slide_and_weights(&d);
    let tiff = slides.join("a.tiff");
    let before = std::fs::read(&tiff).unwrap();
    refused(
        &strs(&eval_predictions(&d, &slides)),
        "which this run reads",
    );
    assert_eq!(
        std::fs::read(&tiff).unwrap(),
        before,
        "the slide was replaced"
    );
    let maps = d.join("maps");
    for name in ["tiles.csv", "a.png", "a.tiff"] {
        std::fs::create_dir_all(&maps).unwrap();
        let fifo = maps.join(name);
        assert!(Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        refused(
            &strs(&eval_predictions(&d, &maps)),
            "not a file gems may write",
        );
        use std::os::unix::fs::FileTypeExt;
        let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(kind.is_fifo(), "{name}: the pipe was replaced");
        std::fs::remove_dir_all(&maps).unwrap();
    }
    // The same run into a folder of its own writes its maps.
    let r = run(&strs(&eval_predictions(&d, &maps)), 120);
    assert!(r.ok && maps.join("a.png").is_file(), "{}", r.err);
    std::fs::remove_dir_all(&d).ok();
}

/// A path with a file bind-mounted over it, unmounted when dropped.
struct Mounted(PathBuf);

impl Mounted {
    /// `source` mounted over `target`, or `None` where this process cannot mount (not root).
    fn bind(source: &Path, target: &Path) -> Option<Mounted> {
        let mounted = Command::new("mount")
            .arg("--bind")
            .args([source, target])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then(|| Mounted(target.to_path_buf()))
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A file mounted over another path (as containers mount a host's files and devices, which
/// cannot be renamed over) is no file to write: export, --metrics, --timeline, --per-sample and
/// --predictions refuse it, and neither the mounted file nor the one under it changes. As root;
/// elsewhere it says it is skipped.
#[test]
fn outputs_write_into_no_mounted_file() {
    let d = scratch("mounted");
    let (host, target) = (d.join("host"), d.join("target"));
    let maps = d.join("maps");
    std::fs::create_dir_all(&maps).unwrap();
    let map = maps.join("a.tiff");
    std::fs::write(&host, "the mounted file").unwrap();
    std::fs::write(&target, "the file under the mount").unwrap();
    std::fs::write(&map, "the map under the mount").unwrap();
    slide_and_weights(&d);
    let (Some(over_target), Some(over_map)) =
        (Mounted::bind(&host, &target), Mounted::bind(&host, &map))
    else {
        eprintln!("skipped: mount --bind failed (it needs root)");
        return;
    };
    let t = target.to_str().unwrap();
    let mut per_sample = eval_predictions(&d, &maps);
    per_sample.truncate(per_sample.len() - 2);
    per_sample.extend(["--per-sample".into(), t.into()]);
    for args in [
        vec!["export", "--out", t],
        vec!["train", "--steps", "1", "--metrics", t],
        vec!["train", "--steps", "1", "--timeline", t],
        vec!["plan", "--timeline", t],
        strs(&per_sample),
        strs(&eval_predictions(&d, &maps)),
    ] {
        refused(&args, "is a mount point");
        assert_eq!(
            std::fs::read_to_string(&host).unwrap(),
            "the mounted file",
            "{args:?} wrote into the mounted file"
        );
    }
    drop((over_target, over_map));
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "the file under the mount"
    );
    assert_eq!(
        std::fs::read_to_string(&map).unwrap(),
        "the map under the mount"
    );
    std::fs::remove_dir_all(&d).ok();
}

/// `path`'s safetensors rewritten by `change` (tensor name, its little-endian bytes), without
/// gems's metadata (so without checksums: what another tool would write).
fn rewrite_tensors(path: &Path, out: &Path, change: impl Fn(&str, &mut Vec<u8>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let mut data = t.data().to_vec();
            change(&n, &mut data);
            (n, t.dtype(), t.shape().to_vec(), data)
        })
        .collect();
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, shape, data)| {
            (
                n.as_str(),
                safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(out, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn damaged_or_unusable_weights_are_refused_by_tensor_name() {
    let d = scratch("integrity");
    let ck = d.join("ck");
    assert!(
        run(
            &[
                "train",
                "--steps",
                "2",
                "--checkpoint-every",
                "1",
                "--checkpoint",
                ck.to_str().unwrap()
            ],
            120
        )
        .ok
    );
    let step2 = ck.join("step-000002.safetensors");
    // One bit flipped in a weight's exponent, as a failing disk would: every load names it.
    let bytes = std::fs::read(&step2).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut flipped = bytes.clone();
    flipped[8 + header + 3] ^= 0x40;
    let damaged = d.join("damaged.safetensors");
    std::fs::write(&damaged, &flipped).unwrap();
    let dm = damaged.to_str().unwrap();
    for args in [
        &["train", "--resume", dm, "--steps", "3"][..],
        &["eval", "--checkpoint", dm],
        &[
            "export",
            "--checkpoint",
            dm,
            "--out",
            d.join("w.safetensors").to_str().unwrap(),
        ],
        &["train", "--init", dm, "--steps", "1"],
    ] {
        let err = refused(args, "is damaged");
        assert!(err.contains("tensor '"), "{args:?}: {err}");
    }
    // Weights from elsewhere (no checksums): a NaN, a negative running variance.
    let nan = d.join("nan.safetensors");
    rewrite_tensors(&step2, &nan, |n, data| {
        if n == "conv1.weight" {
            data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    });
    let err = refused(
        &["train", "--init", nan.to_str().unwrap(), "--steps", "1"],
        "must be finite",
    );
    assert!(err.contains("'conv1.weight'"), "{err}");
    let negative = d.join("negative.safetensors");
    rewrite_tensors(&step2, &negative, |n, data| {
        if n.ends_with("running_var") {
            data[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
        }
    });
    refused(
        &[
            "train",
            "--init",
            negative.to_str().unwrap(),
            "--steps",
            "1",
        ],
        "a running variance cannot be negative",
    );
    // A BN's count of batches below zero.
    let uncounted = d.join("uncounted.safetensors");
    rewrite_tensors(&step2, &uncounted, |n, data| {
        if n == "bn.num_batches_tracked" {
            data.copy_from_slice(&(-1i64).to_le_bytes());
        }
    });
    refused(
        &[
            "train",
            "--init",
            uncounted.to_str().unwrap(),
            "--steps",
            "1",
        ],
        "tensor 'bn.num_batches_tracked' counts -1 batches",
    );
    // A PyTorch file (torch.save writes a zip) is refused with how to convert it.
    let pth = d.join("model.pth");
    std::fs::write(&pth, b"PK\x03\x04 not really a zip").unwrap();
    for args in [
        &["train", "--init", pth.to_str().unwrap(), "--steps", "1"][..],
        &["eval", "--checkpoint", pth.to_str().unwrap()],
    ] {
        refused(args, "is a PyTorch file");
    }
    std::fs::remove_dir_all(&d).ok();
}

/// Writes `images/<stem>.png` (grey) and its mask `masks/<stem>.png` of 8×8 `labels`.
fn segmentation_pair(dir: &Path, stem: &str, labels: impl Fn(u32, u32) -> u8) {
    png(&dir.join("images").join(format!("{stem}.png")), [128; 3]);
    let mask = image::GrayImage::from_fn(8, 8, |x, y| image::Luma([labels(x, y)]));
    std::fs::create_dir_all(dir.join("masks")).unwrap();
    mask.save(dir.join("masks").join(format!("{stem}.png")))
        .unwrap();
}

#[test]
fn data_that_cannot_train_what_it_claims_is_refused_by_layout_and_class() {
    let d = scratch("layouts");
    let folder = |dir: &Path| format!("folder:{}", dir.display());
    let seg = d.join("seg");
    std::fs::create_dir_all(&seg).unwrap();
    std::fs::write(seg.join("classes.txt"), "background\ntumour\nstroma\n").unwrap();
    for stem in ["a", "b"] {
        segmentation_pair(&seg, stem, |x, _| (x >= 4) as u8);
    }
    let unet = |data: &Path, extra: &[&str]| {
        let data = folder(data);
        let args = [
            &[
                "train",
                "--model",
                "unet_d2_w4",
                "--image-size",
                "8",
                "--batch-size",
                "2",
                "--steps",
                "1",
                "--data",
                &data,
            ][..],
            extra,
        ]
        .concat();
        run(&args, 120)
    };
    // A segmentation folder given to a classifier, a classification folder to a U-Net.
    refused(
        &["train", "--data", &folder(&seg), "--steps", "1"],
        "is laid out for segmentation (images/ and masks/)",
    );
    let classes = d.join("classes");
    png(&classes.join("cat/0.png"), [1, 2, 3]);
    png(&classes.join("dog/0.png"), [3, 2, 1]);
    let r = unet(&classes, &[]);
    assert!(
        !r.ok
            && r.err
                .contains("is laid out for classification (one sub-folder per class: cat, dog)"),
        "{}",
        r.err
    );
    // stroma has no pixel: refused by name, or with --allow-empty-class warned by name.
    let r = unet(&seg, &[]);
    assert!(
        !r.ok
            && r.err
                .contains("no pixel of the training masks is labelled stroma"),
        "{}",
        r.err
    );
    let r = unet(&seg, &["--allow-empty-class"]);
    assert!(r.ok, "{}", r.err);
    assert!(
        r.err
            .contains("warning: no pixel of the training masks is labelled stroma"),
        "{}",
        r.err
    );
    // Masks without a labelled pixel have nothing to teach, allowed or not.
    for stem in ["a", "b"] {
        segmentation_pair(&seg, stem, |_, _| 255);
    }
    let r = unet(&seg, &["--allow-empty-class"]);
    assert!(
        !r.ok
            && r.err
                .contains("no pixel of the masks of the 2 samples is labelled"),
        "{}",
        r.err
    );
    std::fs::remove_dir_all(&d).ok();
}

/// A checkpoint of one training step of the default model, in `d/ck`.
fn one_step_checkpoint(d: &Path) -> PathBuf {
    let ck = d.join("ck");
    let args = ["train", "--steps", "1", "--batch-size", "2", "--checkpoint"];
    let args: Vec<&str> = args.into_iter().chain([ck.to_str().unwrap()]).collect();
    assert!(run(&args, 120).ok);
    ck.join("step-000001.safetensors")
}

#[test]
fn numbers_no_machine_can_run_are_refused_by_flag_before_work() {
    let d = scratch("refused-numbers");
    let ckpt = one_step_checkpoint(&d);
    for (args, want) in [
        (
            &["train", "--parts", "0"][..],
            "m (--parts) must be at least 1, got 0",
        ),
        (
            &["plan", "--scheme", "mp", "--split", "0"],
            "P (--split) must be at least 1, got 0",
        ),
        (
            &["plan", "--scheme", "dp", "--dp", "100000000"],
            "more than the 1024 ranks",
        ),
        (
            &[
                "plan",
                "--scheme",
                "mp",
                "--split",
                "2",
                "--dp",
                "9223372036854775808",
            ],
            "more than the 1024 ranks",
        ),
        (
            &["train", "--spatial", "4294967296x4294967296"],
            "a grid of 4294967296x4294967296 tiles",
        ),
        (
            &[
                "plan",
                "--scheme",
                "master",
                "--split",
                "2",
                "--replicas",
                "4294967296",
            ],
            "micro-batch passes per rank and step is more than",
        ),
        (
            &["calibrate", "--out", "/dev/null", "--batch-size", "0"],
            "the batch size must be at least 1",
        ),
        (
            &[
                "calibrate",
                "--out",
                "/dev/null",
                "--image-size",
                "4294967296",
            ],
            "a side is at most",
        ),
        (
            &["export", "--out", "/dev/null", "--classes", "4294967296"],
            "a model takes at most",
        ),
        (
            &[
                "eval",
                "--checkpoint",
                ckpt.to_str().unwrap(),
                "--samples",
                "18446744073709551615",
            ],
            "at most 1048576 are scored",
        ),
        (
            &[
                "data",
                "make-slide",
                "--out",
                "/dev/null",
                "--classes",
                "4294967296",
            ],
            "a slide paints 1 to 1024",
        ),
    ] {
        refused(args, want);
    }
    // Doubling towards 2^64 - 1 GPUs ends.
    let r = run(
        &[
            "simulate",
            "--batch-size",
            "2",
            "--gpus",
            "18446744073709551615",
        ],
        120,
    );
    assert!(r.ok, "{}", r.err);
    std::fs::remove_dir_all(&d).ok();
}

/// Whether `gems <command> --flag=value --help` parses `value` (help printed, not an error).
fn parses(command: &[&str], flag: &str, value: &str) -> bool {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(command)
        .arg(format!("{flag}={value}"))
        .arg("--help")
        .output()
        .unwrap();
    out.status.success()
}

/// The flags of `gems <command>` that take a value, from its help.
fn value_flags(command: &[&str]) -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(command)
        .arg("--help")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim_start().trim_start_matches("-h, ");
            let (flag, rest) = l.split_once(' ')?;
            (flag.starts_with("--") && rest.starts_with('<')).then(|| flag.to_string())
        })
        .collect()
}

#[test]
fn every_number_a_user_can_type_ends_in_success_or_a_message() {
    use rand::{Rng, SeedableRng};
    let d = scratch("numbers");
    let ckpt = one_step_checkpoint(&d);
    let ckpt = ckpt.to_str().unwrap();
    let slides = d.join("slides");
    let slide = slides.join("s.tiff");
    assert!(
        run(
            &[
                "data",
                "make-slide",
                "--out",
                slide.to_str().unwrap(),
                "--width",
                "512"
            ],
            120
        )
        .ok
    );
    let slides_data = format!("slides:{}", slides.display());
    let labels = slides.join("labels.csv");
    let labels = labels.to_str().unwrap();
    // Each command with flags that keep its work small; a drawn value replaces its flag's.
    let small: &[&str] = &["--batch-size", "2", "--steps", "1"];
    let commands: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["train"], small.to_vec()),
        (vec!["plan"], small.to_vec()),
        (vec!["simulate"], [small, &["--gpus", "8"]].concat()),
        (
            vec!["calibrate"],
            [small, &["--out", "c.json", "--repeats", "1"]].concat(),
        ),
        (vec!["schedule", "export"], small.to_vec()),
        (
            vec!["eval"],
            vec!["--checkpoint", ckpt, "--samples", "4", "--batch-size", "2"],
        ),
        (
            vec!["predict"],
            vec![
                "--checkpoint",
                ckpt,
                "--data",
                "synthetic",
                "--out",
                "p",
                "--samples",
                "4",
            ],
        ),
        (vec!["export"], vec!["--out", "e.safetensors"]),
        (vec!["models"], vec!["--image-size", "32"]),
        (
            vec!["data", "make-slide"],
            vec!["--out", "m.tiff", "--width", "512"],
        ),
        (
            vec!["data", "tiles"],
            vec!["--data", &slides_data, "--labels", labels],
        ),
    ];
    let schemes: [&[&str]; 4] = [
        &[],
        &["--scheme", "mp", "--split", "2"],
        &["--scheme", "mast", "--split", "2"],
        &["--scheme", "dp", "--dp", "2"],
    ];
    // Flags whose value is an amount of work: a run still busy at the bound is doing it
    // (`models --device-memory` searches every model's largest batch).
    let work = |command: &[&str], flag: &str| {
        ["--steps", "--repeats", "--measure", "--samples", "--images"].contains(&flag)
            || (command == ["models"] && flag == "--device-memory")
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(36);
    let mut cases = Vec::new();
    for (command, base) in &commands {
        for flag in value_flags(command) {
            // Numbers only: a flag that takes any text (a path, a model name) is not one.
            if parses(command, &flag, "abc") {
                continue;
            }
            let shapes: Vec<fn(&str) -> String> = [
                (|v: &str| v.to_string()) as fn(&str) -> String,
                |v| format!("{v}x{v}"),
                |v| format!("{v},{v}"),
            ]
            .into_iter()
            .filter(|shape| parses(command, &flag, &shape("1")))
            .collect();
            for _ in 0..3 {
                let random = rng.random_range(2..=64u32).to_string();
                let values = [
                    "0",
                    "1",
                    "1000000000000",
                    "-1",
                    "NaN",
                    "inf",
                    "4294967296",
                    "18446744073709551615",
                    &random,
                ];
                let value = values[rng.random_range(0..values.len())];
                let shape = shapes
                    .get(rng.random_range(0..shapes.len().max(1)))
                    .map_or(value.to_string(), |s| s(value));
                let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
                let scheme: &[&str] = match command[0] {
                    "train" | "plan" | "simulate" | "calibrate" | "schedule" => {
                        schemes[rng.random_range(0..schemes.len())]
                    }
                    _ => &[],
                };
                for pair in [base.as_slice(), scheme].concat().chunks(2) {
                    if pair[0] != flag {
                        args.extend(pair.iter().map(|s| s.to_string()));
                    }
                }
                args.push(format!("{flag}={shape}"));
                cases.push((args, work(command, &flag)));
            }
        }
    }
    assert!(cases.len() > 300, "{} cases", cases.len());
    let cwd = d.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((args, work)) = cases.get(i) else {
                    break;
                };
                bounded(args, *work, &cwd);
            });
        }
    });
    std::fs::remove_dir_all(&d).ok();
}

/// Runs `gems args` in `cwd` under an 8 GiB address-space limit: it must end within 30 s
/// (a `work` flag's run may still be busy at 3 s) with success or a message, never a panic,
/// an allocation abort or a signal.
fn bounded(args: &[String], work: bool, cwd: &Path) {
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -v 8388608 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .current_dir(cwd)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).ok();
        s
    });
    let limit = Duration::from_secs(if work { 3 } else { 30 });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let err = err.join().unwrap();
    let Some(status) = status else {
        assert!(
            work && !err.contains("error"),
            "{args:?} ran past {limit:?}: {err}"
        );
        return;
    };
    for sign in ["panicked", "memory allocation of", "stack backtrace"] {
        assert!(!err.contains(sign), "{args:?}: {err}");
    }
    assert!(
        status.code().is_some(),
        "{args:?} was killed by a signal: {err}"
    );
    assert!(
        status.success() || !err.trim().is_empty(),
        "{args:?} failed silently"
    );
}

/// The largest single allocation asked for on this thread since [`Largest::arm`].
struct Largest;

thread_local! {
    static LARGEST: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

impl Largest {
    fn arm() {
        LARGEST.with(|l| l.set(Some(0)));
    }
    fn take() -> usize {
        LARGEST.with(|l| l.take().unwrap_or(0))
    }
}

unsafe impl std::alloc::GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // `try_with`: a thread being torn down has no local left to keep.
        let _ = LARGEST.try_with(|l| {
            if let Some(max) = l.get() {
                l.set(Some(max.max(layout.size())));
            }
        });
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

/// `file` mutated by one of: flipped bits, a byte or a 4-byte word set to an extreme,
/// truncation, inserted or repeated bytes, a decimal number made extreme.
fn mutate(file: &[u8], rng: &mut impl rand::Rng) -> Vec<u8> {
    let mut f = file.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        // Half the time in the first or last 256 bytes, where headers and TIFF IFDs sit.
        let len = f.len().max(1);
        let at = match rng.random_bool(0.5) {
            true => rng.random_range(0..len.min(256)),
            false if rng.random_bool(0.5) => rng.random_range(len.saturating_sub(256)..len),
            false => rng.random_range(0..len),
        };
        match rng.random_range(0..7) {
            // The next number of a text file (JSON, CSV) made extreme.
            6 => {
                let Some(start) = f[at..].iter().position(u8::is_ascii_digit) else {
                    continue;
                };
                let start = at + start;
                let end = f[start..]
                    .iter()
                    .position(|b| !b.is_ascii_digit())
                    .map_or(f.len(), |n| start + n);
                let numbers = ["0", "4294967296", "18446744073709551615", "99999999999"];
                let number = numbers[rng.random_range(0..numbers.len())];
                f.splice(start..end, number.bytes());
            }
            0 if !f.is_empty() => f[at] ^= 1 << rng.random_range(0..8),
            1 if !f.is_empty() => f[at] = [0, 1, 0x7f, 0x80, 0xff][rng.random_range(0..5)],
            2 if at + 4 <= f.len() => {
                let word: u32 = [0, 1, 0x7fff_ffff, 0x8000_0000, u32::MAX, rng.random()]
                    [rng.random_range(0..6)];
                f[at..at + 4].copy_from_slice(&word.to_le_bytes());
            }
            3 => f.truncate(at),
            4 => {
                let bytes: Vec<u8> = (0..rng.random_range(1..16)).map(|_| rng.random()).collect();
                f.splice(at..at, bytes);
            }
            _ if !f.is_empty() => {
                let run = f[at..].iter().take(64).copied().collect::<Vec<_>>();
                f.splice(at..at, run);
            }
            _ => {}
        }
    }
    f
}

#[test]
fn file_parsers_survive_damaged_files_without_panics_hangs_or_large_allocations() {
    use gems::data::Source;
    use rand::SeedableRng;
    let d = scratch("fuzz");
    // Small valid files of every kind gems reads.
    let ck = d.join("ck");
    assert!(
        run(
            &[
                "train",
                "--model",
                "resnet11v2",
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--checkpoint",
                ck.to_str().unwrap()
            ],
            120
        )
        .ok
    );
    let slides = d.join("slides");
    assert!(
        run(
            &[
                "data",
                "make-slide",
                "--out",
                slides.join("s.tiff").to_str().unwrap(),
                "--width",
                "64",
                "--tile",
                "16",
                "--region",
                "16"
            ],
            120
        )
        .ok
    );
    let cal = d.join("cal.json");
    assert!(
        run(
            &[
                "calibrate",
                "--model",
                "resnet11v2",
                "--batch-size",
                "2",
                "--repeats",
                "1",
                "--out",
                cal.to_str().unwrap()
            ],
            120
        )
        .ok
    );
    let schedule = run(
        &[
            "schedule",
            "export",
            "--scheme",
            "mp",
            "--split",
            "2",
            "--parts",
            "2",
            "--batch-size",
            "2",
        ],
        120,
    )
    .out;
    let seg = d.join("seg");
    std::fs::create_dir_all(&seg).unwrap();
    std::fs::write(seg.join("classes.txt"), "background\ntumour\n").unwrap();
    segmentation_pair(&seg, "a", |x, y| ((x + y) % 3).min(1) as u8);
    let mask = seg.join("masks/a.png");

    let tile = gems::data::slide::TileConfig {
        level: 0,
        tile: 16,
        stride: 16,
        tissue_threshold: None,
    };
    let labels = slides.join("labels.csv");
    type Parse = Box<dyn Fn(&Path) -> Result<(), String>>;
    fn s(r: gems::Result<()>) -> Result<(), String> {
        r.map_err(|e| e.to_string())
    }
    let targets: Vec<(PathBuf, Parse)> = vec![
        (
            ck.join("step-000001.safetensors"),
            Box::new(move |p| {
                let c = gems::runtime::Checkpoint::read(p).map_err(|e| e.to_string())?;
                c.model().map_err(|e| e.to_string())?;
                c.config().map(|_| ()).map_err(|e| e.to_string())
            }),
        ),
        (
            slides.join("s.tiff"),
            Box::new(move |p| {
                let slide = gems::data::slide::Slide::open(p).map_err(|e| e.to_string())?;
                for level in 0..slide.levels().len() {
                    let l = slide.levels()[level];
                    s(slide
                        .read_rgb8(level, 0, 0, l.width.min(64), l.height.min(64))
                        .map(|_| ()))?;
                }
                Ok(())
            }),
        ),
        (
            labels.clone(),
            Box::new(move |p| {
                for task in [gems::data::Task::Classify, gems::data::Task::Segment] {
                    s(gems::data::slide::label_classes(p, task).map(|_| ()))?;
                    let tiles = gems::data::slide::Slides::open_for(
                        task,
                        p.parent().unwrap(),
                        p,
                        &tile,
                        false,
                    )
                    .map_err(|e| e.to_string())?;
                    for i in 0..tiles.tiles().len().min(4) {
                        s(tiles.label(i).map(|_| ()))?;
                    }
                }
                Ok(())
            }),
        ),
        (
            mask.clone(),
            Box::new(move |p| {
                let pairs =
                    gems::data::folder::Pairs::open(p.parent().unwrap().parent().unwrap(), false)
                        .map_err(|e| e.to_string())?;
                s(pairs.mask(0).map(|_| ()))
            }),
        ),
        (
            cal.clone(),
            Box::new(|p| s(gems::plan::calibrate::Calibration::load(p).map(|_| ()))),
        ),
    ];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    for (path, parse) in &targets {
        let good = std::fs::read(path).unwrap();
        assert_eq!(
            parse(path),
            Ok(()),
            "{} does not read before mutation",
            path.display()
        );
        for i in 0..150 {
            let bad = mutate(&good, &mut rng);
            std::fs::write(path, &bad).unwrap();
            let started = Instant::now();
            Largest::arm();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parse(path)));
            let largest = Largest::take();
            let what = format!("{} mutation {i} ({} bytes)", path.display(), bad.len());
            assert!(outcome.is_ok(), "{what} panicked");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{what} took {:?}",
                started.elapsed()
            );
            // Decoded pixels may outgrow the file (compressed tiles), within a bound.
            assert!(
                largest <= 64 * good.len() + (1 << 20),
                "{what}: one allocation of {largest} bytes"
            );
        }
        std::fs::write(path, &good).unwrap();
    }
    // Schedule files are text handed over whole.
    for i in 0..300 {
        let bad = mutate(schedule.as_bytes(), &mut rng);
        let text = String::from_utf8_lossy(&bad);
        Largest::arm();
        let outcome = std::panic::catch_unwind(|| {
            if let Ok(s) = gems::schemes::schedule::Schedule::from_json(&text) {
                let scheme = gems::schemes::Scheme::new(
                    gems::schemes::Kind::Mp,
                    s.stages,
                    s.micro_batches,
                    s.replicas,
                    1,
                    s.placement,
                )
                .with_virtual_stages(s.virtual_stages);
                if scheme.validate(s.micro_batches).is_ok() {
                    let _ = s.validate(&scheme);
                }
            }
        });
        let largest = Largest::take();
        assert!(outcome.is_ok(), "schedule mutation {i} panicked: {text}");
        assert!(
            largest <= 64 * bad.len() + (1 << 20),
            "schedule mutation {i}: one allocation of {largest} bytes"
        );
    }
    std::fs::remove_dir_all(&d).ok();
}
