//! Building a graph from nested blocks.

use super::{Block, BlockId, Graph, Node, Output, Param, Value, ValueId};
use crate::ops::activation::Nonlinearity;
use crate::ops::conv::{Conv2d, ConvTranspose2d};
use crate::ops::{
    activation, dropout, elementwise, groupnorm, linear, norm, pool, resize, shape, Op,
};
use crate::ops::{Custom, Init};
use crate::tensor::Shape;
use crate::{Error, Result};

/// Appends nodes to a graph inside the block currently open.
pub struct GraphBuilder {
    g: Graph,
    current: BlockId,
}

impl GraphBuilder {
    /// A graph named `name` whose input has the per-sample shape `input`.
    pub fn new(name: &str, kind: &str, input: Shape) -> (Self, ValueId) {
        let g = Graph {
            name: name.to_string(),
            input: 0,
            values: vec![Value {
                shape: input,
                producer: None,
                consumers: vec![],
            }],
            nodes: vec![],
            params: vec![],
            blocks: vec![Block {
                name: name.to_string(),
                kind: kind.to_string(),
                parent: None,
                children: vec![],
                nodes: vec![],
            }],
            outputs: vec![],
        };
        (GraphBuilder { g, current: 0 }, 0)
    }

    /// The per-sample shape of value `v`.
    pub fn shape(&self, v: ValueId) -> &Shape {
        &self.g.values[v].shape
    }

    /// Runs `f` inside a child block named `name`.
    pub fn block<R>(
        &mut self,
        name: impl Into<String>,
        kind: &str,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let id = self.g.blocks.len();
        self.g.blocks.push(Block {
            name: name.into(),
            kind: kind.to_string(),
            parent: Some(self.current),
            children: vec![],
            nodes: vec![],
        });
        self.g.blocks[self.current].children.push(id);
        let parent = std::mem::replace(&mut self.current, id);
        let r = f(self);
        self.current = parent;
        r
    }

    /// Appends `op` applied to `inputs`; its parameters are named after the block path and `name`.
    pub fn op(&mut self, name: &str, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let path = self.g.block_path(self.current);
        let full = if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        let ins: Vec<&Shape> = inputs.iter().map(|&v| &self.g.values[v].shape).collect();
        let out_shape = op.get().infer(&ins).map_err(|e| {
            Error::Shape(format!("{}: {full} ({}): {e}", self.g.name, op.describe()))
        })?;
        let mut specs = op.get().params(&ins);
        specs.sort_by_key(|s| !s.trainable);
        let node_id = self.g.nodes.len();
        let first = self.g.params.len();
        for spec in specs {
            self.g.params.push(Param {
                name: format!("{full}.{}", spec.suffix),
                spec,
                node: node_id,
            });
        }
        let out = self.g.values.len();
        self.g.values.push(Value {
            shape: out_shape,
            producer: Some(node_id),
            consumers: vec![],
        });
        for &v in inputs {
            self.g.values[v].consumers.push(node_id);
        }
        self.g.nodes.push(Node {
            name: full,
            op,
            inputs: inputs.to_vec(),
            output: out,
            params: first..self.g.params.len(),
            block: self.current,
        });
        self.g.blocks[self.current].nodes.push(node_id);
        Ok(out)
    }

