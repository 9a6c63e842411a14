//! Prediction maps of whole slides: per-tile predictions (one class per tile, or a grid of
//! classes per segmented tile) painted into a map of the slide at one pyramid level, written
//! as a tiled TIFF of class colours and as a PNG of the slide with the colours laid over it.

use std::path::Path;

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
