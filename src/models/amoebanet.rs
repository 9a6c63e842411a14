//! AmoebaNet-D (Real et al. 2019, "Regularized Evolution for Image Classifier Architecture
//! Search") as the GPipe paper benchmarks it, following torchgpipe's benchmark model
//! (`benchmarks/models/amoebanet`), with its state_dict names.
//!
//! `amoebanet_d_<L>x<F>`: L normal cells (a multiple of 3: three groups of L/3) and F filters.
//! `amoebanet_d` is (18, 256), the configuration of torchgpipe's speed benchmark (its
//! `amoebanetd()` defaults, (4, 512), fail its own `L % 3 == 0` check).
//!
//! - stem1: ReLU, conv 3×3/2 pad 1 → F/4, BN. stem2, stem3: reduction cells (F/2, F).
//! - cell1_normal1..L/3 (F), cell2_reduction (2F), cell3_normal* (2F), cell4_reduction (4F),
//!   cell5_normal* (4F), then classify: average pool, flatten, fc.
//! - Every cell takes the two previous cell outputs (s1 the last, s2 the one before; the stem
//!   output is both for stem2): s1 goes through ReLU-conv1×1-BN (`reduce1`); s2 through a
//!   factorized reduce after a reduction cell (it is twice as large), else ReLU-conv1×1-BN when
//!   its channels differ, else as is (`reduce2`). Five nodes follow, each the sum of two
//!   operations on earlier states; the cell's output concatenates states [0, 3, 4, 6] (normal,
//!   4·C channels, TensorFlow's reference genotype, which GPipe's parameter counts match) or
//!   [4, 5, 6] (reduction, 3·C). In a reduction cell, operations on the cell's two inputs have
//!   stride 2.
//! - Operations: `conv_1x1` (ReLU-conv-BN), `conv_3x3` (ReLU-conv1×1 to C/4-BN, ReLU-conv3×3-BN,
//!   ReLU-conv1×1 back to C-BN), `conv_1x7_7x1` (the same bottleneck with 1×7 then 7×1),
//!   `max_pool_2x2`, `avg_pool_3x3` (pad 1, padding not counted), `none` (identity, or a
//!   factorized reduce at stride 2). As in torchgpipe, `max_pool_3x3` is the same 3×3 average
//!   pool as `avg_pool_3x3` (its operations.py builds an `AvgPool2d` for it); parameters do
//!   not depend on it.
//! - Factorized reduce: ReLU, then two 1×1/2 convs to C/2 each, the second on the input shifted
//!   by one pixel (crop the first row and column, zero-pad the last), concatenated, BN.
//! - Classifier: torchgpipe pools 7×7 (the 224² benchmark's final map) before its fc; a global
//!   average pool is the same there and lets any valid image size through.
//!
//! Image sizes: the stem halves the side (rounding up), then the four reduction cells halve it
//! again, each needing an even side (its 2×2/2 max pool and padded 3×3/2 paths must agree), so
//! ⌈S/2⌉ must be a multiple of 16: 32, 224, 256, 1024, ...
//!
//! Initialization follows PyTorch's defaults, as torchgpipe does not override them: conv
//! weights U(±1/√fan_in), linear as [`crate::ops::linear`], BN scale 1 and shift 0.

use crate::graph::{Graph, GraphBuilder, Output, ValueId};
use crate::ops::conv::Conv2d;
use crate::ops::pool::{AvgPoolExcludePad, Window};
use crate::ops::shape::Pad2d;
use crate::ops::{Init, Op};
use crate::tensor::Shape;
use crate::{Error, Result};

/// (normal cells, filters) of `amoebanet_d`.
pub const DEFAULT: (usize, usize) = (18, 256);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Operation {
    /// `none`: the identity, or a factorized reduce at stride 2.
    Identity,
    Conv1x1,
    Conv3x3,
    Conv1x7_7x1,
    MaxPool2x2,
    MaxPool3x3,
    AvgPool3x3,
}
use Operation::*;

