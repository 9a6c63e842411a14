//! Whole-slide images: pyramidal tiled TIFF or BigTIFF files of 8-bit RGB pixels (deflate,
//! LZW or JPEG tiles; JPEG tiles sharing their tables, RGB or YCbCr, as Aperio's SVS files
//! have them), read one tile at a time so that a 100,000² slide never sits in memory; every
//! format OpenSlide reads, through libopenslide when it loads ([`SlideReader`]); a writer of synthetic
//! slides with labelled tissue regions (for tests and demos); and [`Slides`], a [`Source`] of
//! fixed-size tiles cut from a directory of slides at one pyramid level, labelled from a CSV.
//!
//! Levels: the first image of the file is level 0; every later *tiled* image smaller than the
//! level before it is the next level. Other images (a striped thumbnail, a same-size page) are
//! not levels and are passed over, as OpenSlide does for generic tiled TIFF.

use std::collections::HashMap;
use std::f64::consts::{PI, TAU};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, Once};

use rayon::prelude::*;
use tiff::decoder::{ChunkType, Decoder};
use tiff::encoder::{TiffEncoder, TiffKind};
use tiff::tags::{CompressionMethod, PhotometricInterpretation, PlanarConfiguration, Tag};
use tiff::{ColorType, TiffError, TiffFormatError, TiffResult};

use super::openslide::{self, OpenSlide};
use super::{Image, Mask, Source, Task, TilePlace, CHANNELS, UNLABELLED};
use crate::core::rng::splitmix64;
use crate::{Error, Result};

/// One pyramid level: its size and the size of the TIFF tiles it is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Level {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Width of the TIFF tiles it is stored in.
    pub tile_width: u32,
    /// Height of the TIFF tiles it is stored in.
    pub tile_height: u32,
}

impl Level {
    fn tiles_across(&self) -> u32 {
        self.width.div_ceil(self.tile_width)
    }
    fn tiles_down(&self) -> u32 {
        self.height.div_ceil(self.tile_height)
    }
}

// ------------------------------------------------------------------------------------------
// The synthetic slide writer.

/// Options of [`make_slide`]. Sizes are in level-0 pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct MakeSlide {
    /// Width of level 0.
    pub width: u32,
    /// Height of level 0.
    pub height: u32,
    /// Side of the square TIFF tiles (a multiple of 16, as TIFF requires).
    pub tile: u32,
    /// Level 0 plus `levels - 1` levels, each half the size of the one before.
    pub levels: usize,
    /// Tissue classes the regions are drawn from.
    pub classes: usize,
    /// Decides which class each region gets, the gratings' phases and the noise.
    pub seed: u64,
    /// Side of the grid cells; each cell holds one tissue region inset by `region / 8`, with
    /// near-white background between regions.
    pub region: u32,
    /// Amplitude of the uniform per-pixel noise in tissue (half of it on background), in
    /// [0, 1] units; 0 makes slides that compress well.
    pub noise: f32,
    /// Write BigTIFF even when a classic TIFF would do (it is chosen anyway past 4 GiB).
    pub bigtiff: bool,
}

impl MakeSlide {
    /// Defaults: 256² tiles, levels halving until the smallest fits one tile, 4 classes, seed 0,
    /// 1024-pixel regions, noise 0.06, classic TIFF when it fits.
    pub fn new(width: u32, height: u32) -> MakeSlide {
        let mut levels = 1;
        while (width.max(height) >> (levels - 1)) > 256 && (width.min(height) >> levels) >= 1 {
            levels += 1;
        }
        MakeSlide {
            width,
            height,
            tile: 256,
            levels,
            classes: 4,
            seed: 0,
            region: 1024,
            noise: 0.06,
            bigtiff: false,
        }
    }

    /// The size of each level: level k is level 0 divided by 2^k, rounded down.
    pub fn level_sizes(&self) -> Vec<(u32, u32)> {
        (0..self.levels)
            .map(|k| (self.width >> k, self.height >> k))
            .collect()
    }

    /// Whether the file needs BigTIFF's 64-bit offsets. Judged on the uncompressed tile bytes
    /// of every level (noise can leave tiles nearly incompressible, and deflate never grows
    /// data by more than a fraction of a percent), with room for the directories.
    pub fn needs_bigtiff(&self) -> bool {
        let tile_bytes = self.tile as u64 * self.tile as u64 * CHANNELS as u64;
        let bytes: u64 = self
            .level_sizes()
            .iter()
            .map(|&(w, h)| w.div_ceil(self.tile) as u64 * h.div_ceil(self.tile) as u64 * tile_bytes)
            .sum();
        bytes + bytes / 64 + (1 << 20) > u32::MAX as u64
    }

    fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::Config(format!("make-slide: {why}")));
        if self.width == 0 || self.height == 0 {
            return bad(format!("size {}×{} is empty", self.width, self.height));
        }
        if self.tile < 16 || !self.tile.is_multiple_of(16) {
            return bad(format!("tile size {} is not a multiple of 16", self.tile));
        }
        let shift = self.levels.saturating_sub(1).min(31);
        if self.levels == 0 || self.levels > 32 || (self.width.min(self.height) >> shift) == 0 {
            return bad(format!(
                "{} levels do not fit {}×{} (each level halves the size; at least 1 level)",
                self.levels, self.width, self.height
            ));
        }
        // Each class has its own tissue pattern, made up front.
        if !(1..=1024).contains(&self.classes) {
            return bad(format!(
                "{} classes: a slide paints 1 to 1024",
                self.classes
            ));
        }
        if !(0.0..=1.0).contains(&self.noise) {
            return bad(format!("noise {} is outside [0, 1]", self.noise));
        }
        if self.region < 8 {
            return bad(format!("region size {} is under 8 pixels", self.region));
        }
        Ok(())
    }
}

/// A rectangle of level-0 pixels and its class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Left edge.
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
    /// Its class, 0 to `classes - 1`.
    pub class: usize,
}

/// What [`make_slide`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct MadeSlide {
    /// Every level written, level 0 first.
    pub levels: Vec<Level>,
    /// The tissue regions; every level-0 pixel whose centre lies outside them is background.
    pub regions: Vec<Region>,
    /// Tissue classes the regions were drawn from.
    pub classes: usize,
    /// Whether it was written as BigTIFF (over 4 GiB).
    pub bigtiff: bool,
    /// The file's size.
    pub bytes: u64,
}

impl MadeSlide {
    /// The regions as label rows `slide,x,y,w,h,label` for [`Slides::open`], one per line.
    pub fn label_rows(&self, slide: &str) -> String {
        self.regions
            .iter()
            .map(|r| {
                let label = class_name(r.class, self.classes);
                format!("{slide},{},{},{},{},{label}\n", r.x, r.y, r.w, r.h)
            })
            .collect()
    }
}

/// The label of synthetic class `class` out of `classes`: `class0`, `class1`, … zero-padded
/// so that sorting the names keeps the class order.
pub fn class_name(class: usize, classes: usize) -> String {
    let digits = (classes.max(2) - 1).to_string().len();
    format!("class{class:0digits$}")
}

/// Writes a synthetic pyramidal tiled TIFF of 8-bit RGB, deflate-compressed tiles: a grid of
/// tissue regions, each textured by its class's oriented sinusoidal grating and colour (so a
/// small CNN tells them apart) plus noise, with near-white background between them. Levels
/// after the first are marked reduced-resolution (NewSubfileType 1). Pixels are computed per
/// tile (level k as the exact box average of the level-0 grating over each 2^k × 2^k block, so
/// textures fade at low resolution as a scanner's would), and a few tiles at a time are held,
/// whatever the slide's size.
pub fn make_slide(path: &Path, opts: &MakeSlide) -> Result<MadeSlide> {
    opts.check()?;
    let bigtiff = opts.bigtiff || opts.needs_bigtiff();
    let levels: Vec<Level> = opts
        .level_sizes()
        .into_iter()
        .map(|(width, height)| Level {
            width,
            height,
            tile_width: opts.tile,
            tile_height: opts.tile,
        })
        .collect();
    let painters: Vec<Painter> = (0..levels.len()).map(|k| Painter::new(opts, k)).collect();
    let about = format!(
        "gems synthetic slide: {} classes, seed {}, {}-pixel regions",
        opts.classes, opts.seed, opts.region
    );
    let bytes = write_tiled(path, &levels, &about, bigtiff, |k, tx, ty| {
        painters[k].tile(&levels[k], tx, ty)
    })?;
    Ok(MadeSlide {
        levels,
        regions: regions(opts),
        classes: opts.classes,
        bigtiff,
        bytes,
    })
}

