//! `gems predict`: a checkpoint's predictions for every sample of a data set, written to a
//! folder.

use std::io::Write;
use std::path::{Path, PathBuf};

use gems::data::maps::NOTHING;
use gems::data::slide::{self, Slide};
use gems::data::{maps, Pipeline};
use gems::runtime::whole_slide::{segment_slide, WholeSlide, WindowRules};
use gems::{Evaluation, Model};

use crate::cli::{DataSource, PredictArgs};
use crate::eval::{configured, create, map_every, on_tiles, quoted, samples_of, write_predictions};

pub fn predict(a: PredictArgs) -> anyhow::Result<()> {
    if a.batch_size == Some(0) {
        anyhow::bail!("prediction needs a batch of at least 1");
    }
    if a.out.exists() && !a.out.is_dir() {
        anyhow::bail!("--out {} exists and is not a folder", a.out.display());
    }
    if let (DataSource::Slides(dir), None) = (&a.data, &a.slides.labels) {
        return whole_slides(&a, dir);
    }
    if a.margin.is_some() {
        anyhow::bail!("--margin is for whole slides: --data slides:DIR without --labels");
    }
    let mut model = loaded(&a)?;
    let (order, samples) = samples_of(&model, &a.data, &a.slides, a.samples)?;
    let segments = model.graph().positions() > 1;
    // Slides' maps are drawn at about one map pixel per kept prediction; other samples keep
    // every pixel.
    let every = match (segments, order.place(0).is_some()) {
        (false, _) => 0,
        (true, true) => map_every(&order, a.map_level)?,
        (true, false) => 1,
    };
    let e = model.evaluate(&order, samples, every)?;
    std::fs::create_dir_all(&a.out)
        .map_err(|err| anyhow::anyhow!("cannot create {}: {err}", a.out.display()))?;
    let csv = a.out.join("predictions.csv");
    write_csv(&csv, &e, &order, &model.classes())?;
    println!(
        "{} at step {} ({}{}): {} predictions in {}",
        model.graph().name,
        model.steps(),
        model.config().dtype.name(),
        on_tiles(&model),
        e.samples,
        csv.display()
    );
    match (every, order.place(0).is_some()) {
        (0, _) => {}
        (_, true) => write_predictions(&a.out, &e, &order, a.map_level, every)?,
        (_, false) => write_maps(&a.out, &e, order.image_size())?,
    }
    Ok(())
}

/// The checkpoint's model, configured as the flags say.
fn loaded(a: &PredictArgs) -> anyhow::Result<Model> {
    let model = configured(
        Model::load(&a.checkpoint)?,
        &a.on,
        a.dtype,
        a.conv,
        a.skip_bad,
        a.batch_size,
        a.spatial,
    )?;
    Ok(model.configure(|c| c.device_memory = a.device_memory))
}

/// Whole-slide stride when --stride is not given: windows of 512² centres (plus margins)
/// keep most of each window (about 2/3 for unet_d3's 56-pixel margins) at a few hundred MiB.
const WHOLE_SLIDE_STRIDE: u32 = 512;
/// Whole-slide tissue threshold when --tissue is not given (suits bright-field slides).
const WHOLE_SLIDE_TISSUE: f32 = 0.8;
/// Side of the tiles of the map TIFFs.
const MAP_TILE: u32 = 256;