/// (input state, operation), in pairs: the pair k makes state k + 2.
const NORMAL_OPERATIONS: [(usize, Operation); 10] = [
    (1, Conv1x1),
    (1, MaxPool3x3),
    (1, Identity),
    (0, Conv1x7_7x1),
    (0, Conv1x1),
    (0, Conv1x7_7x1),
    (2, MaxPool3x3),
    (2, Identity),
    (1, AvgPool3x3),
    (5, Conv1x1),
];
const NORMAL_CONCAT: &[usize] = &[0, 3, 4, 6];

const REDUCTION_OPERATIONS: [(usize, Operation); 10] = [
    (0, MaxPool2x2),
    (0, MaxPool3x3),
    (2, Identity),
    (1, Conv3x3),
    (2, Conv1x7_7x1),
    (2, MaxPool3x3),
    (3, Identity),
    (1, MaxPool2x2),
    (2, AvgPool3x3),
    (3, Conv1x1),
];
const REDUCTION_CONCAT: &[usize] = &[4, 5, 6];

/// `amoebanet_d` → the default, `amoebanet_d_6x64` → (6, 64); `Ok(None)` when not an
/// AmoebaNet-D name.
pub fn parse(name: &str) -> Result<Option<(usize, usize)>> {
    if name == "amoebanet_d" {
        return Ok(Some(DEFAULT));
    }
    let Some(rest) = name.strip_prefix("amoebanet_d_") else {
        return Ok(None);
    };
    let bad = |why: &str| {
        Error::Config(format!(
            "{name}: {why} (amoebanet_d_<L>x<F>: L normal cells, a multiple of 3, and F \
             filters, a multiple of 8; e.g. amoebanet_d_6x64, amoebanet_d_18x256)"
        ))
    };
    let (l, f) = rest
        .split_once('x')
        .ok_or_else(|| bad("expected <L>x<F>"))?;
    let (Ok(l), Ok(f)) = (l.parse::<usize>(), f.parse::<usize>()) else {
        return Err(bad("L and F must be numbers"));
    };
    if l == 0 || !l.is_multiple_of(3) {
        return Err(bad(&format!(
            "{l} normal cells is not a positive multiple of 3"
        )));
    }
    if f == 0 || !f.is_multiple_of(8) {
        return Err(bad(&format!("{f} filters is not a positive multiple of 8")));
    }
    Ok(Some((l, f)))
}

/// Whether the image side survives the stem and the four reduction cells.
pub fn image_fits(image_size: usize) -> bool {
    let s = image_size.div_ceil(2);
    s > 0 && s.is_multiple_of(16)
}

/// AmoebaNet-D named `name` with (normal cell layers, filters) for `image_size`² inputs and `classes` classes.
pub fn build(
    name: &str,
    (layers, filters): (usize, usize),
    image_size: usize,
    classes: usize,
) -> Result<Graph> {
    if !image_fits(image_size) {
        return Err(Error::Config(format!(
            "{name} needs an image side S with ⌈S/2⌉ a multiple of 16 (the stem halves it, then \
             four reduction cells halve it again, each needing an even side), such as 32, 224, \
             256 or 1024; got {image_size}×{image_size}"
        )));
    }
    build_unchecked(name, (layers, filters), image_size, classes)
}

