//! Checkpoints: resuming is exact, damaged or mismatched files are refused by name, writes
//! are atomic, and evaluation changes nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use gems::optim::schedule::{Decay, LrSchedule};
use gems::optim::SgdConfig;
use gems::schemes::{Kind, Order};
use gems::{models, Dataset, RunConfig, Scheme, Session, TrainConfig};

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn gems(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gems {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every tensor of a checkpoint file: name → (dtype, shape, bytes).
fn tensors(path: &Path) -> HashMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                (
                    format!("{:?}", v.dtype()),
                    v.shape().to_vec(),
                    v.data().to_vec(),
                ),
            )
        })
        .collect()
}

#[test]
fn resuming_in_a_fresh_process_is_bit_identical() {
    let d = temp_dir("resume");
    let (straight, split, resumed) = (d.join("straight"), d.join("split"), d.join("resumed"));
    let common = [
        "train",
        "--batch-size",
        "4",
        "--steps",
        "6",
        "--warmup",
        "2",
        "--seed",
        "5",
    ];
    gems(&[&common[..], &["--checkpoint", straight.to_str().unwrap()]].concat());
    gems(
        &[
            &common[..],
            &[
                "--checkpoint",
                split.to_str().unwrap(),
                "--checkpoint-every",
                "3",
            ],
        ]
        .concat(),
    );
    let half = split.join("step-000003.safetensors");
    gems(&[
        "train",
        "--resume",
        half.to_str().unwrap(),
        "--checkpoint",
        resumed.to_str().unwrap(),
    ]);
    let a = tensors(&straight.join("step-000006.safetensors"));
    let b = tensors(&resumed.join("step-000006.safetensors"));
    assert_eq!(a.len(), b.len());
    assert!(
        a.keys().any(|k| k.starts_with("optimizer."))
            && a.contains_key("layer1.0.bn1.num_batches_tracked")
    );
    for (name, t) in &a {
        assert_eq!(Some(t), b.get(name), "tensor {name} differs after resuming");
    }
    // The half-way checkpoint really is different (training moved on).
    assert_ne!(tensors(&half)["fc.weight"], a["fc.weight"]);
    std::fs::remove_dir_all(d).ok();
}

fn small_trainer() -> Session {
    let train = TrainConfig {
        schedule: LrSchedule {
            base: 0.1,
            decay: Decay::Constant,
            warmup: 0,
            total: 3,
        },
        sgd: SgdConfig {
            momentum: 0.9,
            weight_decay: 5e-4,
            nesterov: true,
        },
        seed: 1,
        ..TrainConfig::new(4, 3)
    };
    let g = models::build("resnet20v2", 32, 10).unwrap();
    let data = Dataset::synthetic(32, 10, 1);
    Session::new(&g, RunConfig::new(train, Scheme::single(1)), data).unwrap()
}

/// Every parameter's values (BN statistics included), in the graph's order.
fn values(t: &mut Session) -> Vec<Vec<f64>> {
    let all = t.parameters().unwrap().swap_remove(0);
    all.into_iter().map(|(_, _, v)| v).collect()
}

/// Re-serializes a checkpoint with `edit` applied to its tensors, its metadata kept but for
/// the tensors' checksums (as a tool that edits tensors and knows nothing of them would write
/// it), so what is checked is the reader's check of the edit itself.
fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl Fn(&mut Vec<(String, (String, Vec<usize>, Vec<u8>))>),
) {
    let bytes = std::fs::read(src).unwrap();
    let mut meta = SafeTensors::read_metadata(&bytes)
        .unwrap()
        .1
        .metadata()
        .clone();
    if let Some(m) = meta.as_mut() {
        m.remove("checksums");
    }
    let mut ts: Vec<_> = tensors(src).into_iter().collect();
    edit(&mut ts);
    let dtype = |s: &str| match s {
        "F32" => safetensors::Dtype::F32,
        "F64" => safetensors::Dtype::F64,
        _ => safetensors::Dtype::I64,
    };
    let views: Vec<_> = ts
        .iter()
        .map(|(n, (dt, shape, data))| {
            (
                n.clone(),
                TensorView::new(dtype(dt), shape.clone(), data).unwrap(),
            )
        })
        .collect();
    std::fs::write(dst, safetensors::serialize(views, meta).unwrap()).unwrap();
}

