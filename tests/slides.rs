//! Whole-slide images: synthetic pyramidal TIFFs written tile by tile, read back region by
//! region, cut into labelled tiles; memory stays bounded on a slide far larger than the bound;
//! bad files are refused by name; region rows rasterised into tile masks.

use std::path::{Path, PathBuf};
use std::process::Command;

use gems::data::slide::{
    class_name, label_classes, make_slide, MadeSlide, MakeSlide, Slide, Slides, TileConfig,
    TISSUE_FOOTPRINT,
};
use gems::data::{DataConfig, Image, Source, SourceSpec, Task, UNLABELLED};
use rayon::prelude::*;

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gems-slides-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A 700×500 slide with 64² TIFF tiles (edge tiles cut off on both axes) and 3 levels.
fn small(seed: u64) -> MakeSlide {
    MakeSlide {
        tile: 64,
        levels: 3,
        classes: 3,
        seed,
        region: 128,
        ..MakeSlide::new(700, 500)
    }
}

/// The whole of `level`, decoded by the `tiff` crate on its own (not through `Slide`).
fn whole_level(path: &Path, level: usize) -> (u32, u32, Vec<u8>) {
    let mut d = tiff::decoder::Decoder::new(std::fs::File::open(path).unwrap()).unwrap();
    d.seek_to_image(level).unwrap();
    let (w, h) = d.dimensions().unwrap();
    match d.read_image().unwrap() {
        tiff::decoder::DecodingResult::U8(v) => (w, h, v),
        _ => panic!("not 8-bit"),
    }
}

fn crop(whole: &(u32, u32, Vec<u8>), x: u32, y: u32, size: u32) -> Image {
    let (w, _, px) = whole;
    let mut rgb = Vec::new();
    for row in y..y + size {
        let at = ((row * w + x) * 3) as usize;
        rgb.extend_from_slice(&px[at..at + size as usize * 3]);
    }
    Image::from_rgb8(size as usize, size as usize, &rgb)
}

fn config(level: usize, tile: u32, stride: u32) -> TileConfig {
    TileConfig {
        level,
        tile,
        stride,
        tissue_threshold: None,
    }
}

/// Reads every tile on two threads and checks it against the whole-level decode.
fn check_tiles(tiles: &Slides, path: &Path, cfg: &TileConfig, cols: u32, rows: u32) {
    let whole = whole_level(path, cfg.level);
    assert_eq!(tiles.samples(), Some((cols * rows) as usize));
    let expected: Vec<(u32, u32)> = (0..rows)
        .flat_map(|r| (0..cols).map(move |c| (c * cfg.stride, r * cfg.stride)))
        .collect();
    let got: Vec<(u32, u32)> = tiles.tiles().iter().map(|t| (t.x, t.y)).collect();
    assert_eq!(got, expected, "tile corners, row-major");
    assert!(
        whole.0 < cols * cfg.stride + cfg.tile,
        "the last column is the last whole tile"
    );
    (0..cols * rows).into_par_iter().for_each(|i| {
        let t = tiles.tiles()[i as usize];
        let image = tiles.read(i as usize).unwrap();
        assert!(
            image == crop(&whole, t.x, t.y, cfg.tile),
            "{} differs from the whole-level decode",
            tiles.describe(i as usize)
        );
    });
}

