//! ImageNet models as torchvision defines them, with torchvision's module names, so that every
//! parameter is named as in its `state_dict` (`features.34.weight`, `layer1.0.downsample.1.bias`)
//! and checkpoints move between gems and PyTorch.
//!
//! - `vgg19`: configuration E without batch norm (Simonyan & Zisserman 2014): sixteen 3×3 convs
//!   with bias and five 2×2 max pools in `features`, adaptive average pool to 7×7, a classifier
//!   of three linear layers with dropout 0.5. Init as torchvision: Kaiming normal (fan-out)
//!   convs, N(0, 0.01²) linear weights, zero biases.
//! - `alexnet`: torchvision's single-tower variant ("One weird trick", Krizhevsky 2014): five
//!   convs, three 3×3/2 max pools, adaptive average pool to 6×6, dropout before the first two
//!   linear layers. torchvision keeps PyTorch's default init: U(±1/√fan_in) for every weight and
//!   bias.
//! - `resnet50`: ResNet v1.5 (He et al. 2015 with the stride on the bottleneck's 3×3 conv):
//!   7×7/2 stem, 3×3/2 max pool, bottleneck stages of 3, 4, 6, 3 blocks, no conv bias, a
//!   1×1 projection with BN (`downsample`) where a block changes shape.
//! - `resnet50_gn`: `resnet50` with every batch norm a group norm of 32 groups
//!   (`resnet50(norm_layer=lambda c: nn.GroupNorm(32, c))`): the same names and trainable
//!   parameters, no running statistics, nothing that depends on the batch.
//!
//! The smallest accepted image is the smallest side every layer still has an output for,
//! found by building the graph (shape inference only, no tensors).

use crate::graph::{Graph, GraphBuilder, Output, ValueId};
use crate::ops::conv::Conv2d;
use crate::ops::pool::Window;
use crate::ops::Init;
use crate::tensor::Shape;
use crate::{Error, Result};

/// The torchvision architectures gems builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// VGG-19 without batch normalization.
    Vgg19,
    /// AlexNet.
    AlexNet,
    /// ResNet-50 (bottleneck blocks, 7×7 stem).
    ResNet50,
    /// ResNet-50 with group norm (32 groups) for batch norm.
    ResNet50Gn,
}

impl Arch {
    /// Every architecture.
    pub const ALL: [Arch; 4] = [Arch::Vgg19, Arch::AlexNet, Arch::ResNet50, Arch::ResNet50Gn];

    /// torchvision's name of the model.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Vgg19 => "vgg19",
            Arch::AlexNet => "alexnet",
            Arch::ResNet50 => "resnet50",
            Arch::ResNet50Gn => "resnet50_gn",
        }
    }

    /// The architecture torchvision calls `name`.
    pub fn parse(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// The smallest image side for which every feature map is non-empty (VGG-19 32,
    /// AlexNet 63, the ResNet-50s 1).
    pub fn min_image_size(self) -> usize {
        (1..=4096)
            .find(|&s| self.graph(s, 2).is_ok())
            .expect("every architecture fits a 4096² image")
    }

    fn graph(self, image_size: usize, classes: usize) -> Result<Graph> {
        match self {
            Arch::Vgg19 => vgg19(image_size, classes),
            Arch::AlexNet => alexnet(image_size, classes),
            Arch::ResNet50 => resnet50(Arch::ResNet50, image_size, classes),
            Arch::ResNet50Gn => resnet50(Arch::ResNet50Gn, image_size, classes),
        }
    }
}

/// Builds `arch` for `image_size`² RGB images and `classes` classes, or says how large an
/// image it needs.
pub fn build(arch: Arch, image_size: usize, classes: usize) -> Result<Graph> {
    let min = arch.min_image_size();
    if image_size < min {
        return Err(Error::Config(format!(
            "{} needs images of at least {min}×{min} (smaller ones leave an empty feature map), \
             got {image_size}×{image_size}",
            arch.name()
        )));
    }
    arch.graph(image_size, classes)
}

fn input(arch: Arch, kind: &str, image_size: usize) -> (GraphBuilder, ValueId) {
    GraphBuilder::new(arch.name(), kind, Shape::new([3, image_size, image_size]))
}

