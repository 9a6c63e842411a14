//! `gems predict`: a checkpoint's predictions for every sample of a data set, written to a
//! folder.

use std::io::Write;
use std::path::Path;

use gems::data::{maps, Pipeline};
use gems::{Evaluation, Model};

use crate::cli::PredictArgs;
use crate::eval::{configured, create, map_every, quoted, samples_of, write_predictions};

pub fn predict(a: PredictArgs) -> anyhow::Result<()> {
    if a.batch_size == Some(0) {
        anyhow::bail!("prediction needs a batch of at least 1");
    }
    if a.out.exists() && !a.out.is_dir() {
        anyhow::bail!("--out {} exists and is not a folder", a.out.display());
    }
    let model = configured(
        Model::load(&a.checkpoint)?,
        &a.on,
        None,
        a.conv,
        a.skip_bad,
        a.batch_size,
    )?;
    let mut model = model.configure(|c| c.device_memory = a.device_memory);
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
        "{} at step {}: {} predictions in {}",
        model.graph().name,
        model.steps(),
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