/// Writes a tiled TIFF of 8-bit RGB with deflate-compressed tiles, one image per level
/// (levels after the first marked reduced-resolution, NewSubfileType 1), BigTIFF when asked.
/// `paint(level, column, row)` makes a whole tile (interleaved RGB, tile_width × tile_height,
/// padded past the level's edge); a few tiles are held at a time, whatever the image's size.
/// Returns the file's size.
pub fn write_tiled(
    path: &Path,
    levels: &[Level],
    description: &str,
    bigtiff: bool,
    paint: impl Fn(usize, u32, u32) -> Vec<u8> + Sync,
) -> Result<u64> {
    let file = crate::core::files::create_output(path)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let written = if bigtiff {
        TiffEncoder::new_big(&mut out).and_then(|t| write_levels(t, levels, description, &paint))
    } else {
        TiffEncoder::new(&mut out).and_then(|t| write_levels(t, levels, description, &paint))
    };
    written.map_err(|e| Error::Data(format!("writing {}: {e}", path.display())))?;
    out.flush()
        .map_err(|e| Error::Data(format!("writing {}: {e}", path.display())))?;
    Ok(std::fs::metadata(path)?.len())
}

/// Tiles are made and compressed this many at a time, in parallel, then written in order.
const WRITE_BATCH: u32 = 64;

fn write_levels<W: Write + Seek, K: TiffKind>(
    mut tiff: TiffEncoder<W, K>,
    levels: &[Level],
    description: &str,
    paint: &(impl Fn(usize, u32, u32) -> Vec<u8> + Sync),
) -> TiffResult<()> {
    for (k, level) in levels.iter().enumerate() {
        let mut dir = tiff.image_directory()?;
        let count = level.tiles_across() * level.tiles_down();
        let mut offsets = Vec::with_capacity(count as usize);
        let mut sizes = Vec::with_capacity(count as usize);
        for first in (0..count).step_by(WRITE_BATCH as usize) {
            let packed = (first..count.min(first + WRITE_BATCH))
                .into_par_iter()
                .map(|t| {
                    let raw = paint(k, t % level.tiles_across(), t / level.tiles_across());
                    let mut z =
                        flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                    z.write_all(&raw)?;
                    z.finish()
                })
                .collect::<std::io::Result<Vec<Vec<u8>>>>()?;
            for bytes in packed {
                offsets.push(K::convert_offset(dir.write_data(bytes.as_slice())?)?);
                sizes.push(K::convert_offset(bytes.len() as u64)?);
            }
        }
        dir.write_tag(Tag::NewSubfileType, u32::from(k > 0))?;
        dir.write_tag(Tag::ImageWidth, level.width)?;
        dir.write_tag(Tag::ImageLength, level.height)?;
        dir.write_tag(Tag::BitsPerSample, &[8u16; CHANNELS][..])?;
        dir.write_tag(Tag::Compression, CompressionMethod::Deflate.to_u16())?;
        dir.write_tag(
            Tag::PhotometricInterpretation,
            PhotometricInterpretation::RGB.to_u16(),
        )?;
        dir.write_tag(Tag::SamplesPerPixel, CHANNELS as u16)?;
        dir.write_tag(
            Tag::PlanarConfiguration,
            PlanarConfiguration::Chunky.to_u16(),
        )?;
        dir.write_tag(Tag::TileWidth, level.tile_width)?;
        dir.write_tag(Tag::TileLength, level.tile_height)?;
        if k == 0 {
            dir.write_tag(Tag::ImageDescription, description)?;
        }
        dir.write_tag(Tag::TileOffsets, K::convert_slice(&offsets))?;
        dir.write_tag(Tag::TileByteCounts, K::convert_slice(&sizes))?;
        dir.finish()?;
    }
    Ok(())
}

/// The tissue regions of a synthetic slide: one per grid cell, inset by a margin, clipped to
/// the slide.
fn regions(opts: &MakeSlide) -> Vec<Region> {
    let margin = opts.region / 8;
    let mut out = Vec::new();
    for j in 0..opts.height.div_ceil(opts.region) {
        for i in 0..opts.width.div_ceil(opts.region) {
            let (x, y) = (i * opts.region + margin, j * opts.region + margin);
            let x1 = ((i + 1) * opts.region - margin).min(opts.width);
            let y1 = ((j + 1) * opts.region - margin).min(opts.height);
            if x < x1 && y < y1 {
                let (class, _) = cell(opts, i, j);
                out.push(Region {
                    x,
                    y,
                    w: x1 - x,
                    h: y1 - y,
                    class,
                });
            }
        }
    }
    out
}

/// The class and grating phase of grid cell (i, j).
fn cell(opts: &MakeSlide, i: u32, j: u32) -> (usize, f64) {
    let h = splitmix64(opts.seed ^ splitmix64(((j as u64) << 32) | i as u64));
    let class = (h % opts.classes as u64) as usize;
    (class, (h >> 32) as f64 / (1u64 << 32) as f64 * TAU)
}

/// Period of every class's grating, in level-0 pixels.
const PERIOD: f64 = 24.0;

/// Entries of the sine table (a power of two): steps of 2π/4096 move a pixel by under 1/3000,
/// far below one 8-bit level.
const SINE_STEPS: usize = 4096;

/// Computes the pixels of one level of a synthetic slide.
struct Painter<'a> {
    opts: &'a MakeSlide,
    /// Level-0 pixels per pixel of this level (2^k).
    scale: f64,
    level_seed: u64,
    /// Per class: wave vector (x, y) in table steps per level-0 pixel, amplitude after box
    /// averaging at this level, colour.
    gratings: Vec<([f64; 2], f64, [f64; CHANNELS])>,
    sine: Vec<f64>,
}

impl<'a> Painter<'a> {
    fn new(opts: &'a MakeSlide, level: usize) -> Painter<'a> {
        let scale = (1u64 << level) as f64;
        let sinc = |u: f64| if u.abs() < 1e-9 { 1.0 } else { u.sin() / u };
        let gratings = (0..opts.classes)
            .map(|c| {
                // Orientation and colour depend on the class only, so every slide agrees.
                let angle = PI * c as f64 / opts.classes as f64;
                let k = [TAU * angle.cos() / PERIOD, TAU * angle.sin() / PERIOD];
                let amplitude = sinc(k[0] * scale / 2.0) * sinc(k[1] * scale / 2.0);
                let steps = SINE_STEPS as f64 / TAU;
                let hue = TAU * c as f64 / opts.classes as f64;
                let colour = [
                    0.6 + 0.2 * hue.cos(),
                    0.45 + 0.2 * (hue - TAU / 3.0).cos(),
                    0.6 + 0.2 * (hue - 2.0 * TAU / 3.0).cos(),
                ];
                ([k[0] * steps, k[1] * steps], amplitude, colour)
            })
            .collect();
        Painter {
            opts,
            scale,
            level_seed: splitmix64(opts.seed ^ splitmix64(level as u64 + 1)),
            gratings,
            sine: (0..SINE_STEPS)
                .map(|i| (TAU * i as f64 / SINE_STEPS as f64).sin())
                .collect(),
        }
    }

    /// Row y of this level from column x0, `out.len() / 3` pixels, interleaved RGB.
    fn row(&self, x0: u32, y: u32, out: &mut [u8]) {
        let region = self.opts.region as f64;
        let margin = (self.opts.region / 8) as f64;
        let inside = |local: f64| local >= margin && local < region - margin;
        // Pixel centres in level-0 pixels: each pixel is the box average of its block.
        let cy = (y as f64 + 0.5) * self.scale;
        let j = (cy / region) as u32;
        let tissue_row = inside(cy - j as f64 * region);
        let noise = self.opts.noise as f64;
        let mut last_cell = (u32::MAX, 0, 0.0);
        for (n, px) in out.chunks_exact_mut(CHANNELS).enumerate() {
            let x = x0 + n as u32;
            let hash = splitmix64(self.level_seed ^ (((y as u64) << 32) | x as u64));
            let jitter = |c: usize| ((hash >> (16 * c)) & 0xffff) as f64 / 65535.0 - 0.5;
            let cx = (x as f64 + 0.5) * self.scale;
            let i = (cx / region) as u32;
            if tissue_row && inside(cx - i as f64 * region) {
                if last_cell.0 != i {
                    let (class, phase) = cell(self.opts, i, j);
                    last_cell = (i, class, phase * SINE_STEPS as f64 / TAU);
                }
                let (k, amplitude, colour) = &self.gratings[last_cell.1];
                let step = (k[0] * cx + k[1] * cy + last_cell.2) as i64;
                let wave = amplitude * self.sine[step as usize & (SINE_STEPS - 1)];
                for (c, v) in px.iter_mut().enumerate() {
                    *v = to_u8(colour[c] + 0.2 * wave + noise * jitter(c));
                }
            } else {
                for (c, v) in px.iter_mut().enumerate() {
                    *v = to_u8(0.92 + 0.5 * noise * jitter(c));
                }
            }
        }
    }

    /// TIFF tile (tx, ty) of `level`, interleaved RGB, zero past the level's edges.
    fn tile(&self, level: &Level, tx: u32, ty: u32) -> Vec<u8> {
        let (tw, th) = (level.tile_width as usize, level.tile_height as usize);
        let mut out = vec![0u8; tw * th * CHANNELS];
        let (x0, y0) = (tx * level.tile_width, ty * level.tile_height);
        let cols = (level.width - x0).min(level.tile_width) as usize;
        let rows = (level.height - y0).min(level.tile_height);
        for r in 0..rows {
            let at = r as usize * tw * CHANNELS;
            self.row(x0, y0 + r, &mut out[at..at + cols * CHANNELS]);
        }
        out
    }
}

/// [0, 1] to 0..=255, rounding (the cast saturates out-of-range values).
fn to_u8(v: f64) -> u8 {
    (v * 255.0 + 0.5) as u8
}

// ------------------------------------------------------------------------------------------
// The reader.

/// A file read at explicit positions (`pread`), so decoders on several threads share one
/// open file without sharing a cursor.
struct At {
    file: Arc<File>,
    pos: u64,
}

impl Read for At {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for At {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let (base, delta) = match to {
            SeekFrom::Start(n) => (n, 0),
            SeekFrom::Current(d) => (self.pos, d),
            SeekFrom::End(d) => (self.file.metadata()?.len(), d),
        };
        self.pos = base.checked_add_signed(delta).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "seek before the start")
        })?;
        Ok(self.pos)
    }
}

