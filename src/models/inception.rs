//! Inception v3 (Szegedy et al. 2016, "Rethinking the Inception Architecture"), as torchvision
//! defines it (`torchvision.models.inception_v3`, `transform_input=False`), with torchvision's
//! state_dict names.
//!
//! - BasicConv2d: conv without bias, BN (eps 0.001), ReLU.
//! - Stem: 3×3/2 → 32, 3×3 → 32, 3×3 pad 1 → 64, max pool 3×3/2, 1×1 → 80, 3×3 → 192,
//!   max pool 3×3/2.
//! - Mixed_5b..5d (InceptionA), Mixed_6a (InceptionB, reduction), Mixed_6b..6e (InceptionC,
//!   factorized 1×7 / 7×1), Mixed_7a (InceptionD, reduction), Mixed_7b, 7c (InceptionE); the
//!   branches of each block are concatenated along channels.
//! - AuxLogits on Mixed_6e (`inception_v3`, torchvision's `aux_logits=True`): avg pool 5×5/3,
//!   1×1 → 128, 5×5 → 768, global average pool, fc; a second output with loss weight 0.4,
//!   used only in training.
//! - Head: global average pool, dropout 0.5, flatten, fc.
//!
//! Smallest image: the auxiliary head's 5×5 conv needs a 5×5 map after the 5×5/3 pool, so
//! Mixed_6e must be at least 17×17, which the stem and Mixed_6a only give from 299×299 (the
//! size torchvision trains at). Without the auxiliary head (`inception_v3_noaux`) the binding
//! constraint is Mixed_7a's 3×3/2 reductions needing 3×3 at Mixed_6e: 75×75, torchvision's
//! documented minimum (its eval mode skips the auxiliary head).

use crate::graph::{Graph, GraphBuilder, Output, ValueId};
use crate::ops::conv::Conv2d;
use crate::ops::norm::BatchNorm;
use crate::ops::pool::Window;
use crate::ops::{Init, Op};
use crate::tensor::Shape;
use crate::{Error, Result};

/// Smallest image side with the auxiliary classifier (see the module docs).
pub const MIN_IMAGE: usize = 299;
/// Smallest image side without it.
pub const MIN_IMAGE_NO_AUX: usize = 75;

/// `inception_v3` → `Some(true)` (with the auxiliary classifier), `inception_v3_noaux` →
/// `Some(false)`; `None` when not an Inception name.
pub fn parse(name: &str) -> Option<bool> {
    match name {
        "inception_v3" => Some(true),
        "inception_v3_noaux" => Some(false),
        _ => None,
    }
}

/// Inception-v3 (with its auxiliary classifier if `aux_logits`) for `image_size`² inputs and `classes` classes.
pub fn build(name: &str, aux_logits: bool, image_size: usize, classes: usize) -> Result<Graph> {
    let (min, why) = if aux_logits {
        (
            MIN_IMAGE,
            "the auxiliary classifier needs 17×17 at Mixed_6e",
        )
    } else {
        (MIN_IMAGE_NO_AUX, "Mixed_7a needs 3×3 at Mixed_6e")
    };
    if image_size < min {
        return Err(Error::Config(format!(
            "{name} needs images of at least {min}×{min} ({why}), got {image_size}×{image_size}"
        )));
    }
    build_unchecked(name, aux_logits, image_size, classes)
}

