//! `gems data make-slide` and `gems data tiles`: synthetic slides, and the tiles a slide set
//! yields.

use std::time::Instant;

use gems::data::SourceSpec;
use gems::memory::human_bytes;

use crate::cli::{MakeSlideArgs, TilesArgs};

pub fn make_slide(a: MakeSlideArgs) -> anyhow::Result<()> {
    use gems::data::slide::MakeSlide;
    let mut opts = MakeSlide::new(a.width, a.height.unwrap_or(a.width));
    opts.tile = a.tile;
    opts.levels = a.levels.unwrap_or(opts.levels);
    opts.classes = a.classes;
    opts.seed = a.seed;
    opts.region = a.region;
    opts.noise = a.noise;
    opts.bigtiff = a.bigtiff;
    let started = Instant::now();
    // A new slide folder is made, as a user naming `slides/a.tiff` expects.
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    let made = gems::data::slide::make_slide(&a.out, &opts)?;
    let name = a
        .out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let labels = a
        .labels
        .unwrap_or_else(|| a.out.with_file_name("labels.csv"));
    // Rows of other slides stay; this slide's are replaced.
    let kept: String = match std::fs::read_to_string(&labels) {
        Ok(old) => old
            .lines()
            .filter(|l| l.split(',').next().map(str::trim) != Some(name.as_str()))
            .map(|l| format!("{l}\n"))
            .collect(),
        Err(_) => "slide,x,y,w,h,label\n".to_string(),
    };
    gems::core::files::write_atomically(&labels, (kept + &made.label_rows(&name)).as_bytes())?;
    println!(
        "wrote {} ({}, {}) in {:.1} s: {} levels ({}), {} tissue regions of {} classes; labels in {}",
        a.out.display(),
        if made.bigtiff { "BigTIFF" } else { "TIFF" },
        human_bytes(made.bytes),
        started.elapsed().as_secs_f64(),
        made.levels.len(),
        made.levels
            .iter()
            .map(|l| format!("{}×{}", l.width, l.height))
            .collect::<Vec<_>>()
            .join(", "),
        made.regions.len(),
        made.classes,
        labels.display()
    );
    Ok(())
}

pub fn tiles(a: TilesArgs) -> anyhow::Result<()> {
    let SourceSpec::Slides { dir, labels, tiles } = a.slides.spec(&a.data, a.image_size)? else {
        anyhow::bail!("gems data tiles lists the tiles of --data slides:DIR");
    };
    let slides = gems::data::slide::Slides::open(&dir, &labels, &tiles, false)?;
    let all = slides.tiles();
    let classes = gems::data::Source::classes(&slides);
    println!(
        "{} tiles of {}² at level {} (stride {}) from {} slides in {}",
        all.len(),
        tiles.tile,
        tiles.level,
        tiles.stride,
        slides.slides().len(),
        dir.display()
    );
    for (c, name) in classes.iter().enumerate() {
        let n = all.iter().filter(|t| t.label as usize == c).count();
        println!("  class {c} {name}: {n} tiles");
    }
    for (i, t) in all.iter().enumerate().take(a.limit) {
        let slide = slides.slides()[t.slide].path().display();
        println!(
            "  {i:>6}  {slide}  x {:>6}  y {:>6}  {}",
            t.x, t.y, classes[t.label as usize]
        );
    }
    if all.len() > a.limit {
        println!("  … {} more (--limit)", all.len() - a.limit);
    }
    if let Some(out) = &a.export {
        for i in 0..all.len() {
            slides.export_png(i, out)?;
        }
        let out = out.display();
        println!(
            "exported {} tiles to {out} (train on them with --data folder:{out})",
            all.len()
        );
    }
    Ok(())
}
