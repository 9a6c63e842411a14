//! Data: image folders, bad files, the epoch order and its sharding, the loader, and
//! training plus evaluation on a folder of images from the command line; segmentation masks.

use std::path::{Path, PathBuf};
#[path = "common/cli.rs"]
mod cli;
use cli::gems;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gems::data::loader::Loader;
use gems::data::transform::{Normalize, Transform, MEAN, STD};
use gems::data::{DataConfig, Image, Pipeline, Source, SourceSpec, Task, UNLABELLED};
use gems::schemes::{Kind, Order, Scheme};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-data-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A w×h image of one colour.
fn solid(path: &Path, w: u32, h: u32, rgb: [u8; 3]) {
    image::RgbImage::from_pixel(w, h, image::Rgb(rgb))
        .save(path)
        .unwrap();
}

fn folder(dir: &Path, skip_bad: bool, val: f64) -> DataConfig {
    DataConfig {
        source: SourceSpec::Folder(dir.into()),
        skip_bad,
        val,
        ..DataConfig::default()
    }
}

#[test]
fn folder_classes_labels_and_pixels() {
    let d = temp("folder");
    for class in ["cat", "dog"] {
        std::fs::create_dir_all(d.join(class).join("deeper")).unwrap();
    }
    solid(&d.join("cat/a.png"), 8, 8, [255, 0, 0]);
    solid(&d.join("cat/deeper/b.tiff"), 8, 12, [0, 255, 0]);
    solid(&d.join("dog/c.png"), 16, 16, [0, 0, 255]);
    solid(&d.join("dog/d.jpg"), 8, 8, [128, 128, 128]);
    std::fs::write(d.join("README.txt"), "not a sample").unwrap();
    let data = gems::data::open(&folder(&d, false, 0.0), 8, 0, 1).unwrap();
    assert_eq!(data.classes, ["cat", "dog"]);
    let p = &data.train;
    assert_eq!(p.samples(), Some(4));
    let mut seen = Vec::new();
    for pos in 0..4 {
        let mut out = vec![0.0; p.sample_len()];
        let label = p.sample(pos, &mut out).unwrap();
        let index = p.index(pos);
        seen.push(index);
        assert_eq!(label, [0, 0, 1, 1][index]);
        // Every pixel is the file's colour, normalized (JPEG within its rounding).
        let rgb = [[255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128]][index];
        for c in 0..3 {
            let want = (rgb[c] as f32 / 255.0 - MEAN[c]) / STD[c];
            let tol = if index == 3 { 0.05 } else { 1e-5 };
            assert!(
                out[c * 64..(c + 1) * 64]
                    .iter()
                    .all(|&v| (v - want).abs() < tol),
                "sample {index} channel {c}"
            );
        }
    }
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3]);
    // The data names its classes: a model with another count is refused.
    let config = gems::RunConfig::new(gems::TrainConfig::new(2, 1), gems::Scheme::single(1));
    let g = gems::models::build("resnet20v2", 32, 3).unwrap();
    let data = gems::data::open(&folder(&d, false, 0.0), 32, 3, 0).unwrap();
    let err = gems::Session::new(&g, config, data)
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("2 classes") && err.contains("3 outputs"),
        "{err}"
    );
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn bad_files_fail_by_name_or_are_skipped_and_counted() {
    let d = temp("bad");
    std::fs::create_dir_all(d.join("a")).unwrap();
    std::fs::create_dir_all(d.join("b")).unwrap();
    solid(&d.join("a/good.png"), 8, 8, [10, 20, 30]);
    solid(&d.join("b/good.png"), 8, 8, [30, 20, 10]);
    // A PNG cut after its header: readable header, unreadable pixels.
    solid(&d.join("b/full.png"), 64, 64, [1, 2, 3]);
    let full = std::fs::read(d.join("b/full.png")).unwrap();
    std::fs::write(d.join("b/truncated.png"), &full[..full.len() / 2]).unwrap();
    std::fs::remove_file(d.join("b/full.png")).unwrap();
    std::fs::write(d.join("a/notes.jpg"), "this is text, not a JPEG").unwrap();
    std::fs::write(d.join("a/empty.png"), "").unwrap();

    // Without --skip-bad the first bad file stops the run, by name.
    let data = gems::data::open(&folder(&d, false, 0.0), 8, 0, 0).unwrap();
    let p = &data.train;
    let n = p.samples().unwrap();
    assert_eq!(n, 5);
    let mut failures = Vec::new();
    for pos in 0..n as u64 {
        let mut out = vec![0.0; p.sample_len()];
        if let Err(e) = p.sample(pos, &mut out) {
            failures.push(e.to_string());
        }
    }
    assert_eq!(failures.len(), 3, "{failures:?}");
    for name in ["notes.jpg", "empty.png", "truncated.png"] {
        assert!(
            failures.iter().any(|f| f.contains(name)),
            "no error names {name}: {failures:?}"
        );
    }

    // With --skip-bad files whose header does not read are left out when opening, and a
    // file that fails later is counted and given a blank input.
    let data = gems::data::open(&folder(&d, true, 0.0), 8, 0, 0).unwrap();
    let skipped: Vec<&str> = data.skipped.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(skipped.iter().any(|f| f.ends_with("notes.jpg")));
    assert!(skipped.iter().any(|f| f.ends_with("empty.png")));
    let p = &data.train;
    assert_eq!(p.samples(), Some(3));
    let (pixels, labels) = p.batch(0, 3).unwrap();
    assert_eq!(labels.len(), 3);
    let (bad, last) = p.bad();
    assert_eq!(bad, 1);
    assert!(last.unwrap().ends_with("truncated.png"));
    assert_eq!(pixels.iter().filter(|&&v| v == 0.0).count(), 3 * 64);
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn sharding_uses_every_sample_once_per_epoch() {
    // A source of n samples; D groups of a hybrid run take positions micro-batch by
    // micro-batch (as the executor does).
    let d = temp("shard");
    let n = 60;
    for c in 0..3 {
        std::fs::create_dir_all(d.join(format!("c{c}"))).unwrap();
    }
    for i in 0..n {
        solid(
            &d.join(format!("c{}/{i:03}.png", i % 3)),
            4,
            4,
            [i as u8; 3],
        );
    }
    let data = gems::data::open(&folder(&d, false, 0.0), 4, 0, 9).unwrap();
    for groups in [1, 2, 3] {
        let s = Scheme::new(Kind::Mp, 2, 2, 1, groups, Order::GPipe);
        let (micro, per_step) = (5, s.micro_batches_per_step());
        let steps_per_epoch = n / (micro * per_step);
        let epoch = |e: usize| -> Vec<Vec<usize>> {
            let mut by_group = vec![Vec::new(); groups];
            for step in e * steps_per_epoch..(e + 1) * steps_per_epoch {
                for (g, samples) in by_group.iter_mut().enumerate() {
                    for m in 0..s.parts {
                        let gm = s.global_micro(g, 0, m);
                        let first = ((step * per_step + gm) * micro) as u64;
                        samples.extend((first..first + micro as u64).map(|p| data.train.index(p)));
                    }
                }
            }
            by_group
        };
        let first = epoch(0);
        let mut all: Vec<usize> = first.concat();
        all.sort();
        assert_eq!(all, (0..n).collect::<Vec<_>>(), "D={groups}");
        assert_eq!(first, epoch(0));
        assert_ne!(first, epoch(1));
        let mut second = epoch(1).concat();
        second.sort();
        assert_eq!(second, all);
    }
    // Another seed, another order.
    let other = gems::data::open(&folder(&d, false, 0.0), 4, 0, 10).unwrap();
    let order = |p: &Pipeline| (0..n as u64).map(|i| p.index(i)).collect::<Vec<_>>();
    assert_ne!(order(&data.train), order(&other.train));
    std::fs::remove_dir_all(d).ok();
}

/// Counts reads in flight and at most at once; each read takes a while.
struct Slow {
    classes: Vec<String>,
    reads: AtomicUsize,
}

impl Source for Slow {
    fn samples(&self) -> Option<usize> {
        Some(1000)
    }
    fn classes(&self) -> &[String] {
        &self.classes
    }
    fn label(&self, index: usize) -> gems::Result<u32> {
        Ok((index % 2) as u32)
    }
    fn read(&self, index: usize) -> gems::Result<Image> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(2));
        Ok(Image {
            height: 2,
            width: 2,
            pixels: vec![index as f32; 12],
        })
    }
    fn describe(&self, index: usize) -> String {
        format!("slow {index}")
    }
}

