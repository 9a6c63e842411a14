//! Slide formats: gems' own reader decodes Aperio-style JPEG tiles that share one set of
//! tables (the JPEGTables tag; RGB and subsampled YCbCr), and reads them as OpenSlide does,
//! tile for tile (to within what two JPEG decoders' rounding allows); OpenSlide, loaded at
//! run time, reads gems' generated slides pixel for pixel as gems' reader does. The fixtures
//! come from scripts/make_svs_fixture.py.

use std::path::{Path, PathBuf};

use gems::data::openslide;
use gems::data::slide::{self, make_slide, MakeSlide, Slide, SlideReader};

mod common;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// Largest and mean absolute difference of two equal-length pixel buffers.
fn differences(a: &[u8], b: &[u8]) -> (u8, f64) {
    assert_eq!(a.len(), b.len());
    let most = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).max().unwrap();
    let sum: u64 = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y) as u64).sum();
    (most, sum as f64 / a.len() as f64)
}

#[test]
fn jpeg_tiles_with_shared_tables_read_as_openslide_reads_them() {
    for name in ["aperio_rgb.svs", "aperio_ycbcr.svs"] {
        let path = fixture(name);
        let ours = Slide::open_with(&path, SlideReader::Gems).unwrap();
        // The striped thumbnail between the two tiled levels is not a level.
        let sizes: Vec<(u32, u32, u32)> = ours
            .levels()
            .iter()
            .map(|l| (l.width, l.height, l.tile_width))
            .collect();
        assert_eq!(sizes, [(384, 256, 128), (192, 128, 128)], "{name}");
        // The texture's colours, not a YCbCr reading of them: a red-dominated corner.
        let corner = ours.read_rgb8(0, 0, 0, 1, 1).unwrap();
        assert!(corner[0] > corner[1], "{name}: {corner:?}");
        if !common::openslide_present(&format!("{name} compared with OpenSlide")) {
            continue;
        }
        let theirs = Slide::open_with(&path, SlideReader::OpenSlide).unwrap();
        assert_eq!(theirs.levels(), ours.levels(), "{name}");
        for (k, l) in ours.levels().iter().enumerate() {
            for ty in 0..l.height.div_ceil(128) {
                for tx in 0..l.width.div_ceil(128) {
                    let (x, y) = (tx * 128, ty * 128);
                    let (w, h) = ((l.width - x).min(128), (l.height - y).min(128));
                    let a = ours.read_rgb8(k, x, y, w, h).unwrap();
                    let b = theirs.read_rgb8(k, x, y, w, h).unwrap();
                    // zune-jpeg and libjpeg round their inverse DCTs and colour conversions
                    // differently, and upsample chroma differently: a few levels at most
                    // (measured: up to 1 for RGB, 4 for subsampled YCbCr, means under 0.5).
                    let (most, mean) = differences(&a, &b);
                    assert!(
                        most <= 6 && mean < 1.0,
                        "{name} level {k} tile ({tx}, {ty}): differs from OpenSlide by up to \
                         {most} (mean {mean:.2})"
                    );
                }
            }
        }
    }
}

#[test]
fn a_jpeg_slide_without_its_tables_is_refused_by_name() {
    // The fixture with its JPEGTables tag renamed to a private tag nothing reads: the
    // abbreviated tile streams cannot decode alone.
    let mut bytes = std::fs::read(fixture("aperio_rgb.svs")).unwrap();
    let tag = 347u16.to_le_bytes();
    let mut renamed = 0;
    for i in 0..bytes.len() - 4 {
        // An IFD entry: tag 347, type UNDEFINED (7).
        if bytes[i..i + 2] == tag && bytes[i + 2..i + 4] == 7u16.to_le_bytes() {
            bytes[i..i + 2].copy_from_slice(&65000u16.to_le_bytes());
            renamed += 1;
        }
    }
    assert_eq!(renamed, 2, "one JPEGTables tag per level");
    let path = std::env::temp_dir().join(format!("gems-no-tables-{}.svs", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let e = Slide::open_with(&path, SlideReader::Gems)
        .and_then(|s| s.read_rgb8(0, 0, 0, 8, 8))
        .unwrap_err()
        .to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        e.contains("gems-no-tables") && e.contains("unreadable"),
        "{e}"
    );
}

#[test]
fn openslide_reads_generated_slides_as_gems_reads_them() {
    if !common::openslide_present("a generated slide read through OpenSlide") {
        return;
    }
    let path = std::env::temp_dir().join(format!("gems-openslide-{}.tiff", std::process::id()));
    let opts = MakeSlide {
        tile: 64,
        levels: 3,
        region: 96,
        ..MakeSlide::new(300, 200)
    };
    make_slide(&path, &opts).unwrap();
    let ours = Slide::open_with(&path, SlideReader::Gems).unwrap();
    let theirs = Slide::open_with(&path, SlideReader::OpenSlide).unwrap();
    assert!(theirs.read_by_openslide() && !ours.read_by_openslide());
    assert_eq!(theirs.levels(), ours.levels());
    for (k, l) in ours.levels().iter().enumerate() {
        // A region across tile borders, and the whole level.
        let (x, y) = (l.width / 3, l.height / 4);
        for (x, y, w, h) in [(x, y, l.width / 2, l.height / 2), (0, 0, l.width, l.height)] {
            assert_eq!(
                theirs.read_rgb8(k, x, y, w, h).unwrap(),
                ours.read_rgb8(k, x, y, w, h).unwrap(),
                "level {k} at ({x}, {y})"
            );
        }
    }
    // A file OpenSlide does not recognise is refused by name.
    let text = path.with_extension("svs");
    std::fs::write(&text, "not a slide").unwrap();
    let e = Slide::open_with(&text, SlideReader::OpenSlide)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a slide OpenSlide recognises"), "{e}");
    std::fs::remove_file(&text).unwrap();
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_folder_of_dicom_files_is_one_slide_read_through_openslide() {
    let dir = tempfile::tempdir().unwrap();
    let case = dir.path().join("case 7");
    std::fs::create_dir(&case).unwrap();
    for file in ["level1.dcm", "level0.DCM"] {
        std::fs::write(case.join(file), b"not DICOM").unwrap();
    }
    // A folder without DICOM files (a MIRAX slide's data, say) is no slide of its own.
    std::fs::create_dir(dir.path().join("b")).unwrap();
    std::fs::write(dir.path().join("b/data0.dat"), b"").unwrap();
    std::fs::write(dir.path().join("b.svs"), b"").unwrap();
    let found = slide::slide_files(dir.path()).unwrap();
    assert_eq!(found, [dir.path().join("b.svs"), case.clone()]);
    assert_eq!(
        found
            .iter()
            .map(|p| slide::slide_name(p))
            .collect::<Vec<_>>(),
        ["b", "case 7"]
    );
    // The series' folder itself as the data folder: one slide.
    assert_eq!(
        slide::slide_files(&case).unwrap(),
        std::slice::from_ref(&case)
    );
    let e = Slide::open_with(&case, SlideReader::Gems)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("case 7") && e.contains("only OpenSlide reads DICOM"),
        "{e}"
    );
    if !common::openslide_present("a DICOM folder opened through OpenSlide") {
        return;
    }
    // OpenSlide opens the series through its first file, and refuses this one by name.
    let e = Slide::open_with(&case, SlideReader::OpenSlide)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("level0.DCM"), "{e}");
    let version = openslide::version().unwrap();
    if version.split('.').next().unwrap().parse::<u32>().unwrap() < 4 {
        assert!(
            e.contains(&format!("OpenSlide {version} reads no DICOM")),
            "{e}"
        );
    }
}
