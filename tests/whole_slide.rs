//! Whole-slide segmentation: windows stitched without seams equal one large window's
//! prediction away from the slide's borders (in f64, so that no near tie flips a class), the
//! map's pyramidal TIFF holds the map at every level and opens in OpenSlide with the right
//! size, levels and pixels, and `gems predict` segments a folder of slides.

use std::path::{Path, PathBuf};
use std::process::Command;

use gems::data::maps::NOTHING;
use gems::data::slide::{make_slide, MakeSlide, Slide, SlideReader};
use gems::data::Image;
use gems::runtime::whole_slide::{segment_slide, WholeSlide, WindowRules};
use gems::{DType, Model};

mod common;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-wsi-{name}-{}", std::process::id()));
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

/// A 448×320 slide of 3 classes in 128-pixel cells (64² TIFF tiles, 3 levels) in
/// DIR/slides, and a unet_d3_w4 trained on it for a few steps (so that its map shows
/// several classes).
fn slide_and_model(dir: &Path) -> (PathBuf, PathBuf) {
    let slides = dir.join("slides");
    std::fs::create_dir_all(&slides).unwrap();
    let opts = MakeSlide {
        tile: 64,
        levels: 3,
        classes: 3,
        region: 128,
        seed: 5,
        ..MakeSlide::new(448, 320)
    };
    let made = make_slide(&slides.join("a.tiff"), &opts).unwrap();
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, made.label_rows("a.tiff")).unwrap();
    let ckpt = dir.join("ckpt");
    gems(&[
        "train",
        "--model",
        "unet_d3_w4",
        "--data",
        &format!("slides:{}", slides.display()),
        "--labels",
        labels.to_str().unwrap(),
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--steps",
        "12",
        "--lr",
        "0.05",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--checkpoint-every",
        "12",
    ]);
    (slides, ckpt.join("step-000012.safetensors"))
}

/// The level-0 labels of a map TIFF, read with the `tiff` crate: (width, height, labels).
fn read_labels(path: &Path, image: usize) -> (u32, u32, Vec<u8>) {
    let mut d = tiff::decoder::Decoder::new(std::fs::File::open(path).unwrap()).unwrap();
    d.seek_to_image(image).unwrap();
    let (w, h) = d.dimensions().unwrap();
    assert_eq!(d.colortype().unwrap(), tiff::ColorType::Gray(8));
    match d.read_image().unwrap() {
        tiff::decoder::DecodingResult::U8(v) => (w, h, v),
        other => panic!("labels decode as {other:?}"),
    }
}

/// The model's classes for the `side`² square of `slide`'s level 0 at (x, y), in f64.
fn one_window(ckpt: &Path, slide: &Slide, (x, y): (u32, u32), side: u32) -> Vec<u32> {
    let mut model = Model::load(ckpt)
        .unwrap()
        .configure(|c| c.dtype = DType::F64)
        .at_side(side as usize)
        .unwrap();
    let image: Image = slide.read_region(0, x, y, side, side).unwrap();
    model.segment(vec![image]).unwrap().pop().unwrap()
}

#[test]
fn stitched_windows_equal_one_large_window_and_the_tiff_holds_the_map() {
    let dir = temp_dir("stitch");
    let (slides, ckpt) = slide_and_model(&dir);
    let slide = Slide::open(&slides.join("a.tiff")).unwrap();
    let rules = WindowRules::of("unet_d3_w4").unwrap();
    assert_eq!((rules.granule, rules.radius), (8, 51));
    let opts = WholeSlide {
        level: 0,
        stride: 64,
        margin: rules.default_margin(),
        tissue: None,
        tile: 256,
    };
    let side = (opts.stride + 2 * opts.margin) as usize;
    let mut model = Model::load(&ckpt)
        .unwrap()
        .configure(|c| c.dtype = DType::F64)
        .at_side(side)
        .unwrap();
    let (tiff, png) = (dir.join("a.classes.tiff"), dir.join("a.classes.png"));
    let map = segment_slide(&mut model, &slide, &opts, &tiff, &png).unwrap();
    assert_eq!(map.windows, 7 * 5);
    assert_eq!(map.levels, vec![(448, 320), (224, 160)]);
    let (w, h, stitched) = read_labels(&tiff, 0);
    assert_eq!((w, h), (448, 320));

    // One 320² window at (64, 0) (a multiple of 2^3), kept where neither its border nor the
    // slide's is within the margin: the region spans window seams at x = 128, 192, 256, 320
    // and y = 64, 128, 192, 256.
    let (x0, side) = (64u32, 320u32);
    let reference = one_window(&ckpt, &slide, (x0, 0), side);
    let m = opts.margin;
    let mut compared = 0;
    let mut classes = std::collections::BTreeSet::new();
    for y in m..side - m {
        for x in x0 + m..x0 + side - m {
            let want = reference[(y * side + x - x0) as usize];
            let got = stitched[(y * w + x) as usize] as u32;
            assert_eq!(got, want, "pixel ({x}, {y})");
            classes.insert(got);
            compared += 1;
        }
    }
    assert_eq!(compared, (side - 2 * m) * (side - 2 * m));
    assert!(
        classes.len() >= 2,
        "a map of one class proves little: {classes:?}"
    );

    // Level 1 is level 0 at every other pixel.
    let (w1, h1, level1) = read_labels(&tiff, 1);
    assert_eq!((w1, h1), (224, 160));
    for y in 0..h1 {
        for x in 0..w1 {
            assert_eq!(
                level1[(y * w1 + x) as usize],
                stitched[(2 * y * w + 2 * x) as usize]
            );
        }
    }
    // The overview: the largest level within 1024 pixels, here level 0, each pixel half the
    // slide's and half its class's colour.
    let png = image::open(&png).unwrap().to_rgb8();
    assert_eq!(png.dimensions(), (448, 320));
    let under = slide.read_rgb8(0, 0, 0, 448, 320).unwrap();
    for (i, px) in png.pixels().enumerate() {
        let colour = gems::data::maps::colour(stitched[i]);
        let want: Vec<u8> = (0..3)
            .map(|c| ((under[i * 3 + c] as u16 + colour[c] as u16) / 2) as u8)
            .collect();
        assert_eq!(px.0[..], want[..], "overview pixel {i}");
    }

    // OpenSlide opens the map as a generic tiled TIFF of two levels and reads back its
    // labels (grey: R = G = B = the label).
    if !common::openslide_present("the map TIFF read through OpenSlide") {
        return;
    }
    let by_openslide = Slide::open_with(&tiff, SlideReader::OpenSlide).unwrap();
    let sizes: Vec<(u32, u32)> = by_openslide
        .levels()
        .iter()
        .map(|l| (l.width, l.height))
        .collect();
    assert_eq!(sizes, map.levels);
    for (k, labels) in [(0, &stitched), (1, &level1)] {
        let (lw, lh) = sizes[k];
        let rgb = by_openslide.read_rgb8(k, 0, 0, lw, lh).unwrap();
        for (px, &label) in rgb.chunks_exact(3).zip(labels.iter()) {
            assert_eq!(px, [label; 3], "level {k}");
        }
    }
}

