//! The embedding API. A trained [`Model`] predicting on a caller's tensors gives what
//! evaluation gives on the same images — a classifier on decoded files (so normalized as in
//! training) and a U-Net — from a checkpoint or a plain state_dict, under a memory cap or
//! not; `gems predict` writes the same predictions `gems eval` scores. Step hooks see every
//! step's report.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use gems::data::folder::Folder;
use gems::data::{DataConfig, Pipeline, Source, SourceSpec};
use gems::runtime::{Evaluation, Prediction};
use gems::{
    models, Category, DType, Dataset, Device, Kind, Model, Order, RunConfig, Scheme, Session,
    Shape, Tensor, TrainConfig,
};

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-embed-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// (succeeded, stdout, stderr) of `gems args…`.
fn gems(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `gems args…`'s standard output; a panic with both streams when it fails.
fn gems_ok(args: &[&str]) -> String {
    let (ok, stdout, stderr) = gems(args);
    assert!(ok, "gems {args:?}:\n{stdout}\n{stderr}");
    stdout
}

/// Two classes of 40×36 PNGs in class folders: not square and not the model's side, so
/// they are cut and resampled, and as files they are normalized.
fn image_folder(dir: &Path) -> PathBuf {
    let root = dir.join("images");
    for (c, name) in ["cat", "dog"].iter().enumerate() {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for i in 0..5u32 {
            let img = image::RgbImage::from_fn(40, 36, |x, y| {
                let v = ((x * 7 + y * 13 + i * 31) % 256) as u8;
                image::Rgb([v, (v / 2).wrapping_add(90 * c as u8), 255 - v])
            });
            img.save(d.join(format!("{i}.png"))).unwrap();
        }
    }
    root
}

/// resnet20v2 on `side`² inputs trained two steps on `images`, saved at `dir`/classifier.
fn trained_classifier(dir: &Path, images: &Path, side: usize) -> PathBuf {
    let data_config = folder_data(images);
    let graph = models::build("resnet20v2", side, 2).unwrap();
    let mut train = TrainConfig::new(4, 2);
    train.data = data_config.clone();
    let data = gems::data::open(&data_config, side, 2, 0).unwrap();
    let mut s = Session::new(&graph, RunConfig::new(train, Scheme::single(1)), data).unwrap();
    s.step().unwrap();
    s.step().unwrap();
    let ckpt = dir.join("classifier.safetensors");
    s.save(&ckpt).unwrap();
    ckpt
}

/// Images N×3×H×W on the host.
fn tensor(images: &[gems::data::Image]) -> Tensor {
    let (h, w) = (images[0].height, images[0].width);
    let values: Vec<f64> = images
        .iter()
        .flat_map(|i| i.pixels.iter().map(|&v| v as f64))
        .collect();
    Device::cpu("host", None)
        .upload(
            Shape::new([images.len(), 3, h, w]),
            &values,
            DType::F32,
            Category::Activations,
        )
        .unwrap()
}

/// The data set of the PNGs in `images`.
fn folder_data(images: &Path) -> DataConfig {
    DataConfig {
        source: SourceSpec::Folder(images.to_path_buf()),
        ..DataConfig::default()
    }
}

/// A session of `graph` on the PNGs in `images`, in micro-batches of `batch`, restored from
/// `ckpt`: how `gems eval` evaluated before models predicted.
fn restored(graph: &gems::Graph, images: &Path, ckpt: &Path, batch: usize) -> Session {
    let config = RunConfig::new(TrainConfig::new(batch, 1), Scheme::single(1));
    let data = gems::data::open(&folder_data(images), 32, 2, 0).unwrap();
    let mut s = Session::new(graph, config, data).unwrap();
    s.restore(ckpt).unwrap();
    s
}

/// The evaluation's samples as predictions, in their order.
fn as_predictions(e: Evaluation) -> Vec<Prediction> {
    e.per_sample.into_iter().map(Prediction::from).collect()
}

#[test]
fn a_classifier_predicts_what_evaluation_scores_and_gems_predict_writes_it() {
    let dir = temp_dir("classifier");
    let images = image_folder(&dir);
    let ckpt = trained_classifier(&dir, &images, 32);
    let graph = models::build("resnet20v2", 32, 2).unwrap();
    // The folder in its order, prepared as evaluation prepares files.
    let folder = Arc::new(Folder::open(&images, false).unwrap());
    let transform = folder_data(&images).held_out_transform();
    let order = Arc::new(Pipeline::new(
        folder.clone(),
        32,
        transform,
        0,
        false,
        false,
    ));
    let e = restored(&graph, &images, &ckpt, 4).predict(&order, None, 0);
    let want = as_predictions(e.unwrap());
    let decoded: Vec<_> = (0..10).map(|i| folder.read(i).unwrap()).collect();
    let mut model = Model::load(&ckpt).unwrap().configure(|c| c.batch_size = 4);
    assert_eq!(model.classes(), ["cat", "dog"]);
    assert_eq!(model.steps(), 2);
    let got = model.predict_batch(&tensor(&decoded)).unwrap();
    assert_eq!(
        got, want,
        "predictions on decoded images differ from evaluation's"
    );
    // One image alone, C×H×W.
    let one = tensor(&decoded[3..4])
        .reshape(Shape::new([3, 36, 40]))
        .unwrap();
    assert_eq!(model.predict(&one).unwrap(), want[3]);
    // Probabilities, not logits.
    for p in &got {
        assert!((p.scores.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{p:?}");
    }

    // The same weights as a plain state_dict and the graph they belong to.
    let weights = dir.join("weights.safetensors");
    gems_ok(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        weights.to_str().unwrap(),
    ]);
    let mut plain = Model::from_state_dict(&weights, graph.clone())
        .unwrap()
        .configure(|c| c.batch_size = 4);
    assert_eq!(plain.predict_batch(&tensor(&decoded)).unwrap(), want);

    // The command line: predictions.csv holds each file's probabilities, and its classes
    // are those `gems eval` scores.
    let out = dir.join("out");
    let (ckpt_s, data) = (
        ckpt.to_str().unwrap(),
        format!("folder:{}", images.display()),
    );
    gems_ok(&[
        "predict",
        "--checkpoint",
        ckpt_s,
        "--data",
        &data,
        "--out",
        out.to_str().unwrap(),
        "--batch-size",
        "4",
    ]);
    let csv = std::fs::read_to_string(out.join("predictions.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("sample,predicted,cat,dog"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 10);
    let per_sample = dir.join("eval.csv");
    let eval_out = gems_ok(&[
        "eval",
        "--checkpoint",
        ckpt_s,
        "--data",
        &data,
        "--batch-size",
        "4",
        "--per-sample",
        per_sample.to_str().unwrap(),
    ]);
    let eval_rows: Vec<String> = std::fs::read_to_string(&per_sample)
        .unwrap()
        .lines()
        .skip(1)
        .map(String::from)
        .collect();
    let mut right = 0;
    for row in &rows {
        let i = (0..10)
            .find(|&i| folder.describe(i) == row[0])
            .unwrap_or_else(|| panic!("no sample {}", row[0]));
        let scores: Vec<f32> = row[2..].iter().map(|v| v.parse().unwrap()).collect();
        assert_eq!(scores, want[i].scores, "{}", row[0]);
        assert_eq!(row[1], ["cat", "dog"][want[i].class as usize]);
        let eval_row = eval_rows
            .iter()
            .find(|r| r.starts_with(&format!("{},", row[0])))
            .unwrap();
        let eval_predicted = eval_row.split(',').nth(2).unwrap();
        assert_eq!(eval_predicted, row[1], "{}", row[0]);
        right += usize::from(folder.label(i).unwrap() == want[i].class);
    }
    let accuracy = format!("accuracy {:.1}% on 10 samples", 10.0 * right as f64);
    assert!(eval_out.contains(&accuracy), "{accuracy} in:\n{eval_out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_unet_predicts_the_maps_evaluation_finds_and_gems_predict_draws_them() {
    let dir = temp_dir("unet");
    let graph = models::build("unet_d3_w8", 32, 3).unwrap();
    let data = Dataset::scenes(32, 3, 0).unwrap();
    let held_out = data.val.clone().unwrap();
    // Trained until its maps tell the scenes' shapes from their background.
    let mut train = TrainConfig::new(4, 30);
    train.data.task = gems::data::Task::Segment;
    let mut s = Session::new(&graph, RunConfig::new(train, Scheme::single(1)), data).unwrap();
    for _ in 0..30 {
        s.step().unwrap();
    }
    let ckpt = dir.join("unet.safetensors");
    s.save(&ckpt).unwrap();
    drop(s);
    let e = {
        let config = RunConfig::new(TrainConfig::new(2, 1), Scheme::single(1));
        let mut s = Session::new(&graph, config, Dataset::scenes(32, 3, 0).unwrap()).unwrap();
        s.restore(&ckpt).unwrap();
        s.predict(&held_out, Some(4), 1).unwrap()
    };
    let want = as_predictions(e);
    assert_eq!(want[0].map.len(), 32 * 32);
    let varies = |p: &Prediction| p.map.iter().any(|&c| c != p.map[0]);
    assert!(want.iter().all(varies), "a map of one class");
    // Synthetic scenes are model inputs as they are: the held-out stream's pixels.
    let (pixels, _) = held_out.batch(0, 4).unwrap();
    let values: Vec<f64> = pixels.iter().map(|&v| v as f64).collect();
    let images = Device::cpu("host", None)
        .upload(
            Shape::new([4, 3, 32, 32]),
            &values,
            DType::F32,
            Category::Activations,
        )
        .unwrap();
    let mut model = Model::load(&ckpt).unwrap().configure(|c| c.batch_size = 2);
    assert_eq!(model.predict_batch(&images).unwrap(), want);

    let out = dir.join("out");
    gems_ok(&[
        "predict",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--data",
        "synthetic",
        "--samples",
        "4",
        "--out",
        out.to_str().unwrap(),
        "--batch-size",
        "2",
    ]);
    let csv = std::fs::read_to_string(out.join("predictions.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 4);
    for (i, (row, p)) in rows.iter().zip(&want).enumerate() {
        let scores: Vec<f32> = row.split(',').skip(2).map(|v| v.parse().unwrap()).collect();
        assert_eq!(scores, p.scores, "row {i}");
        // Each pixel of the map in its class's colour.
        let png = image::open(out.join("maps").join(format!("{i}.png")))
            .unwrap()
            .to_rgb8();
        for (px, &class) in png.pixels().zip(&p.map) {
            assert_eq!(px.0, gems::data::maps::colour(class as u8), "map {i}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_batch_that_does_not_fit_the_cap_is_split_and_predicts_the_same() {
    let dir = temp_dir("cap");
    let images = image_folder(&dir);
    let ckpt = trained_classifier(&dir, &images, 32);
    let folder = Folder::open(&images, false).unwrap();
    let decoded: Vec<_> = (0..10).map(|i| folder.read(i).unwrap()).collect();
    // The peaks of one image at a time and of all ten at once, in a session like the model's.
    let graph = models::build("resnet20v2", 32, 2).unwrap();
    let order = gems::data::open(&folder_data(&images), 32, 2, 0)
        .unwrap()
        .train;
    let peak = |batch: usize| {
        let mut s = restored(&graph, &images, &ckpt, batch);
        s.predict(&order, Some(batch), 0).unwrap();
        s.memory().unwrap()[0].peak
    };
    let (one, ten) = (peak(1), peak(10));
    assert!(one < ten, "{one} {ten}");
    let cap = (one + ten) / 2;
    let mut whole = Model::load(&ckpt).unwrap().configure(|c| c.batch_size = 10);
    let mut capped = Model::load(&ckpt).unwrap().configure(|c| {
        c.batch_size = 10;
        c.device_memory = Some(cap);
    });
    let want = whole.predict_batch(&tensor(&decoded)).unwrap();
    let got = capped.predict_batch(&tensor(&decoded)).unwrap();
    assert!(capped.config().batch_size < 10, "the batch was not split");
    assert_eq!(got, want);
    // Under a cap below one image's needs, the allocator's error, not a panic.
    let mut tiny = Model::load(&ckpt)
        .unwrap()
        .configure(|c| c.device_memory = Some(one / 2));
    let err = tiny.predict_batch(&tensor(&decoded)).unwrap_err();
    assert!(err.to_string().contains("memory"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_image_too_large_for_one_device_predicts_tiled_over_two() {
    let dir = temp_dir("tiled");
    let images = image_folder(&dir);
    let ckpt = trained_classifier(&dir, &images, 96);
    let folder = Folder::open(&images, false).unwrap();
    let decoded: Vec<_> = (0..10).map(|i| folder.read(i).unwrap()).collect();
    let model = |cap: Option<u64>| {
        Model::load(&ckpt).unwrap().configure(|c| {
            c.batch_size = 1;
            c.device_memory = cap;
        })
    };
    let tiles = Scheme::single(1).with_spatial(gems::ops::tiles::Grid { rows: 2, cols: 1 });
    let mut alone = model(None);
    let want = alone.predict_batch(&tensor(&decoded)).unwrap();
    let mut tiled = model(None).spread(tiles);
    tiled.predict_batch(&tensor(&decoded)).unwrap();
    let peak = |m: &mut Model| {
        let ranks = m.memory().unwrap();
        (ranks.len(), ranks.iter().map(|r| r.peak).max().unwrap())
    };
    let ((one, alone_peak), (two, tiled_peak)) = (peak(&mut alone), peak(&mut tiled));
    assert_eq!((one, two), (1, 2));
    assert!(tiled_peak < alone_peak, "{tiled_peak} {alone_peak}");
    // A cap one image on one device exceeds, and its halves on two devices meet.
    let cap = Some((tiled_peak + alone_peak) / 2);
    let err = model(cap).predict_batch(&tensor(&decoded)).unwrap_err();
    assert!(err.to_string().contains("out of memory"), "{err}");
    let got = model(cap)
        .spread(tiles)
        .predict_batch(&tensor(&decoded))
        .unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.class, b.class);
        for (x, y) in a.scores.iter().zip(&b.scores) {
            // f32, the tiles' sums in another order than one device's (as in training).
            assert!((x - y).abs() <= 1e-5, "{a:?} {b:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_to_predict_is_refused_clearly() {
    let dir = temp_dir("bad");
    let missing = dir.join("missing.safetensors");
    assert!(Model::load(&missing).is_err());
    let graph = models::build("resnet20v2", 32, 2).unwrap();
    let err = Model::from_state_dict(&missing, graph).err().unwrap();
    assert!(err.to_string().contains("missing.safetensors"), "{err}");
    let (ok, _, stderr) = gems(&[
        "predict",
        "--checkpoint",
        missing.to_str().unwrap(),
        "--data",
        "synthetic",
        "--out",
        dir.join("out").to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("missing.safetensors"), "{stderr}");
    let file = dir.join("a-file");
    std::fs::write(&file, "not a folder").unwrap();
    let (ok, _, stderr) = gems(&[
        "predict",
        "--checkpoint",
        missing.to_str().unwrap(),
        "--data",
        "synthetic",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("is not a folder"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_step_hook_sees_every_step_as_step_returns_it() {
    let schemes = [
        Scheme::single(1),
        Scheme::new(Kind::Mp, 2, 2, 1, 1, Order::GPipe),
    ];
    for scheme in schemes {
        let graph = models::build("resnet20v2", 32, 4).unwrap();
        let config = RunConfig::new(TrainConfig::new(4, 3), scheme);
        let mut s = Session::new(&graph, config, Dataset::synthetic(32, 4, 0)).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        s.on_step(move |r| log.lock().unwrap().push(r.clone()));
        let returned: Vec<_> = (0..3).map(|_| s.step().unwrap()).collect();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 3, "{:?}", scheme.kind);
        for (h, r) in seen.iter().zip(&returned) {
            assert_eq!(h.step, r.step);
            assert_eq!(h.loss.to_bits(), r.loss.to_bits());
            // Every rank's memory and timing.
            assert_eq!(h.ranks.len(), scheme.world());
            for k in &h.ranks {
                assert!(k.memory.peak > 0 && k.seconds > 0.0, "{:?}", scheme.kind);
            }
        }
    }
}