type TiffDecoder = Decoder<BufReader<At>>;

/// Decoders kept between reads, per slide: each holds its level's tile offsets, so keeping
/// more would cost memory on large levels; a read that finds none opens another (cheap).
const IDLE_DECODERS: usize = 2;

/// Which reader opens slides ([`use_reader`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SlideReader {
    /// gems' own reader for .tif, .tiff and .svs files (tiled TIFF, BigTIFF, Aperio SVS), so
    /// that they read the same with or without libopenslide; OpenSlide for every other
    /// format, when libopenslide loads.
    #[default]
    Auto,
    /// libopenslide for every slide; an error when it does not load.
    OpenSlide,
    /// gems' own TIFF reader only.
    Gems,
}

impl std::str::FromStr for SlideReader {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(SlideReader::Auto),
            "openslide" => Ok(SlideReader::OpenSlide),
            "gems" => Ok(SlideReader::Gems),
            _ => Err(format!(
                "'{s}' is not a slide reader: auto, openslide or gems"
            )),
        }
    }
}

/// The reader every [`Slide::open`] of this process uses (a process-wide choice, as the
/// command line's `--slide-reader` makes it).
static READER: AtomicU8 = AtomicU8::new(0);

/// Makes every later [`Slide::open`] use `reader`.
pub fn use_reader(reader: SlideReader) {
    READER.store(reader as u8, Ordering::Relaxed);
}

fn chosen_reader() -> SlideReader {
    match READER.load(Ordering::Relaxed) {
        1 => SlideReader::OpenSlide,
        2 => SlideReader::Gems,
        _ => SlideReader::Auto,
    }
}

/// File extensions gems' own reader opens.
const TIFF_EXTENSIONS: [&str; 3] = ["tif", "tiff", "svs"];
/// File extensions only OpenSlide opens (its single-file formats and the index files of its
/// multi-file ones).
const OPENSLIDE_EXTENSIONS: [&str; 7] = ["ndpi", "mrxs", "scn", "vms", "vmu", "svslide", "bif"];
/// The extension of DICOM files: a DICOM slide is a folder of them (a series, a file per
/// level), which OpenSlide opens from any one of them.
const DICOM_EXTENSION: &str = "dcm";

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
}

/// The first (by name) DICOM file directly in `dir`, if it holds any: the file a DICOM
/// slide is opened through.
fn dicom_series(dir: &Path) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.is_file() && extension(p).as_deref() == Some(DICOM_EXTENSION))
        .collect();
    files.sort();
    files.into_iter().next()
}

/// Whether `path` is a slide the chosen reader may open: a file by its extension, or a
/// folder of DICOM files (read through OpenSlide).
pub fn is_slide(path: &Path) -> bool {
    if path.is_dir() {
        return chosen_reader() != SlideReader::Gems && dicom_series(path).is_some();
    }
    extension(path).is_some_and(|ext| {
        TIFF_EXTENSIONS.contains(&ext.as_str())
            || (chosen_reader() != SlideReader::Gems
                && OPENSLIDE_EXTENSIONS.contains(&ext.as_str()))
    })
}

/// What outputs and label rows call the slide at `path`: a file's stem, a DICOM folder's
/// name.
pub fn slide_name(path: &Path) -> String {
    let name = match path.is_dir() {
        true => path.file_name(),
        false => path.file_stem(),
    };
    name.unwrap_or_default().to_string_lossy().into_owned()
}

/// The slides in `dir` ([`is_slide`]), sorted; `dir` itself where it is a folder of DICOM
/// files; refuses a folder with none.
pub fn slide_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if is_slide(dir) {
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut paths = Vec::new();
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::Data(format!("cannot read {}: {e}", dir.display())))?;
    for entry in entries {
        let path = entry
            .map_err(|e| Error::Data(format!("cannot read {}: {e}", dir.display())))?
            .path();
        if is_slide(&path) {
            paths.push(path);
        }
    }
    paths.sort();
    if paths.is_empty() {
        let openslide = match chosen_reader() {
            SlideReader::Gems => String::new(),
            _ => format!(
                ", .{} or folders of .{DICOM_EXTENSION} files",
                OPENSLIDE_EXTENSIONS.join(", .")
            ),
        };
        return Err(Error::Data(format!(
            "{} holds no slides (.tif, .tiff, .svs{openslide})",
            dir.display()
        )));
    }
    Ok(paths)
}

/// An open whole-slide image. Reads decode only the tiles they overlap, and may run on
/// several threads at once.
pub struct Slide {
    path: PathBuf,
    levels: Vec<Level>,
    reader: Reader,
}

/// What reads a slide's pixels.
enum Reader {
    Tiff(TiffReader),
    OpenSlide(OpenSlide),
}

/// gems' own reader: one open file, a decoder per concurrent read.
struct TiffReader {
    file: Arc<File>,
    /// The index of each level's image in the file.
    images: Vec<usize>,
    /// Per level: whether its JPEG tiles decode to YCbCr, which reads convert to RGB.
    ycbcr: Vec<bool>,
    /// Idle decoders and the image each is on.
    idle: Mutex<Vec<(usize, TiffDecoder)>>,
}

impl Slide {
    /// Opens a slide with the reader [`use_reader`] chose (by default [`SlideReader::Auto`]).
    /// gems' reader refuses, naming the file: a file that is not a TIFF, a damaged or
    /// truncated one, a striped (not tiled) one, and levels that are not 8-bit RGB (or
    /// JPEG-compressed YCbCr) with interleaved samples.
    pub fn open(path: &Path) -> Result<Slide> {
        Slide::open_with(path, chosen_reader())
    }

    /// Opens a slide with `reader` (see [`Slide::open`]).
    pub fn open_with(path: &Path, reader: SlideReader) -> Result<Slide> {
        let tiff = !path.is_dir()
            && extension(path).is_some_and(|e| TIFF_EXTENSIONS.contains(&e.as_str()));
        match reader {
            SlideReader::Gems if path.is_dir() => Err(Error::Data(format!(
                "{} is a folder (a DICOM slide): only OpenSlide reads DICOM",
                path.display()
            ))),
            SlideReader::Gems => Slide::open_tiff(path),
            SlideReader::OpenSlide => Slide::open_openslide(path),
            SlideReader::Auto if tiff => Slide::open_tiff(path),
            SlideReader::Auto => match openslide::available() {
                Ok(()) => Slide::open_openslide(path),
                Err(why) => {
                    OPENSLIDE_MISSING.call_once(|| {
                        eprintln!("note: {why}; gems reads TIFF slides with its own reader only")
                    });
                    Err(Error::Data(format!(
                        "{}: only OpenSlide reads this format, and {why}",
                        path.display()
                    )))
                }
            },
        }
    }