#[test]
fn tiles_equal_the_whole_level_decode_at_two_levels() {
    let dir = temp_dir("tiles");
    let path = dir.join("a.tiff");
    let made = make_slide(&path, &small(1)).unwrap();
    assert!(!made.bigtiff);
    let sizes: Vec<(u32, u32)> = made.levels.iter().map(|l| (l.width, l.height)).collect();
    assert_eq!(sizes, [(700, 500), (350, 250), (175, 125)]);
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, "slide,label\na.tiff,tumour\n").unwrap();

    let slide = Slide::open(&path).unwrap();
    assert_eq!(slide.levels(), &made.levels[..]);

    // Level 0, tiles of 96 at stride 96 (not TIFF-tile aligned): 7 × 5 whole tiles.
    let cfg = config(0, 96, 96);
    let tiles = Slides::open(&dir, &labels, &cfg, false).unwrap();
    assert_eq!(tiles.classes(), ["tumour"]);
    assert_eq!(tiles.describe(8), "a.tiff level 0 tile at (96, 96)");
    check_tiles(&tiles, &path, &cfg, 7, 5);

    // Level 1 (350×250), overlapping tiles of 64 at stride 40: 8 × 5.
    let cfg = config(1, 64, 40);
    let tiles = Slides::open(&dir, &labels, &cfg, false).unwrap();
    assert_eq!(tiles.describe(9), "a.tiff level 1 tile at (40, 40)");
    check_tiles(&tiles, &path, &cfg, 8, 5);

    // Tiles exported as PNG read back as the same pixels, in an image folder.
    let out = dir.join("png");
    let pngs: Vec<PathBuf> = [0, 39]
        .iter()
        .map(|&i| tiles.export_png(i, &out).unwrap())
        .collect();
    assert_eq!(pngs[1], out.join("tumour/a_level1_280_160.png"));
    for (path, i) in pngs.iter().zip([0, 39]) {
        let png = image::open(path).unwrap().into_rgb8();
        let t = tiles.tiles()[i];
        assert!(png.as_raw() == &slide.read_rgb8(1, t.x, t.y, 64, 64).unwrap());
    }
    let folder = gems::data::folder::Folder::open(&out, false).unwrap();
    assert_eq!(
        (folder.classes(), folder.samples()),
        (&["tumour".to_string()][..], Some(2))
    );

    // A region across TIFF tile edges at the right and bottom edges of level 2.
    let whole = whole_level(&path, 2);
    let got = slide.read_rgb8(2, 60, 50, 115, 75).unwrap();
    let want: Vec<u8> = (50..125)
        .flat_map(|y| {
            whole.2[((y * 175 + 60) * 3) as usize..((y * 175 + 175) * 3) as usize].to_vec()
        })
        .collect();
    assert!(got == want);

    // The same slide as BigTIFF reads the same.
    let big = dir.join("big.tif");
    let made_big = make_slide(
        &big,
        &MakeSlide {
            bigtiff: true,
            ..small(1)
        },
    )
    .unwrap();
    assert!(made_big.bigtiff);
    assert_eq!(
        &std::fs::read(&big).unwrap()[..4],
        b"II+\0",
        "a BigTIFF header"
    );
    let big = Slide::open(&big).unwrap();
    for level in 0..3 {
        let l = made.levels[level];
        assert!(
            big.read_rgb8(level, 0, 0, l.width, l.height).unwrap() == whole_level(&path, level).2,
            "level {level}"
        );
    }
    // BigTIFF is chosen by itself past 4 GiB of tiles.
    assert!(!small(1).needs_bigtiff());
    assert!(MakeSlide::new(40_000, 40_000).needs_bigtiff());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Whether the rectangle [x, x+size)² (level 0) meets `r`.
fn meets(r: &gems::data::slide::Region, x: u32, y: u32, size: u32) -> bool {
    x < r.x + r.w && r.x < x + size && y < r.y + r.h && r.y < y + size
}

fn inside(r: &gems::data::slide::Region, x: u32, y: u32, size: u32) -> bool {
    x >= r.x && x + size <= r.x + r.w && y >= r.y && y + size <= r.y + r.h
}