fn refusal(path: &Path) -> String {
    let mut t = small_trainer();
    let before = values(&mut t);
    let err = t.restore(path).expect_err("must be refused").to_string();
    assert_eq!(
        values(&mut t),
        before,
        "a refused checkpoint must change nothing"
    );
    err
}

#[test]
fn damaged_or_mismatched_checkpoints_are_refused_by_name() {
    let d = temp_dir("damaged");
    let good = d.join("good.safetensors");
    let mut t = small_trainer();
    t.step().unwrap();
    t.save(&good).unwrap();
    // A good file restores.
    let mut fresh = small_trainer();
    fresh.restore(&good).unwrap();
    assert_eq!(values(&mut fresh)[5], values(&mut t)[5]);
    assert_eq!(fresh.steps_done(), 1);

    let removed = d.join("removed.safetensors");
    rewrite(&good, &removed, |ts| {
        ts.retain(|(n, _)| n != "layer2.1.conv2.weight")
    });
    let e = refusal(&removed);
    assert!(e.contains("lacks tensor 'layer2.1.conv2.weight'"), "{e}");

    let reshaped = d.join("reshaped.safetensors");
    rewrite(&good, &reshaped, |ts| {
        let (_, (_, shape, _)) = ts
            .iter_mut()
            .find(|(n, _)| n == "layer1.0.conv2.weight")
            .unwrap();
        *shape = vec![shape.iter().product()];
    });
    let e = refusal(&reshaped);
    assert!(
        e.contains("'layer1.0.conv2.weight' has shape [2304]"),
        "{e}"
    );

    let retyped = d.join("retyped.safetensors");
    rewrite(&good, &retyped, |ts| {
        let (_, (dt, _, data)) = ts.iter_mut().find(|(n, _)| n == "fc.bias").unwrap();
        *dt = "F64".into();
        *data = data
            .chunks(4)
            .flat_map(|c| (f32::from_le_bytes(c.try_into().unwrap()) as f64).to_le_bytes())
            .collect();
    });
    let e = refusal(&retyped);
    assert!(e.contains("'fc.bias' is F64, expected F32"), "{e}");

    let extra = d.join("extra.safetensors");
    rewrite(&good, &extra, |ts| {
        ts.push(("head.weight".into(), ("F32".into(), vec![1], vec![0; 4])))
    });
    assert!(refusal(&extra).contains("'head.weight'"));

    let truncated = d.join("truncated.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 1000]).unwrap();
    let e = refusal(&truncated);
    assert!(e.contains("is cut short") && e.contains('\''), "{e}");

    std::fs::write(d.join("junk.safetensors"), b"not a checkpoint").unwrap();
    let e = refusal(&d.join("junk.safetensors"));
    assert!(
        e.contains("junk.safetensors") && e.contains("is not a gems checkpoint"),
        "{e}"
    );
    // Not a file at all: refused before opening (a pipe would block the read).
    let e = refusal(&d);
    assert!(e.contains("is a folder"), "{e}");
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn a_failed_write_leaves_the_previous_checkpoint_intact() {
    let d = temp_dir("atomic");
    let path = d.join("model.safetensors");
    let mut t = small_trainer();
    t.save(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    t.step().unwrap();
    // The temporary file's name (this process's) is taken by a folder: the write fails part-way.
    let tmp = format!(".model.safetensors.{}.tmp", std::process::id());
    std::fs::create_dir(d.join(tmp)).unwrap();
    assert!(t.save(&path).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let mut fresh = small_trainer();
    fresh.restore(&path).unwrap();
    assert_eq!(fresh.steps_done(), 0);
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn evaluation_changes_nothing_and_reports() {
    let mut t = small_trainer();
    for _ in 0..3 {
        t.step().unwrap();
    }
    let before = values(&mut t);
    let a = t.evaluate_held_out(Some(20)).unwrap();
    let b = t.evaluate_held_out(Some(20)).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.samples, 20);
    assert!(a.loss.is_finite() && (0.0..=1.0).contains(&a.accuracy));
    let after = values(&mut t);
    assert_eq!(
        before, after,
        "evaluation must not change weights or BN statistics"
    );
}

/// The tensors of a safetensors file by name, with dtype, shape and bytes.
fn tensor_map(path: &Path) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                (
                    format!("{:?}", t.dtype()),
                    t.shape().to_vec(),
                    t.data().to_vec(),
                ),
            )
        })
        .collect()
}