#[test]
fn windows_off_the_pooling_grid_are_refused() {
    let rules = WindowRules::of("unet_d3_w4").unwrap();
    let e = rules.check("unet_d3_w4", 64, 52).unwrap_err().to_string();
    assert!(
        e.contains("multiples of 8") && e.contains("margin 56"),
        "{e}"
    );
    assert!(rules.check("unet_d3_w4", 60, 56).is_err());
    let e = rules
        .check("unet_d3_w4", 1 << 30, 56)
        .unwrap_err()
        .to_string();
    assert!(e.contains("over the 16384²"), "{e}");
    let e = WindowRules::of("resnet20v2").unwrap_err().to_string();
    assert!(e.contains("needs a U-Net"), "{e}");
}

#[test]
fn gems_predict_segments_every_slide_of_a_folder() {
    let dir = temp_dir("cli");
    let (slides, ckpt) = slide_and_model(&dir);
    // `gems predict` of the slides in `folder` into `out`, windows `stride` apart.
    let predict = |folder: &Path, stride: &str, out: &Path, more: &[&str]| {
        let data = format!("slides:{}", folder.display());
        let (ckpt, out) = (ckpt.to_str().unwrap(), out.to_str().unwrap());
        let args = [
            "predict",
            "--checkpoint",
            ckpt,
            "--data",
            &data,
            "--stride",
            stride,
        ];
        gems(&[&args[..], more, &["--out", out]].concat())
    };
    let out = dir.join("out");
    let printed = predict(&slides, "128", &out, &[]);
    assert!(
        printed.contains("margin 56; receptive radius 51"),
        "{printed}"
    );
    let (w, h, labels) = read_labels(&out.join("a.classes.tiff"), 0);
    assert_eq!((w, h), (448, 320));
    // The default tissue threshold leaves out no window of this slide (every one holds
    // tissue), so every pixel holds a class.
    assert!(labels.iter().all(|&c| c < 3), "{printed}");
    assert!(out.join("a.classes.png").is_file());
    let classes = std::fs::read_to_string(out.join("classes.csv")).unwrap();
    assert!(classes.starts_with("value,class\n0,"), "{classes}");
    assert!(classes.ends_with(&format!("{NOTHING},background (no tissue)\n")));
    // Each window spread over 2x2 tiles, a rank each: the same map.
    let in_f64 = |grid: &str| {
        let out = dir.join(format!("out-{grid}"));
        let printed = predict(&slides, "128", &out, &["--dtype", "f64", "--spatial", grid]);
        (printed, read_labels(&out.join("a.classes.tiff"), 0))
    };
    let ((_, whole), (printed, tiled)) = (in_f64("1x1"), in_f64("2x2"));
    assert!(
        printed.contains(", on 2x2 tiles: windows of 240²"),
        "{printed}"
    );
    assert_eq!(whole, tiled, "{printed}");

    // A slide with one tissue region at [64, 448) × [64, 320) (a 512-pixel cell inset by 64):
    // the 64² window centres of the top row and the left column are bare glass, background
    // (255) without a prediction, at every level of the map.
    let blank = dir.join("blank");
    std::fs::create_dir_all(&blank).unwrap();
    let opts = MakeSlide {
        tile: 64,
        levels: 3,
        classes: 3,
        region: 512,
        seed: 5,
        ..MakeSlide::new(448, 320)
    };
    make_slide(&blank.join("b.tiff"), &opts).unwrap();
    let out = dir.join("out-blank");
    let printed = predict(&blank, "64", &out, &[]);
    assert!(
        printed.contains("24 windows predicted, 11 background"),
        "{printed}"
    );
    for (image, side) in [(0, 64u32), (1, 32)] {
        let (w, h, labels) = read_labels(&out.join("b.classes.tiff"), image);
        for y in 0..h {
            for x in 0..w {
                let class = labels[(y * w + x) as usize];
                assert_eq!(
                    class == NOTHING,
                    x < side || y < side,
                    "level {image} ({x}, {y})"
                );
            }
        }
    }

    // A margin off the pooling grid is refused before any work.
    let refused = Command::new(env!("CARGO_BIN_EXE_gems"))
        .args([
            "predict",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--data",
            &format!("slides:{}", slides.display()),
            "--margin",
            "50",
            "--out",
            dir.join("refused").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("multiples of 8"), "{stderr}");
    assert!(!dir.join("refused").exists());
}
