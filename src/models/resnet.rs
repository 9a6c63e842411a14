//! ResNets for small and large images (CIFAR-style stems, three stages).
//!
//! - v2 (He et al. 2016, "Identity Mappings in Deep Residual Networks"): pre-activation
//!   bottleneck blocks (BN-ReLU-conv 1×1, 3×3, 1×1), widths 16/32/64 with outputs 64/128/256,
//!   depth 9n+2, no conv bias, a BN-ReLU-global-average-pool-linear head.
//! - v1 (He et al. 2015): basic blocks (conv-BN-ReLU, two 3×3), widths 16/32/64, depth 6n+2.

use crate::graph::{Graph, GraphBuilder, Output, ValueId};
use crate::ops::conv::Conv2d;
use crate::tensor::Shape;
use crate::{Error, Result};

/// The smallest image side these models accept: three stages of stride 1, 2, 2 still leave 8×8.
pub const MIN_IMAGE: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// Which ResNet family.
pub enum Version {
    /// The original ResNet (post-activation basic blocks, He et al. 2015).
    V1,
    /// Pre-activation bottleneck blocks (He et al. 2016).
    V2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// A CIFAR-style ResNet: family and depth.
pub struct ResNetSpec {
    /// Which family.
    pub version: Version,
    /// Blocks per stage.
    pub blocks: usize,
}

impl ResNetSpec {
    /// `resnet110v2` → v2 with 12 blocks per stage; `Ok(None)` when not a ResNet name.
    pub fn parse(name: &str) -> Result<Option<ResNetSpec>> {
        let Some(rest) = name.strip_prefix("resnet") else {
            return Ok(None);
        };
        let (depth, version) = if let Some(d) = rest.strip_suffix("v2") {
            (d, Version::V2)
        } else if let Some(d) = rest.strip_suffix("v1") {
            (d, Version::V1)
        } else {
            return Ok(None);
        };
        let Ok(depth) = depth.parse::<usize>() else {
            return Ok(None);
        };
        let (per_block, kind) = match version {
            Version::V2 => (9, "9n+2"),
            Version::V1 => (6, "6n+2"),
        };
        if depth < per_block + 2 || (depth - 2) % per_block != 0 {
            return Err(Error::Config(format!(
                "{name}: depth {depth} is not {kind} (e.g. {})",
                match version {
                    Version::V2 => "20, 56, 110, 164, 1001",
                    Version::V1 => "20, 32, 56, 110",
                }
            )));
        }
        Ok(Some(ResNetSpec {
            version,
            blocks: (depth - 2) / per_block,
        }))
    }
}

/// ResNet `spec` named `name` for `image_size`² inputs and `classes` classes.
pub fn build(name: &str, spec: &ResNetSpec, image_size: usize, classes: usize) -> Result<Graph> {
    if image_size < MIN_IMAGE {
        return Err(Error::Config(format!("{name} needs images of at least {MIN_IMAGE}×{MIN_IMAGE}, got {image_size}×{image_size}")));
    }
    let kind = match spec.version {
        Version::V1 => "ResNetV1",
        Version::V2 => "ResNetV2",
    };
    let (mut b, x) = GraphBuilder::new(name, kind, Shape::new([3, image_size, image_size]));
    let mut x = b.conv("conv1", x, Conv2d::new(16, 3, 1, 1))?;
    if spec.version == Version::V1 {
        x = b.batchnorm_relu("bn1", x)?;
    }
    for stage in 0..3 {
        let width = 16 << stage;
        x = b.block(format!("layer{}", stage + 1), "Stage", |b| {
            let mut x = x;
            for i in 0..spec.blocks {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                x = match spec.version {
                    Version::V2 => b.block(i.to_string(), "PreActBottleneck", |b| {
                        preact_bottleneck(b, x, width, stride)
                    })?,
                    Version::V1 => b.block(i.to_string(), "BasicBlock", |b| {
                        basic_block(b, x, width, stride)
                    })?,
                };
            }
            Ok(x)
        })?;
    }
    if spec.version == Version::V2 {
        x = b.batchnorm_relu("bn", x)?;
    }
    let x = b.global_avg_pool("avgpool", x)?;
    let x = b.flatten("flatten", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    b.finish(vec![Output::new(logits)])
}

/// BN-ReLU-conv1×1 → BN-ReLU-conv3×3(stride) → BN-ReLU-conv1×1(4·width), plus the shortcut:
/// identity, or a strided 1×1 projection of the pre-activated input where the shape changes.
fn preact_bottleneck(
    b: &mut GraphBuilder,
    x: ValueId,
    width: usize,
    stride: usize,
) -> Result<ValueId> {
    let out = 4 * width;
    let pre = b.batchnorm_relu("bn1", x)?;
    let shortcut = if stride != 1 || b.shape(x).dim(0) != out {
        b.conv("shortcut", pre, Conv2d::new(out, 1, stride, 0))?
    } else {
        x
    };
    let h = b.conv("conv1", pre, Conv2d::new(width, 1, 1, 0))?;
    let h = b.batchnorm_relu("bn2", h)?;
    let h = b.conv("conv2", h, Conv2d::new(width, 3, stride, 1))?;
    let h = b.batchnorm_relu("bn3", h)?;
    let h = b.conv("conv3", h, Conv2d::new(out, 1, 1, 0))?;
    b.add("add", h, shortcut)
}

/// conv3×3(stride)-BN-ReLU-conv3×3-BN, plus identity or a 1×1 projection with BN, then ReLU:
/// torchvision's `BasicBlock`, with its names.
pub(super) fn basic_block(
    b: &mut GraphBuilder,
    x: ValueId,
    width: usize,
    stride: usize,
) -> Result<ValueId> {
    let h = b.conv("conv1", x, Conv2d::new(width, 3, stride, 1))?;
    let h = b.batchnorm_relu("bn1", h)?;
    let h = b.conv("conv2", h, Conv2d::new(width, 3, 1, 1))?;
    let h = b.batchnorm("bn2", h)?;
    let shortcut = if stride != 1 || b.shape(x).dim(0) != width {
        b.block("downsample", "Projection", |b| {
            let s = b.conv("0", x, Conv2d::new(width, 1, stride, 0))?;
            b.batchnorm("1", s)
        })?
    } else {
        x
    };
    b.add_relu("relu2", h, shortcut)
}