#[test]
fn weights_go_out_as_a_plain_state_dict_and_come_back_in() {
    let d = temp_dir("export");
    let gems = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gems"))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!err.contains("panicked"), "{err}");
        (out.status.success(), text, err)
    };
    let p = |name: &str| d.join(name).to_str().unwrap().to_string();
    // The initialization, exported, starts a run exactly where the model's own would.
    let (ok, _, err) = gems(&["export", "--out", &p("init.safetensors")]);
    assert!(ok, "{err}");
    let init = tensor_map(&d.join("init.safetensors"));
    assert!(init.keys().all(|n| !n.starts_with("optimizer.")));
    assert_eq!(init["bn.num_batches_tracked"].0, "I64");
    for (ck, extra) in [("a", None), ("b", Some(p("init.safetensors")))] {
        let mut args = vec!["train", "--steps", "2", "--batch-size", "8", "--checkpoint"];
        let dir = p(ck);
        args.push(&dir);
        if let Some(file) = &extra {
            args.extend(["--init", file.as_str()]);
        }
        let (ok, _, err) = gems(&args);
        assert!(ok, "{err}");
    }
    let (a, b) = (
        d.join("a/step-000002.safetensors"),
        d.join("b/step-000002.safetensors"),
    );
    let strip = |m: std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>| {
        m.into_iter()
            .filter(|(n, _)| !n.starts_with("optimizer."))
            .collect::<Vec<_>>()
    };
    assert!(strip(tensor_map(&a)) == strip(tensor_map(&b)));
    // A checkpoint's weights, exported, score as the checkpoint does.
    let (ok, _, err) = gems(&[
        "export",
        "--checkpoint",
        a.to_str().unwrap(),
        "--out",
        &p("w.safetensors"),
    ]);
    assert!(ok, "{err}");
    let score = |args: &[&str]| {
        let (ok, out, err) = gems(
            &[
                &["eval", "--data", "synthetic", "--samples", "64"][..],
                args,
            ]
            .concat(),
        );
        assert!(ok, "{err}");
        out.lines()
            .next()
            .unwrap()
            .split(": ")
            .nth(1)
            .unwrap()
            .to_string()
    };
    assert_eq!(
        score(&["--init", &p("w.safetensors")]),
        score(&["--checkpoint", a.to_str().unwrap()])
    );
    // --class-weights that are not the model's count are refused (tests/segmentation.rs
    // checks that they weigh a U-Net's loss).
    let (ok, _, err) = gems(&[
        "eval",
        "--checkpoint",
        a.to_str().unwrap(),
        "--class-weights",
        "1,2",
    ]);
    assert!(
        !ok && err.contains("2 weights for the model's 10 classes"),
        "{err}"
    );
    // Plain weights hold no held-out split: without --data they are scored on synthetic data.
    let (ok, out, err) = gems(&["eval", "--init", &p("w.safetensors"), "--samples", "64"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&score(&["--init", &p("w.safetensors")])),
        "{out}"
    );
    // What does not match the model is refused by name.
    let (ok, _, err) = gems(&[
        "eval",
        "--init",
        &p("w.safetensors"),
        "--model",
        "resnet56v2",
        "--data",
        "synthetic",
    ]);
    assert!(!ok && err.contains("has no tensor 'layer1.2."), "{err}");
    let (ok, _, err) = gems(&[
        "eval",
        "--init",
        &p("w.safetensors"),
        "--classes",
        "5",
        "--data",
        "synthetic",
    ]);
    assert!(
        !ok && err.contains("tensor 'fc.weight' has shape [10, 256], the model's [5, 256]"),
        "{err}"
    );
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn a_unet_exports_its_weights_and_preprocessing_travels_in_its_checkpoints() {
    // The pairs of tests/data/unet_preprocess: four images of different shapes, two classes.
    let pairs = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/unet_preprocess/pairs");
    let data = format!("folder:{}", pairs.display());
    let d = temp_dir("unet-export");
    let p = |name: &str| d.join(name).to_str().unwrap().to_string();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_gems"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "gems {args:?}: {err}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let model = ["--model", "unet_d2_w4", "--image-size", "16"];
    // A segmentation model's initialization exports, and a run started from it is the run
    // started from the model's own.
    run(&[
        &["export", "--classes", "2", "--out", &p("init.safetensors")],
        &model[..],
    ]
    .concat());
    let train = [
        &["train", "--data", &data, "--normalize", "unit", "--resize"][..],
        &["--steps", "2", "--batch-size", "2", "--lr", "0.05"],
        &model,
    ]
    .concat();
    run(&[&train[..], &["--checkpoint", &p("a")]].concat());
    run(&[
        &train[..],
        &["--checkpoint", &p("b"), "--init", &p("init.safetensors")],
    ]
    .concat());
    let (a, b) = (
        d.join("a/step-000002.safetensors"),
        d.join("b/step-000002.safetensors"),
    );
    let weights = |path: &Path| {
        let mut t = tensors(path);
        t.retain(|n, _| !n.starts_with("optimizer."));
        t
    };
    let differ = |x: &Path, y: &Path| {
        let (x, y) = (weights(x), weights(y));
        let mut names: Vec<&String> = x.keys().filter(|n| x.get(*n) != y.get(*n)).collect();
        names.sort();
        names.into_iter().cloned().collect::<Vec<_>>()
    };
    assert_eq!(differ(&a, &b), Vec::<String>::new());
    // A trained U-Net's weights go out as they are in its checkpoint.
    run(&[
        "export",
        "--checkpoint",
        a.to_str().unwrap(),
        "--out",
        &p("w.safetensors"),
    ]);
    assert_eq!(differ(&a, &d.join("w.safetensors")), Vec::<String>::new());
    // The checkpoint's preprocessing is evaluation's: plain weights score alike only when
    // told it. Scores are each sample's loss in full, and the summary's head.
    let csv = p("scores.csv");
    let score = |args: &[&str]| {
        let out = run(&[&["eval", "--data", &data, "--per-sample", &csv][..], args].concat());
        let head = out.lines().next().unwrap().split(": ").next().unwrap();
        let losses: Vec<f64> = (std::fs::read_to_string(&csv).unwrap().lines().skip(1))
            .map(|row| row.rsplit(',').next().unwrap().parse().unwrap())
            .collect();
        (head.to_string(), losses)
    };
    let (head, ckpt) = score(&["--checkpoint", a.to_str().unwrap()]);
    assert!(head.ends_with("at step 2 (f32)"), "{head}");
    let exported = p("w.safetensors");
    let init = [&["--init", &exported][..], &model].concat();
    let told = [&init[..], &["--normalize", "unit", "--resize"]].concat();
    assert_eq!(score(&told).1, ckpt);
    let imagenet = score(&init).1;
    assert!(
        imagenet.iter().zip(&ckpt).all(|(x, y)| x != y),
        "{imagenet:?}"
    );
    // --dtype evaluates a checkpoint in another dtype, its weights converted.
    let (head, in_f64) = score(&["--checkpoint", a.to_str().unwrap(), "--dtype", "f64"]);
    assert!(head.ends_with("at step 2 (f64)"), "{head}");
    for (x, y) in in_f64.iter().zip(&ckpt) {
        assert!(x != y && (x - y).abs() < 1e-5 * y, "f64 {x}, f32 {y}");
    }
    // And predicts in it.
    let predict = |dtype: &[&str]| {
        let ckpt = a.to_str().unwrap();
        let out = p("pred");
        let args = [
            "predict",
            "--checkpoint",
            ckpt,
            "--data",
            &data,
            "--out",
            &out,
        ];
        run(&[&args[..], dtype].concat())
    };
    let out = predict(&[]);
    assert!(out.contains("at step 2 (f32)"), "{out}");
    let out = predict(&["--dtype", "f64"]);
    assert!(out.contains("at step 2 (f64)"), "{out}");
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn num_batches_tracked_comes_in_counts_steps_as_pytorch_and_goes_out() {
    // tests/data/unet_tracked (scripts/make_tracked_fixture.py): a state_dict whose BNs counted
    // different numbers of batches, and each count after PyTorch trained some steps.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let weights = fixture.join("unet_tracked/weights.safetensors");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture.join("unet_tracked/expected.json")).unwrap(),
    )
    .unwrap();
    let steps = expected["steps"].as_u64().unwrap() as usize;
    let trained = expected["tracked"].as_object().unwrap();
    let d = temp_dir("tracked");
    let counts = |path: &Path| -> std::collections::BTreeMap<String, i64> {
        tensors(path)
            .into_iter()
            .filter(|(n, _)| n.ends_with(".num_batches_tracked"))
            .map(|(n, (_, _, b))| (n, i64::from_le_bytes(b.try_into().unwrap())))
            .collect()
    };
    let theirs = counts(&weights);
    // Read and written back as they are.
    let g = models::build("unet_d2_w4", 16, 2).unwrap();
    let config = RunConfig::new(TrainConfig::new(2, steps + 2), Scheme::single(1));
    let mut s = Session::new(&g, config, Dataset::scenes(16, 2, 0).unwrap()).unwrap();
    s.load_weights(&weights).unwrap();
    s.save_weights(d.join("same.safetensors")).unwrap();
    assert_eq!(counts(&d.join("same.safetensors")), theirs);
    // Each training step adds one to every BN's count, as PyTorch's training forwards do.
    for _ in 0..steps {
        s.step().unwrap();
    }
    s.save(d.join("trained.safetensors")).unwrap();
    let ours = counts(&d.join("trained.safetensors"));
    assert_eq!(ours.len(), trained.len());
    for (name, n) in trained {
        assert_eq!(ours[name], n.as_i64().unwrap(), "{name}");
    }
    // The same under MAST over 2 ranks (two replicas, two micro-batches each): a step is one
    // update of the running statistics whatever the scheme.
    let mast = Scheme::new(Kind::Mast, 2, 2, 2, 1, Order::GPipe);
    let config = RunConfig::new(TrainConfig::new(2, steps), mast);
    let mut spread = Session::new(&g, config, Dataset::scenes(16, 2, 0).unwrap()).unwrap();
    spread.load_weights(&weights).unwrap();
    for _ in 0..steps {
        spread.step().unwrap();
    }
    spread.save(d.join("mast.safetensors")).unwrap();
    assert_eq!(counts(&d.join("mast.safetensors")), ours);
    // A checkpoint's counts resume and export as they stand.
    let mut resumed = Session::new(
        &g,
        RunConfig::new(TrainConfig::new(2, steps + 2), Scheme::single(1)),
        Dataset::scenes(16, 2, 0).unwrap(),
    )
    .unwrap();
    resumed.restore(d.join("trained.safetensors")).unwrap();
    resumed.step().unwrap();
    resumed.save_weights(d.join("resumed.safetensors")).unwrap();
    for (name, n) in counts(&d.join("resumed.safetensors")) {
        assert_eq!(n, ours[&name] + 1, "{name}");
    }
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn weights_from_pytorch_score_as_pytorch_scores_them() {
    // tests/data/torch_init (scripts/make_init_fixture.py): resnet20v2 weights initialised by
    // PyTorch, BN statistics random, stored in f16, and each image's loss as PyTorch computes
    // it (f64) in evaluation mode.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_init");
    let d = temp_dir("torch-init");
    let csv = d.join("scores.csv");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(["eval", "--init"])
        .arg(fixture.join("weights.safetensors"))
        .arg("--data")
        .arg(format!("folder:{}", fixture.join("images").display()))
        .arg("--per-sample")
        .arg(&csv)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: std::collections::BTreeMap<String, f64> =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap())
            .unwrap();
    let rows = std::fs::read_to_string(&csv).unwrap();
    let mut seen = 0;
    for row in rows.lines().skip(1) {
        let fields: Vec<&str> = row.split(',').collect();
        let key = expected
            .keys()
            .find(|k| fields[0].ends_with(k.as_str()))
            .unwrap_or_else(|| panic!("{row}"));
        let (ours, theirs) = (fields[3].parse::<f64>().unwrap(), expected[key]);
        // f32 arithmetic against PyTorch's f64: seen 2e-8 apart.
        assert!(
            (ours - theirs).abs() <= 1e-6 * theirs.abs(),
            "{key}: gems {ours}, PyTorch {theirs}"
        );
        seen += 1;
    }
    assert_eq!(seen, expected.len());
    std::fs::remove_dir_all(d).ok();
}