/// The graph without the size check, so that a test can hold the check to shape inference.
fn build_unchecked(
    name: &str,
    (layers, filters): (usize, usize),
    image_size: usize,
    classes: usize,
) -> Result<Graph> {
    let (mut b, x) = GraphBuilder::new(name, "AmoebaNetD", Shape::new([3, image_size, image_size]));
    let mut channels = filters / 4;
    let stem = b.block("stem1", "Stem", |b| {
        let x = b.relu("relu", x)?;
        let x = conv(b, "conv", x, Conv2d::new(channels, 3, 2, 1))?;
        b.batchnorm("bn", x)
    })?;
    // (s1, s2): the last cell output and the one before.
    let mut states = (stem, stem);
    let mut reduction_prev = false;
    let mut cell = |b: &mut GraphBuilder, name: String, reduction: bool, channels: usize| {
        let kind = if reduction {
            "ReductionCell"
        } else {
            "NormalCell"
        };
        let out = b.block(name, kind, |b| {
            make_cell(b, states, channels, reduction, reduction_prev)
        })?;
        states = (out, states.0);
        reduction_prev = reduction;
        Ok::<_, Error>(())
    };
    for stem in ["stem2", "stem3"] {
        channels *= 2;
        cell(&mut b, stem.to_string(), true, channels)?;
    }
    for group in 0..3 {
        if group > 0 {
            channels *= 2;
            cell(
                &mut b,
                format!("cell{}_reduction", 2 * group),
                true,
                channels,
            )?;
        }
        for i in 0..layers / 3 {
            cell(
                &mut b,
                format!("cell{}_normal{}", 2 * group + 1, i + 1),
                false,
                channels,
            )?;
        }
    }
    let x = states.0;
    let logits = b.block("classify", "Classify", |b| {
        let x = b.global_avg_pool("pool", x)?;
        let x = b.flatten("flat", x)?;
        b.linear("fc", x, classes, true)
    })?;
    b.finish(vec![Output::new(logits)])
}

/// A conv without bias, with PyTorch's default init U(±1/√fan_in).
fn conv(b: &mut GraphBuilder, name: &str, x: ValueId, c: Conv2d) -> Result<ValueId> {
    let fan_in = b.shape(x).dim(0) / c.groups * c.kernel.0 * c.kernel.1;
    let y = b.conv(name, x, c)?;
    b.set_init("weight", Init::Uniform(1.0 / (fan_in as f64).sqrt()))?;
    Ok(y)
}

/// ReLU, conv, BN as nodes `first`, `first + 1`, `first + 2` of an `nn.Sequential`.
fn relu_conv_bn(b: &mut GraphBuilder, first: usize, x: ValueId, c: Conv2d) -> Result<ValueId> {
    let x = b.relu(&first.to_string(), x)?;
    let x = conv(b, &(first + 1).to_string(), x, c)?;
    b.batchnorm(&(first + 2).to_string(), x)
}

/// A (kh, kw) conv with per-axis stride and padding.
fn conv_k(
    c_out: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
) -> Conv2d {
    Conv2d {
        kernel,
        stride,
        pad,
        ..Conv2d::new(c_out, 1, 1, 0)
    }
}

/// ReLU, then two 1×1/2 convs to `c_out / 2`, the second on the input shifted by one pixel,
/// concatenated, BN: halves H and W (rounding up).
fn factorized_reduce(b: &mut GraphBuilder, x: ValueId, c_out: usize) -> Result<ValueId> {
    let x = b.relu("relu", x)?;
    let a = conv(b, "conv1", x, Conv2d::new(c_out / 2, 1, 2, 0))?;
    let shift = Pad2d {
        top: -1,
        bottom: 1,
        left: -1,
        right: 1,
    };
    let shifted = b.op("pad", Op::Pad2d(shift), &[x])?;
    let c = conv(b, "conv2", shifted, Conv2d::new(c_out / 2, 1, 2, 0))?;
    let y = b.concat("cat", &[a, c])?;
    b.batchnorm("bn", y)
}

/// One cell on (s1, s2); returns its output.
fn make_cell(
    b: &mut GraphBuilder,
    (s1, s2): (ValueId, ValueId),
    channels: usize,
    reduction: bool,
    reduction_prev: bool,
) -> Result<ValueId> {
    let r1 = b.block("reduce1", "Sequential", |b| {
        relu_conv_bn(b, 0, s1, Conv2d::new(channels, 1, 1, 0))
    })?;
    let r2 = if reduction_prev {
        b.block("reduce2", "FactorizedReduce", |b| {
            factorized_reduce(b, s2, channels)
        })?
    } else if b.shape(s2).dim(0) != channels {
        b.block("reduce2", "Sequential", |b| {
            relu_conv_bn(b, 0, s2, Conv2d::new(channels, 1, 1, 0))
        })?
    } else {
        s2
    };
    let (ops, concat) = if reduction {
        (&REDUCTION_OPERATIONS, REDUCTION_CONCAT)
    } else {
        (&NORMAL_OPERATIONS, NORMAL_CONCAT)
    };
    let mut states = vec![r1, r2];
    for (k, pair) in ops.chunks(2).enumerate() {
        let mut h = [0; 2];
        for (j, &(input, op)) in pair.iter().enumerate() {
            let stride = if reduction && input < 2 { 2 } else { 1 };
            h[j] = operation(b, 2 * k + j, op, states[input], channels, stride)?;
        }
        states.push(b.add(&format!("state{}", k + 2), h[0], h[1])?);
    }
    let outs: Vec<ValueId> = concat.iter().map(|&i| states[i]).collect();
    b.concat("cat", &outs)
}

