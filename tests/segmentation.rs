//! Segmentation end to end, as a user runs it: a U-Net trained on a generated slide's labelled
//! regions scores far above a trivial predictor on held-out tiles, and `gems eval
//! --predictions` stitches the tiles' predictions into maps of the slide whose pixels are the
//! tiles' predictions.

use std::path::{Path, PathBuf};
use std::process::Command;

use gems::data::maps;
use gems::data::slide::Slide;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-seg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `gems` with `args`; its standard output, or a panic with both streams.
fn gems(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "gems {args:?}:\n{stdout}\n{stderr}");
    stdout
}

/// The number after `key` in `text`.
fn number_after(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no '{key}' in:\n{text}"))
        + key.len();
    text[at..]
        .split_whitespace()
        .next()
        .and_then(|w| w.trim_end_matches(['%', ',']).parse().ok())
        .unwrap_or_else(|| panic!("no number after '{key}' in:\n{text}"))
}

/// A 1024×768 slide of 3 tissue classes in 256-pixel cells (64² TIFF tiles, 3 levels) and
/// its region rows.
fn slide(dir: &Path) -> (PathBuf, PathBuf) {
    let slides = dir.join("slides");
    std::fs::create_dir_all(&slides).unwrap();
    let (tiff, labels) = (slides.join("a.tiff"), dir.join("labels.csv"));
    gems(&[
        "data",
        "make-slide",
        "--out",
        tiff.to_str().unwrap(),
        "--width",
        "1024",
        "--height",
        "768",
        "--tile",
        "64",
        "--levels",
        "3",
        "--classes",
        "3",
        "--region",
        "256",
        "--seed",
        "3",
        "--labels",
        labels.to_str().unwrap(),
    ]);
    (slides, labels)
}

/// Colours of a map back to classes (white: nothing predicted).
fn class_of(rgb: &[u8]) -> Option<u8> {
    (0..=254u8).find(|&c| maps::colour(c) == [rgb[0], rgb[1], rgb[2]])
}

#[test]
fn a_unet_learns_the_regions_of_a_slide_and_maps_its_predictions() {
    let dir = temp_dir("unet");
    let (slides, labels) = slide(&dir);
    let data = format!("slides:{}", slides.display());
    let ckpt = dir.join("ckpt");
    let train = gems(&[
        "train",
        "--model",
        "unet_d3_w8",
        "--data",
        &data,
        "--labels",
        labels.to_str().unwrap(),
        "--image-size",
        "64",
        "--batch-size",
        "8",
        "--steps",
        "240",
        "--lr",
        "0.05",
        "--val",
        "0.2",
        "--seed",
        "1",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--checkpoint-every",
        "240",
    ]);
    // The pixel balance of the training tiles: a trivial predictor paints every pixel with
    // the commonest class, scoring its share as IoU for that class and 0 for the others.
    let shares: Vec<f64> = train
        .lines()
        .find(|l| l.contains("pixels:"))
        .unwrap_or_else(|| panic!("no pixel balance in:\n{train}"))
        .split("pixels:")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .unwrap()
        .split(',')
        .map(|part| number_after(part.trim_start(), " ") / 100.0)
        .collect();
    let trivial = shares.iter().copied().fold(0.0, f64::max) / shares.len() as f64;
    let out = dir.join("maps");
    let eval = gems(&[
        "eval",
        "--checkpoint",
        ckpt.join("step-000240.safetensors").to_str().unwrap(),
        "--predictions",
        out.to_str().unwrap(),
        "--map-level",
        "0",
    ]);
    let miou = number_after(&eval, "mean IoU");
    // Other class weights score the same predictions with another loss.
    let weights: Vec<String> = (1..=shares.len()).map(|k| k.to_string()).collect();
    let weighted = gems(&[
        "eval",
        "--checkpoint",
        ckpt.join("step-000240.safetensors").to_str().unwrap(),
        "--class-weights",
        &weights.join(","),
    ]);
    assert_eq!(number_after(&weighted, "mean IoU"), miou);
    assert_ne!(number_after(&weighted, "loss"), number_after(&eval, "loss"));
    // Each map split into tiles, a rank each, scored on the tiles: the same report.
    let on = |grid: &str| {
        gems(&[
            "eval",
            "--checkpoint",
            ckpt.join("step-000240.safetensors").to_str().unwrap(),
            "--dtype",
            "f64",
            "--spatial",
            grid,
        ])
    };
    let whole = on("1x1");
    assert!(whole.contains("mean IoU"), "{whole}");
    for grid in ["2x2", "3x1"] {
        let (tiled, said) = (on(grid), format!(", on {grid} tiles"));
        assert!(tiled.contains(&said), "{tiled}");
        assert_eq!(tiled.replace(&said, ""), whole, "{grid}");
    }
    assert!(
        miou > 0.6 && miou > 3.0 * trivial,
        "mean IoU {miou} against a trivial {trivial}:\n{eval}"
    );

    // The maps, at level 0: the slide's size, so its aspect ratio.
    let png = image::open(out.join("a.png")).unwrap().to_rgb8();
    assert_eq!(png.dimensions(), (1024, 768));
    let map = Slide::open(&out.join("a.tiff")).unwrap();
    assert_eq!(map.levels().len(), 1);
    let (w, h) = (map.levels()[0].width, map.levels()[0].height);
    assert_eq!((w, h), (1024, 768));
    let rgb = map.read_rgb8(0, 0, 0, w, h).unwrap();
    // Every held-out tile's square holds its predictions pixel for pixel, so the class its
    // square shows most is the tile's most predicted class in tiles.csv.
    let csv = std::fs::read_to_string(out.join("tiles.csv")).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    assert_eq!(
        &header[..8],
        [
            "slide",
            "level",
            "x",
            "y",
            "side",
            "true",
            "predicted",
            "loss"
        ]
    );
    let names = &header[8..];
    let mut tiles = 0;
    for row in rows {
        let f: Vec<&str> = row.split(',').collect();
        let (x, y): (u32, u32) = (f[2].parse().unwrap(), f[3].parse().unwrap());
        let predicted = names.iter().position(|n| *n == f[6]).unwrap() as u8;
        let mut counts = vec![0usize; names.len()];
        for my in y..y + 64 {
            for mx in x..x + 64 {
                let at = (my * w + mx) as usize * 3;
                let class = class_of(&rgb[at..at + 3]).expect("a held-out tile's pixel is painted");
                counts[class as usize] += 1;
            }
        }
        let most = (0..counts.len())
            .max_by_key(|&c| (counts[c], usize::MAX - c))
            .unwrap();
        assert_eq!(most as u8, predicted, "tile at ({x}, {y}): {counts:?}");
        tiles += 1;
    }
    assert!(tiles > 10, "{tiles} held-out tiles");
}