fn finish(b: GraphBuilder, logits: ValueId) -> Result<Graph> {
    b.finish(vec![Output::new(logits)])
}

/// A square convolution with bias.
fn conv_bias(c_out: usize, k: usize, stride: usize, pad: usize) -> Conv2d {
    Conv2d::new(c_out, k, stride, pad).with_bias()
}

/// torchvision's configuration E of VGG's `features`: conv output channels, [`M`] a max pool.
const VGG19_FEATURES: &[usize] = &[
    64, 64, M, 128, 128, M, 256, 256, 256, 256, M, 512, 512, 512, 512, M, 512, 512, 512, 512, M,
];
/// A 2×2/2 max pool in a VGG configuration.
const M: usize = 0;

fn vgg19(image_size: usize, classes: usize) -> Result<Graph> {
    let (mut b, x) = input(Arch::Vgg19, "VGG", image_size);
    // Sequential indices count the ReLUs and pools too: conv 0, relu 1, conv 2, relu 3, pool 4.
    let x = b.block("features", "Sequential", |b| {
        let (mut x, mut i) = (x, 0);
        for &c in VGG19_FEATURES {
            if c == M {
                x = b.max_pool(&i.to_string(), x, Window::square(2, 2, 0))?;
                i += 1;
            } else {
                x = b.conv(&i.to_string(), x, conv_bias(c, 3, 1, 1))?;
                x = b.relu(&(i + 1).to_string(), x)?;
                i += 2;
            }
        }
        Ok(x)
    })?;
    let x = b.adaptive_avg_pool("avgpool", x, (7, 7))?;
    let x = b.flatten("flatten", x)?;
    let logits = b.block("classifier", "Sequential", |b| {
        let linear = |b: &mut GraphBuilder, i: usize, x: ValueId, d_out: usize| {
            let y = b.linear(&i.to_string(), x, d_out, true)?;
            b.set_init("weight", Init::Normal(0.01))?;
            b.set_init("bias", Init::Zeros)?;
            Ok::<_, Error>(y)
        };
        let x = linear(b, 0, x, 4096)?;
        let x = b.relu("1", x)?;
        let x = b.dropout("2", x, 0.5)?;
        let x = linear(b, 3, x, 4096)?;
        let x = b.relu("4", x)?;
        let x = b.dropout("5", x, 0.5)?;
        linear(b, 6, x, classes)
    })?;
    finish(b, logits)
}

fn alexnet(image_size: usize, classes: usize) -> Result<Graph> {
    let (mut b, x) = input(Arch::AlexNet, "AlexNet", image_size);
    let x = b.block("features", "Sequential", |b| {
        // PyTorch's default conv init: U(±1/√fan_in) for weight and bias.
        let conv = |b: &mut GraphBuilder, i: usize, x: ValueId, c: Conv2d| {
            let fan_in = b.shape(x).dim(0) * c.kernel.0 * c.kernel.1;
            let bound = 1.0 / (fan_in as f64).sqrt();
            let y = b.conv(&i.to_string(), x, c)?;
            b.set_init("weight", Init::Uniform(bound))?;
            b.set_init("bias", Init::Uniform(bound))?;
            b.relu(&(i + 1).to_string(), y)
        };
        let pool = Window::square(3, 2, 0);
        let x = conv(b, 0, x, conv_bias(64, 11, 4, 2))?;
        let x = b.max_pool("2", x, pool)?;
        let x = conv(b, 3, x, conv_bias(192, 5, 1, 2))?;
        let x = b.max_pool("5", x, pool)?;
        let x = conv(b, 6, x, conv_bias(384, 3, 1, 1))?;
        let x = conv(b, 8, x, conv_bias(256, 3, 1, 1))?;
        let x = conv(b, 10, x, conv_bias(256, 3, 1, 1))?;
        b.max_pool("12", x, pool)
    })?;
    let x = b.adaptive_avg_pool("avgpool", x, (6, 6))?;
    let x = b.flatten("flatten", x)?;
    let logits = b.block("classifier", "Sequential", |b| {
        let x = b.dropout("0", x, 0.5)?;
        let x = b.linear("1", x, 4096, true)?;
        let x = b.relu("2", x)?;
        let x = b.dropout("3", x, 0.5)?;
        let x = b.linear("4", x, 4096, true)?;
        let x = b.relu("5", x)?;
        b.linear("6", x, classes, true)
    })?;
    finish(b, logits)
}