#[test]
fn loader_hands_out_batches_in_order_and_stays_bounded() {
    let source = Arc::new(Slow {
        classes: vec!["even".into(), "odd".into()],
        reads: AtomicUsize::new(0),
    });
    let transform = Transform {
        augment: false,
        normalize: Normalize::Unit,
        resize: false,
    };
    let p = Arc::new(Pipeline::new(source.clone(), 2, transform, 0, false, false));
    let requests: Vec<(u64, usize)> = (0..20).map(|i| (i * 3, 3)).collect();
    let (workers, depth) = (3, 2);
    let list = requests.clone();
    let mut loader = Loader::new(
        p.clone(),
        Box::new(move |i| list.get(i).copied()),
        workers,
        depth,
    );
    // Nobody takes anything: the workers stop `depth` batches ahead.
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(source.reads.load(Ordering::SeqCst), depth * 3);
    let mut waited = std::time::Duration::ZERO;
    for &(first, n) in &requests {
        let b = loader.next_batch().unwrap();
        waited += b.waited;
        let (pixels, labels) = p.batch(first, n).unwrap();
        assert_eq!(b.pixels, pixels);
        assert_eq!(b.labels, labels);
    }
    assert!(loader.next_batch().is_err());
    assert!(waited.as_secs_f64() > 0.0);
}