#[test]
fn a_classifier_maps_each_tile_in_its_predicted_class() {
    let dir = temp_dir("classify");
    let (slides, labels) = slide(&dir);
    let data = format!("slides:{}", slides.display());
    let ckpt = dir.join("ckpt");
    gems(&[
        "train",
        "--model",
        "resnet20v2",
        "--data",
        &data,
        "--labels",
        labels.to_str().unwrap(),
        "--image-size",
        "32",
        "--tile-size",
        "64",
        "--batch-size",
        "16",
        "--steps",
        "4",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    let out = dir.join("maps");
    gems(&[
        "eval",
        "--checkpoint",
        ckpt.join("step-000004.safetensors").to_str().unwrap(),
        "--data",
        &data,
        "--labels",
        labels.to_str().unwrap(),
        "--tile-size",
        "64",
        "--predictions",
        out.to_str().unwrap(),
        "--map-level",
        "1",
    ]);
    // Level 1 is 512×384: each 64² tile of level 0 covers a 32² square, in its class's colour.
    let map = Slide::open(&out.join("a.tiff")).unwrap();
    let (w, h) = (map.levels()[0].width, map.levels()[0].height);
    assert_eq!((w, h), (512, 384));
    let rgb = map.read_rgb8(0, 0, 0, w, h).unwrap();
    let csv = std::fs::read_to_string(out.join("tiles.csv")).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let names = &header[8..];
    let mut painted = vec![false; (w * h) as usize];
    for row in rows {
        let f: Vec<&str> = row.split(',').collect();
        let (x, y): (u32, u32) = (f[2].parse().unwrap(), f[3].parse().unwrap());
        let predicted = names.iter().position(|n| *n == f[6]).unwrap() as u8;
        // The class probabilities follow, one per class, summing to 1.
        let p: f64 = f[8..].iter().map(|v| v.parse::<f64>().unwrap()).sum();
        assert!((p - 1.0).abs() < 1e-5, "{row}");
        for my in y / 2..y / 2 + 32 {
            for mx in x / 2..x / 2 + 32 {
                let at = (my * w + mx) as usize;
                assert_eq!(
                    class_of(&rgb[at * 3..at * 3 + 3]),
                    Some(predicted),
                    "({mx}, {my})"
                );
                painted[at] = true;
            }
        }
    }
    // Tiles whose centre is in no region were left out: their squares stay unpainted.
    for (at, p) in painted.iter().enumerate() {
        if !p {
            assert_eq!(class_of(&rgb[at * 3..at * 3 + 3]), None);
        }
    }
}
