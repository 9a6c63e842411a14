//! U-Nets for segmentation: per-pixel logits, `[classes, H, W]` per sample at the input's
//! `H × W`, with no pooling or linear head. Parameters carry the reference implementation's
//! `state_dict` names, so that its weights load with `--init`.
//!
//! - `unet`, `unet_d<depth>_w<width>`: the U-Net of milesial/Pytorch-UNet
//!   (`UNet(n_channels=3, n_classes=K, bilinear=False)`: depth 4, width 64; Ronneberger et al.
//!   2015 with padded convolutions and BN). `inc` is a DoubleConv ((3×3 conv without bias, BN,
//!   ReLU) twice) to `width` channels; `down<i>` a 2×2 max pool and a DoubleConv doubling the
//!   channels; `up<i>` a 2×2/2 transposed convolution halving them, the skip and the upsampled
//!   map concatenated (skip first) and a DoubleConv halving them again; `outc` a 1×1 conv with
//!   bias. PyTorch's default init (U(±1/√fan_in)), which the reference keeps.
//! - `unet_resnet34`, `unet_resnet18`: segmentation_models_pytorch's `Unet(encoder,
//!   encoder_weights=None, classes=K)`. `encoder` is torchvision's ResNet without its head
//!   (skips after the stem's ReLU and after stages 1–3, at strides 2, 4, 8, 16); the decoder's
//!   five blocks each upsample ×2 (nearest), concatenate the map and the skip (map first; the
//!   last block has no skip) and apply two 3×3 conv-BN-ReLU, to 256, 128, 64, 32, 16 channels;
//!   `segmentation_head` is a 3×3 conv with bias. smp's init: Kaiming uniform (fan-in) decoder
//!   convs, Xavier uniform head, zero biases; the encoder keeps torchvision's.
//!
//! A skip connection is a plain value of the graph: an encoder node's output with two
//! consumers, the next encoder node and a `concat` node in the decoder (`up1.cat`,
//! `decoder.blocks.0.cat`), the only decoder node that reads it.

use super::resnet::basic_block;
use crate::graph::{Graph, GraphBuilder, Output, ValueId};
use crate::ops::conv::{Conv2d, ConvTranspose2d};
use crate::ops::pool::Window;
use crate::ops::Init;
use crate::tensor::Shape;
use crate::{Error, Result};

/// The most channels the bottom of a `unet_d<depth>_w<width>` may have (width·2^depth), so
/// that no parameter count overflows.
pub const MAX_BOTTOM_CHANNELS: usize = 1 << 16;

/// Which U-Net.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spec {
    /// milesial's U-Net with `depth` down- and up-steps and `width` channels at full resolution.
    Plain {
        /// Down-steps (each halves the side and doubles the channels).
        depth: usize,
        /// Channels of `inc`, at full resolution.
        width: usize,
    },
    /// smp's U-Net on a torchvision ResNet encoder with this many basic blocks per stage.
    ResNet {
        /// Basic blocks in each of the four stages.
        blocks: [usize; 4],
    },
}

impl Spec {
    /// How many times the model halves the side: images need a side that is a multiple of
    /// 2^this.
    pub fn reductions(self) -> usize {
        match self {
            Spec::Plain { depth, .. } => depth,
            // The stem's stride-2 conv and max pool, and stages 2 to 4.
            Spec::ResNet { .. } => 5,
        }
    }
}

impl Spec {
    /// How far, in input pixels, the inputs an output pixel depends on may lie beyond it (a
    /// bound): each k×k window at a map of s input pixels per pixel reaches s·(k−1)/2 further,
    /// pooling and strides only group pixels, and each ×2 upsampling lets a pixel depend on
    /// its coarse parent's block, up to s/2 further. Outputs at least this far from a
    /// window's border do not see its zero padding.
    pub fn receptive_radius(self) -> usize {
        // r: the reach so far; s: input pixels per pixel of the current map.
        let (mut r, mut s) = (0, 1);
        let window = |r: &mut usize, k: usize, s: usize| *r += s * (k - 1) / 2;
        let up = |r: &mut usize, s: &mut usize| {
            *s /= 2;
            *r += *s;
        };
        match self {
            Spec::Plain { depth, .. } => {
                window(&mut r, 3, s);
                window(&mut r, 3, s);
                for _ in 0..depth {
                    s *= 2;
                    window(&mut r, 3, s);
                    window(&mut r, 3, s);
                }
                for _ in 0..depth {
                    up(&mut r, &mut s);
                    window(&mut r, 3, s);
                    window(&mut r, 3, s);
                }
            }
            Spec::ResNet { blocks } => {
                // The stem's 7×7/2 convolution and 3×3/2 max pool.
                window(&mut r, 7, s);
                s *= 2;
                window(&mut r, 3, s);
                s *= 2;
                for (stage, &n) in blocks.iter().enumerate() {
                    for block in 0..n {
                        window(&mut r, 3, s);
                        if stage > 0 && block == 0 {
                            s *= 2;
                        }
                        window(&mut r, 3, s);
                    }
                }
                for _ in 0..5 {
                    up(&mut r, &mut s);
                    window(&mut r, 3, s);
                    window(&mut r, 3, s);
                }
                window(&mut r, 3, s);
            }
        }
        r
    }
}

