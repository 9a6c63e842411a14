//! Whole-slide segmentation: a U-Net segments every tissue region of a slide at one pyramid
//! level in overlapping windows, and keeps only each window's centre, so that the stitched
//! map has no seams: a window's outputs near its border depend on its zero padding, and
//! those are dropped. Windows are read, predicted and written a few at a time (a micro-batch),
//! so memory is bounded by the windows, never the slide or its map.
//!
//! Exactness: each window's kept centre lies at least `margin` pixels from its border, with
//! `margin` at least the model's receptive radius ([`crate::models::unet::Spec`]), so its
//! outputs see only real pixels; windows sit at multiples of 2^depth, the model's total
//! downsampling, so every pooling sees the same pixel groups as in one large window. The
//! stitched map is then the prediction of one window holding the whole region, away from
//! the slide's borders.

use std::path::Path;

use crate::data::maps::{LabelPyramid, NOTHING};
use crate::data::slide::Slide;
use crate::data::{Image, CHANNELS};
use crate::models::unet;
use crate::{Error, Result};

use super::Model;

/// How [`segment_slide`] cuts a slide into windows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WholeSlide {
    /// The pyramid level segmented (0: full resolution); the map has its size.
    pub level: usize,
    /// Side of each window's kept centre: the distance between neighbouring windows.
    pub stride: u32,
    /// Pixels of context around the centre on each side: windows are `stride + 2·margin`.
    pub margin: u32,
    /// Leave out centres whose mean brightness (0 to 1) is above this: background, labelled
    /// [`NOTHING`] (255) without a prediction. `None`: segment everything.
    pub tissue: Option<f32>,
    /// Side of the output TIFF's tiles.
    pub tile: u32,
}

/// What a model needs of the windows: their sides a multiple of `granule` (2^depth, the
/// model's total downsampling) and at least `radius` pixels of context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowRules {
    /// Windows' offsets and sides are multiples of this.
    pub granule: u32,
    /// The model's receptive radius in pixels.
    pub radius: u32,
}

impl WindowRules {
    /// The rules of model `name`; refuses a model that is not a U-Net.
    pub fn of(name: &str) -> Result<WindowRules> {
        let spec = unet::parse(name)?.ok_or_else(|| {
            Error::Config(format!(
                "whole-slide segmentation needs a U-Net (unet_d<depth>_w<width>, \
                 unet_resnet18, unet_resnet34), not {name}"
            ))
        })?;
        Ok(WindowRules {
            granule: 1 << spec.reductions(),
            radius: spec.receptive_radius() as u32,
        })
    }

    /// The default margin: the receptive radius rounded up to the granule, the least
    /// context for which the stitched map equals one large window's prediction.
    pub fn default_margin(&self) -> u32 {
        self.radius.div_ceil(self.granule) * self.granule
    }

    /// Refuses a stride or margin that is not a multiple of the granule (windows would
    /// group pixels differently from one large window) and a stride of 0.
    pub fn check(&self, name: &str, stride: u32, margin: u32) -> Result<()> {
        let g = self.granule;
        if stride == 0 || !stride.is_multiple_of(g) || !margin.is_multiple_of(g) {
            return Err(Error::Config(format!(
                "{name} halves the side {} times, so windows' stride and margin must be \
                 multiples of {g} (stride from {g}), not stride {stride} and margin {margin}; \
                 {name}'s receptive radius is {} pixels (margin {} by default)",
                g.trailing_zeros(),
                self.radius,
                self.default_margin()
            )));
        }
        let side = stride as u64 + 2 * margin as u64;
        if side > MAX_WINDOW as u64 {
            return Err(Error::Config(format!(
                "windows of {side}² pixels (stride {stride} + twice margin {margin}) are over \
                 the {MAX_WINDOW}² gems predicts at once"
            )));
        }
        Ok(())
    }
}

/// The largest window side: a 16384² window is 3 GiB of f32 input alone, past what one
/// device's memory holds for a U-Net's activations.
pub const MAX_WINDOW: u32 = 16384;

/// A window's kept centre: its corner and size in pixels of the segmented level.
type Centre = ((u32, u32), (u32, u32));

/// What [`segment_slide`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct SlideMap {
    /// Each level of the map's TIFF: width and height.
    pub levels: Vec<(u32, u32)>,
    /// Windows predicted.
    pub windows: usize,
    /// Window centres left out as background.
    pub background: usize,
    /// The TIFF's size in bytes.
    pub bytes: u64,
}