/// The graph without the size check, so that a test can find the limits by shape inference.
fn build_unchecked(
    name: &str,
    aux_logits: bool,
    image_size: usize,
    classes: usize,
) -> Result<Graph> {
    let (mut b, x) = GraphBuilder::new(name, "Inception3", Shape::new([3, image_size, image_size]));
    let x = basic(&mut b, "Conv2d_1a_3x3", x, 32, (3, 3), 2, (0, 0))?;
    let x = basic(&mut b, "Conv2d_2a_3x3", x, 32, (3, 3), 1, (0, 0))?;
    let x = basic(&mut b, "Conv2d_2b_3x3", x, 64, (3, 3), 1, (1, 1))?;
    let x = b.max_pool("maxpool1", x, Window::square(3, 2, 0))?;
    let x = basic(&mut b, "Conv2d_3b_1x1", x, 80, (1, 1), 1, (0, 0))?;
    let x = basic(&mut b, "Conv2d_4a_3x3", x, 192, (3, 3), 1, (0, 0))?;
    let x = b.max_pool("maxpool2", x, Window::square(3, 2, 0))?;
    let x = b.block("Mixed_5b", "InceptionA", |b| inception_a(b, x, 32))?;
    let x = b.block("Mixed_5c", "InceptionA", |b| inception_a(b, x, 64))?;
    let x = b.block("Mixed_5d", "InceptionA", |b| inception_a(b, x, 64))?;
    let x = b.block("Mixed_6a", "InceptionB", |b| inception_b(b, x))?;
    let x = b.block("Mixed_6b", "InceptionC", |b| inception_c(b, x, 128))?;
    let x = b.block("Mixed_6c", "InceptionC", |b| inception_c(b, x, 160))?;
    let x = b.block("Mixed_6d", "InceptionC", |b| inception_c(b, x, 160))?;
    let x = b.block("Mixed_6e", "InceptionC", |b| inception_c(b, x, 192))?;
    // Built here, between Mixed_6e and Mixed_7a, as torchvision registers it (state_dict order).
    let aux = if aux_logits {
        Some(b.block("AuxLogits", "InceptionAux", |b| aux_head(b, x, classes))?)
    } else {
        None
    };
    let x = b.block("Mixed_7a", "InceptionD", |b| inception_d(b, x))?;
    let x = b.block("Mixed_7b", "InceptionE", |b| inception_e(b, x))?;
    let x = b.block("Mixed_7c", "InceptionE", |b| inception_e(b, x))?;
    let x = b.global_avg_pool("avgpool", x)?;
    let x = b.dropout("dropout", x, 0.5)?;
    let x = b.flatten("flatten", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    // torchvision: truncated normal, std 0.1, for every conv and linear without its own.
    b.set_init("weight", Init::Normal(0.1))?;
    let mut outputs = vec![Output::new(logits)];
    if let Some(aux) = aux {
        outputs.push(Output::auxiliary(aux, 0.4));
    }
    b.finish(outputs)
}

/// BasicConv2d `name`: conv (no bias) `name.conv`, BN eps 0.001 `name.bn`, ReLU.
#[allow(clippy::too_many_arguments)]
fn basic_init(
    b: &mut GraphBuilder,
    name: &str,
    x: ValueId,
    c_out: usize,
    kernel: (usize, usize),
    stride: usize,
    pad: (usize, usize),
    std: f64,
) -> Result<ValueId> {
    b.block(name, "BasicConv2d", |b| {
        let conv = Conv2d {
            kernel,
            pad,
            ..Conv2d::new(c_out, 1, stride, 0)
        };
        let x = b.conv("conv", x, conv)?;
        b.set_init("weight", Init::Normal(std))?;
        let bn = BatchNorm {
            eps: 1e-3,
            relu: true,
            ..BatchNorm::default()
        };
        b.op("bn", Op::BatchNorm(bn), &[x])
    })
}

/// A BasicConv2d with torchvision's default init (truncated normal, std 0.1; the truncation
/// at ±2 is 20 standard deviations out, so a plain normal draws the same distribution).
fn basic(
    b: &mut GraphBuilder,
    name: &str,
    x: ValueId,
    c_out: usize,
    kernel: (usize, usize),
    stride: usize,
    pad: (usize, usize),
) -> Result<ValueId> {
    basic_init(b, name, x, c_out, kernel, stride, pad, 0.1)
}

/// A 1×1 BasicConv2d.
fn pointwise(b: &mut GraphBuilder, name: &str, x: ValueId, c_out: usize) -> Result<ValueId> {
    basic(b, name, x, c_out, (1, 1), 1, (0, 0))
}

/// The 3×3/1 pad 1 average pool, padding counted (`F.avg_pool2d` defaults), of the pool
/// branches.
fn avg_pool_3x3(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    b.avg_pool("avg_pool", x, Window::square(3, 1, 1))
}

/// 35×35 block: 1×1 (64) | 1×1 (48) → 5×5 (64) | 1×1 (64) → 3×3 (96) → 3×3 (96) |
/// avg pool → 1×1 (`pool_features`).
fn inception_a(b: &mut GraphBuilder, x: ValueId, pool_features: usize) -> Result<ValueId> {
    let b1 = pointwise(b, "branch1x1", x, 64)?;
    let b5 = pointwise(b, "branch5x5_1", x, 48)?;
    let b5 = basic(b, "branch5x5_2", b5, 64, (5, 5), 1, (2, 2))?;
    let b3 = pointwise(b, "branch3x3dbl_1", x, 64)?;
    let b3 = basic(b, "branch3x3dbl_2", b3, 96, (3, 3), 1, (1, 1))?;
    let b3 = basic(b, "branch3x3dbl_3", b3, 96, (3, 3), 1, (1, 1))?;
    let bp = avg_pool_3x3(b, x)?;
    let bp = pointwise(b, "branch_pool", bp, pool_features)?;
    b.concat("cat", &[b1, b5, b3, bp])
}

/// 35 → 17 reduction: 3×3/2 (384) | 1×1 (64) → 3×3 (96) → 3×3/2 (96) | max pool 3×3/2.
fn inception_b(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let b3 = basic(b, "branch3x3", x, 384, (3, 3), 2, (0, 0))?;
    let bd = pointwise(b, "branch3x3dbl_1", x, 64)?;
    let bd = basic(b, "branch3x3dbl_2", bd, 96, (3, 3), 1, (1, 1))?;
    let bd = basic(b, "branch3x3dbl_3", bd, 96, (3, 3), 2, (0, 0))?;
    let bp = b.max_pool("max_pool", x, Window::square(3, 2, 0))?;
    b.concat("cat", &[b3, bd, bp])
}

/// 17×17 block with factorized 7×7s: 1×1 (192) | 1×1 (c7) → 1×7 (c7) → 7×1 (192) |
/// 1×1 (c7) → 7×1 → 1×7 → 7×1 (c7) → 1×7 (192) | avg pool → 1×1 (192).
fn inception_c(b: &mut GraphBuilder, x: ValueId, c7: usize) -> Result<ValueId> {
    let (k17, p17, k71, p71) = ((1, 7), (0, 3), (7, 1), (3, 0));
    let b1 = pointwise(b, "branch1x1", x, 192)?;
    let b7 = pointwise(b, "branch7x7_1", x, c7)?;
    let b7 = basic(b, "branch7x7_2", b7, c7, k17, 1, p17)?;
    let b7 = basic(b, "branch7x7_3", b7, 192, k71, 1, p71)?;
    let bd = pointwise(b, "branch7x7dbl_1", x, c7)?;
    let bd = basic(b, "branch7x7dbl_2", bd, c7, k71, 1, p71)?;
    let bd = basic(b, "branch7x7dbl_3", bd, c7, k17, 1, p17)?;
    let bd = basic(b, "branch7x7dbl_4", bd, c7, k71, 1, p71)?;
    let bd = basic(b, "branch7x7dbl_5", bd, 192, k17, 1, p17)?;
    let bp = avg_pool_3x3(b, x)?;
    let bp = pointwise(b, "branch_pool", bp, 192)?;
    b.concat("cat", &[b1, b7, bd, bp])
}

/// 17 → 8 reduction: 1×1 (192) → 3×3/2 (320) | 1×1 (192) → 1×7 → 7×1 → 3×3/2 (192) |
/// max pool 3×3/2.
fn inception_d(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let b3 = pointwise(b, "branch3x3_1", x, 192)?;
    let b3 = basic(b, "branch3x3_2", b3, 320, (3, 3), 2, (0, 0))?;
    let b7 = pointwise(b, "branch7x7x3_1", x, 192)?;
    let b7 = basic(b, "branch7x7x3_2", b7, 192, (1, 7), 1, (0, 3))?;
    let b7 = basic(b, "branch7x7x3_3", b7, 192, (7, 1), 1, (3, 0))?;
    let b7 = basic(b, "branch7x7x3_4", b7, 192, (3, 3), 2, (0, 0))?;
    let bp = b.max_pool("max_pool", x, Window::square(3, 2, 0))?;
    b.concat("cat", &[b3, b7, bp])
}

/// 8×8 block with split 1×3 / 3×1 branches: 1×1 (320) | 1×1 (384) → [1×3, 3×1] (384 each) |
/// 1×1 (448) → 3×3 (384) → [1×3, 3×1] (384 each) | avg pool → 1×1 (192).
fn inception_e(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let (k13, p13, k31, p31) = ((1, 3), (0, 1), (3, 1), (1, 0));
    let b1 = pointwise(b, "branch1x1", x, 320)?;
    let b3 = pointwise(b, "branch3x3_1", x, 384)?;
    let b3a = basic(b, "branch3x3_2a", b3, 384, k13, 1, p13)?;
    let b3b = basic(b, "branch3x3_2b", b3, 384, k31, 1, p31)?;
    let b3 = b.concat("branch3x3_cat", &[b3a, b3b])?;
    let bd = pointwise(b, "branch3x3dbl_1", x, 448)?;
    let bd = basic(b, "branch3x3dbl_2", bd, 384, (3, 3), 1, (1, 1))?;
    let bda = basic(b, "branch3x3dbl_3a", bd, 384, k13, 1, p13)?;
    let bdb = basic(b, "branch3x3dbl_3b", bd, 384, k31, 1, p31)?;
    let bd = b.concat("branch3x3dbl_cat", &[bda, bdb])?;
    let bp = avg_pool_3x3(b, x)?;
    let bp = pointwise(b, "branch_pool", bp, 192)?;
    b.concat("cat", &[b1, b3, bd, bp])
}

/// InceptionAux: avg pool 5×5/3 → 1×1 (128) → 5×5 (768, init std 0.01) → global average pool
/// (torchvision's `adaptive_avg_pool2d` to 1×1) → flatten → fc (init std 0.001).
fn aux_head(b: &mut GraphBuilder, x: ValueId, classes: usize) -> Result<ValueId> {
    let x = b.avg_pool("avg_pool", x, Window::square(5, 3, 0))?;
    let x = pointwise(b, "conv0", x, 128)?;
    let x = basic_init(b, "conv1", x, 768, (5, 5), 1, (0, 0), 0.01)?;
    let x = b.global_avg_pool("avgpool", x)?;
    let x = b.flatten("flatten", x)?;
    let logits = b.linear("fc", x, classes, true)?;
    b.set_init("weight", Init::Normal(0.001))?;
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documented limits are what shape inference finds, not just what the check says.
    #[test]
    fn smallest_images_by_shape_inference() {
        for (aux, min) in [(true, MIN_IMAGE), (false, MIN_IMAGE_NO_AUX)] {
            assert!(
                build_unchecked("inception_v3", aux, min, 2).is_ok(),
                "{aux} at {min}"
            );
            for s in [min - 1, min - 2] {
                assert!(
                    matches!(
                        build_unchecked("inception_v3", aux, s, 2),
                        Err(Error::Shape(_))
                    ),
                    "aux {aux}: {s} should not fit"
                );
            }
            let e = build("inception_v3", aux, min - 1, 2)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("at least {min}×{min}")), "{e}");
        }
    }
}
