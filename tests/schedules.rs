//! Schedule files through the command line: `gems schedule export` writes what `--schedule-file`
//! reads back; a file that cannot run (a task missing, a pair swapped into a deadlock, a stage
//! on a rank that does not hold it, more memory than `--device-memory`) is refused before any
//! work, naming the rank and the task.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gems::schemes::schedule::{Pass, Schedule, Task};

mod common;

fn gems(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap()
}

const RUN: [&str; 10] = [
    "--scheme",
    "mp",
    "--batch-size",
    "4",
    "--image-size",
    "32",
    "--classes",
    "4",
    "--steps",
    "1",
];

/// `gems schedule export` of 1F1B on 2 ranks, 4 micro-batches.
fn exported(dir: &Path) -> Schedule {
    let out = gems(&[
        "schedule",
        "export",
        "--scheme",
        "mp",
        "--split",
        "2",
        "--parts",
        "4",
        "--order",
        "1f1b",
        "--batch-size",
        "4",
        "--classes",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    std::fs::write(dir.join("1f1b.json"), &text).unwrap();
    let s = Schedule::from_json(&text).unwrap();
    // It lists each stage's REDUCE right after the stage's last backward (and the send of
    // its gradients), and the STEP last.
    for (r, tasks) in s.ranks.iter().enumerate() {
        let last_bw = tasks
            .iter()
            .rposition(|t| t.pass == Pass::Backward)
            .unwrap();
        let sends = (r > 0) as usize;
        assert_eq!(
            tasks[last_bw + 1 + sends..],
            [Task::reduce(r), Task::step()]
        );
    }
    assert!(text.contains("{\"kind\":\"REDUCE\",\"stage\":0}"), "{text}");
    assert!(text.contains("{\"kind\":\"STEP\"}"), "{text}");
    s
}

fn write(dir: &Path, name: &str, s: &Schedule) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, s.to_json()).unwrap();
    path
}

