//! Model builders. Each builds a graph from nested blocks for a given image size and number
//! of classes, and refuses configurations its architecture cannot take. Classifiers output
//! `[classes]` logits per sample, segmentation models (the U-Nets) `[classes, H, W]`.

pub mod amoebanet;
pub mod inception;
pub mod resnet;
pub mod torchvision;
pub mod unet;

use crate::data::Task;
use crate::graph::Graph;
use crate::{Error, Result};

/// Named models `gems models` lists (any valid depth of a family is accepted by [`build`]).
pub const LISTED: &[&str] = &[
    "resnet20v1",
    "resnet56v1",
    "resnet110v1",
    "resnet20v2",
    "resnet56v2",
    "resnet110v2",
    "resnet164v2",
    "resnet1001v2",
    "vgg19",
    "alexnet",
    "resnet50",
    "resnet50_gn",
    "inception_v3",
    "amoebanet_d",
    "unet",
    "unet_resnet18",
    "unet_resnet34",
];

/// What model `name` predicts: a class per image, or per pixel (the U-Nets).
pub fn task(name: &str) -> Result<Task> {
    Ok(match unet::parse(name)? {
        Some(_) => Task::Segment,
        None => Task::Classify,
    })
}

/// The most classes a model may have: every class is named and counted in memory.
pub const MAX_CLASSES: usize = 1 << 20;

/// The largest image side a model may take: the sizes of its maps stay far from overflowing.
pub const MAX_IMAGE_SIZE: usize = 1 << 20;

/// Builds the model called `name` for `image_size`² RGB images and `classes` classes.
pub fn build(name: &str, image_size: usize, classes: usize) -> Result<Graph> {
    if classes < 2 {
        return Err(Error::Config(format!(
            "{name}: a model needs at least 2 classes (for segmentation, count the background), \
             got {classes}"
        )));
    }
    if classes > MAX_CLASSES {
        return Err(Error::Config(format!(
            "{name}: a model takes at most {MAX_CLASSES} classes, got {classes}"
        )));
    }
    if image_size > MAX_IMAGE_SIZE {
        return Err(Error::Config(format!(
            "{name}: images of {image_size}² pixels: a side is at most {MAX_IMAGE_SIZE} (larger \
             images are slides, read a tile at a time)"
        )));
    }
    if let Some(spec) = unet::parse(name)? {
        return unet::build(name, spec, image_size, classes);
    }
    if let Some(spec) = resnet::ResNetSpec::parse(name)? {
        return resnet::build(name, &spec, image_size, classes);
    }
    if let Some(arch) = torchvision::Arch::parse(name) {
        return torchvision::build(arch, image_size, classes);
    }
    if let Some(aux_logits) = inception::parse(name) {
        return inception::build(name, aux_logits, image_size, classes);
    }
    if let Some(spec) = amoebanet::parse(name)? {
        return amoebanet::build(name, spec, image_size, classes);
    }
    Err(Error::Config(format!(
        "unknown model '{name}' (known: {}, or resnet<9n+2>v2 / resnet<6n+2>v1 / unet_d<depth>_w<width>)",
        LISTED.join(", ")
    )))
}
