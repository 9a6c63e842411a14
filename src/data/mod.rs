//! Training data: sources of labelled images addressed by index (synthetic, image folders,
//! tiled whole-slide images; a caller's unlabelled images to predict), labelled per image (classification) or per pixel (masks, for
//! segmentation), the epoch order and its sharding across data-parallel groups,
//! augmentation, and a loader that prepares batches ahead on worker threads.

pub mod folder;
pub mod images;
pub mod loader;
pub mod maps;
pub mod openslide;
pub mod order;
pub mod pipeline;
pub mod slide;
pub mod synthetic;
pub mod transform;

pub use pipeline::{open, DataConfig, Dataset, Pipeline, SourceSpec};

use crate::{Error, Result};

/// Colour planes of every image the sources yield.
pub const CHANNELS: usize = 3;

/// The target of a pixel that has no label: it takes no part in the loss or the metrics.
pub const UNLABELLED: u32 = u32::MAX;

/// What a data set's labels say: a class per image, or a class per pixel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Task {
    /// One class per image.
    #[default]
    Classify,
    /// One class per pixel (a mask per image).
    Segment,
}

/// Per-pixel labels of one sample, at the resolution its [`Image`] has: class indices, or
/// [`UNLABELLED`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mask {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// Row-major labels.
    pub labels: Vec<u32>,
}

/// A decoded image: `CHANNELS` planes of `height × width` values (CHW), in [0, 1] for
/// decoded files.
#[derive(Clone, Debug, PartialEq)]
pub struct Image {
    /// Height in pixels.
    pub height: usize,
    /// Width in pixels.
    pub width: usize,
    /// The planes' values, channel by channel, row-major.
    pub pixels: Vec<f32>,
}

impl Image {
    /// Interleaved 8-bit RGB (HWC) to planes in [0, 1].
    pub fn from_rgb8(width: usize, height: usize, rgb: &[u8]) -> Image {
        let mut pixels = Vec::with_capacity(CHANNELS * width * height);
        // Plane by plane, appended: no zeroed buffer to overwrite.
        for c in 0..CHANNELS {
            pixels.extend(rgb.chunks_exact(CHANNELS).map(|px| px[c] as f32 / 255.0));
        }
        Image {
            height,
            width,
            pixels,
        }
    }
}

/// A square tile of a whole-slide image: the slide, the pyramid level it was cut from, and its
/// corner and side in pixels of that level.
#[derive(Clone, Copy)]
pub struct TilePlace<'a> {
    /// The slide.
    pub slide: &'a slide::Slide,
    /// The level the tile was cut from.
    pub level: usize,
    /// Left edge in pixels of that level.
    pub x: u32,
    /// Top edge in pixels of that level.
    pub y: u32,
    /// Side in pixels of that level.
    pub side: u32,
}

/// Labelled images addressed by index. Implementations are cheap to share between threads;
/// `read` may be called concurrently for different indices.
pub trait Source: Send + Sync {
    /// How many samples there are; `None` for an unbounded stream (synthetic data).
    fn samples(&self) -> Option<usize>;
    /// Class names, in label order.
    fn classes(&self) -> &[String];
    /// The label of sample `index`, without decoding it (segmentation sources: the class at
    /// its centre, a summary for listings; targets come from [`Source::mask`]).
    fn label(&self, index: usize) -> Result<u32>;
    /// Decodes sample `index`. Errors are [`crate::Error::Data`] naming the file.
    fn read(&self, index: usize) -> Result<Image>;
    /// Where sample `index` comes from, for messages (a file name, a slide and tile position).
    fn describe(&self, index: usize) -> String;
    /// The task its labels serve.
    fn task(&self) -> Task {
        Task::Classify
    }
    /// Where on a whole-slide image sample `index` was cut (for prediction maps); `None` for
    /// samples that are not a slide's tiles.
    fn place(&self, _index: usize) -> Option<TilePlace<'_>> {
        None
    }
    /// The per-pixel labels of sample `index`, the size [`Source::read`] gives, without
    /// decoding the image (segmentation sources).
    fn mask(&self, index: usize) -> Result<Mask> {
        Err(Error::Config(format!(
            "{} has a class per image, not per pixel: it has no mask",
            self.describe(index)
        )))
    }
}