/// Operation `index` of a cell (`operations.<index>.module`, as torchgpipe names it).
fn operation(
    b: &mut GraphBuilder,
    index: usize,
    op: Operation,
    x: ValueId,
    c: usize,
    stride: usize,
) -> Result<ValueId> {
    if op == Identity && stride == 1 {
        return Ok(x);
    }
    let kind = match op {
        Identity => "none",
        Conv1x1 => "conv_1x1",
        Conv3x3 => "conv_3x3",
        Conv1x7_7x1 => "conv_1x7_7x1",
        MaxPool2x2 => "max_pool_2x2",
        MaxPool3x3 => "max_pool_3x3",
        AvgPool3x3 => "avg_pool_3x3",
    };
    let s = stride;
    b.block(format!("operations.{index}"), kind, |b| match op {
        Identity => b.block("module", "FactorizedReduce", |b| factorized_reduce(b, x, c)),
        MaxPool2x2 => b.max_pool("module", x, Window::square(2, s, 0)),
        MaxPool3x3 | AvgPool3x3 => b.op(
            "module",
            Op::AvgPoolExcludePad(AvgPoolExcludePad(Window::square(3, s, 1))),
            &[x],
        ),
        Conv1x1 => b.block("module", "Sequential", |b| {
            relu_conv_bn(b, 0, x, Conv2d::new(c, 1, s, 0))
        }),
        Conv3x3 => b.block("module", "Sequential", |b| {
            let x = relu_conv_bn(b, 0, x, Conv2d::new(c / 4, 1, 1, 0))?;
            let x = relu_conv_bn(b, 3, x, Conv2d::new(c / 4, 3, s, 1))?;
            relu_conv_bn(b, 6, x, Conv2d::new(c, 1, 1, 0))
        }),
        Conv1x7_7x1 => b.block("module", "Sequential", |b| {
            let x = relu_conv_bn(b, 0, x, Conv2d::new(c / 4, 1, 1, 0))?;
            let x = relu_conv_bn(b, 3, x, conv_k(c / 4, (1, 7), (1, s), (0, 3)))?;
            let x = relu_conv_bn(b, 6, x, conv_k(c / 4, (7, 1), (s, 1), (3, 0)))?;
            relu_conv_bn(b, 9, x, Conv2d::new(c, 1, 1, 0))
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_sizes() {
        assert_eq!(parse("amoebanet_d").unwrap(), Some(DEFAULT));
        assert_eq!(parse("amoebanet_d_6x64").unwrap(), Some((6, 64)));
        assert_eq!(parse("resnet20v2").unwrap(), None);
        for bad in [
            "amoebanet_d_6",
            "amoebanet_d_4x64",
            "amoebanet_d_6x60",
            "amoebanet_d_ax8",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let fits: Vec<usize> = (1..=100).filter(|&s| image_fits(s)).collect();
        assert_eq!(fits, [31, 32, 63, 64, 95, 96]);
        // What the check lets through builds; what it refuses fails shape inference.
        for s in 1..=100 {
            let r = build_unchecked("a", (3, 16), s, 2);
            assert_eq!(r.is_ok(), image_fits(s), "{s}: {:?}", r.err());
        }
        let e = build("amoebanet_d", DEFAULT, 48, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("multiple of 16") && e.contains("48×48"), "{e}");
    }
}