/// `unet` → depth 4, width 64; `unet_d3_w16` → depth 3, width 16; `unet_resnet34`,
/// `unet_resnet18`; `Ok(None)` when not a U-Net name.
pub fn parse(name: &str) -> Result<Option<Spec>> {
    let named = match name {
        "unet" => Some(Spec::Plain {
            depth: 4,
            width: 64,
        }),
        "unet_resnet18" => Some(Spec::ResNet {
            blocks: [2, 2, 2, 2],
        }),
        "unet_resnet34" => Some(Spec::ResNet {
            blocks: [3, 4, 6, 3],
        }),
        _ => None,
    };
    if named.is_some() {
        return Ok(named);
    }
    let Some(rest) = name.strip_prefix("unet_d") else {
        return Ok(None);
    };
    let bad = |why: &str| {
        Error::Config(format!(
            "{name}: {why} (unet_d<depth>_w<width>, e.g. unet_d4_w64 as unet, unet_d3_w16)"
        ))
    };
    let (depth, width) = rest
        .split_once("_w")
        .ok_or_else(|| bad("expected _w<width> after the depth"))?;
    let (Ok(depth), Ok(width)) = (depth.parse::<usize>(), width.parse::<usize>()) else {
        return Err(bad("depth and width must be numbers"));
    };
    if depth == 0 || width == 0 {
        return Err(bad("depth and width must be at least 1"));
    }
    let bottom = (depth < usize::BITS as usize)
        .then(|| width.checked_mul(1 << depth))
        .flatten();
    if bottom.is_none_or(|c| c > MAX_BOTTOM_CHANNELS) {
        return Err(bad(&format!(
            "width·2^depth channels at the bottom must be at most {MAX_BOTTOM_CHANNELS}"
        )));
    }
    Ok(Some(Spec::Plain { depth, width }))
}

/// U-Net `spec` named `name` for `image_size`² RGB inputs and `classes` classes, or which
/// sides it takes.
pub fn build(name: &str, spec: Spec, image_size: usize, classes: usize) -> Result<Graph> {
    let step = 1 << spec.reductions();
    if image_size == 0 || !image_size.is_multiple_of(step) {
        let below = image_size / step * step;
        let near = if below == 0 {
            format!("{step}")
        } else {
            format!("{below} or {}", below + step)
        };
        return Err(Error::Config(format!(
            "{name} needs an image side that is a multiple of {step} (it halves the side {} \
             times and doubles it back), such as {near}; got {image_size}×{image_size}",
            spec.reductions()
        )));
    }
    let input = Shape::new([3, image_size, image_size]);
    let (b, logits) = match spec {
        Spec::Plain { depth, width } => {
            let (mut b, x) = GraphBuilder::new(name, "UNet", input);
            let logits = plain(&mut b, x, depth, width, classes)?;
            (b, logits)
        }
        Spec::ResNet { blocks } => {
            let (mut b, x) = GraphBuilder::new(name, "Unet", input);
            let logits = resnet_unet(&mut b, x, blocks, classes)?;
            (b, logits)
        }
    };
    b.finish(vec![Output::new(logits)])
}

/// milesial's UNet: `inc`, `down1..depth`, `up1..depth`, `outc`.
fn plain(
    b: &mut GraphBuilder,
    x: ValueId,
    depth: usize,
    width: usize,
    classes: usize,
) -> Result<ValueId> {
    let mut x = b.block("inc", "DoubleConv", |b| double_conv(b, x, width))?;
    let mut skips = Vec::with_capacity(depth);
    for i in 1..=depth {
        skips.push(x);
        x = b.block(format!("down{i}"), "Down", |b| {
            b.block("maxpool_conv", "Sequential", |b| {
                let p = b.max_pool("0", x, Window::square(2, 2, 0))?;
                b.block("1", "DoubleConv", |b| double_conv(b, p, width << i))
            })
        })?;
    }
    for (i, skip) in skips.into_iter().rev().enumerate() {
        let c = width << (depth - 1 - i);
        x = b.block(format!("up{}", i + 1), "Up", |b| {
            let up = b.conv_transpose("up", x, ConvTranspose2d::new(c, 2, 2))?;
            let cat = b.concat("cat", &[skip, up])?;
            b.block("conv", "DoubleConv", |b| double_conv(b, cat, c))
        })?;
    }
    b.block("outc", "OutConv", |b| {
        torch_default_conv(b, "conv", x, Conv2d::new(classes, 1, 1, 0).with_bias())
    })
}