    /// A 2-d convolution of `x`.
    pub fn conv(&mut self, name: &str, x: ValueId, c: Conv2d) -> Result<ValueId> {
        self.op(name, Op::Conv2d(c), &[x])
    }
    /// A 2-d transposed convolution of `x` (an up-convolution).
    pub fn conv_transpose(
        &mut self,
        name: &str,
        x: ValueId,
        c: ConvTranspose2d,
    ) -> Result<ValueId> {
        self.op(name, Op::ConvTranspose2d(c), &[x])
    }
    /// `x` upsampled `scale` times in each direction by repeating pixels (PyTorch's
    /// `Upsample(scale_factor=scale, mode="nearest")`): an adaptive average pool to the
    /// larger size, whose windows are then single pixels.
    pub fn upsample_nearest(&mut self, name: &str, x: ValueId, scale: usize) -> Result<ValueId> {
        let (h, w) = match self.shape(x).dims() {
            [_, h, w] => (*h, *w),
            _ => {
                return Err(Error::Shape(format!(
                    "{name}: upsampling needs a C×H×W input"
                )))
            }
        };
        if scale == 0 {
            return Err(Error::Shape(format!("{name}: a scale of 0")));
        }
        self.adaptive_avg_pool(name, x, (h * scale, w * scale))
    }
    /// `x` upsampled `scale` times in each direction by bilinear interpolation (PyTorch's
    /// `Upsample(scale_factor=scale, mode="bilinear", align_corners=...)`).
    pub fn upsample_bilinear(
        &mut self,
        name: &str,
        x: ValueId,
        scale: usize,
        align_corners: bool,
    ) -> Result<ValueId> {
        let (h, w) = match self.shape(x).dims() {
            [_, h, w] => (*h, *w),
            _ => {
                return Err(Error::Shape(format!(
                    "{name}: upsampling needs a C×H×W input"
                )))
            }
        };
        if scale == 0 {
            return Err(Error::Shape(format!("{name}: a scale of 0")));
        }
        self.resize_bilinear(name, x, (h * scale, w * scale), align_corners)
    }
    /// `x` resized to `out.0 × out.1` by bilinear interpolation (PyTorch's
    /// `F.interpolate(x, size=out, mode="bilinear", align_corners=...)`), enlarging or
    /// shrinking.
    pub fn resize_bilinear(
        &mut self,
        name: &str,
        x: ValueId,
        out: (usize, usize),
        align_corners: bool,
    ) -> Result<ValueId> {
        let op = resize::ResizeBilinear { out, align_corners };
        self.op(name, Op::ResizeBilinear(op), &[x])
    }
    /// Batch normalization of `x` (PyTorch's defaults: eps 1e-5, momentum 0.1).
    pub fn batchnorm(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.op(name, Op::BatchNorm(norm::BatchNorm::default()), &[x])
    }
    /// Batch normalization and the ReLU after it, as one op (see [`norm::BatchNorm`]).
    pub fn batchnorm_relu(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        let bn = norm::BatchNorm {
            relu: true,
            ..Default::default()
        };
        self.op(name, Op::BatchNorm(bn), &[x])
    }
    /// max(x, 0).
    pub fn relu(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.op(name, Op::Relu(activation::Relu), &[x])
    }
    /// x·σ(x) (PyTorch's `nn.SiLU`).
    pub fn silu(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.smooth(name, x, Nonlinearity::Silu)
    }
    /// GELU (PyTorch's `nn.GELU(approximate=...)`): exact, x·Φ(x), or with `tanh` its tanh
    /// approximation.
    pub fn gelu(&mut self, name: &str, x: ValueId, tanh: bool) -> Result<ValueId> {
        let f = match tanh {
            true => Nonlinearity::GeluTanh,
            false => Nonlinearity::Gelu,
        };
        self.smooth(name, x, f)
    }
    /// 1/(1 + e^(−x)) (PyTorch's `nn.Sigmoid`).
    pub fn sigmoid(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.smooth(name, x, Nonlinearity::Sigmoid)
    }
    /// The smooth activation `f` of `x`.
    pub fn smooth(&mut self, name: &str, x: ValueId, f: Nonlinearity) -> Result<ValueId> {
        self.op(name, Op::Smooth(activation::Smooth(f)), &[x])
    }
    /// Group normalization of `x` in `groups` groups of channels (PyTorch's
    /// `nn.GroupNorm(groups, C)`, eps 1e-5); an error unless the channels divide into them.
    pub fn group_norm(&mut self, name: &str, x: ValueId, groups: usize) -> Result<ValueId> {
        self.op(name, Op::GroupNorm(groupnorm::GroupNorm::new(groups)), &[x])
    }
    /// Layer normalization of each sample's C×H×W with a scale and shift per channel:
    /// PyTorch's `nn.GroupNorm(1, C)` (see [`groupnorm::GroupNorm`]).
    pub fn layer_norm(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.group_norm(name, x, 1)
    }
    /// a + b (a residual connection).
    pub fn add(&mut self, name: &str, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.op(name, Op::Add(elementwise::Add::default()), &[a, b])
    }
    /// max(a + b, 0): a residual connection and the ReLU after it, as one op.
    pub fn add_relu(&mut self, name: &str, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.op(name, Op::Add(elementwise::Add { relu: true }), &[a, b])
    }
    /// Max pooling of `x` over window `w`.
    pub fn max_pool(&mut self, name: &str, x: ValueId, w: pool::Window) -> Result<ValueId> {
        self.op(name, Op::MaxPool(pool::MaxPool(w)), &[x])
    }
    /// Average pooling of `x` over window `w`, padding counted.
    pub fn avg_pool(&mut self, name: &str, x: ValueId, w: pool::Window) -> Result<ValueId> {
        self.op(name, Op::AvgPool(pool::AvgPool(w)), &[x])
    }
    /// The mean of each channel's plane: `[C, H, W]` to `[C, 1, 1]` (which [`GraphBuilder::linear`]
    /// reads as a vector).
    pub fn global_avg_pool(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.op(name, Op::GlobalAvgPool(pool::GlobalAvgPool), &[x])
    }
    /// Average pooling to an `out.0 × out.1` map (PyTorch's `AdaptiveAvgPool2d`).
    pub fn adaptive_avg_pool(
        &mut self,
        name: &str,
        x: ValueId,
        out: (usize, usize),
    ) -> Result<ValueId> {
        self.op(
            name,
            Op::AdaptiveAvgPool(pool::AdaptiveAvgPool { out }),
            &[x],
        )
    }
    /// A sample's tensor as one vector.
    pub fn flatten(&mut self, name: &str, x: ValueId) -> Result<ValueId> {
        self.op(name, Op::Flatten(shape::Flatten), &[x])
    }
    /// The values `xs` concatenated along channels.
    pub fn concat(&mut self, name: &str, xs: &[ValueId]) -> Result<ValueId> {
        self.op(name, Op::Concat(shape::Concat), xs)
    }
    /// Dropout with drop probability `p` (identity in evaluation).
    pub fn dropout(&mut self, name: &str, x: ValueId, p: f64) -> Result<ValueId> {
        self.op(name, Op::Dropout(dropout::Dropout { p }), &[x])
    }
    /// An op defined outside the crate (see [`crate::ops::Operator`]) applied to `inputs`;
    /// metered, planned and checkpointed (its parameters named `name.suffix`) as a built-in
    /// is.
    pub fn custom(&mut self, name: &str, op: Custom, inputs: &[ValueId]) -> Result<ValueId> {
        self.op(name, Op::Custom(op), inputs)
    }
    /// A fully connected layer of `x` seen as one vector (a `[C, 1, 1]` pool's output, or
    /// already flat).
    pub fn linear(&mut self, name: &str, x: ValueId, d_out: usize, bias: bool) -> Result<ValueId> {
        let d_in = self.shape(x).numel();
        self.op(name, Op::Linear(linear::Linear { d_in, d_out, bias }), &[x])
    }

    /// Overrides how parameter `suffix` (`weight`, `bias`) of the node appended last starts,
    /// for a model whose initialization differs from the op's default.
    pub fn set_init(&mut self, suffix: &str, init: Init) -> Result<()> {
        let node =
            self.g.nodes.last().ok_or_else(|| {
                Error::Internal(format!("{}: set_init before any node", self.g.name))
            })?;
        let p = self.g.params[node.params.clone()]
            .iter_mut()
            .find(|p| p.spec.suffix == suffix)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "{}: {} has no parameter '{suffix}'",
                    self.g.name, node.name
                ))
            })?;
        p.spec.init = init;
        Ok(())
    }

    /// The finished graph with its loss outputs; checks that parameter names are unique.
    pub fn finish(mut self, outputs: Vec<Output>) -> Result<Graph> {
        let mut names = std::collections::HashSet::new();
        for p in &self.g.params {
            if !names.insert(p.name.as_str()) {
                return Err(Error::Internal(format!(
                    "{}: parameter name {} used twice",
                    self.g.name, p.name
                )));
            }
        }
        self.g.outputs = outputs;
        Ok(self.g)
    }
}