/// `gems train` with the schedule file `path` (and `extra` flags): its exit and its stderr.
fn train(dir: &Path, path: &Path, extra: &[&str]) -> (bool, String) {
    let metrics = dir.join("metrics.jsonl");
    let mut args = vec!["train", "--schedule-file", path.to_str().unwrap()];
    args.extend(RUN);
    args.extend(["--metrics", metrics.to_str().unwrap()]);
    args.extend(extra);
    let out = gems(&args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn an_exported_schedule_trains_and_a_broken_one_is_refused_naming_rank_and_task() {
    let dir = tempfile::tempdir().unwrap();
    let good = exported(dir.path());
    let (ok, err) = train(dir.path(), &dir.path().join("1f1b.json"), &[]);
    assert!(ok, "{err}");

    // A task missing: rank 1 never runs micro-batch 2's backward.
    let mut s = good.clone();
    s.ranks[1].retain(|t| *t != Task::backward(1, 2));
    let (ok, err) = train(dir.path(), &write(dir.path(), "missing.json", &s), &[]);
    assert!(!ok);
    assert!(
        err.contains("rank 1 has no backward") && err.contains("stage 1, micro-batch 2"),
        "{err}"
    );

    // A swapped pair that deadlocks: rank 0 waits for micro-batch 0's gradient before it
    // sends micro-batch 1, which rank 1 waits for first.
    let mut s = Schedule::empty(2, 4);
    for k in 0..4 {
        s.push(0, Task::forward(0, k)).push(0, Task::backward(0, k));
    }
    for k in [1, 0, 2, 3] {
        s.push(1, Task::forward(1, k)).push(1, Task::backward(1, k));
    }
    let (ok, err) = train(dir.path(), &write(dir.path(), "deadlock.json", &s), &[]);
    assert!(!ok);
    assert!(
        err.contains("deadlocks")
            && err.contains("rank 0 at task 1")
            && err.contains("rank 1 at task 0"),
        "{err}"
    );

    // A stage on the wrong rank.
    let mut s = good.clone();
    let t = s.ranks[1].remove(0);
    s.ranks[0].push(t);
    let (ok, err) = train(dir.path(), &write(dir.path(), "misplaced.json", &s), &[]);
    assert!(!ok);
    assert!(
        err.contains("rank 0, task") && err.contains("held by rank 1"),
        "{err}"
    );

    // A W before its B.
    let mut s = good.clone();
    let i = s.ranks[0]
        .iter()
        .position(|t| *t == Task::backward(0, 3))
        .unwrap();
    s.ranks[0][i] = Task::weight(0, 3);
    s.ranks[0].push(Task::input(0, 3));
    let (ok, err) = train(dir.path(), &write(dir.path(), "w-first.json", &s), &[]);
    assert!(!ok);
    assert!(
        err.contains("rank 0, task") && err.contains("before its B"),
        "{err}"
    );

    // A REDUCE before the last backward of its stage.
    let mut s = good.clone();
    let r = s.ranks[0]
        .iter()
        .position(|t| *t == Task::reduce(0))
        .unwrap();
    let reduce = s.ranks[0].remove(r);
    let b = s.ranks[0]
        .iter()
        .position(|t| *t == Task::backward(0, 3))
        .unwrap();
    s.ranks[0].insert(b, reduce);
    let (ok, err) = train(dir.path(), &write(dir.path(), "early.json", &s), &[]);
    assert!(!ok);
    assert!(
        err.contains(&format!(
            "rank 0, task {b} (REDUCE of stage 0): comes before the BW"
        )),
        "{err}"
    );

    // No STEP on rank 1.
    let mut s = good.clone();
    s.ranks[1].pop();
    let (ok, err) = train(dir.path(), &write(dir.path(), "no-step.json", &s), &[]);
    assert!(!ok);
    assert!(err.contains("rank 1 has no STEP"), "{err}");

    // Over the memory cap: the metered run of the file's own tasks is refused.
    let (ok, err) = train(
        dir.path(),
        &dir.path().join("1f1b.json"),
        &["--device-memory", "2MiB"],
    );
    assert!(!ok);
    assert!(err.contains("rank") && err.contains("2.00 MiB"), "{err}");
    // A file that is not a schedule.
    std::fs::write(dir.path().join("bad.json"), "{\"stages\": 2}").unwrap();
    let (ok, err) = train(dir.path(), &dir.path().join("bad.json"), &[]);
    assert!(!ok && err.contains("bad.json"), "{err}");
}

#[test]
fn deferring_every_w_holds_more_memory_than_1f1b_and_plans_say_so() {
    // 1F1B with every W at the end of the step: each rank keeps every micro-batch's
    // convolution inputs and output gradients until then. The metered peak says how much.
    let dir = tempfile::tempdir().unwrap();
    let good = exported(dir.path());
    let late = common::defer_weights(&good);
    let peak = |path: &Path| -> f64 {
        let mut args = vec!["plan", "--schedule-file", path.to_str().unwrap()];
        args.extend(RUN);
        let out = gems(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("rank 0:"))
            .unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        let unit = match words[3].trim_end_matches(':') {
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            u => panic!("unit {u} in {line}"),
        };
        words[2].parse::<f64>().unwrap() * unit
    };
    let (one_f, deferred) = (
        peak(&dir.path().join("1f1b.json")),
        peak(&write(dir.path(), "late.json", &late)),
    );
    assert!(
        deferred > one_f,
        "1F1B {one_f} bytes, W deferred {deferred} bytes"
    );
}

#[test]
fn the_documented_example_file_is_a_valid_schedule() {
    let guide = include_str!("../docs/memory-research.md");
    let start = guide
        .find("```json\n")
        .expect("the memory guide shows a schedule file")
        + 8;
    let end = start + guide[start..].find("```").unwrap();
    let s = Schedule::from_json(&guide[start..end]).unwrap();
    let scheme = gems::Scheme::new(gems::Kind::Mp, 2, 2, 1, 1, gems::Order::OneFOneB);
    s.validate(&scheme).unwrap();
}
