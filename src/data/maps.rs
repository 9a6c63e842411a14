//! Prediction maps of whole slides: per-tile predictions (one class per tile, or a grid of
//! classes per segmented tile) painted into a map of the slide at one pyramid level, written
//! as a tiled TIFF of class colours and as a PNG of the slide with the colours laid over it;
//! and [`LabelPyramid`], a whole slide's class map written as a pyramidal TIFF of labels as
//! its pixels arrive, never held whole.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tiff::encoder::{TiffEncoder, TiffKind};
use tiff::tags::{CompressionMethod, PhotometricInterpretation, PlanarConfiguration, Tag};
use tiff::TiffResult;

use super::slide::{self, Level, Slide};
use super::CHANNELS;
use crate::{Error, Result};

/// Map pixels that no tile predicted.
pub const NOTHING: u8 = u8::MAX;

/// Colours of classes 0, 1, … (then repeating): distinct on screen and on tissue.
const PALETTE: [[u8; 3]; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

/// The colour of class `c` in the maps.
pub fn colour(c: u8) -> [u8; 3] {
    match c {
        NOTHING => [255, 255, 255],
        c => PALETTE[c as usize % PALETTE.len()],
    }
}

/// Largest map held in memory (pixels); a finer level is refused with the coarsest that fits.
const MAX_PIXELS: u64 = 1 << 28;

/// One slide's predicted classes at one pyramid level.
pub struct ClassMap {
    /// The level's width in pixels.
    pub width: u32,
    /// The level's height in pixels.
    pub height: u32,
    /// The map's level.
    pub level: usize,
    /// Level-0 pixels per map pixel each way.
    pub scale: (f64, f64),
    /// A class (or [`NOTHING`]) per pixel, row-major.
    pub classes: Vec<u8>,
}

/// Level-0 pixels per pixel of `level` each way, as OpenSlide counts them (from the sizes).
pub fn downsample(slide: &Slide, level: usize) -> Result<(f64, f64)> {
    let (l0, l) = (slide.level(0)?, slide.level(level)?);
    Ok((
        l0.width as f64 / l.width as f64,
        l0.height as f64 / l.height as f64,
    ))
}

impl ClassMap {
    /// An empty map of `slide` at `level`.
    pub fn new(slide: &Slide, level: usize) -> Result<ClassMap> {
        let l = *slide.level(level)?;
        let pixels = l.width as u64 * l.height as u64;
        if pixels > MAX_PIXELS {
            let coarsest_fitting = (level..slide.levels().len()).find(|&k| {
                slide.levels()[k].width as u64 * slide.levels()[k].height as u64 <= MAX_PIXELS
            });
            return Err(Error::Config(format!(
                "{}: a map of level {level} ({}×{}) is too large to hold; {}",
                slide.path().display(),
                l.width,
                l.height,
                match coarsest_fitting {
                    Some(k) => format!("level {k} fits"),
                    None => "no level of this slide fits".into(),
                }
            )));
        }
        Ok(ClassMap {
            width: l.width,
            height: l.height,
            level,
            scale: downsample(slide, level)?,
            classes: vec![NOTHING; pixels as usize],
        })
    }

    /// Paints a tile of `slide` cut at `tile_level` with its corner at (`x`, `y`) and side
    /// `side` in pixels of that level, whose predictions are `classes`: a `cols`-wide grid of
    /// square cells of side `cell` tile pixels (one cell of side `side` for a classified
    /// tile). Each map pixel whose centre falls in the tile takes the class of the cell
    /// holding it.
    #[allow(clippy::too_many_arguments)]
    pub fn paint(
        &mut self,
        slide: &Slide,
        tile_level: usize,
        (x, y): (u32, u32),
        side: u32,
        cell: f64,
        cols: usize,
        classes: &[u32],
    ) -> Result<()> {
        if classes.is_empty()
            || cols == 0
            || cell.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
        {
            return Err(Error::Internal("a tile painted without predictions".into()));
        }
        let rows = classes.len().div_ceil(cols);
        let t = downsample(slide, tile_level)?;
        // The tile in level-0 pixels, then the map pixels whose centres it holds.
        let (x0, y0) = (x as f64 * t.0, y as f64 * t.1);
        let (x1, y1) = ((x + side) as f64 * t.0, (y + side) as f64 * t.1);
        let first = |a: f64, s: f64| (a / s - 0.5).ceil().max(0.0) as u32;
        let (mx0, mx1) = (
            first(x0, self.scale.0),
            first(x1, self.scale.0).min(self.width),
        );
        let (my0, my1) = (
            first(y0, self.scale.1),
            first(y1, self.scale.1).min(self.height),
        );
        for my in my0..my1 {
            let v = ((my as f64 + 0.5) * self.scale.1 / t.1 - y as f64) / cell;
            let row = (v.max(0.0) as usize).min(rows - 1);
            for mx in mx0..mx1 {
                let u = ((mx as f64 + 0.5) * self.scale.0 / t.0 - x as f64) / cell;
                let col = (u.max(0.0) as usize).min(cols - 1);
                let class = classes[(row * cols + col).min(classes.len() - 1)];
                self.classes[my as usize * self.width as usize + mx as usize] =
                    u8::try_from(class).unwrap_or(NOTHING);
            }
        }
        Ok(())
    }

    /// The map as a tiled TIFF of class colours (white where nothing was predicted), tiles
    /// of `tile` pixels; gems and slide viewers open it as a one-level slide.
    pub fn write_tiff(&self, path: &Path, tile: u32, description: &str) -> Result<u64> {
        let level = Level {
            width: self.width,
            height: self.height,
            tile_width: tile,
            tile_height: tile,
        };
        slide::write_tiled(path, &[level], description, false, |_, tx, ty| {
            let mut out = vec![255u8; (tile * tile) as usize * CHANNELS];
            for r in 0..tile.min(self.height.saturating_sub(ty * tile)) {
                let y = (ty * tile + r) as usize;
                for c in 0..tile.min(self.width.saturating_sub(tx * tile)) {
                    let class = self.classes[y * self.width as usize + (tx * tile + c) as usize];
                    let at = (r * tile + c) as usize * CHANNELS;
                    out[at..at + CHANNELS].copy_from_slice(&colour(class));
                }
            }
            out
        })
    }

    /// The slide at the map's level with each predicted pixel half its class's colour, as a
    /// PNG.
    pub fn write_overlay(&self, slide: &Slide, path: &Path) -> Result<()> {
        let mut rgb = slide.read_rgb8(self.level, 0, 0, self.width, self.height)?;
        for (px, &class) in rgb.chunks_exact_mut(CHANNELS).zip(&self.classes) {
            if class != NOTHING {
                for (v, c) in px.iter_mut().zip(colour(class)) {
                    *v = ((*v as u16 + c as u16) / 2) as u8;
                }
            }
        }
        crate::core::files::write_png(path, &rgb, self.width, self.height)
    }
}

/// Longest side of the overview [`LabelPyramid`] writes beside the TIFF.
pub const PNG_SIDE: u32 = 1024;

/// A class map written as a pyramidal tiled TIFF of 8-bit labels (one sample per pixel,
/// deflate-compressed square tiles) that OpenSlide and QuPath open as a generic tiled TIFF:
/// level 0 first, then levels each half the size of the one before (rounded up) until one
/// fits a tile, each a further image marked reduced-resolution (NewSubfileType 1). Pixel
/// (x, y) of level k is pixel (2^k·x, 2^k·y) of level 0, so every level holds labels only.
///
/// Pixels arrive as rectangles of level 0 in any order ([`LabelPyramid::put`]), each pixel
/// exactly once. A tile is compressed as soon as its last pixel arrives and set aside in a
/// scratch file beside the output; [`LabelPyramid::finish`] writes the TIFF from it. Memory
/// holds only the tiles not yet complete (with rectangles arriving row by row, about one
/// row of tiles per level) and the small overview.
pub struct LabelPyramid {
    path: PathBuf,
    tile: u32,
    /// Each level's width and height.
    levels: Vec<(u32, u32)>,
    scratch_path: PathBuf,
    scratch: BufWriter<File>,
    scratch_len: u64,
    /// Per level, per tile (row-major): where its compressed bytes lie in the scratch file.
    done: Vec<Vec<Option<(u64, u64)>>>,
    /// Tiles with some pixels and not all: (level, tile) → (pixels, how many arrived).
    partial: HashMap<(usize, usize), (Vec<u8>, u64)>,
    /// The overview: the pyramid level it shows, its labels, and the slide's pixels under
    /// them (interleaved RGB, white where none came).
    small: (usize, Vec<u8>, Vec<u8>),
}

impl LabelPyramid {
    /// A pyramid of a `width × height` map with `tile`-pixel tiles (a multiple of 16), to be
    /// written at `path`.
    pub fn create(path: &Path, width: u32, height: u32, tile: u32) -> Result<LabelPyramid> {
        if width == 0 || height == 0 || tile < 16 || !tile.is_multiple_of(16) {
            return Err(Error::Config(format!(
                "a label map of {width}×{height} pixels in {tile}-pixel tiles: sizes from 1, \
                 tiles a multiple of 16"
            )));
        }
        let mut levels = vec![(width, height)];
        while let Some(&(w, h)) = levels.last().filter(|(w, h)| w.max(h) > &tile) {
            levels.push((w.div_ceil(2), h.div_ceil(2)));
        }
        let small = (0..levels.len())
            .find(|&k| levels[k].0.max(levels[k].1) <= PNG_SIDE)
            .unwrap_or(levels.len() - 1);
        let (sw, sh) = levels[small];
        let scratch_path = path.with_extension("tiles.tmp");
        let scratch = BufWriter::new(crate::core::files::create_output(&scratch_path)?);
        let done = levels
            .iter()
            .map(|&(w, h)| vec![None; (w.div_ceil(tile) * h.div_ceil(tile)) as usize])
            .collect();
        Ok(LabelPyramid {
            path: path.to_path_buf(),
            tile,
            levels,
            scratch_path,
            scratch,
            scratch_len: 0,
            done,
            partial: HashMap::new(),
            small: (
                small,
                vec![NOTHING; sw as usize * sh as usize],
                vec![u8::MAX; sw as usize * sh as usize * CHANNELS],
            ),
        })
    }

    /// Each level's width and height, level 0 first.
    pub fn levels(&self) -> &[(u32, u32)] {
        &self.levels
    }

    /// The labels of the `w × h` rectangle of level 0 at (x, y), row-major, and the slide's
    /// pixels there (interleaved RGB) if at hand, for the overview.
    pub fn put(
        &mut self,
        (x, y): (u32, u32),
        (w, h): (u32, u32),
        labels: &[u8],
        rgb: Option<&[u8]>,
    ) -> Result<()> {
        let (width, height) = self.levels[0];
        if labels.len() != w as usize * h as usize
            || rgb.is_some_and(|p| p.len() != labels.len() * CHANNELS)
            || x as u64 + w as u64 > width as u64
            || y as u64 + h as u64 > height as u64
        {
            return Err(Error::Internal(format!(
                "{} labels for a {w}×{h} rectangle at ({x}, {y}) of a {width}×{height} map",
                labels.len()
            )));
        }
        let t = self.tile;
        for k in 0..self.levels.len() {
            // The level-k pixels whose level-0 source lies in the rectangle.
            let first = |a: u32| a.div_ceil(1 << k);
            let (kx0, kx1, ky0, ky1) = (first(x), first(x + w), first(y), first(y + h));
            if kx0 >= kx1 || ky0 >= ky1 {
                continue;
            }
            let at =
                |kx: u32, ky: u32| ((ky << k) - y) as usize * w as usize + ((kx << k) - x) as usize;
            let source = |kx: u32, ky: u32| labels[at(kx, ky)];
            if k == self.small.0 {
                let sw = self.levels[k].0 as usize;
                for ky in ky0..ky1 {
                    for kx in kx0..kx1 {
                        let i = ky as usize * sw + kx as usize;
                        self.small.1[i] = source(kx, ky);
                        if let Some(rgb) = rgb {
                            let from = &rgb[at(kx, ky) * CHANNELS..][..CHANNELS];
                            self.small.2[i * CHANNELS..][..CHANNELS].copy_from_slice(from);
                        }
                    }
                }
            }
            let (lw, lh) = self.levels[k];
            let across = lw.div_ceil(t);
            for ty in ky0 / t..=(ky1 - 1) / t {
                for tx in kx0 / t..=(kx1 - 1) / t {
                    let index = (ty * across + tx) as usize;
                    let entry = self
                        .partial
                        .entry((k, index))
                        .or_insert_with(|| (vec![0; (t * t) as usize], 0));
                    let (rows, cols) = (
                        ky0.max(ty * t)..ky1.min((ty + 1) * t),
                        kx0.max(tx * t)..kx1.min((tx + 1) * t),
                    );
                    for ky in rows.clone() {
                        for kx in cols.clone() {
                            entry.0[((ky - ty * t) * t + kx - tx * t) as usize] = source(kx, ky);
                        }
                    }
                    entry.1 += rows.len() as u64 * cols.len() as u64;
                    let inside = (lw - tx * t).min(t) as u64 * (lh - ty * t).min(t) as u64;
                    if entry.1 >= inside {
                        let (pixels, _) = self.partial.remove(&(k, index)).unwrap_or_default();
                        self.store(k, index, &pixels)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Compresses a complete tile into the scratch file.
    fn store(&mut self, level: usize, index: usize, pixels: &[u8]) -> Result<()> {
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        let bytes = z.write_all(pixels).and_then(|_| z.finish());
        let bytes = bytes.and_then(|b| self.scratch.write_all(&b).map(|_| b));
        let bytes = bytes.map_err(|e| self.write_error(&self.scratch_path, e))?;
        self.done[level][index] = Some((self.scratch_len, bytes.len() as u64));
        self.scratch_len += bytes.len() as u64;
        Ok(())
    }

    fn write_error(&self, path: &Path, e: impl std::fmt::Display) -> Error {
        Error::Data(format!("writing {}: {e}", path.display()))
    }

    /// Writes the TIFF (BigTIFF past 4 GiB) and the overview at `png` (the slide's pixels
    /// half covered by their classes' colours, bare where [`NOTHING`]: the largest pyramid
    /// level within [`PNG_SIDE`] pixels); removes the scratch file. Refuses a map with pixels
    /// that never arrived.
    pub fn finish(mut self, description: &str, png: &Path) -> Result<u64> {
        if let Some((k, i)) = self
            .done
            .iter()
            .enumerate()
            .find_map(|(k, tiles)| tiles.iter().position(Option::is_none).map(|i| (k, i)))
        {
            return Err(Error::Internal(format!(
                "{}: tile {i} of level {k} never received all its pixels",
                self.path.display()
            )));
        }
        self.scratch
            .flush()
            .map_err(|e| self.write_error(&self.scratch_path, e))?;
        let scratch =
            File::open(&self.scratch_path).map_err(|e| self.write_error(&self.scratch_path, e))?;
        let file = crate::core::files::create_output(&self.path)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let big = self.scratch_len + (1 << 20) > u32::MAX as u64;
        let written = if big {
            TiffEncoder::new_big(&mut out).and_then(|t| self.write_levels(t, &scratch, description))
        } else {
            TiffEncoder::new(&mut out).and_then(|t| self.write_levels(t, &scratch, description))
        };
        written.map_err(|e| self.write_error(&self.path, e))?;
        out.flush().map_err(|e| self.write_error(&self.path, e))?;
        drop(scratch);
        std::fs::remove_file(&self.scratch_path)
            .map_err(|e| self.write_error(&self.scratch_path, e))?;
        let (k, labels, rgb) = &mut self.small;
        let (w, h) = self.levels[*k];
        for (px, &class) in rgb.chunks_exact_mut(CHANNELS).zip(labels.iter()) {
            if class != NOTHING {
                for (v, c) in px.iter_mut().zip(colour(class)) {
                    *v = ((*v as u16 + c as u16) / 2) as u8;
                }
            }
        }
        crate::core::files::write_png(png, rgb, w, h)?;
        Ok(std::fs::metadata(&self.path)?.len())
    }

    fn write_levels<W: Write + std::io::Seek, K: TiffKind>(
        &self,
        mut tiff: TiffEncoder<W, K>,
        scratch: &File,
        description: &str,
    ) -> TiffResult<()> {
        for (k, &(width, height)) in self.levels.iter().enumerate() {
            let mut dir = tiff.image_directory()?;
            let mut offsets = Vec::with_capacity(self.done[k].len());
            let mut sizes = Vec::with_capacity(self.done[k].len());
            for &(at, len) in self.done[k].iter().flatten() {
                let mut bytes = vec![0u8; len as usize];
                scratch.read_exact_at(&mut bytes, at)?;
                offsets.push(K::convert_offset(dir.write_data(bytes.as_slice())?)?);
                sizes.push(K::convert_offset(len)?);
            }
            dir.write_tag(Tag::NewSubfileType, u32::from(k > 0))?;
            dir.write_tag(Tag::ImageWidth, width)?;
            dir.write_tag(Tag::ImageLength, height)?;
            dir.write_tag(Tag::BitsPerSample, 8u16)?;
            dir.write_tag(Tag::Compression, CompressionMethod::Deflate.to_u16())?;
            dir.write_tag(
                Tag::PhotometricInterpretation,
                PhotometricInterpretation::BlackIsZero.to_u16(),
            )?;
            dir.write_tag(Tag::SamplesPerPixel, 1u16)?;
            dir.write_tag(
                Tag::PlanarConfiguration,
                PlanarConfiguration::Chunky.to_u16(),
            )?;
            dir.write_tag(Tag::TileWidth, self.tile)?;
            dir.write_tag(Tag::TileLength, self.tile)?;
            if k == 0 {
                dir.write_tag(Tag::ImageDescription, description)?;
            }
            dir.write_tag(Tag::TileOffsets, K::convert_slice(&offsets))?;
            dir.write_tag(Tag::TileByteCounts, K::convert_slice(&sizes))?;
            dir.finish()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::slide::{make_slide, MakeSlide};

    #[test]
    fn a_tile_paints_the_map_pixels_whose_centres_it_holds_at_a_coarser_level() {
        let path = std::env::temp_dir().join(format!("gems-map-{}.tiff", std::process::id()));
        let opts = MakeSlide {
            tile: 64,
            levels: 3,
            region: 128,
            ..MakeSlide::new(256, 192)
        };
        make_slide(&path, &opts).unwrap();
        let slide = Slide::open(&path).unwrap();
        let mut map = ClassMap::new(&slide, 1).unwrap();
        assert_eq!((map.width, map.height), (128, 96));
        // A level-0 tile at (64, 0), side 64, predicted as a 2×2 grid of 32-pixel cells.
        map.paint(&slide, 0, (64, 0), 64, 32.0, 2, &[0, 1, 2, 3])
            .unwrap();
        for my in 0..96u32 {
            for mx in 0..128u32 {
                let want = match (mx, my) {
                    (32..=47, 0..=15) => 0,
                    (48..=63, 0..=15) => 1,
                    (32..=47, 16..=31) => 2,
                    (48..=63, 16..=31) => 3,
                    _ => NOTHING,
                };
                assert_eq!(map.classes[(my * 128 + mx) as usize], want, "({mx}, {my})");
            }
        }
        // A level-1 tile (two level-0 pixels per pixel) classified as one class.
        map.paint(&slide, 1, (0, 64), 32, 32.0, 1, &[5]).unwrap();
        assert_eq!(map.classes[64 * 128], 5);
        assert_eq!(map.classes[95 * 128 + 31], 5);
        assert_eq!(map.classes[95 * 128 + 32], NOTHING);
        std::fs::remove_file(&path).unwrap();
    }
}