    /// Opens a slide through libopenslide.
    fn open_openslide(path: &Path) -> Result<Slide> {
        let slide = match path.is_dir() {
            true => OpenSlide::open(&dicom_series(path).ok_or_else(|| {
                Error::Data(format!(
                    "{} holds no .{DICOM_EXTENSION} files",
                    path.display()
                ))
            })?)?,
            false => OpenSlide::open(path)?,
        };
        let levels = slide
            .levels()
            .iter()
            .map(|l| {
                let (tile_width, tile_height) = l.tile.unwrap_or((256, 256));
                let side = |n: u64| u32::try_from(n).ok().filter(|&n| n > 0);
                match (side(l.size.0), side(l.size.1)) {
                    (Some(width), Some(height)) => Ok(Level {
                        width,
                        height,
                        tile_width: tile_width.max(1),
                        tile_height: tile_height.max(1),
                    }),
                    _ => Err(Error::Data(format!(
                        "{}: a level of {}×{} pixels (gems reads levels of 1 to 2^32 - 1 \
                         pixels a side)",
                        path.display(),
                        l.size.0,
                        l.size.1
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if levels.is_empty() {
            return Err(Error::Data(format!("{} has no levels", path.display())));
        }
        Ok(Slide {
            path: path.to_path_buf(),
            levels,
            reader: Reader::OpenSlide(slide),
        })
    }

    /// Opens a pyramidal tiled TIFF with gems' own reader and lists its levels.
    fn open_tiff(path: &Path) -> Result<Slide> {
        let file = Arc::new(crate::core::files::open_regular(path)?);
        let mut decoder = Decoder::new(BufReader::new(At {
            file: file.clone(),
            pos: 0,
        }))
        .map_err(|e| structure_error(path, e))?;
        let mut levels: Vec<Level> = Vec::new();
        let mut images = Vec::new();
        let mut ycbcr = Vec::new();
        let mut image = 0;
        loop {
            let tiled = decoder.get_chunk_type() == ChunkType::Tile;
            let (width, height) = decoder.dimensions().map_err(|e| structure_error(path, e))?;
            if image == 0 && !tiled {
                return Err(Error::Data(format!(
                    "{} is a striped TIFF, not a tiled one: slides must be stored in tiles to be \
                     read a region at a time (e.g. `vips tiffsave in.tif out.tif --tile --pyramid`)",
                    path.display()
                )));
            }
            let smaller = levels
                .last()
                .is_none_or(|l| width < l.width && height <= l.height);
            if tiled && smaller {
                ycbcr.push(check_layout(path, levels.len(), &mut decoder)?);
                let (tile_width, tile_height) = decoder.chunk_dimensions();
                levels.push(Level {
                    width,
                    height,
                    tile_width,
                    tile_height,
                });
                images.push(image);
            }
            if !decoder.more_images() {
                break;
            }
            decoder.next_image().map_err(|e| structure_error(path, e))?;
            image += 1;
        }
        Ok(Slide {
            path: path.to_path_buf(),
            levels,
            reader: Reader::Tiff(TiffReader {
                file,
                images,
                ycbcr,
                idle: Mutex::new(vec![(image, decoder)]),
            }),
        })
    }

    /// Whether libopenslide reads it.
    pub fn read_by_openslide(&self) -> bool {
        matches!(self.reader, Reader::OpenSlide(_))
    }

    /// The slide's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pyramid, level 0 (full resolution) first.
    pub fn levels(&self) -> &[Level] {
        &self.levels
    }

    /// Level `level`, or an error naming the file and how many levels it has.
    pub fn level(&self, level: usize) -> Result<&Level> {
        self.levels.get(level).ok_or_else(|| {
            Error::Data(format!(
                "{} has {} level{} (0 to {}); there is no level {level}",
                self.path.display(),
                self.levels.len(),
                if self.levels.len() == 1 { "" } else { "s" },
                self.levels.len() - 1
            ))
        })
    }

    /// The `w × h` pixels at (x, y) of `level`, as an [`Image`] in [0, 1].
    pub fn read_region(&self, level: usize, x: u32, y: u32, w: u32, h: u32) -> Result<Image> {
        let rgb = self.read_rgb8(level, x, y, w, h)?;
        Ok(Image::from_rgb8(w as usize, h as usize, &rgb))
    }

    /// The `w × h` pixels at (x, y) of `level`, as interleaved 8-bit RGB rows. Decodes only
    /// the tiles the region overlaps.
    pub fn read_rgb8(&self, level: usize, x: u32, y: u32, w: u32, h: u32) -> Result<Vec<u8>> {
        let l = *self.level(level)?;
        if w == 0
            || h == 0
            || x as u64 + w as u64 > l.width as u64
            || y as u64 + h as u64 > l.height as u64
        {
            return Err(Error::Data(format!(
                "{}: region {w}×{h} at ({x}, {y}) is not inside level {level} ({}×{})",
                self.path.display(),
                l.width,
                l.height
            )));
        }
        match &self.reader {
            Reader::Tiff(tiff) => tiff.read_rgb8(&self.path, level, &l, (x, y, w, h)),
            Reader::OpenSlide(slide) => {
                // OpenSlide places a region by its corner in level-0 pixels.
                let down = slide.levels()[level].downsample;
                let (x0, y0) = ((x as f64 * down).round(), (y as f64 * down).round());
                let argb = slide.read_argb(level, x0 as i64, y0 as i64, w, h)?;
                Ok(openslide::argb_to_rgb8(&argb))
            }
        }
    }

    /// Mean brightness (mean of R, G, B in [0, 1]) of the `w × h` pixels at (x, y) of
    /// `level`, measured on the coarsest level where the region still spans
    /// [`TISSUE_FOOTPRINT`] pixels each way, as the tissue filter measures tiles.
    pub fn brightness(&self, level: usize, x: u32, y: u32, w: u32, h: u32) -> Result<f32> {
        let own = *self.level(level)?;
        if w == 0
            || h == 0
            || x as u64 + w as u64 > own.width as u64
            || y as u64 + h as u64 > own.height as u64
        {
            return Err(Error::Data(format!(
                "{}: region {w}×{h} at ({x}, {y}) is not inside level {level} ({}×{})",
                self.path.display(),
                own.width,
                own.height
            )));
        }
        let spans = |l: &Level| {
            w as u64 * l.width as u64 >= TISSUE_FOOTPRINT as u64 * own.width as u64
                && h as u64 * l.height as u64 >= TISSUE_FOOTPRINT as u64 * own.height as u64
        };
        let coarse = (level..self.levels.len())
            .rev()
            .find(|&k| spans(&self.levels[k]))
            .unwrap_or(level);
        let low = self.levels[coarse];
        let scale = |v: u32, low_len: u32, own_len: u32| v as f64 * low_len as f64 / own_len as f64;
        let x0 = (scale(x, low.width, own.width).floor() as u32).min(low.width - 1);
        let y0 = (scale(y, low.height, own.height).floor() as u32).min(low.height - 1);
        let x1 = (scale(x + w, low.width, own.width).ceil() as u32).clamp(x0 + 1, low.width);
        let y1 = (scale(y + h, low.height, own.height).ceil() as u32).clamp(y0 + 1, low.height);
        let rgb = self.read_rgb8(coarse, x0, y0, x1 - x0, y1 - y0)?;
        let sum: u64 = rgb.iter().map(|&v| v as u64).sum();
        Ok((sum as f64 / (rgb.len() as f64 * 255.0)) as f32)
    }
}

/// Said once per process: libopenslide did not load where it would have been used.
static OPENSLIDE_MISSING: Once = Once::new();

impl TiffReader {
    /// The `(x, y, w, h)` region of `level` (inside it), decoding each tile it overlaps into
    /// one reused buffer.
    fn read_rgb8(
        &self,
        path: &Path,
        level: usize,
        l: &Level,
        (x, y, w, h): (u32, u32, u32, u32),
    ) -> Result<Vec<u8>> {
        let mut decoder = self.decoder(path, level)?;
        let mut out = vec![0u8; w as usize * h as usize * CHANNELS];
        let mut pixels = vec![0u8; l.tile_width as usize * l.tile_height as usize * CHANNELS];
        for ty in y / l.tile_height..=(y + h - 1) / l.tile_height {
            for tx in x / l.tile_width..=(x + w - 1) / l.tile_width {
                let index = ty * l.tiles_across() + tx;
                decoder.read_chunk_bytes(index, &mut pixels).map_err(|e| {
                    Error::Data(format!(
                        "{}: level {level} tile {index} (column {tx}, row {ty}) is unreadable: {e}",
                        path.display()
                    ))
                })?;
                if self.ycbcr[level] {
                    ycbcr_to_rgb(&mut pixels);
                }
                // The tile's pixels inside the level (edge tiles come cropped, rows `cols` wide).
                let (x0, y0) = (tx * l.tile_width, ty * l.tile_height);
                let cols = (l.width - x0).min(l.tile_width) as usize;
                let rows = (l.height - y0).min(l.tile_height);
                let (left, right) = (x.max(x0), (x + w).min(x0 + cols as u32));
                let span = (right - left) as usize * CHANNELS;
                for row in y.max(y0)..(y + h).min(y0 + rows) {
                    let src = ((row - y0) as usize * cols + (left - x0) as usize) * CHANNELS;
                    let dst = ((row - y) as usize * w as usize + (left - x) as usize) * CHANNELS;
                    out[dst..dst + span].copy_from_slice(&pixels[src..src + span]);
                }
            }
        }
        // A decoder that failed is dropped rather than reused: its state is unknown.
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < IDLE_DECODERS {
            idle.push((self.images[level], decoder));
        }
        Ok(out)
    }

    /// A decoder on `level`'s image: an idle one if there is one, else a new one.
    fn decoder(&self, path: &Path, level: usize) -> Result<TiffDecoder> {
        let image = self.images[level];
        let taken = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let same = idle.iter().position(|(i, _)| *i == image);
            same.or(idle.len().checked_sub(1))
                .map(|at| idle.swap_remove(at))
        };
        let (on, mut decoder) = match taken {
            Some(d) => d,
            None => {
                let reader = BufReader::new(At {
                    file: self.file.clone(),
                    pos: 0,
                });
                (
                    0,
                    Decoder::new(reader).map_err(|e| structure_error(path, e))?,
                )
            }
        };
        if on != image {
            decoder
                .seek_to_image(image)
                .map_err(|e| structure_error(path, e))?;
        }
        Ok(decoder)
    }
}

/// JPEG's YCbCr (JFIF: full range, BT.601) to RGB, in place on interleaved pixels, as libjpeg
/// converts.
fn ycbcr_to_rgb(pixels: &mut [u8]) {
    for px in pixels.chunks_exact_mut(CHANNELS) {
        let (y, cb, cr) = (px[0] as f32, px[1] as f32 - 128.0, px[2] as f32 - 128.0);
        let clamp = |v: f32| v.round().clamp(0.0, 255.0) as u8;
        px[0] = clamp(y + 1.402 * cr);
        px[1] = clamp(y - 0.344_136 * cb - 0.714_136 * cr);
        px[2] = clamp(y + 1.772 * cb);
    }
}

/// Refuses levels this reader cannot turn into RGB images; says whether the level's tiles
/// decode to YCbCr (JPEG-compressed YCbCr, Aperio's and most scanners' case; the JPEG tables
/// a level shares, its JPEGTables tag, are read by the decoder).
fn check_layout(path: &Path, level: usize, decoder: &mut TiffDecoder) -> Result<bool> {
    let refuse = |what: String| {
        Err(Error::Data(format!(
            "{}: level {level} is {what}; only 8-bit RGB slides (or JPEG-compressed YCbCr) can be read",
            path.display()
        )))
    };
    let compression = decoder
        .find_tag_unsigned::<u16>(Tag::Compression)
        .map_err(|e| structure_error(path, e))?;
    // The JPEG decoder returns a tile's components as stored, without colour conversion: an
    // RGB level's tiles come out RGB (Aperio stores RGB components under photometric RGB),
    // a YCbCr level's YCbCr, which reads convert.
    let jpeg = compression == Some(CompressionMethod::ModernJPEG.to_u16());
    let ycbcr = match decoder.colortype() {
        Ok(ColorType::RGB(8)) => false,
        Ok(ColorType::YCbCr(8)) if jpeg => true,
        Ok(other) => return refuse(format!("{other:?}")),
        Err(e) => return refuse(format!("in an unsupported layout ({e})")),
    };
    let planar = decoder
        .find_tag_unsigned::<u16>(Tag::PlanarConfiguration)
        .map_err(|e| structure_error(path, e))?;
    if planar == Some(PlanarConfiguration::Planar.to_u16()) {
        return refuse("stored as separate colour planes".into());
    }
    Ok(ycbcr)
}

/// A TIFF structure that does not read, as an error naming the file.
fn structure_error(path: &Path, e: TiffError) -> Error {
    let path = path.display();
    Error::Data(match e {
        TiffError::FormatError(
            TiffFormatError::TiffSignatureNotFound | TiffFormatError::TiffSignatureInvalid,
        ) => format!("{path} is not a TIFF file"),
        TiffError::IoError(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            format!("{path} is truncated: its TIFF structure ends early ({e})")
        }
        e => format!("{path} is not a readable TIFF: {e}"),
    })
}

// ------------------------------------------------------------------------------------------
// Tiles of a directory of slides, as a Source.

/// How [`Slides`] cuts slides into tiles.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TileConfig {
    /// The pyramid level tiles are cut from (0 = full resolution).
    pub level: usize,
    /// Side of the square tiles, in pixels of that level.
    pub tile: u32,
    /// Distance between neighbouring tiles' corners (less than `tile` for overlapping tiles).
    pub stride: u32,
    /// Leave out tiles whose mean brightness (mean of R, G, B in [0, 1]) is above this:
    /// near-white background without tissue. Around 0.8 suits bright-field slides.
    pub tissue_threshold: Option<f32>,
}

/// One tile of [`Slides`]: a slide (index into [`Slides::slides`]), the tile's top-left corner
/// in pixels of the configured level, and its label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Index of the slide in [`Slides::slides`].
    pub slide: usize,
    /// Left edge in pixels of the configured level.
    pub x: u32,
    /// Top edge in pixels of the configured level.
    pub y: u32,
    /// Its class's index in [`Slides`]'s class names (when segmenting, the class at its
    /// centre, or [`UNLABELLED`]).
    pub label: u32,
}

/// Labelled square tiles cut from every `.tif`/`.tiff` slide of a directory at one level.
///
/// Tiles are whole tiles inside the level, in row-major order per slide, slides sorted by file
/// name. Labels come from a CSV file of rows
/// - `slide,label`: every tile of the slide gets `label`;
/// - `slide,x,y,w,h,label`: a rectangle in level-0 pixels; a tile gets the label of the first
///   such row (in file order) whose rectangle holds the tile's centre, and a tile whose centre
///   is in none is left out.
///
/// `slide` is the file name (`a.tiff`) or its stem (`a`). A slide has either one whole-slide
/// row or region rows. A first line whose first field is `slide`, or whose numbers do not
/// parse, is a header. Fields are trimmed; quoting is not supported. Class names are the
/// sorted distinct labels of the rows.
///
/// Labels that would train on something other than what they say are refused, naming the file
/// and line: a slide without a row, a row naming a slide that is not in the directory, a
/// region reaching outside its slide or holding no tile's centre, regions of different labels
/// that overlap, and a class left with no tile.
///
/// To segment ([`Slides::open_for`] with [`Task::Segment`]), every tile of a slide that passes
/// the tissue filter is a sample, and rows label pixels ([`Slides::tile_mask`]): each pixel
/// takes the label of the first region holding its centre, a whole-slide row labels every
/// pixel, and pixels in no region are of the class [`BACKGROUND`] (added to the class names);
/// a region labelled [`UNLABELLED_REGION`] marks its pixels [`UNLABELLED`]. A region need
/// not hold a tile's centre, nor a class a tile.
///
/// The tissue filter reads each tile once at opening, from the coarsest level on which the
/// tile still spans [`TISSUE_FOOTPRINT`] pixels (so opening costs a small fraction of reading
/// the tiles), decoding each TIFF tile of that level at most once.
pub struct Slides {
    slides: Vec<Slide>,
    classes: Vec<String>,
    tiles: Vec<Tile>,
    config: TileConfig,
    task: Task,
    /// Per slide, its regions in level-0 pixels and their classes, in file order.
    regions: Vec<Vec<([u32; 4], u32)>>,
    /// Slides left out at opening because they could not be read (`skip_bad`), and why.
    pub skipped: Vec<(PathBuf, String)>,
}

/// The tissue filter judges a tile on the coarsest level where it still spans this many
/// pixels each way (or on the tile's own level when no coarser one does).
pub const TISSUE_FOOTPRINT: u32 = 8;

impl Slides {
    /// Opens every slide in `dir`, reads the labels in `labels` and lists the tiles, to
    /// classify. With `skip_bad`, a slide that cannot be opened or read (damaged, truncated)
    /// is left out with its reason in [`Slides::skipped`] instead of failing.
    pub fn open(dir: &Path, labels: &Path, config: &TileConfig, skip_bad: bool) -> Result<Slides> {
        Slides::open_for(Task::Classify, dir, labels, config, skip_bad)
    }

    /// [`Slides::open`] for `task`.
    pub fn open_for(
        task: Task,
        dir: &Path,
        labels: &Path,
        config: &TileConfig,
        skip_bad: bool,
    ) -> Result<Slides> {
        if config.stride == 0 {
            return Err(Error::Config("tile stride must be at least 1 pixel".into()));
        }
        let rows = read_labels(labels, task)?;
        let paths = slide_files(dir)?;
        let mut slides = Vec::new();
        let mut tiles = Vec::new();
        let mut regions = Vec::new();
        let mut skipped = Vec::new();
        let mut named = std::collections::HashSet::new();
        for path in paths {
            let key = rows.key_for(&path).ok_or_else(|| Error::BadInput {
                path: labels.to_path_buf(),
                why: format!(
                    "no row names slide {}: add `{},<label>` or region rows `{},x,y,w,h,<label>`",
                    path.display(),
                    file_name(&path),
                    file_name(&path)
                ),
            })?;
            let labelled = &rows.by_slide[&key];
            named.insert(key);
            let slide = match Slide::open(&path) {
                Ok(slide) => slide,
                Err(e) if skip_bad => {
                    skipped.push((path, e.to_string()));
                    continue;
                }
                Err(e) => return Err(e),
            };
            // The labels' geometry first: its errors are the labels file's, never skipped.
            check_regions(&slide, labelled, &rows, config)?;
            match slide_tiles(&slide, slides.len(), labelled, &rows, config) {
                Ok(t) => {
                    tiles.extend(t);
                    regions.push(rows.regions(labelled, &slide.levels()[0]));
                    slides.push(slide);
                }
                Err(e) if skip_bad => skipped.push((path, e.to_string())),
                Err(e) => return Err(e),
            }
        }
        let mut unnamed: Vec<(usize, &String)> = rows
            .by_slide
            .iter()
            .filter(|(k, _)| !named.contains(*k))
            .map(|(k, r)| (r.line(), k))
            .collect();
        unnamed.sort();
        if let Some((line, slide)) = unnamed.first() {
            return Err(rows.error(*line, &format!("slide {slide} is not in {}", dir.display())));
        }
        let mut counts = vec![0usize; rows.classes.len()];
        for t in &tiles {
            if let Some(n) = counts.get_mut(t.label as usize) {
                *n += 1;
            }
        }
        // A segmenting tile holds many classes: its centre's says little.
        let empty = counts.iter().position(|&n| n == 0);
        if let Some(class) = empty.filter(|_| task == Task::Classify) {
            let label = &rows.classes[class];
            let mut lines: Vec<usize> = rows
                .by_slide
                .values()
                .flat_map(|r| r.lines_of(label))
                .collect();
            lines.sort();
            let lines: Vec<String> = lines.iter().map(usize::to_string).collect();
            let why = match (config.tissue_threshold, skipped.is_empty()) {
                (Some(t), _) => format!("the tissue threshold {t} left out all its tiles"),
                (None, false) => "its slides were left out as unreadable".into(),
                (None, true) => "no tile's centre lies in its regions".into(),
            };
            return Err(Error::BadInput {
                path: rows.path.clone(),
                why: format!(
                    "class {label} (line {}) has no tiles: {why}",
                    lines.join(", ")
                ),
            });
        }
        Ok(Slides {
            slides,
            classes: rows.classes,
            tiles,
            config: *config,
            task,
            regions,
            skipped,
        })
    }

    /// Every tile, in sample order.
    pub fn tiles(&self) -> &[Tile] {
        &self.tiles
    }

    /// The slides, in file-name order ([`Tile::slide`] indexes this).
    pub fn slides(&self) -> &[Slide] {
        &self.slides
    }

    /// How the slides are cut into tiles.
    pub fn config(&self) -> &TileConfig {
        &self.config
    }

    /// Writes tile `index` as a PNG in the image-folder layout, `dir/<class>/<slide
    /// stem>_level<L>_<x>_<y>.png` (so [`super::folder::Folder`] reads exported tiles back),
    /// and returns its path.
    pub fn export_png(&self, index: usize, dir: &Path) -> Result<PathBuf> {
        let t = *self.tile(index)?;
        let slide = &self.slides[t.slide];
        let (level, size) = (self.config.level, self.config.tile);
        let rgb = slide.read_rgb8(level, t.x, t.y, size, size)?;
        let folder = dir.join(&self.classes[t.label as usize]);
        let stem = slide_name(slide.path());
        let path = folder.join(format!("{stem}_level{level}_{}_{}.png", t.x, t.y));
        std::fs::create_dir_all(&folder)
            .map_err(|e| Error::Data(format!("cannot write {}: {e}", path.display())))?;
        crate::core::files::write_png(&path, &rgb, size, size)?;
        Ok(path)
    }

    /// The labels of tile `index`'s pixels, row-major: each pixel takes the class of the first
    /// region (in file order) holding its centre in level-0 pixels, else the background's.
    /// Computed from the rectangles as per-row spans, without reading pixels.
    pub fn tile_mask(&self, index: usize) -> Result<Mask> {
        let t = *self.tile(index)?;
        let (base, level) = (
            self.slides[t.slide].levels()[0],
            self.slides[t.slide].levels()[self.config.level],
        );
        let (sx, sy) = (
            base.width as f64 / level.width as f64,
            base.height as f64 / level.height as f64,
        );
        let n = self.config.tile as usize;
        let background = match self
            .classes
            .binary_search_by(|c| c.as_str().cmp(BACKGROUND))
        {
            Ok(i) => i as u32,
            Err(_) => UNLABELLED,
        };
        let mut labels = vec![background; n * n];
        // The pixels [first, end) along an axis whose centres lie in [from, from + len).
        let span = |corner: u32, scale: f64, from: u32, len: u32| {
            let inside = |p: usize| {
                let centre = (corner as f64 + p as f64 + 0.5) * scale;
                centre >= from as f64 && centre < from as f64 + len as f64
            };
            let first = (0..n).position(inside).unwrap_or(n);
            let end = first + (first..n).take_while(|&p| inside(p)).count();
            first..end
        };
        // Later regions first, so the first one holding a pixel paints it last.
        let (left, top) = (t.x as f64 * sx, t.y as f64 * sy);
        let (right, bottom) = (left + n as f64 * sx, top + n as f64 * sy);
        for &([x, y, w, h], class) in self.regions[t.slide].iter().rev() {
            let (x0, y0) = (x as f64, y as f64);
            if x0 >= right || x0 + w as f64 <= left || y0 >= bottom || y0 + h as f64 <= top {
                continue;
            }
            let cols = span(t.x, sx, x, w);
            if cols.is_empty() {
                continue;
            }
            for row in span(t.y, sy, y, h) {
                labels[row * n + cols.start..row * n + cols.end].fill(class);
            }
        }
        Ok(Mask {
            height: n,
            width: n,
            labels,
        })
    }

    fn tile(&self, index: usize) -> Result<&Tile> {
        self.tiles.get(index).ok_or_else(|| {
            Error::Internal(format!("tile {index} asked of {} tiles", self.tiles.len()))
        })
    }
}

impl Source for Slides {
    fn samples(&self) -> Option<usize> {
        Some(self.tiles.len())
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn label(&self, index: usize) -> Result<u32> {
        Ok(self.tile(index)?.label)
    }

    fn read(&self, index: usize) -> Result<Image> {
        let t = self.tile(index)?;
        let size = self.config.tile;
        self.slides[t.slide].read_region(self.config.level, t.x, t.y, size, size)
    }

    fn place(&self, index: usize) -> Option<TilePlace<'_>> {
        let t = self.tiles.get(index)?;
        Some(TilePlace {
            slide: &self.slides[t.slide],
            level: self.config.level,
            x: t.x,
            y: t.y,
            side: self.config.tile,
        })
    }

    fn task(&self) -> Task {
        self.task
    }

    fn mask(&self, index: usize) -> Result<Mask> {
        self.tile_mask(index)
    }

    /// `a.tiff level 1 tile at (2048, 1024)`, the corner in pixels of that level.
    fn describe(&self, index: usize) -> String {
        match self.tiles.get(index) {
            Some(t) => format!(
                "{} level {} tile at ({}, {})",
                file_name(self.slides[t.slide].path()),
                self.config.level,
                t.x,
                t.y
            ),
            None => format!("tile {index} (out of range)"),
        }
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// A region row of a labels CSV: (x, y, w, h) in level-0 pixels, its label, and its line.
#[derive(Debug)]
struct RegionRow {
    rect: [u32; 4],
    label: String,
    line: usize,
}

impl RegionRow {
    /// Whether the point (x, y), in level-0 pixels, lies inside.
    fn holds(&self, x: f64, y: f64) -> bool {
        let [rx, ry, rw, rh] = self.rect.map(f64::from);
        x >= rx && x < rx + rw && y >= ry && y < ry + rh
    }

    fn overlaps(&self, o: &RegionRow) -> bool {
        let ([ax, ay, aw, ah], [bx, by, bw, bh]) =
            (self.rect.map(u64::from), o.rect.map(u64::from));
        ax < bx + bw && bx < ax + aw && ay < by + bh && by < ay + ah
    }
}

/// The rows of a labels CSV that concern one slide.
#[derive(Debug)]
enum SlideLabels {
    /// One label for the whole slide, and its row's line.
    Whole(String, usize),
    Regions(Vec<RegionRow>),
}

impl SlideLabels {
    /// The line of the slide's first row.
    fn line(&self) -> usize {
        match self {
            SlideLabels::Whole(_, line) => *line,
            SlideLabels::Regions(rows) => rows[0].line,
        }
    }

    /// The lines of the rows naming `label`.
    fn lines_of(&self, label: &str) -> Vec<usize> {
        match self {
            SlideLabels::Whole(l, line) => [*line].into_iter().filter(|_| l == label).collect(),
            SlideLabels::Regions(rows) => rows
                .iter()
                .filter(|r| r.label == label)
                .map(|r| r.line)
                .collect(),
        }
    }
}

struct Labels {
    path: PathBuf,
    by_slide: HashMap<String, SlideLabels>,
    classes: Vec<String>,
    task: Task,
}

impl Labels {
    /// The number of class `label`; [`UNLABELLED`] for unlabelled regions when segmenting.
    fn number(&self, label: &str) -> u32 {
        match self.classes.binary_search_by(|c| c.as_str().cmp(label)) {
            Ok(i) => i as u32,
            Err(_) => UNLABELLED,
        }
    }

    /// A slide's rows as regions of numbered classes, in file order: a whole-slide row is
    /// one region covering `base`.
    fn regions(&self, rows: &SlideLabels, base: &Level) -> Vec<([u32; 4], u32)> {
        match rows {
            SlideLabels::Whole(l, _) => vec![([0, 0, base.width, base.height], self.number(l))],
            SlideLabels::Regions(list) => list
                .iter()
                .map(|r| (r.rect, self.number(&r.label)))
                .collect(),
        }
    }

    /// The key of the rows for the slide at `path`: its file name, else its stem.
    fn key_for(&self, path: &Path) -> Option<String> {
        [Some(file_name(path)), Some(slide_name(path))]
            .into_iter()
            .flatten()
            .find(|k| self.by_slide.contains_key(k))
    }

    /// An error about line `line` of the labels file.
    fn error(&self, line: usize, why: &str) -> Error {
        Error::BadInput {
            path: self.path.clone(),
            why: format!("line {line}: {why}"),
        }
    }
}

/// The class names a labels file gives for `task` (see [`Slides`]), without opening any slide.
pub fn label_classes(labels: &Path, task: Task) -> Result<Vec<String>> {
    Ok(read_labels(labels, task)?.classes)
}

/// When segmenting, the class of pixels in no region; added to the class names.
pub const BACKGROUND: &str = "background";
/// When segmenting, the label of regions whose pixels are [`UNLABELLED`]; not a class.
pub const UNLABELLED_REGION: &str = "unlabelled";

fn read_labels(path: &Path, task: Task) -> Result<Labels> {
    let text = crate::core::files::read_text(path)?;
    let mut by_slide: HashMap<String, SlideLabels> = HashMap::new();
    let bad = |line: usize, why: &str| Error::BadInput {
        path: path.to_path_buf(),
        why: format!("line {line}: {why} (rows are `slide,label` or `slide,x,y,w,h,label`)"),
    };
    for (n, text) in text.lines().enumerate() {
        let line = n + 1;
        let fields: Vec<&str> = text.split(',').map(str::trim).collect();
        if text.trim().is_empty() {
            continue;
        }
        let numbers: Option<Vec<i64>> = match fields.len() {
            6 => fields[1..5].iter().map(|f| f.parse().ok()).collect(),
            _ => Some(Vec::new()),
        };
        if n == 0 && (fields[0].eq_ignore_ascii_case("slide") || numbers.is_none()) {
            continue;
        }
        let (slide, label) = (fields[0].to_string(), fields[fields.len() - 1].to_string());
        if slide.is_empty() || label.is_empty() {
            return Err(bad(line, "empty slide or label"));
        }
        match (fields.len(), numbers) {
            (2, _) => {
                if let Some(rows) = by_slide.get(&slide) {
                    let why = format!("slide {slide} already has a row (line {})", rows.line());
                    return Err(bad(line, &why));
                }
                by_slide.insert(slide, SlideLabels::Whole(label, line));
            }
            (6, Some(r)) => {
                let rect: [u32; 4] = match [r[0], r[1], r[2], r[3]].map(u32::try_from) {
                    [Ok(x), Ok(y), Ok(w), Ok(h)] if w > 0 && h > 0 => [x, y, w, h],
                    _ => {
                        let why = format!(
                            "a region needs x, y ≥ 0 and a width and height ≥ 1 pixel, not {}, {}, {}, {}",
                            r[0], r[1], r[2], r[3]
                        );
                        return Err(bad(line, &why));
                    }
                };
                let row = RegionRow { rect, label, line };
                match by_slide
                    .entry(slide)
                    .or_insert_with(|| SlideLabels::Regions(Vec::new()))
                {
                    SlideLabels::Regions(rows) => {
                        if let Some(o) = rows
                            .iter()
                            .find(|o| o.label != row.label && o.overlaps(&row))
                        {
                            let why = format!(
                                "its region ({}) overlaps line {}'s ({}), which has another label",
                                row.label, o.line, o.label
                            );
                            return Err(bad(line, &why));
                        }
                        rows.push(row);
                    }
                    SlideLabels::Whole(..) => {
                        return Err(bad(
                            line,
                            "a slide has a whole-slide row or region rows, not both",
                        ))
                    }
                }
            }
            (6, None) => return Err(bad(line, "x, y, w, h must be whole numbers")),
            _ => return Err(bad(line, &format!("{} fields", fields.len()))),
        }
    }
    let mut classes: Vec<String> = by_slide
        .values()
        .flat_map(|rows| match rows {
            SlideLabels::Whole(l, _) => vec![l.clone()],
            SlideLabels::Regions(list) => list.iter().map(|r| r.label.clone()).collect(),
        })
        .collect();
    if task == Task::Segment {
        classes.retain(|c| c != UNLABELLED_REGION);
        classes.push(BACKGROUND.into());
    }
    classes.sort();
    classes.dedup();
    if classes.is_empty() {
        return Err(Error::BadInput {
            path: path.to_path_buf(),
            why: "has no label rows".into(),
        });
    }
    Ok(Labels {
        path: path.to_path_buf(),
        by_slide,
        classes,
        task,
    })
}

/// The grid of `config`'s tiles on `slide`: (columns, rows). Refuses a tile that does not fit.
fn tile_grid(slide: &Slide, config: &TileConfig) -> Result<(u32, u32)> {
    let level = *slide.level(config.level)?;
    let size = config.tile;
    if size == 0 || size > level.width || size > level.height {
        return Err(Error::Data(format!(
            "{}: a {size}-pixel tile does not fit level {} ({}×{}); tiles must be 1 to {} pixels",
            slide.path().display(),
            config.level,
            level.width,
            level.height,
            level.width.min(level.height)
        )));
    }
    Ok((
        (level.width - size) / config.stride + 1,
        (level.height - size) / config.stride + 1,
    ))
}

/// A grid tile's corner in pixels of its level, and its centre in level-0 pixels.
type Placed = ((u32, u32), (f64, f64));

/// The grid's tiles, row-major.
fn tile_centres(slide: &Slide, config: &TileConfig) -> Result<Vec<Placed>> {
    let (cols, rows) = tile_grid(slide, config)?;
    let (base, level) = (slide.levels()[0], slide.levels()[config.level]);
    let (sx, sy) = (
        base.width as f64 / level.width as f64,
        base.height as f64 / level.height as f64,
    );
    let half = config.tile as f64 / 2.0;
    Ok((0..rows)
        .flat_map(|r| (0..cols).map(move |c| (c * config.stride, r * config.stride)))
        .map(|(x, y)| ((x, y), ((x as f64 + half) * sx, (y as f64 + half) * sy)))
        .collect())
}

/// Refuses region rows of `slide` that reach outside it or (classifying) hold no tile's
/// centre.
fn check_regions(
    slide: &Slide,
    rows: &SlideLabels,
    labels: &Labels,
    config: &TileConfig,
) -> Result<()> {
    let SlideLabels::Regions(regions) = rows else {
        return Ok(());
    };
    let base = slide.levels()[0];
    for r in regions {
        let [x, y, w, h] = r.rect.map(u64::from);
        if x + w > base.width as u64 || y + h > base.height as u64 {
            let why = format!(
                "the region {x},{y},{w},{h} reaches outside {} ({}×{} pixels at level 0)",
                file_name(slide.path()),
                base.width,
                base.height
            );
            return Err(labels.error(r.line, &why));
        }
    }
    if labels.task == Task::Segment {
        // Every tile is a sample, whatever its centre: a region may lie between centres.
        return Ok(());
    }
    let centres = tile_centres(slide, config)?;
    for r in regions {
        if !centres.iter().any(|&(_, (cx, cy))| r.holds(cx, cy)) {
            let why = format!(
                "the region {:?} of {} holds the centre of no {}-pixel tile of level {} at stride {}",
                r.rect,
                file_name(slide.path()),
                config.tile,
                config.level,
                config.stride
            );
            return Err(labels.error(r.line, &why));
        }
    }
    Ok(())
}

/// The labelled tiles of one slide (see [`Slides`]); reads the slide for the tissue filter.
fn slide_tiles(
    slide: &Slide,
    index: usize,
    rows: &SlideLabels,
    labels: &Labels,
    config: &TileConfig,
) -> Result<Vec<Tile>> {
    let (cols, rows_down) = tile_grid(slide, config)?;
    let brightness = match config.tissue_threshold {
        Some(_) => Some(tile_brightness(slide, config, cols, rows_down)?),
        None => None,
    };
    let number = |label: &String| labels.number(label);
    let mut tiles = Vec::new();
    for (i, ((x, y), (cx, cy))) in tile_centres(slide, config)?.into_iter().enumerate() {
        if let (Some(b), Some(limit)) = (&brightness, config.tissue_threshold) {
            if b[i] > limit {
                continue;
            }
        }
        let label = match rows {
            SlideLabels::Whole(l, _) => Some(number(l)),
            SlideLabels::Regions(list) => list
                .iter()
                .find(|region| region.holds(cx, cy))
                .map(|region| number(&region.label))
                .or((labels.task == Task::Segment).then(|| labels.number(BACKGROUND))),
        };
        if let Some(label) = label {
            tiles.push(Tile {
                slide: index,
                x,
                y,
                label,
            });
        }
    }
    Ok(tiles)
}

/// Mean brightness of each tile of the `cols × rows` grid (row-major), measured on the coarsest
/// level where a tile spans [`TISSUE_FOOTPRINT`] pixels: each tile's footprint there is
/// summed from the TIFF tiles it overlaps, each TIFF tile decoded once.
fn tile_brightness(slide: &Slide, config: &TileConfig, cols: u32, rows: u32) -> Result<Vec<f32>> {
    let own = slide.levels()[config.level];
    let spans = |l: &Level| {
        config.tile as u64 * l.width as u64 >= TISSUE_FOOTPRINT as u64 * own.width as u64
            && config.tile as u64 * l.height as u64 >= TISSUE_FOOTPRINT as u64 * own.height as u64
    };
    let coarse = (config.level..slide.levels().len())
        .rev()
        .find(|&k| spans(&slide.levels()[k]))
        .unwrap_or(config.level);
    let low = slide.levels()[coarse];
    // Footprints of the grid's columns and rows on the coarse level: [start, end) pixels.
    let footprint = |n: u32, coarse_len: u32, own_len: u32| -> Vec<(u32, u32)> {
        let scale = coarse_len as f64 / own_len as f64;
        (0..n)
            .map(|i| {
                let at = (i * config.stride) as f64;
                let start = ((at * scale).floor() as u32).min(coarse_len - 1);
                let end = (((at + config.tile as f64) * scale).ceil() as u32)
                    .clamp(start + 1, coarse_len);
                (start, end)
            })
            .collect()
    };
    let xs = footprint(cols, low.width, own.width);
    let ys = footprint(rows, low.height, own.height);
    let overlapping = |spans: &[(u32, u32)], from: u32, to: u32| -> Vec<u32> {
        (0..spans.len() as u32)
            .filter(|&i| spans[i as usize].0 < to && spans[i as usize].1 > from)
            .collect()
    };
    let tiff_tiles: Vec<(u32, u32)> = (0..low.tiles_down())
        .flat_map(|ty| (0..low.tiles_across()).map(move |tx| (tx, ty)))
        .collect();
    // Per TIFF tile: (grid index, sum of brightness, pixels) for each footprint it meets.
    let parts = tiff_tiles
        .par_iter()
        .map(|&(tx, ty)| -> Result<Vec<(usize, f64, u64)>> {
            let (x0, y0) = (tx * low.tile_width, ty * low.tile_height);
            let (x1, y1) = (
                (x0 + low.tile_width).min(low.width),
                (y0 + low.tile_height).min(low.height),
            );
            let (cs, rs) = (overlapping(&xs, x0, x1), overlapping(&ys, y0, y1));
            if cs.is_empty() || rs.is_empty() {
                return Ok(Vec::new());
            }
            let rgb = slide.read_rgb8(coarse, x0, y0, x1 - x0, y1 - y0)?;
            let table = SummedArea::of_brightness(&rgb, (x1 - x0) as usize, (y1 - y0) as usize);
            let mut out = Vec::with_capacity(cs.len() * rs.len());
            for &r in &rs {
                let (a, b) = ys[r as usize];
                let (a, b) = (a.max(y0) - y0, b.min(y1) - y0);
                for &c in &cs {
                    let (l, rt) = xs[c as usize];
                    let (l, rt) = (l.max(x0) - x0, rt.min(x1) - x0);
                    let pixels = (rt - l) as u64 * (b - a) as u64;
                    out.push(((r * cols + c) as usize, table.sum(l, a, rt, b), pixels));
                }
            }
            Ok(out)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut sums = vec![(0.0f64, 0u64); (cols * rows) as usize];
    for (i, s, n) in parts.into_iter().flatten() {
        sums[i].0 += s;
        sums[i].1 += n;
    }
    Ok(sums
        .into_iter()
        .map(|(s, n)| (s / n.max(1) as f64) as f32)
        .collect())
}

/// Sums of brightness over rectangles of one decoded tile in O(1) each.
struct SummedArea {
    width: usize,
    /// (width + 1) × (height + 1); entry (x, y) sums the pixels above and left of (x, y).
    table: Vec<f64>,
}

impl SummedArea {
    fn of_brightness(rgb: &[u8], width: usize, height: usize) -> SummedArea {
        let stride = width + 1;
        let mut table = vec![0.0; stride * (height + 1)];
        for y in 0..height {
            let mut row = 0.0;
            for x in 0..width {
                let px = &rgb[(y * width + x) * CHANNELS..][..CHANNELS];
                row += px.iter().map(|&v| v as f64).sum::<f64>() / (CHANNELS as f64 * 255.0);
                table[(y + 1) * stride + x + 1] = table[y * stride + x + 1] + row;
            }
        }
        SummedArea { width, table }
    }

    /// The sum over columns [x0, x1) and rows [y0, y1).
    fn sum(&self, x0: u32, y0: u32, x1: u32, y1: u32) -> f64 {
        let s = self.width + 1;
        let at = |x: u32, y: u32| self.table[y as usize * s + x as usize];
        at(x1, y1) - at(x0, y1) - at(x1, y0) + at(x0, y0)
    }
}
