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

/// What `gems plan --schedule-file path` prints for the run `RUN` with `more` flags.
fn plan_of(path: &Path, more: &[&str]) -> String {
    let mut args = vec!["plan", "--schedule-file", path.to_str().unwrap()];
    args.extend(RUN);
    args.extend(more);
    let out = gems(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

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
        let text = plan_of(path, &[]);
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

/// OFFLOAD and PREFETCH tasks, as the metered run of their schedule shows them: a micro-batch's
/// saved tensors leave the device after its F and come back before its backward; what a
/// deferred W reads leaves after its B. Each OFFLOAD ends with fewer bytes live on the device
/// than the task before it, each PREFETCH with more, and the peak is lower. (Training with
/// them matches one device: tests/schemes.rs.)
#[test]
fn offload_and_prefetch_tasks_free_the_device_until_the_pass_that_reads_it() {
    use gems::schemes::{Kind, Order};
    use gems::{models, plan::Layout, RunConfig, Scheme, TrainConfig};
    use std::sync::Arc;
    let g = models::build("resnet20v2", 32, 4).unwrap();
    let scheme = Scheme::new(Kind::Mp, 2, 4, 1, 1, Order::OneFOneB);
    let mut c = RunConfig::new(TrainConfig::new(4, 1), scheme);
    let one_f = Layout::new(&g, &c).unwrap().schedule.schedule(&scheme);
    // Each rank's tasks as it runs them (messages, REDUCE and STEP listed), and the device
    // bytes during each.
    let mut metered = |s: &Schedule| {
        c.schedule = Some(Arc::new(s.clone()));
        let tasks: Vec<Vec<Task>> = (Layout::new(&g, &c).unwrap().schedule.ranks.iter())
            .map(|r| r.iter().map(|t| t.task).collect())
            .collect();
        (tasks, gems::fit::per_task(&g, &c).unwrap())
    };
    let peak =
        |held: &[Vec<gems::memory::Held>], r: usize| held[r].iter().map(|h| h.peak).max().unwrap();
    let (_, plain) = metered(&one_f);
    let offloaded = one_f.offloading(|_| true, 0);
    let (tasks, held) = metered(&offloaded);
    let late = common::defer_weights(&one_f);
    let (_, late_held) = metered(&late);
    let (late_tasks, late_offloaded) = metered(&common::offload_weight_work(&late));
    for (tasks, held) in [(&tasks, &held), (&late_tasks, &late_offloaded)] {
        for r in 0..2 {
            let copies = tasks[r].iter().filter(|t| t.pass.copies()).count();
            assert_eq!(copies, 2 * 4, "rank {r}: {:?}", tasks[r]);
            for (i, t) in tasks[r].iter().enumerate().filter(|(_, t)| t.pass.copies()) {
                let (before, after) = (held[r][i - 1].live, held[r][i].live);
                match t.pass {
                    Pass::Offload => assert!(after < before, "rank {r}, {t}: {before} → {after}"),
                    _ => assert!(after > before, "rank {r}, {t}: {before} → {after}"),
                }
            }
        }
    }
    // The first stage holds two micro-batches between F and backward, the last one none
    // (its backward follows its F); with every W at the end, both hold four W's tensors.
    assert!(peak(&held, 0) < peak(&plain, 0));
    for r in 0..2 {
        assert!(peak(&late_offloaded, r) < peak(&late_held, r), "rank {r}");
    }
    // The timeline draws each copy as a box of its own, named in the legend.
    c.schedule = Some(Arc::new(offloaded.clone()));
    let timed = Layout::new(&g, &c).unwrap().schedule.ranks;
    let svg = gems::plan::timeline::svg("offloaded", &timed, &[]);
    // ranks · micro-batches · (OFFLOAD, PREFETCH)
    assert_eq!(svg.matches(r#"class="copy""#).count(), 2 * 4 * 2);
    assert!(svg.contains("OFFLOAD/PREFETCH host copies"));

    // What the validator refuses, naming the rank and the task.
    let refused = |s: &Schedule, why: &str| {
        let err = s.validate(&scheme).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    };
    let find = |s: &Schedule, t: Task| s.ranks[0].iter().position(|&u| u == t).unwrap();
    let (off, pre) = (Task::offload(0, 1), Task::prefetch(0, 1));
    let mut s = offloaded.clone();
    let q = find(&s, pre);
    s.ranks[0].remove(q);
    let o = find(&s, off);
    refused(
        &s,
        &format!("rank 0, task {o} (OFFLOAD of stage 0, micro-batch 1): has no PREFETCH after it"),
    );
    let mut s = offloaded.clone();
    let o = find(&s, off);
    s.ranks[0].remove(o);
    refused(
        &s,
        "(PREFETCH of stage 0, micro-batch 1): has no OFFLOAD before it",
    );
    // The backward between the two: it would read what is in the host tier.
    let mut s = offloaded.clone();
    let (q, b) = (find(&s, pre), find(&s, Task::backward(0, 1)));
    s.ranks[0].remove(q);
    s.ranks[0].insert(b, pre);
    refused(
        &s,
        &format!(
            "rank 0, task {} (BW of stage 0, micro-batch 1): comes between the OFFLOAD",
            b - 1
        ),
    );
    let mut s = offloaded.clone();
    let (o, q) = (find(&s, off), find(&s, pre));
    s.ranks[0].swap(o, q);
    refused(
        &s,
        &format!("rank 0, task {o} (PREFETCH of stage 0, micro-batch 1): comes before its OFFLOAD"),
    );
    let mut s = offloaded.clone();
    let o = find(&s, off);
    s.ranks[0].remove(o);
    s.ranks[0].insert(0, off);
    refused(
        &s,
        "rank 0, task 0 (OFFLOAD of stage 0, micro-batch 1): comes before its F",
    );
    let mut s = one_f.clone();
    s.ranks[0].extend([off, pre]);
    refused(&s, "nothing is left to move");
    let mut s = offloaded.clone();
    s.ranks[1].insert(0, Task::offload(0, 2));
    refused(&s, "rank 1, task 0 (OFFLOAD of stage 0, micro-batch 2): stage 0 of replica 0 is held by rank 0");
    // A file says the same as the Rust it was written from.
    assert_eq!(
        Schedule::from_json(&offloaded.to_json()).unwrap(),
        offloaded
    );
    assert!(offloaded
        .to_json()
        .contains(r#"{"kind":"OFFLOAD","stage":0,"micro_batch":0,"replica":0}"#));
}

#[test]
fn a_plan_of_one_schedule_measures_its_step_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    exported(dir.path());
    let text = plan_of(&dir.path().join("1f1b.json"), &["--measure", "3"]);
    let line = (text.lines())
        .find(|l| l.starts_with("measured step "))
        .unwrap_or_else(|| panic!("no measured step in:\n{text}"));
    let seconds: f64 = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(seconds > 0.0 && seconds < 60.0, "{line}");
    assert!(line.contains("3 steps on local ranks"), "{line}");
}
