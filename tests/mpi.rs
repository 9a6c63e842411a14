//! The schemes through the MPI transport, one process per rank under mpirun: the same
//! per-step losses as the local transport to the last bit, and as single-device training on
//! the same micro-batches to 1e-9; a killed rank ends the job instead of hanging it.
#![cfg(feature = "mpi")]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn gems() -> &'static str {
    env!("CARGO_BIN_EXE_gems")
}

/// `mpirun` that may start more ranks than cores, also as root (containers, CI).
fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

fn losses(path: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

const COMMON: [&str; 8] = [
    "train",
    "--dtype",
    "f64",
    "--steps",
    "4",
    "--classes",
    "4",
    "--seed=3",
];

fn check(name: &str, np: usize, scheme: &[&str], reference: &[&str]) {
    let dir = std::env::temp_dir().join(format!("gems-mpi-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (m, l, r) = (
        dir.join("mpi.jsonl"),
        dir.join("local.jsonl"),
        dir.join("single.jsonl"),
    );
    let out = mpirun(np)
        .arg(gems())
        .args(COMMON)
        .args(scheme)
        .args(["--transport", "mpi", "--metrics", m.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (path, args) in [(&l, scheme), (&r, reference)] {
        let out = Command::new(gems())
            .args(COMMON)
            .args(args)
            .args(["--metrics", path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (mpi, local, single) = (losses(&m), losses(&l), losses(&r));
    assert_eq!(mpi.len(), 4);
    assert_eq!(
        mpi.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        local.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{name}: mpi {mpi:?} vs local {local:?}"
    );
    for (a, b) in mpi.iter().zip(&single) {
        assert!(
            (a - b).abs() <= 1e-9 * b.abs(),
            "{name}: mpi {mpi:?} vs single {single:?}"
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn mp_and_mast_over_mpi() {
    // 4 ranks; the reference is single-device training on the same micro-batches.
    check(
        "mp",
        4,
        &[
            "--scheme",
            "mp",
            "--split",
            "4",
            "--parts",
            "2",
            "--order",
            "1f1b",
            "--batch-size",
            "4",
        ],
        &["--scheme", "single", "--parts", "2", "--batch-size", "4"],
    );
    check(
        "mast",
        4,
        &[
            "--scheme",
            "mast",
            "--split",
            "4",
            "--parts",
            "2",
            "--batch-size",
            "4",
        ],
        &["--scheme", "single", "--parts", "4", "--batch-size", "8"],
    );
    check(
        "master",
        4,
        &[
            "--scheme",
            "master",
            "--replicas",
            "4",
            "--split",
            "4",
            "--batch-size",
            "2",
        ],
        &["--scheme", "single", "--parts", "4", "--batch-size", "8"],
    );
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn pipeline_orders_and_schedule_files_over_mpi() {
    // The same micro-batches of one image on one device.
    let single =
        |m: &str| ["--scheme", "single", "--parts", m, "--batch-size", m].map(String::from);
    let mp = |extra: &[&str]| -> Vec<String> {
        [
            "--scheme",
            "mp",
            "--split",
            "2",
            "--parts",
            "4",
            "--batch-size",
            "4",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    for order in ["zbh1", "zbv", "interleaved"] {
        let args = mp(&["--order", order]);
        check(order, 2, &refs(&args), &refs(&single("4")));
    }
    let hybrid = mp(&["--order", "zbv", "--dp", "2"]);
    check("zbv-dp", 4, &refs(&hybrid), &refs(&single("8")));
    // A schedule file, as `gems schedule export` writes it, read back by every rank.
    let dir = std::env::temp_dir().join(format!("gems-mpi-schedule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("zbv.json");
    let out = Command::new(gems())
        .args(["schedule", "export", "--dtype", "f64", "--classes", "4"])
        .args(mp(&["--order", "zbv"]))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&file, &out.stdout).unwrap();
    let args = vec![
        "--scheme".to_string(),
        "mp".into(),
        "--batch-size".into(),
        "4".into(),
        "--schedule-file".into(),
        file.to_str().unwrap().into(),
    ];
    check("schedule-file", 2, &refs(&args), &refs(&single("4")));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn spatial_over_mpi() {
    // Halo exchange and BN's sums over the tiles between processes: each sample in 2x2 tiles,
    // then a 3x1 first stage feeding a second stage (assembled from the tiles).
    check(
        "sp",
        4,
        &["--spatial", "2x2", "--batch-size", "4"],
        &["--batch-size", "4"],
    );
    check(
        "sp-mp",
        4,
        &[
            "--scheme",
            "mp",
            "--split",
            "2",
            "--spatial",
            "3x1",
            "--parts",
            "2",
            "--batch-size",
            "4",
        ],
        &["--scheme", "single", "--parts", "2", "--batch-size", "4"],
    );
}

#[test]
fn hybrid_over_mpi_on_8_ranks() {
    check(
        "hybrid",
        8,
        &[
            "--scheme",
            "mast",
            "--split",
            "4",
            "--dp",
            "2",
            "--batch-size",
            "2",
        ],
        &["--scheme", "single", "--parts", "4", "--batch-size", "8"],
    );
}

#[test]
fn validation_over_mpi_equals_local() {
    let dir = std::env::temp_dir().join(format!("gems-mpi-val-{}", std::process::id()));
    for (c, class) in ["dark", "light"].iter().enumerate() {
        std::fs::create_dir_all(dir.join(class)).unwrap();
        for i in 0..12u8 {
            let v = 40 + 120 * c as u8 + 5 * i;
            image::RgbImage::from_pixel(32, 32, image::Rgb([v, v / 2, 90]))
                .save(dir.join(class).join(format!("{i}.png")))
                .unwrap();
        }
    }
    let spec = format!("folder:{}", dir.display());
    let args = [
        "train",
        "--dtype",
        "f64",
        "--steps",
        "4",
        "--data",
        &spec,
        "--val",
        "0.25",
        "--val-every",
        "2",
        "--batch-size",
        "4",
        "--scheme",
        "mp",
        "--split",
        "2",
    ];
    let validation = |out: std::process::Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("validation"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let mpi = validation(
        mpirun(2)
            .arg(gems())
            .args(args)
            .args(["--transport", "mpi"])
            .output()
            .unwrap(),
    );
    let local = validation(Command::new(gems()).args(args).output().unwrap());
    assert_eq!(mpi.len(), 2, "{mpi:?}");
    assert_eq!(mpi, local);
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_killed_rank_ends_the_job() {
    let mut job = mpirun(2)
        .arg(gems())
        .args([
            "train",
            "--transport",
            "mpi",
            "--scheme",
            "mp",
            "--split",
            "2",
            "--steps",
            "100000",
            "--seed=424242",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until both ranks run, then kill one of them.
    let started = Instant::now();
    let pids = loop {
        let out = Command::new("pgrep")
            .args(["-f", "seed=424242"])
            .output()
            .unwrap();
        let pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(String::from)
            .filter(|p| *p != job.id().to_string())
            .collect();
        if pids.len() >= 2 || started.elapsed() > Duration::from_secs(20) {
            break pids;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(pids.len() >= 2, "ranks did not start: {pids:?}");
    std::thread::sleep(Duration::from_secs(1));
    Command::new("kill")
        .args(["-9", &pids[0]])
        .status()
        .unwrap();
    let killed = Instant::now();
    loop {
        if let Some(status) = job.try_wait().unwrap() {
            assert!(!status.success(), "the job must fail when a rank dies");
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the other rank hangs"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(killed.elapsed() < Duration::from_secs(30));
}

/// fp16 activations cross the wire as 16 bits, and every process skips the steps whose
/// gradients overflow the loss scale (2³⁹ overflows for all four): the same losses, bit for
/// bit, as the threads of a local run.
#[test]
fn fp16_over_mpi_equals_local() {
    let dir = std::env::temp_dir().join(format!("gems-mpi-fp16-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args = [
        "train",
        "--precision",
        "fp16",
        "--loss-scale",
        "1e12",
        "--steps",
        "4",
        "--classes",
        "4",
        "--seed=3",
        "--scheme",
        "mp",
        "--split",
        "2",
        "--batch-size",
        "4",
    ];
    let (m, l) = (dir.join("mpi.jsonl"), dir.join("local.jsonl"));
    let mpi = mpirun(2)
        .arg(gems())
        .args(args)
        .args(["--transport", "mpi", "--metrics", m.to_str().unwrap()])
        .output()
        .unwrap();
    let local = Command::new(gems())
        .args(args)
        .args(["--metrics", l.to_str().unwrap()])
        .output()
        .unwrap();
    for out in [&mpi, &local] {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("4 steps skipped"), "{text}");
    }
    let bits = |p: &std::path::Path| losses(p).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&m), bits(&l));
    std::fs::remove_dir_all(dir).ok();
}

/// `gems` on the GPU: the emulated CUDA driver (scripts/cuda_emu, built by build.rs in every
/// `cargo test`) where there is one, else the machine's.
fn on_gpu(mut c: Command) -> Command {
    if let Some(dir) = option_env!("GEMS_CUDA_EMU_DIR") {
        c.env("GEMS_CUDA_LIB_DIRS", dir);
    }
    c
}

/// Device buffers between 2 MPI processes on the GPU, both ways they go: the same losses, bit
/// for bit, as the same run over threads. Staged (what this OpenMPI, built without CUDA,
/// gets): through pinned buffers in 1000-byte pieces, so each tensor is many pieces and the
/// copy stream overlaps MPI, under the emulator's chaos (random delays per stream), which
/// shows a piece sent before its copy's event. Direct (CUDA-awareness forced): the device
/// pointers themselves go to MPI_Isend and MPI_Recv; the emulator's device memory is host
/// memory, so the library really reads and writes it, and the losses check the bytes.
#[test]
fn device_buffers_over_mpi_staged_and_handed_over() {
    let dir = std::env::temp_dir().join(format!("gems-mpi-gpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args = [
        "train",
        "--model",
        "resnet8v1",
        "--device",
        "cuda",
        "--steps",
        "2",
        "--classes",
        "4",
        "--seed=3",
        "--scheme",
        "mp",
        "--split",
        "2",
        "--parts",
        "2",
        "--batch-size",
        "2",
    ];
    let run = |c: Command, name: &str, env: &[(&str, &str)]| -> (String, Vec<u64>) {
        let metrics = dir.join(format!("{name}.jsonl"));
        let mut c = on_gpu(c);
        let mpi = c.get_program() == "mpirun";
        if mpi {
            c.arg(gems());
        }
        let out = c
            .args(args)
            .args(mpi.then_some(["--transport", "mpi"]).into_iter().flatten())
            .args(["--metrics", metrics.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let bits = losses(&metrics).iter().map(|x| x.to_bits()).collect();
        (String::from_utf8_lossy(&out.stdout).into_owned(), bits)
    };
    let (_, local) = run(Command::new(gems()), "local", &[]);
    assert_eq!(local.len(), 2);
    let mpi = || mpirun(2);
    let (text, staged) = run(
        mpi(),
        "staged",
        &[
            ("GEMS_MPI_CUDA_AWARE", "0"),
            ("GEMS_MPI_CHUNK_BYTES", "1000"),
            ("GEMS_EMU_CHAOS", "5,300"),
        ],
    );
    assert!(
        text.contains("MPI: staged through pinned host buffers"),
        "{text}"
    );
    assert_eq!(staged, local, "staged through pinned buffers");
    let (text, direct) = run(mpi(), "direct", &[("GEMS_MPI_CUDA_AWARE", "1")]);
    assert!(text.contains("MPI: CUDA-aware"), "{text}");
    assert_eq!(direct, local, "device pointers handed to MPI");
    std::fs::remove_dir_all(dir).ok();
}
