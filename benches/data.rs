//! Loader throughput on this machine's cores: 1024² tiles from a tiled TIFF slide, and
//! 1024² images from a folder of JPEGs, decoded, cut, flipped and normalized into model
//! inputs by the loader's worker threads (as many as cores), one image per batch.
//!
//! Criterion's "elem/s" column is images (tiles) per second. Groups: `loader/slide_tiles_1024`,
//! `loader/folder_jpeg_1024`. The files are written once under the system's temp folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gems::data::loader::Loader;
use gems::data::slide::{make_slide, MakeSlide, Slides, TileConfig};
use gems::data::transform::{Normalize, Transform};
use gems::data::{Pipeline, Source};

const SIDE: u32 = 1024;

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join("gems-bench-data");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An 8192² slide of 256² TIFF tiles (64 tiles of 1024² at level 0), with realistic noise.
fn slide(dir: &Path) -> Slides {
    let slides = dir.join("slides");
    let labels = dir.join("labels.csv");
    if !slides.join("bench.tiff").exists() {
        std::fs::create_dir_all(&slides).unwrap();
        let made = make_slide(&slides.join("bench.tiff"), &MakeSlide::new(8192, 8192)).unwrap();
        std::fs::write(&labels, made.label_rows("bench.tiff")).unwrap();
    }
    let config = TileConfig {
        level: 0,
        tile: SIDE,
        stride: SIDE,
        tissue_threshold: None,
    };
    Slides::open(&slides, &labels, &config, false).unwrap()
}

/// 32 JPEGs of 1024² in two classes, exported from the slide's tiles (tissue texture).
fn jpeg_folder(dir: &Path, slides: &Slides) -> gems::data::folder::Folder {
    let folder = dir.join("jpeg");
    if !folder.exists() {
        let n = slides.samples().unwrap();
        for i in 0..32 {
            let t = slides.tiles()[i % n];
            let rgb = slides.slides()[t.slide]
                .read_rgb8(0, t.x, t.y, SIDE, SIDE)
                .unwrap();
            let class = folder.join(format!("c{}", i % 2));
            std::fs::create_dir_all(&class).unwrap();
            image::RgbImage::from_raw(SIDE, SIDE, rgb)
                .unwrap()
                .save(class.join(format!("{i}.jpg")))
                .unwrap();
        }
    }
    gems::data::folder::Folder::open(&folder, false).unwrap()
}

fn throughput(c: &mut Criterion, name: &str, source: Arc<dyn Source>) {
    let transform = Transform {
        augment: true,
        normalize: Normalize::ImageNet,
        resize: false,
    };
    let pipeline = Arc::new(Pipeline::new(
        source,
        SIDE as usize,
        transform,
        0,
        false,
        true,
    ));
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    // An endless run of one-image batches: the measurement takes what it needs.
    let requests = Box::new(|i: usize| Some((i as u64, 1)));
    let mut loader = Loader::new(pipeline, requests, cores, 2 * cores);
    let mut g = c.benchmark_group("loader");
    g.throughput(Throughput::Elements(1));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(15));
    g.bench_function(name, |b| b.iter(|| loader.next_batch().unwrap()));
    g.finish();
}

fn loader(c: &mut Criterion) {
    let dir = scratch();
    let slides = Arc::new(slide(&dir));
    let folder = Arc::new(jpeg_folder(&dir, &slides));
    throughput(c, "slide_tiles_1024", slides);
    throughput(c, "folder_jpeg_1024", folder);
}

criterion_group!(benches, loader);
criterion_main!(benches);