/// Segments every slide of `dir` whole (see `--out`).
fn whole_slides(a: &PredictArgs, dir: &Path) -> anyhow::Result<()> {
    let unused = [
        ("--tile-size", a.slides.tile_size.is_some()),
        ("--samples", a.samples.is_some()),
        ("--map-level", a.map_level.is_some()),
    ];
    if let Some((flag, _)) = unused.iter().find(|(_, given)| *given) {
        anyhow::bail!(
            "{flag} is for tiles of labelled slides; whole slides (slides:DIR without \
             --labels) are cut into windows of --stride plus --margin"
        );
    }
    slide::use_reader(a.slides.slide_reader);
    let model = loaded(a)?;
    let name = model.graph().name.clone();
    let rules = WindowRules::of(&name)?;
    let opts = WholeSlide {
        level: a.slides.level,
        stride: a.slides.stride.unwrap_or(WHOLE_SLIDE_STRIDE),
        margin: a.margin.unwrap_or(rules.default_margin()),
        tissue: Some(a.slides.tissue.unwrap_or(WHOLE_SLIDE_TISSUE)),
        tile: MAP_TILE,
    };
    rules.check(&name, opts.stride, opts.margin)?;
    let side = opts.stride as usize + 2 * opts.margin as usize;
    let mut model = model.at_side(side)?;
    let slides = slide::slide_files(dir)?;
    let outputs: Vec<(PathBuf, PathBuf)> = slides
        .iter()
        .map(|p| {
            let stem = slide::slide_name(p);
            (
                a.out.join(format!("{stem}.classes.tiff")),
                a.out.join(format!("{stem}.classes.png")),
            )
        })
        .collect();
    let all_outputs: Vec<PathBuf> = outputs
        .iter()
        .flat_map(|(t, p)| [t.clone(), p.clone()])
        .collect();
    gems::core::files::refuse_overwriting(&all_outputs, &slides)?;
    std::fs::create_dir_all(&a.out)
        .map_err(|err| anyhow::anyhow!("cannot create {}: {err}", a.out.display()))?;
    println!(
        "{name} at step {}{}: windows of {side}² ({}² kept, margin {}; receptive radius {}) at level {}",
        model.steps(),
        on_tiles(&model),
        opts.stride,
        opts.margin,
        rules.radius,
        opts.level
    );
    for (path, (tiff, png)) in slides.iter().zip(&outputs) {
        let slide = Slide::open(path)?;
        let map = segment_slide(&mut model, &slide, &opts, tiff, png)?;
        let (w, h) = map.levels[0];
        println!(
            "{}: {w}×{h}, {} windows predicted, {} background; {} ({} levels), {}",
            path.display(),
            map.windows,
            map.background,
            tiff.display(),
            map.levels.len(),
            png.display()
        );
    }
    let csv = a.out.join("classes.csv");
    let mut out = create(&csv)?;
    writeln!(out, "value,class")?;
    for (i, c) in model.classes().iter().enumerate() {
        writeln!(out, "{i},{}", quoted(c))?;
    }
    writeln!(out, "{NOTHING},background (no tissue)")?;
    out.flush()?;
    Ok(())
}

/// One row per sample, in the data's order: where it comes from, the predicted class, and
/// each class's probability (segmenting: the share of the sample's pixels predicted as it).
fn write_csv(
    path: &Path,
    e: &Evaluation,
    order: &Pipeline,
    classes: &[String],
) -> anyhow::Result<()> {
    let mut out = create(path)?;
    let names: Vec<String> = classes.iter().map(|c| quoted(c)).collect();
    writeln!(out, "sample,predicted,{}", names.join(","))?;
    let mut rows: Vec<_> = e.per_sample.iter().collect();
    rows.sort_by_key(|s| order.index(s.position));
    for s in rows {
        let scores: Vec<String> = s.scores.iter().map(f32::to_string).collect();
        writeln!(
            out,
            "{},{},{}",
            quoted(&order.describe(s.position)),
            quoted(&classes[s.predicted as usize]),
            scores.join(",")
        )?;
    }
    out.flush()?;
    Ok(())
}

/// Each segmented sample's class per pixel as a PNG in the classes' colours,
/// DIR/maps/<position>.png.
fn write_maps(dir: &Path, e: &Evaluation, side: usize) -> anyhow::Result<()> {
    let maps_dir = dir.join("maps");
    std::fs::create_dir_all(&maps_dir)
        .map_err(|err| anyhow::anyhow!("cannot create {}: {err}", maps_dir.display()))?;
    for s in &e.per_sample {
        let png = image::RgbImage::from_fn(side as u32, side as u32, |x, y| {
            image::Rgb(maps::colour(s.map[y as usize * side + x as usize] as u8))
        });
        let path = maps_dir.join(format!("{}.png", s.position));
        gems::core::files::write_png(&path, png.as_raw(), png.width(), png.height())?;
    }
    println!(
        "wrote {} maps into {}",
        e.per_sample.len(),
        maps_dir.display()
    );
    Ok(())
}