fn resnet50(arch: Arch, image_size: usize, classes: usize) -> Result<Graph> {
    let (mut b, x) = input(arch, "ResNet", image_size);
    let norm = Norm::of(arch);
    let x = b.conv("conv1", x, Conv2d::new(64, 7, 2, 3))?;
    let x = norm.with_relu(&mut b, "bn1", "relu", x)?;
    let mut x = b.max_pool("maxpool", x, Window::square(3, 2, 1))?;
    for (stage, blocks) in [3, 4, 6, 3].into_iter().enumerate() {
        let planes = 64 << stage;
        x = b.block(format!("layer{}", stage + 1), "Sequential", |b| {
            let mut x = x;
            for i in 0..blocks {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                x = b.block(i.to_string(), "Bottleneck", |b| {
                    bottleneck(b, norm, x, planes, stride)
                })?;
            }
            Ok(x)
        })?;
    }
    let x = b.global_avg_pool("avgpool", x)?;
    let x = b.flatten("flatten", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    finish(b, logits)
}

/// ResNet-50's norm layers: batch norm, or group norm of [`GROUPS`] groups.
#[derive(Clone, Copy)]
enum Norm {
    Batch,
    Group,
}

/// The groups of `resnet50_gn`'s group norms (every channel count of ResNet-50 divides).
const GROUPS: usize = 32;

impl Norm {
    fn of(arch: Arch) -> Norm {
        match arch {
            Arch::ResNet50Gn => Norm::Group,
            _ => Norm::Batch,
        }
    }

    /// The norm layer `name` of `x`.
    fn apply(self, b: &mut GraphBuilder, name: &str, x: ValueId) -> Result<ValueId> {
        match self {
            Norm::Batch => b.batchnorm(name, x),
            Norm::Group => b.group_norm(name, x, GROUPS),
        }
    }

    /// The norm layer `name` of `x` and a ReLU: fused into batch norm, a node `relu` after a
    /// group norm.
    fn with_relu(
        self,
        b: &mut GraphBuilder,
        name: &str,
        relu: &str,
        x: ValueId,
    ) -> Result<ValueId> {
        match self {
            Norm::Batch => b.batchnorm_relu(name, x),
            Norm::Group => {
                let y = b.group_norm(name, x, GROUPS)?;
                b.relu(relu, y)
            }
        }
    }
}

/// torchvision's `Bottleneck` (expansion 4): conv1×1-norm-ReLU, conv3×3(stride)-norm-ReLU,
/// conv1×1(4·planes)-norm, plus the input or its projection (`downsample`: strided 1×1 conv and
/// norm, built after `bn3` as torchvision registers it), then ReLU.
fn bottleneck(
    b: &mut GraphBuilder,
    norm: Norm,
    x: ValueId,
    planes: usize,
    stride: usize,
) -> Result<ValueId> {
    let out = 4 * planes;
    let h = b.conv("conv1", x, Conv2d::new(planes, 1, 1, 0))?;
    let h = norm.with_relu(b, "bn1", "relu1", h)?;
    let h = b.conv("conv2", h, Conv2d::new(planes, 3, stride, 1))?;
    let h = norm.with_relu(b, "bn2", "relu2", h)?;
    let h = b.conv("conv3", h, Conv2d::new(out, 1, 1, 0))?;
    let h = norm.apply(b, "bn3", h)?;
    let shortcut = if stride != 1 || b.shape(x).dim(0) != out {
        b.block("downsample", "Sequential", |b| {
            let s = b.conv("0", x, Conv2d::new(out, 1, stride, 0))?;
            norm.apply(b, "1", s)
        })?
    } else {
        x
    };
    b.add_relu("relu3", h, shortcut)
}