/// milesial's DoubleConv: `double_conv` = (3×3 conv without bias, BN, ReLU) twice, the ReLUs
/// fused into the BNs (Sequential indices 2 and 5 have no parameters).
fn double_conv(b: &mut GraphBuilder, x: ValueId, c_out: usize) -> Result<ValueId> {
    b.block("double_conv", "Sequential", |b| {
        let h = torch_default_conv(b, "0", x, Conv2d::new(c_out, 3, 1, 1))?;
        let h = b.batchnorm_relu("1", h)?;
        let h = torch_default_conv(b, "3", h, Conv2d::new(c_out, 3, 1, 1))?;
        b.batchnorm_relu("4", h)
    })
}

/// A convolution with PyTorch's default init: weight and bias U(±1/√fan_in).
fn torch_default_conv(b: &mut GraphBuilder, name: &str, x: ValueId, c: Conv2d) -> Result<ValueId> {
    let fan_in = b.shape(x).dim(0) / c.groups * c.kernel.0 * c.kernel.1;
    let bound = 1.0 / (fan_in as f64).sqrt();
    let bias = c.bias;
    let y = b.conv(name, x, c)?;
    b.set_init("weight", Init::Uniform(bound))?;
    if bias {
        b.set_init("bias", Init::Uniform(bound))?;
    }
    Ok(y)
}

/// smp's decoder channels, one per decoder block.
const DECODER_CHANNELS: [usize; 5] = [256, 128, 64, 32, 16];

/// smp's Unet: `encoder` (torchvision's ResNet stem and stages), `decoder.blocks.0..4`,
/// `segmentation_head`.
fn resnet_unet(
    b: &mut GraphBuilder,
    x: ValueId,
    blocks: [usize; 4],
    classes: usize,
) -> Result<ValueId> {
    // The skips (the stem's output and each stage's but the last's) and the deepest map.
    let (head, mut skips) = b.block("encoder", "ResNetEncoder", |b| {
        let x = b.conv("conv1", x, Conv2d::new(64, 7, 2, 3))?;
        let x = b.batchnorm_relu("bn1", x)?;
        let mut skips = vec![x];
        let mut x = b.max_pool("maxpool", x, Window::square(3, 2, 1))?;
        for (stage, &n) in blocks.iter().enumerate() {
            if stage > 0 {
                skips.push(x);
            }
            let width = 64 << stage;
            x = b.block(format!("layer{}", stage + 1), "Sequential", |b| {
                let mut x = x;
                for i in 0..n {
                    let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                    x = b.block(i.to_string(), "BasicBlock", |b| {
                        basic_block(b, x, width, stride)
                    })?;
                }
                Ok(x)
            })?;
        }
        Ok((x, skips))
    })?;
    let x = b.block("decoder", "UnetDecoder", |b| {
        b.block("blocks", "ModuleList", |b| {
            let mut x = head;
            for (i, c) in DECODER_CHANNELS.into_iter().enumerate() {
                // The skips from deep to shallow; the last block has none.
                let skip = skips.pop();
                x = b.block(i.to_string(), "UnetDecoderBlock", |b| {
                    let mut h = b.upsample_nearest("up", x, 2)?;
                    if let Some(skip) = skip {
                        h = b.concat("cat", &[h, skip])?;
                    }
                    let h = decoder_conv(b, "conv1", h, c)?;
                    decoder_conv(b, "conv2", h, c)
                })?;
            }
            Ok(x)
        })
    })?;
    b.block("segmentation_head", "SegmentationHead", |b| {
        let c_in = b.shape(x).dim(0);
        let y = b.conv("0", x, Conv2d::new(classes, 3, 1, 1).with_bias())?;
        // Xavier uniform: √(6 / (fan_in + fan_out)).
        let bound = (6.0 / (9 * (c_in + classes)) as f64).sqrt();
        b.set_init("weight", Init::Uniform(bound))?;
        b.set_init("bias", Init::Zeros)?;
        Ok(y)
    })
}

/// smp's Conv2dReLU with BN: `0` a 3×3 conv without bias (Kaiming uniform, fan-in, for ReLU:
/// U(±√(6/fan_in))), `1` BN with the ReLU fused.
fn decoder_conv(b: &mut GraphBuilder, name: &str, x: ValueId, c_out: usize) -> Result<ValueId> {
    let fan_in = b.shape(x).dim(0) * 9;
    b.block(name, "Conv2dReLU", |b| {
        let h = b.conv("0", x, Conv2d::new(c_out, 3, 1, 1))?;
        b.set_init("weight", Init::Uniform((6.0 / fan_in as f64).sqrt()))?;
        b.batchnorm_relu("1", h)
    })
}