#[test]
fn cli_trains_on_a_folder_validates_and_evaluates() {
    // Two classes told apart by the direction of their stripes, in colours and phases that
    // vary; some images larger than the model's input, so they are resized.
    let root = temp("cli");
    let d = root.join("images");
    for (c, class) in ["horizontal", "vertical"].iter().enumerate() {
        std::fs::create_dir_all(d.join(class)).unwrap();
        for i in 0..48u32 {
            let side = if i % 3 == 0 { 48 } else { 32 };
            let period = 4 + i % 5;
            let img = image::RgbImage::from_fn(side, side, |x, y| {
                let t = if c == 0 { y } else { x } + i;
                let on = (t / period) % 2 == 0;
                let base = [(i * 37) % 200, (i * 91) % 200, (i * 53) % 200];
                image::Rgb(base.map(|b| (b + if on { 55 } else { 0 }) as u8))
            });
            img.save(d.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    let spec = format!("folder:{}", d.display());
    let ckpt = root.join("ckpt");
    let (ok, out, err) = gems(&[
        "train",
        "--data",
        &spec,
        "--val",
        "0.25",
        "--val-every",
        "20",
        "--augment",
        "--batch-size",
        "16",
        "--steps",
        "40",
        "--lr",
        "0.05",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("2 classes"), "{out}");
    // The images of each class, for training and held out, before step 1.
    let counts = out
        .lines()
        .find(|l| l.starts_with("data: "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        counts.contains(" for training (horizontal ") && counts.contains(" held out (horizontal "),
        "{counts}"
    );
    assert!(out.contains("step    20/40  validation"), "{out}");
    assert!(out.contains("waited for data"), "{out}");
    let val_acc: f64 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("validation: loss "))
        .and_then(|l| l.split("accuracy ").nth(1))
        .and_then(|l| l.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no validation line in {out}"));
    assert!(val_acc >= 80.0, "validation accuracy {val_acc}%:\n{out}");
    let ckpt_file = ckpt.join("step-000040.safetensors");
    // Eval on the held-out split the checkpoint remembers, then on the whole folder.
    let (ok, held, err) = gems(&["eval", "--checkpoint", ckpt_file.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(
        held.contains("held-out samples") && held.contains("confusion matrix"),
        "{held}"
    );
    let (ok, all, err) = gems(&[
        "eval",
        "--checkpoint",
        ckpt_file.to_str().unwrap(),
        "--data",
        &spec,
    ]);
    assert!(ok, "{err}");
    assert!(all.contains("on 96 samples"), "{all}");
    let rows: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("horizontal") || l.contains("vertical"))
        .collect();
    assert_eq!(rows.len(), 2, "{all}");
    assert!(
        rows.iter()
            .all(|r| r.split_whitespace().nth(2) == Some("48")),
        "{all}"
    );
    // A missing folder and a model with the wrong class count are refused plainly.
    let (ok, _, err) = gems(&["train", "--data", "folder:/no/such/dir", "--steps", "1"]);
    assert!(!ok && err.contains("/no/such/dir"), "{err}");
    let (ok, _, err) = gems(&["train", "--data", &spec, "--classes", "5", "--steps", "1"]);
    assert!(!ok && err.contains("2 classes"), "{err}");
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn cli_validates_a_spread_run_as_it_does_a_single_one() {
    let d = temp("cli-spread");
    for (c, class) in ["dark", "light"].iter().enumerate() {
        std::fs::create_dir_all(d.join(class)).unwrap();
        for i in 0..12u8 {
            let v = 40 + 120 * c as u8 + 5 * i;
            solid(
                &d.join(class).join(format!("{i}.png")),
                32,
                32,
                [v, v / 2, 90],
            );
        }
    }
    let spec = format!("folder:{}", d.display());
    let validation = |spread: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            &spec,
            "--val",
            "0.25",
            "--val-every",
            "2",
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--dtype",
            "f64",
        ];
        args.extend(spread);
        let (ok, out, err) = gems(&args);
        assert!(ok, "{args:?}:\n{out}\n{err}");
        out.lines()
            .filter(|l| l.contains("validation"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    // In f64 a pipeline of one micro-batch per step trains as the single device does, so the
    // lines match to the last digit printed.
    let single = validation(&[]);
    assert_eq!(single.len(), 2, "{single:?}");
    assert!(
        single[0].starts_with("step     2/4  validation loss"),
        "{single:?}"
    );
    assert!(single[1].contains("held-out samples"), "{single:?}");
    assert_eq!(validation(&["--scheme", "mp", "--split", "2"]), single);
    std::fs::remove_dir_all(d).ok();
}

#[test]
fn cli_learns_a_generated_slide_and_eval_reports_it() {
    let d = temp("slide-cli");
    let slides = d.join("slides");
    std::fs::create_dir_all(&slides).unwrap();
    let (ok, out, err) = gems(&[
        "data",
        "make-slide",
        "--out",
        slides.join("a.tiff").to_str().unwrap(),
        "--width",
        "2048",
        "--classes",
        "2",
        "--region",
        "512",
        "--seed",
        "3",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("4 levels") && out.contains("16 tissue regions"),
        "{out}"
    );
    let labels = slides.join("labels.csv");
    let spec = format!("slides:{}", slides.display());
    let slide_flags = [
        "--data",
        &spec,
        "--labels",
        labels.to_str().unwrap(),
        "--level",
        "1",
        "--tissue",
        "0.8",
    ];
    let (ok, listed, err) =
        gems(&[&["data", "tiles", "--image-size", "32"][..], &slide_flags].concat());
    assert!(ok, "{err}");
    assert!(listed.contains("tiles of 32² at level 1"), "{listed}");
    let ckpt = d.join("ckpt");
    let args = [
        &[
            "train",
            "--val",
            "0.2",
            "--augment",
            "--batch-size",
            "16",
            "--steps",
            "40",
        ][..],
        &["--lr", "0.05", "--checkpoint", ckpt.to_str().unwrap()],
        &slide_flags,
    ]
    .concat();
    let (ok, out, err) = gems(&args);
    assert!(ok, "{out}\n{err}");
    assert!(out.contains("2 classes"), "{out}");
    // The tiles of each class, for training and held out, before step 1.
    let counts = out
        .lines()
        .find(|l| l.starts_with("data: "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        counts.contains(" for training (class0 ") && counts.contains(" held out (class0 "),
        "{counts}"
    );
    let (ok, eval, err) = gems(&[
        "eval",
        "--checkpoint",
        ckpt.join("step-000040.safetensors").to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let acc: f64 = eval
        .split("accuracy ")
        .nth(1)
        .and_then(|l| l.split('%').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {eval}"));
    assert!(
        acc >= 90.0,
        "held-out accuracy {acc}% (chance 50%):\n{eval}"
    );
    assert!(
        eval.contains("0 class0") && eval.contains("1 class1"),
        "{eval}"
    );
    std::fs::remove_dir_all(d).ok();
}

// ------------------------------------------------------------------------------------------
// Segmentation: image/mask folders, targets under augmentation, synthetic scenes.

/// The colour of pixels of class `label` (255: unlabelled) in segmentation test images.
fn class_colour(label: u8) -> [u8; 3] {
    match label {
        255 => [200, 200, 200],
        c => [c * 80, 255 - c * 80, 40],
    }
}

/// Writes `images/<stem>.<ext>` coloured by `labels` (w×h, row-major) and `masks/<stem>.png`.
fn pair(dir: &Path, stem: &str, ext: &str, w: u32, h: u32, labels: &[u8]) {
    std::fs::create_dir_all(dir.join("images")).unwrap();
    std::fs::create_dir_all(dir.join("masks")).unwrap();
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb(class_colour(labels[(y * w + x) as usize]))
    });
    img.save(dir.join(format!("images/{stem}.{ext}"))).unwrap();
    image::GrayImage::from_raw(w, h, labels.to_vec())
        .unwrap()
        .save(dir.join(format!("masks/{stem}.png")))
        .unwrap();
}

/// 8×8 blocks of classes 0 to 2 or unlabelled (255), drawn from `seed`.
fn blocks(w: u32, h: u32, seed: u64) -> Vec<u8> {
    (0..w * h)
        .map(|i| {
            let (bx, by) = ((i % w) / 8, (i / w) / 8);
            let hash = gems::core::rng::splitmix64(seed ^ ((by as u64) << 16 | bx as u64));
            [0, 1, 2, 255][(hash % 4) as usize]
        })
        .collect()
}

fn segment(dir: &Path) -> DataConfig {
    DataConfig {
        source: SourceSpec::Folder(dir.into()),
        task: Task::Segment,
        ..DataConfig::default()
    }
}

#[test]
fn targets_line_up_with_augmented_inputs() {
    let d = temp("seg-augment");
    std::fs::write(d.join("classes.txt"), "background\nstroma\ntumour\n").unwrap();
    pair(&d, "a", "png", 48, 40, &blocks(48, 40, 1));
    pair(&d, "b", "tiff", 40, 44, &blocks(40, 44, 2));
    // Shrinking (32) and enlarging (44) windows of 32 to 40 pixels.
    for size in [32, 44] {
        let c = DataConfig {
            augment: true,
            ..segment(&d)
        };
        let data = gems::data::open(&c, size, 0, 7).unwrap();
        let p = &data.train;
        assert_eq!((p.task(), p.positions()), (Task::Segment, size * size));
        let n = 16;
        let targets = p.targets(0, n).unwrap();
        let (pixels, batch_targets) = p.batch(0, n).unwrap();
        assert_eq!(targets, batch_targets);
        let mut checked = 0;
        for s in 0..n {
            let t = &targets[s * size * size..][..size * size];
            let x = &pixels[s * 3 * size * size..][..3 * size * size];
            let at = |ty: usize, tx: usize| t[ty * size + tx];
            for ty in 0..size {
                for tx in 0..size {
                    // Where the neighbours agree, the input is the class's pure colour (the
                    // linear filter's taps lie between the neighbours' nearest pixels).
                    let label = at(ty, tx);
                    let near = (ty.saturating_sub(1)..(ty + 2).min(size)).flat_map(|y| {
                        (tx.saturating_sub(1)..(tx + 2).min(size)).map(move |x| (y, x))
                    });
                    if near.clone().any(|(y, x)| at(y, x) != label) {
                        continue;
                    }
                    checked += 1;
                    let colour = class_colour(if label == UNLABELLED {
                        255
                    } else {
                        label as u8
                    });
                    for ch in 0..3 {
                        let want = (colour[ch] as f32 / 255.0 - MEAN[ch]) / STD[ch];
                        let got = x[ch * size * size + ty * size + tx];
                        assert!(
                            (got - want).abs() < 1e-3,
                            "size {size} sample {s} pixel ({tx}, {ty}) channel {ch}: {got} vs {want} (target {label})"
                        );
                    }
                }
            }
        }
        assert!(
            checked > n * size * size / 3,
            "only {checked} pixels checked"
        );
        assert!(targets.contains(&UNLABELLED));
    }
}

#[test]
fn folder_masks_count_rename_and_refuse() {
    let d = temp("seg-folder");
    std::fs::write(d.join("classes.txt"), "background\nstroma\ntumour\n").unwrap();
    // 4×2: background, stroma, tumour and unlabelled pixels in known numbers.
    pair(&d, "a", "png", 4, 2, &[0, 0, 0, 1, 2, 2, 255, 255]);
    pair(&d, "b", "jpg", 4, 2, &[1; 8]);
    let data = gems::data::open(&segment(&d), 4, 0, 3).unwrap();
    assert_eq!(data.classes, ["background", "stroma", "tumour"]);
    let p = &data.train;
    assert_eq!(p.class_counts().unwrap(), Some(vec![3, 9, 2]));
    let pos = (0..2).find(|&pos| p.index(pos) == 0).unwrap();
    let want = [0, 0, 0, 1, 2, 2, UNLABELLED, UNLABELLED];
    // The centred 2×2 square of a, resampled to 4×4 by nearest.
    let t = p.targets(pos, 1).unwrap();
    let centred: Vec<u32> = (0..16)
        .map(|i| want[(i / 4 / 2) * 4 + 1 + (i % 4) / 2])
        .collect();
    assert_eq!(t, centred);
    // Renumbered by name; unlabelled stays.
    let names: Vec<String> = ["tumour", "background", "stroma"].map(String::from).into();
    let renamed = p.by_class_names(&names).unwrap();
    let map = |l: u32| {
        if l == UNLABELLED {
            l
        } else {
            [1, 2, 0][l as usize]
        }
    };
    assert_eq!(
        renamed.targets(pos, 1).unwrap(),
        centred.iter().map(|&l| map(l)).collect::<Vec<_>>()
    );
    assert_eq!(renamed.class_counts().unwrap(), Some(vec![2, 3, 9]));

    let refused = |setup: &dyn Fn(&Path), needles: &[&str]| {
        let d = temp("seg-refused");
        std::fs::write(d.join("classes.txt"), "background\ntumour\n").unwrap();
        pair(&d, "a", "png", 4, 2, &[0; 8]);
        setup(&d);
        let e = match gems::data::open(&segment(&d), 4, 0, 3) {
            Err(e) => e.to_string(),
            Ok(data) => data.train.class_counts().unwrap_err().to_string(),
        };
        for n in needles {
            assert!(e.contains(n), "{e:?} lacks {n:?}");
        }
    };
    refused(
        &|d| pair(d, "b", "png", 4, 2, &[0, 1, 5, 0, 0, 0, 0, 0]),
        &["masks/b.png", "value 5"],
    );
    refused(
        &|d| std::fs::remove_file(d.join("masks/a.png")).unwrap(),
        &["images/a.png", "has no mask"],
    );
    refused(
        &|d| solid(&d.join("images/c.png"), 4, 2, [0, 0, 0]),
        &["images/c.png", "has no mask"],
    );
    refused(
        &|d| {
            image::GrayImage::new(4, 2)
                .save(d.join("masks/c.png"))
                .unwrap()
        },
        &["masks/c.png", "has no image"],
    );
    refused(
        &|d| {
            image::GrayImage::new(4, 3)
                .save(d.join("masks/a.png"))
                .unwrap()
        },
        &["masks/a.png", "4×3", "4×2"],
    );
    refused(
        &|d| solid(&d.join("masks/a.png"), 4, 2, [0, 0, 0]),
        &["masks/a.png", "grayscale"],
    );
    refused(
        &|d| std::fs::remove_file(d.join("classes.txt")).unwrap(),
        &["classes.txt"],
    );
    // With --skip-bad an unreadable image leaves its pair out, by name.
    std::fs::write(d.join("images/c.png"), "not a png").unwrap();
    image::GrayImage::new(3, 3)
        .save(d.join("masks/c.png"))
        .unwrap();
    let c = DataConfig {
        skip_bad: true,
        ..segment(&d)
    };
    let data = gems::data::open(&c, 4, 0, 3).unwrap();
    assert_eq!(data.train.samples(), Some(2));
    assert!(
        data.skipped[0].0.ends_with("images/c.png"),
        "{:?}",
        data.skipped
    );
    assert!(gems::data::open(&segment(&d), 4, 0, 3).is_err());
}

#[test]
fn synthetic_scenes_segment() {
    let c = DataConfig {
        task: Task::Segment,
        augment: true,
        ..DataConfig::default()
    };
    let data = gems::data::open(&c, 32, 3, 5).unwrap();
    assert_eq!(data.classes, ["background", "1", "2"]);
    let (train, val) = (&data.train, data.val.as_ref().unwrap());
    assert_eq!((train.task(), train.positions()), (Task::Segment, 32 * 32));
    let t = train.targets(10, 4).unwrap();
    assert_eq!(t.len(), 4 * 32 * 32);
    assert_eq!(train.batch(10, 4).unwrap().1, t);
    assert!(
        (0..3).all(|c| t.contains(&c)),
        "every class shows in 4 scenes"
    );
    assert_ne!(val.targets(10, 4).unwrap(), t);
    let e = gems::data::open(&c, 32, 1, 5).err().unwrap().to_string();
    assert!(e.contains("at least 2 classes"), "{e}");
}

/// Numbered samples of a caller's own, each image filled with its index.
struct Numbered(usize, Vec<String>);

impl Source for Numbered {
    fn samples(&self) -> Option<usize> {
        Some(self.0)
    }
    fn classes(&self) -> &[String] {
        &self.1
    }
    fn label(&self, index: usize) -> gems::Result<u32> {
        Ok((index % 2) as u32)
    }
    fn read(&self, index: usize) -> gems::Result<Image> {
        Ok(Image {
            height: 2,
            width: 2,
            pixels: vec![index as f32; 12],
        })
    }
    fn describe(&self, index: usize) -> String {
        format!("numbered {index}")
    }
}

#[test]
fn a_users_source_holds_out_the_same_fraction_every_time() {
    let source = Arc::new(Numbered(400, vec!["even".into(), "odd".into()]));
    let open = |held_out| gems::Dataset::from_source(source.clone(), 2, held_out, 9);
    let all = open(0.0).unwrap();
    assert_eq!(all.train.samples(), Some(400));
    assert!(all.val.is_none());
    let d = open(0.25).unwrap();
    let val = d.val.as_ref().expect("a held-out split");
    let indices = |p: &Pipeline| -> Vec<usize> {
        let n = p.samples().unwrap() as u64;
        let mut v: Vec<usize> = (0..n).map(|pos| p.index(pos)).collect();
        v.sort();
        v
    };
    let (train, held) = (indices(&d.train), indices(val));
    // About a quarter held out, disjoint from training, together every sample once.
    assert!((70..130).contains(&held.len()), "{} held out", held.len());
    let mut both = [train.clone(), held.clone()].concat();
    both.sort();
    assert_eq!(both, (0..400).collect::<Vec<_>>());
    // The same split from the same seed.
    assert_eq!(indices(open(0.25).unwrap().val.as_ref().unwrap()), held);
    assert!(open(1.0).is_err());
}