/// Segments `slide` at `opts.level` with `model` (built at the window's side,
/// `stride + 2·margin`: [`Model::at_side`]) and writes the class map as a pyramidal TIFF of
/// labels at `tiff` (class numbers; [`NOTHING`], 255, for background) and an overview of
/// the slide under the classes' colours at `png`.
pub fn segment_slide(
    model: &mut Model,
    slide: &Slide,
    opts: &WholeSlide,
    tiff: &Path,
    png: &Path,
) -> Result<SlideMap> {
    let name = model.graph().name.clone();
    let rules = WindowRules::of(&name)?;
    rules.check(&name, opts.stride, opts.margin)?;
    let side = opts.stride as usize + 2 * opts.margin as usize;
    if model.graph().image_size() != side {
        return Err(Error::Internal(format!(
            "a model on {}² inputs for {side}² windows",
            model.graph().image_size()
        )));
    }
    if model.graph().classes() >= NOTHING as usize {
        return Err(Error::Config(format!(
            "{name} has {} classes; an 8-bit map holds at most {}",
            model.graph().classes(),
            NOTHING
        )));
    }
    let level = *slide.level(opts.level)?;
    let mut map = LabelPyramid::create(tiff, level.width, level.height, opts.tile)?;
    let batch = model.config().batch_size.max(1);
    let (mut windows, mut background) = (0, 0);
    let mut pending = Vec::with_capacity(batch);
    for y in (0..level.height).step_by(opts.stride as usize) {
        for x in (0..level.width).step_by(opts.stride as usize) {
            let size = (
                opts.stride.min(level.width - x),
                opts.stride.min(level.height - y),
            );
            if let Some(limit) = opts.tissue {
                if slide.brightness(opts.level, x, y, size.0, size.1)? > limit {
                    let labels = vec![NOTHING; size.0 as usize * size.1 as usize];
                    map.put((x, y), size, &labels, None)?;
                    background += 1;
                    continue;
                }
            }
            pending.push(((x, y), size));
            if pending.len() == batch {
                windows += predict_windows(model, slide, opts, &pending, &mut map)?;
                pending.clear();
            }
        }
    }
    windows += predict_windows(model, slide, opts, &pending, &mut map)?;
    let classes = model.classes().join(", ");
    let description = format!(
        "gems class map: {name} on level {} of {}; pixel values are classes 0 to {} ({classes}), \
         {NOTHING} is background without tissue",
        opts.level,
        slide.path().display(),
        model.graph().classes() - 1,
    );
    let levels = map.levels().to_vec();
    let bytes = map.finish(&description, png)?;
    Ok(SlideMap {
        levels,
        windows,
        background,
        bytes,
    })
}

/// Predicts the windows around `centres` (corner and size of each kept centre) and puts
/// their centres into `map`; returns how many windows it predicted.
fn predict_windows(
    model: &mut Model,
    slide: &Slide,
    opts: &WholeSlide,
    centres: &[Centre],
    map: &mut LabelPyramid,
) -> Result<usize> {
    if centres.is_empty() {
        return Ok(0);
    }
    let side = opts.stride as usize + 2 * opts.margin as usize;
    let windows = centres
        .iter()
        .map(|&(corner, _)| window(slide, opts, corner))
        .collect::<Result<Vec<_>>>()?;
    let images = windows
        .iter()
        .map(|rgb| Image::from_rgb8(side, side, rgb))
        .collect();
    let m = opts.margin as usize;
    let classes = model.segment(images)?;
    for ((classes, rgb), &((x, y), (w, h))) in classes.iter().zip(&windows).zip(centres) {
        let (w, h) = (w as usize, h as usize);
        let mut labels = Vec::with_capacity(w * h);
        let mut pixels = Vec::with_capacity(w * h * CHANNELS);
        for row in m..m + h {
            let line = &classes[row * side + m..][..w];
            labels.extend(line.iter().map(|&c| u8::try_from(c).unwrap_or(NOTHING)));
            pixels.extend_from_slice(&rgb[(row * side + m) * CHANNELS..][..w * CHANNELS]);
        }
        map.put((x, y), (w as u32, h as u32), &labels, Some(&pixels))?;
    }
    Ok(centres.len())
}

/// The window around the centre whose corner is `(x, y)`: `margin` pixels more on each
/// side, white (as bare glass) where it reaches past the slide's edge; interleaved RGB.
fn window(slide: &Slide, opts: &WholeSlide, (x, y): (u32, u32)) -> Result<Vec<u8>> {
    let level = *slide.level(opts.level)?;
    let side = opts.stride as i64 + 2 * opts.margin as i64;
    let (x0, y0) = (x as i64 - opts.margin as i64, y as i64 - opts.margin as i64);
    let (left, top) = (x0.max(0), y0.max(0));
    let right = (x0 + side).min(level.width as i64);
    let bottom = (y0 + side).min(level.height as i64);
    let (w, h) = ((right - left) as usize, (bottom - top) as usize);
    let inside = slide.read_rgb8(opts.level, left as u32, top as u32, w as u32, h as u32)?;
    let side = side as usize;
    let mut rgb = vec![u8::MAX; side * side * CHANNELS];
    let (dx, dy) = ((left - x0) as usize, (top - y0) as usize);
    for row in 0..h {
        let dst = ((dy + row) * side + dx) * CHANNELS;
        rgb[dst..dst + w * CHANNELS].copy_from_slice(&inside[row * w * CHANNELS..][..w * CHANNELS]);
    }
    Ok(rgb)
}