#[test]
fn labels_from_region_rows_and_whole_slide_rows() {
    let dir = temp_dir("labels");
    let a: MadeSlide = make_slide(&dir.join("a.tiff"), &small(2)).unwrap();
    make_slide(&dir.join("b.tif"), &small(3)).unwrap();
    // A region row per tissue region for a (named by file name), one row for b (by stem).
    let rows = format!("slide,x,y,w,h,label\n{}b,normal\n", a.label_rows("a.tiff"));
    let labels = dir.join("labels.csv");
    let size = 32;
    // A row for a slide that is not in the directory labels nothing: refused by line.
    std::fs::write(&labels, format!("{rows}elsewhere.tiff,zzz\n")).unwrap();
    let e = error_of(Slides::open(&dir, &labels, &config(0, size, size), false));
    let line = rows.lines().count() + 1;
    assert!(
        e.contains(&format!("line {line}: slide elsewhere.tiff is not in")),
        "{e}"
    );
    std::fs::write(&labels, rows).unwrap();

    let tiles = Slides::open(&dir, &labels, &config(0, size, size), false).unwrap();
    let mut want = ["normal"].map(String::from).to_vec();
    want.extend((0..3).map(|c| class_name(c, 3)));
    want.sort();
    assert_eq!(tiles.classes(), want);
    assert_eq!(want[..3], ["class0", "class1", "class2"]);

    // a: a tile is there iff its centre is in a region, with that region's class.
    let mut expected = Vec::new();
    for y in (0..=500 - size).step_by(size as usize) {
        for x in (0..=700 - size).step_by(size as usize) {
            let (cx, cy) = (x + size / 2, y + size / 2);
            let hit = a
                .regions
                .iter()
                .find(|r| cx >= r.x && cx < r.x + r.w && cy >= r.y && cy < r.y + r.h);
            if let Some(r) = hit {
                expected.push((x, y, r.class as u32));
            }
        }
    }
    let of_a: Vec<(u32, u32, u32)> = tiles
        .tiles()
        .iter()
        .filter(|t| t.slide == 0)
        .map(|t| (t.x, t.y, t.label))
        .collect();
    assert_eq!(of_a, expected);
    assert!(expected.len() < 21 * 15 && !expected.is_empty());
    // b: every tile, labelled `normal`.
    let normal = tiles.classes().iter().position(|c| c == "normal").unwrap() as u32;
    let of_b: Vec<u32> = tiles
        .tiles()
        .iter()
        .filter(|t| t.slide == 1)
        .map(|t| t.label)
        .collect();
    assert_eq!(of_b, vec![normal; 21 * 15]);
    assert!(tiles
        .describe(tiles.tiles().len() - 1)
        .starts_with("b.tif level 0 tile at"));

    // The tissue filter, judged on level 2 (a 32-pixel tile spans 8 pixels there): tiles
    // inside a region stay, tiles that meet no region go.
    assert_eq!(32 >> 2, TISSUE_FOOTPRINT);
    std::fs::write(&labels, "a,tissue\nb,tissue\n").unwrap();
    let filtered = TileConfig {
        tissue_threshold: Some(0.8),
        ..config(0, size, 16)
    };
    let kept = Slides::open(&dir, &labels, &filtered, false).unwrap();
    let all = Slides::open(&dir, &labels, &config(0, size, 16), false).unwrap();
    let kept_a: Vec<(u32, u32)> = kept
        .tiles()
        .iter()
        .filter(|t| t.slide == 0)
        .map(|t| (t.x, t.y))
        .collect();
    let (mut tissue, mut background) = (0, 0);
    for t in all.tiles().iter().filter(|t| t.slide == 0) {
        let here = kept_a.contains(&(t.x, t.y));
        if a.regions.iter().any(|r| inside(r, t.x, t.y, size)) {
            assert!(here, "tissue tile at ({}, {}) was dropped", t.x, t.y);
            tissue += 1;
        }
        if !a.regions.iter().any(|r| meets(r, t.x, t.y, size)) {
            assert!(!here, "background tile at ({}, {}) was kept", t.x, t.y);
            background += 1;
        }
    }
    assert!(
        tissue > 50 && background > 50,
        "{tissue} tissue, {background} background tiles"
    );
    assert!(kept.tiles().len() < all.tiles().len());

    // Every slide needs a row; a slide cannot have both kinds of rows.
    std::fs::write(&labels, "a,tissue\n").unwrap();
    let e = Slides::open(&dir, &labels, &config(0, 32, 32), false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("b.tif") && e.contains("no row"), "{e}");
    std::fs::write(&labels, "a,tissue\nb,x\na,0,0,10,10,y\n").unwrap();
    let e = Slides::open(&dir, &labels, &config(0, 32, 32), false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("line 3") && e.contains("not both"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn error_of<T>(r: gems::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_slides_are_refused_by_name() {
    let dir = temp_dir("bad");
    let good = dir.join("good.tiff");
    make_slide(&good, &small(4)).unwrap();
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, "good,x\n").unwrap();
    let name = good.display().to_string();

    // A level out of range, a tile larger than the level, a zero tile.
    let e = error_of(Slides::open(&dir, &labels, &config(3, 32, 32), false));
    assert!(e.contains(&name) && e.contains("has 3 levels"), "{e}");
    let e = error_of(Slides::open(&dir, &labels, &config(1, 251, 251), false));
    assert!(
        e.contains(&name) && e.contains("does not fit level 1 (350×250)"),
        "{e}"
    );
    let e = error_of(Slides::open(&dir, &labels, &config(0, 0, 8), false));
    assert!(e.contains(&name), "{e}");
    let slide = Slide::open(&good).unwrap();
    let e = error_of(slide.read_region(2, 100, 0, 76, 10));
    assert!(e.contains(&name) && e.contains("not inside level 2"), "{e}");

    // Not a TIFF.
    let junk = dir.join("junk.tiff");
    std::fs::write(&junk, "slide,label\n").unwrap();
    let e = error_of(Slide::open(&junk));
    assert!(
        e.contains(&junk.display().to_string()) && e.contains("not a TIFF"),
        "{e}"
    );

    // A striped TIFF (what most writers produce by default).
    let striped = dir.join("striped.tif");
    let mut file = std::fs::File::create(&striped).unwrap();
    let mut tiff = tiff::encoder::TiffEncoder::new(&mut file).unwrap();
    tiff.write_image::<tiff::encoder::colortype::RGB8>(64, 48, &vec![200u8; 64 * 48 * 3])
        .unwrap();
    let e = error_of(Slide::open(&striped));
    assert!(
        e.contains(&striped.display().to_string()) && e.contains("striped"),
        "{e}"
    );

    // A tiled TIFF of grey pixels.
    let gray = dir.join("gray.tiff");
    let mut file = std::fs::File::create(&gray).unwrap();
    let mut tiff = tiff::encoder::TiffEncoder::new(&mut file).unwrap();
    let mut d = tiff.image_directory().unwrap();
    let at = d.write_data(&[128u8; 16 * 16][..]).unwrap() as u32;
    use tiff::tags::Tag;
    for (tag, v) in [
        (Tag::ImageWidth, 16),
        (Tag::ImageLength, 16),
        (Tag::TileWidth, 16),
        (Tag::TileLength, 16),
    ] {
        d.write_tag(tag, v as u32).unwrap();
    }
    for (tag, v) in [
        (Tag::BitsPerSample, 8),
        (Tag::Compression, 1),
        (Tag::PhotometricInterpretation, 1),
        (Tag::SamplesPerPixel, 1),
    ] {
        d.write_tag(tag, v as u16).unwrap();
    }
    d.write_tag(Tag::TileOffsets, &[at][..]).unwrap();
    d.write_tag(Tag::TileByteCounts, &[256u32][..]).unwrap();
    d.finish().unwrap();
    let e = error_of(Slide::open(&gray));
    assert!(
        e.contains(&gray.display().to_string()) && e.contains("only 8-bit RGB"),
        "{e}"
    );

    // Cut in half: the directories (written after each level's tiles) are gone.
    let bytes = std::fs::read(&good).unwrap();
    let cut = dir.join("cut.tiff");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = error_of(Slide::open(&cut));
    assert!(
        e.contains(&cut.display().to_string()) && e.contains("truncated"),
        "{e}"
    );

    // Damaged tile data: the structure reads, the tile does not.
    let mut damaged = bytes.clone();
    for b in &mut damaged[1000..3000] {
        *b = 0x5a;
    }
    let broken = dir.join("broken.tiff");
    std::fs::write(&broken, &damaged).unwrap();
    let slide = Slide::open(&broken).unwrap();
    let e = error_of(slide.read_region(0, 0, 0, 700, 500));
    assert!(
        e.contains(&broken.display().to_string()) && e.contains("level 0 tile"),
        "{e}"
    );

    // Through the source too: the directory now holds the bad files.
    let e = error_of(Slides::open(&dir, &labels, &config(0, 32, 32), false));
    assert!(e.contains("broken.tiff") || e.contains("cut.tiff"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn labels_that_would_train_on_nothing_are_refused_by_line() {
    let dir = temp_dir("sanity");
    make_slide(&dir.join("a.tiff"), &small(5)).unwrap();
    let labels = dir.join("labels.csv");
    let tiles = config(0, 32, 32);
    let refused = |csv: &str| {
        std::fs::write(&labels, csv).unwrap();
        error_of(Slides::open(&dir, &labels, &tiles, false))
    };
    for (csv, want) in [
        // The slide is 700×500 pixels.
        (
            "a,600,0,200,100,x\n",
            "line 1: the region 600,0,200,100 reaches outside a.tiff",
        ),
        (
            "a,0,0,100,100,x\na,50,50,100,100,y\n",
            "line 2: its region (y) overlaps line 1's (x)",
        ),
        // 32-pixel tiles have centres at 16 + 32k: none lies in [17, 47).
        (
            "a,17,17,30,30,x\n",
            "line 1: the region [17, 17, 30, 30] of a.tiff holds the centre of no",
        ),
        (
            "a,0,0,-5,10,x\n",
            "line 1: a region needs x, y ≥ 0 and a width and height ≥ 1 pixel, not 0, 0, -5, 10",
        ),
        (
            "slide,x,y,w,h,label\na,0,0,10,1.5,x\n",
            "line 2: x, y, w, h must be whole numbers",
        ),
    ] {
        let e = refused(csv);
        assert!(
            e.contains(&labels.display().to_string()) && e.contains(want),
            "{csv}: {e}"
        );
    }
    // Same-label regions may overlap.
    std::fs::write(&labels, "a,0,0,100,100,x\na,50,50,100,100,x\n").unwrap();
    Slides::open(&dir, &labels, &tiles, false).unwrap();
    // A class all of whose tiles the tissue filter leaves out.
    std::fs::write(&labels, "a,0,0,700,500,x\n").unwrap();
    let blank = TileConfig {
        tissue_threshold: Some(0.0),
        ..tiles
    };
    let e = error_of(Slides::open(&dir, &labels, &blank, false));
    assert!(
        e.contains("class x (line 1) has no tiles: the tissue threshold 0"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn skip_bad_leaves_out_a_truncated_slide_and_refuses_a_pipe() {
    let dir = temp_dir("skip");
    let good = dir.join("a.tiff");
    make_slide(&good, &small(6)).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(dir.join("b.tiff"), &bytes[..bytes.len() / 2]).unwrap();
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, "a,x\nb,y\nc,y\n").unwrap();
    // c.tiff is a named pipe: reading it would block forever.
    let fifo = dir.join("c.tiff");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let e = error_of(Slides::open(&dir, &labels, &config(0, 32, 32), false));
    assert!(e.contains("b.tiff") && e.contains("truncated"), "{e}");
    // Skipping bad slides leaves out b and c; class y then has no tiles, which is refused.
    let e = error_of(Slides::open(&dir, &labels, &config(0, 32, 32), true));
    assert!(
        e.contains("class y (line 2, 3) has no tiles: its slides were left out"),
        "{e}"
    );
    std::fs::write(&labels, "a,x\nb,x\nc,x\n").unwrap();
    let s = Slides::open(&dir, &labels, &config(0, 32, 32), true).unwrap();
    let skipped: Vec<String> = s
        .skipped
        .iter()
        .map(|(p, why)| format!("{}: {why}", p.display()))
        .collect();
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(
        skipped[0].contains("b.tiff") && skipped[0].contains("truncated"),
        "{skipped:?}"
    );
    assert!(
        skipped[1].contains("c.tiff") && skipped[1].contains("not a regular file"),
        "{skipped:?}"
    );
    assert_eq!(s.slides().len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Set in the child process of `memory_stays_bounded`: the slide directory to read.
const CHILD: &str = "GEMS_SLIDES_MEMORY_CHILD";

/// Peak resident memory of this process so far, in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[test]
fn memory_stays_bounded() {
    let dir = temp_dir("memory");
    // 9472² RGB: 257 MiB at level 0 (1 GiB as f32 tiles).
    let made = make_slide(
        &dir.join("big.tiff"),
        &MakeSlide {
            noise: 0.0,
            ..MakeSlide::new(9472, 9472)
        },
    )
    .unwrap();
    let level0 = 9472u64 * 9472 * 3;
    assert!(level0 >= 256 << 20);
    std::fs::write(dir.join("labels.csv"), "big,tissue\n").unwrap();
    // Read in a fresh process, so that its peak memory is the reading's alone.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "memory_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{text}");
    assert!(text.contains("1 passed"), "the child did not run:\n{text}");
    eprintln!(
        "{} MiB file; {}",
        made.bytes >> 20,
        text.lines().find(|l| l.contains("peak")).unwrap_or("")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "the child process of memory_stays_bounded (run alone, it runs that test)"]
fn memory_child() {
    let Some(dir) = std::env::var_os(CHILD) else {
        return memory_stays_bounded();
    };
    let dir = PathBuf::from(dir);
    let before = peak_rss();
    let tiles = Slides::open(&dir, &dir.join("labels.csv"), &config(0, 512, 512), false).unwrap();
    assert_eq!(tiles.samples(), Some(18 * 18));
    // Every tile, on two threads, as a loader would.
    let sum: f64 = (0..18 * 18)
        .into_par_iter()
        .map(|i| {
            tiles
                .read(i)
                .unwrap()
                .pixels
                .iter()
                .map(|&v| v as f64)
                .sum::<f64>()
        })
        .sum();
    let mean = sum / (18.0 * 18.0 * 512.0 * 512.0 * 3.0);
    let grown = peak_rss().saturating_sub(before);
    println!(
        "mean {mean:.3}; peak memory grew {} MiB reading 257 MiB of pixels",
        grown >> 20
    );
    assert!(mean > 0.4 && mean < 0.95, "mean {mean}");
    assert!(grown < 48 << 20, "peak memory grew {} MiB", grown >> 20);
}

/// Region rows of a.tiff (file order matters where they overlap), and b.tiff labelled whole.
const SEGMENT_ROWS: &str = "slide,x,y,w,h,label
a.tiff,10,20,300,150,tumour
a.tiff,200,100,200,200,tumour
a.tiff,450,50,101,333,stroma
a.tiff,0,400,77,99,unlabelled
a.tiff,600,0,5,5,stroma
b.tiff,stroma
";

/// The label of level-0 point (x, y) by the definition: the first region holding it.
fn by_hand(x: f64, y: f64) -> u32 {
    // Classes sort as background 0, stroma 1, tumour 2.
    let rows = [
        (10, 20, 300, 150, 2),
        (200, 100, 200, 200, 2),
        (450, 50, 101, 333, 1),
        (0, 400, 77, 99, UNLABELLED),
        (600, 0, 5, 5, 1),
    ];
    rows.iter()
        .find(|&&(rx, ry, w, h, _)| {
            let (rx, ry) = (rx as f64, ry as f64);
            x >= rx && x < rx + w as f64 && y >= ry && y < ry + h as f64
        })
        .map_or(0, |r| r.4)
}

#[test]
fn region_rows_rasterise_into_tile_masks_at_levels_0_and_1() {
    let dir = temp_dir("masks");
    make_slide(&dir.join("a.tiff"), &small(1)).unwrap();
    make_slide(&dir.join("b.tiff"), &small(2)).unwrap();
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, SEGMENT_ROWS).unwrap();
    // Classifying, the tiny region holds no tile's centre and is refused; segmenting, not.
    let e = error_of(Slides::open(&dir, &labels, &config(0, 64, 50), false));
    assert!(e.contains("line 6") && e.contains("centre of no"), "{e}");
    for (level, tile, stride, scale) in [(0, 64, 50, 1.0), (1, 40, 30, 2.0)] {
        let cfg = config(level, tile, stride);
        let s = Slides::open_for(Task::Segment, &dir, &labels, &cfg, false).unwrap();
        assert_eq!(s.classes(), ["background", "stroma", "tumour"]);
        assert_eq!(s.task(), Task::Segment);
        // Every tile of both slides, whatever its centre.
        let (w, h) = (700 / scale as u32, 500 / scale as u32);
        let grid = ((w - tile) / stride + 1) * ((h - tile) / stride + 1);
        assert_eq!(s.samples(), Some(2 * grid as usize), "level {level}");
        let mut counts = vec![0usize; 3];
        let mut unlabelled = 0;
        for (i, t) in s.tiles().iter().enumerate() {
            let mask = s.mask(i).unwrap();
            assert_eq!((mask.width, mask.height), (tile as usize, tile as usize));
            for py in 0..tile {
                for px in 0..tile {
                    let centre = |corner: u32, p: u32| (corner + p) as f64 * scale + 0.5 * scale;
                    let want = match t.slide {
                        0 => by_hand(centre(t.x, px), centre(t.y, py)),
                        _ => 1,
                    };
                    let got = mask.labels[(py * tile + px) as usize];
                    assert_eq!(
                        got,
                        want,
                        "level {level} {} pixel ({px}, {py})",
                        s.describe(i)
                    );
                    match got {
                        UNLABELLED => unlabelled += 1,
                        c => counts[c as usize] += 1,
                    }
                }
            }
        }
        assert!(
            counts.iter().all(|&n| n > 0) && unlabelled > 0,
            "{counts:?}"
        );
        // The pipeline counts the same pixels and, unaugmented at the tile's side, its
        // targets are the masks.
        let spec = SourceSpec::Slides {
            dir: dir.clone(),
            labels: labels.clone(),
            tiles: cfg,
        };
        let c = DataConfig {
            source: spec,
            task: Task::Segment,
            ..DataConfig::default()
        };
        let p = gems::data::open(&c, tile as usize, 0, 1).unwrap().train;
        assert_eq!(p.class_counts().unwrap(), Some(counts));
        let first = s.mask(p.index(3)).unwrap().labels;
        assert_eq!(p.targets(3, 1).unwrap(), first);
    }
}

#[test]
fn background_is_named_once_and_unlabelled_is_no_class() {
    let dir = temp_dir("background");
    let labels = dir.join("labels.csv");
    std::fs::write(
        &labels,
        "a.tiff,0,0,8,8,background\na.tiff,20,0,8,8,unlabelled\nb.tiff,tumour\n",
    )
    .unwrap();
    assert_eq!(
        label_classes(&labels, Task::Segment).unwrap(),
        ["background", "tumour"]
    );
    assert_eq!(
        label_classes(&labels, Task::Classify).unwrap(),
        ["background", "tumour", "unlabelled"]
    );
}

#[test]
fn segmenting_keeps_tissue_tiles_and_splits() {
    let dir = temp_dir("seg-tissue");
    make_slide(&dir.join("a.tiff"), &small(1)).unwrap();
    make_slide(&dir.join("b.tiff"), &small(2)).unwrap();
    let labels = dir.join("labels.csv");
    std::fs::write(&labels, SEGMENT_ROWS).unwrap();
    let all = config(0, 32, 32);
    let tissue = TileConfig {
        tissue_threshold: Some(0.8),
        ..all
    };
    let every = Slides::open_for(Task::Segment, &dir, &labels, &all, false).unwrap();
    let kept = Slides::open_for(Task::Segment, &dir, &labels, &tissue, false).unwrap();
    let (every, kept) = (every.samples().unwrap(), kept.samples().unwrap());
    assert!(kept > every / 4 && kept < every, "{kept} of {every}");
    let c = DataConfig {
        source: SourceSpec::Slides {
            dir: dir.clone(),
            labels,
            tiles: tissue,
        },
        task: Task::Segment,
        val: 0.3,
        ..DataConfig::default()
    };
    let data = gems::data::open(&c, 16, 0, 2).unwrap();
    let (train, val) = (&data.train, data.val.as_ref().unwrap());
    assert_eq!(train.samples().unwrap() + val.samples().unwrap(), kept);
    let pixels =
        |p: &gems::data::Pipeline| p.class_counts().unwrap().unwrap().iter().sum::<usize>();
    assert!(pixels(train) > 0 && pixels(val) > 0);
    assert_eq!(val.targets(0, 2).unwrap().len(), 2 * 16 * 16);
}
