//! One file per op family: shape inference, parameters, forward, backward and cost. Ops decide
//! shapes and allocate through the device; the backend computes. Shapes in the graph are per
//! sample (no batch dimension); tensors carry the batch as their first dimension. An op
//! defined outside the crate implements the same [`Operator`] trait, goes into a graph as
//! [`Op::Custom`], and is checked as the built-in ones are, with [`check_gradients`].

pub mod activation;
pub mod conv;
pub mod dropout;
pub mod elementwise;
mod gradcheck;
pub mod groupnorm;
pub mod linear;
pub mod loss;
pub mod norm;
pub mod pool;
pub mod resize;
pub mod shape;
pub mod tiles;

use std::sync::Arc;

use crate::memory::Category;
use crate::tensor::Device;
use crate::tensor::{DType, Shape, Storage, Tensor};
use crate::Result;

pub use gradcheck::{
    check_gradients, GradientCheck, GradientError, F32_TOLERANCE, GRADIENT_TOLERANCE,
};

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal(0, std²).
    Normal(f64),
    /// Uniform(-bound, bound).
    Uniform(f64),
}

/// A parameter an op owns: `suffix` completes its dotted name (`weight`, `running_mean`).
/// Buffers (running statistics) are state, not trained.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// The last part of its dotted name (`weight`, `running_mean`).
    pub suffix: &'static str,
    /// Its shape.
    pub shape: Shape,
    /// How it starts.
    pub init: Init,
    /// Whether the optimizer updates it (false for buffers).
    pub trainable: bool,
}

/// What forward needs to keep for backward.
#[derive(Debug, Default)]
pub struct Saved(pub Vec<Tensor>);

/// What an op saves for backward, so memory can be predicted from the graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SavesFor {
    /// Its inputs (shared with whoever else saves them).
    pub inputs: bool,
    /// Its output.
    pub output: bool,
    /// Elements of its own per sample (a dropout mask).
    pub per_sample: usize,
    /// Elements of its own per batch (batch statistics).
    pub per_batch: usize,
    /// Statistics of its own per sample, in the compute type (group norm's mean and variance
    /// of each sample's groups).
    pub stats_per_sample: usize,
}

/// What backward starts from.
pub struct Backward<'a> {
    /// What forward kept.
    pub saved: Saved,
    /// Gradient of the output.
    pub dy: Tensor,
    /// Shapes of the inputs, batch included.
    pub inputs: &'a [Shape],
    /// Which inputs want a gradient.
    pub need: &'a [bool],
    /// Whether to add the parameters' gradients into `grads`. Only an op that
    /// [splits its backward](Operator::splits_weights) is ever told `false`; its weight pass
    /// then comes as a second call with `need` all false.
    pub weights: bool,
}

/// Everything forward and backward need besides tensors.
pub struct Ctx<'a> {
    /// The device computing.
    pub device: &'a Device,
    /// Training mode (batch statistics, dropout) or evaluation.
    pub training: bool,
    /// Seed for this op's randomness in this pass (dropout).
    pub seed: u64,
    /// Where the op runs on tiles of the samples (a [`tiles::TileRule::Tiled`] or
    /// [`tiles::TileRule::Reduces`] op with every input split): the group and the whole maps.
    pub tiles: Option<tiles::OnTiles<'a>>,
}

impl Ctx<'_> {
    /// A fresh activation (or activation gradient) tensor, zero-filled: for kernels that
    /// leave elements to the zeros (padding) or add into their output.
    pub fn activation(&self, shape: Shape, like: &Tensor) -> Result<Tensor> {
        self.device
            .zeros(shape, like.dtype(), Category::Activations)
    }
    /// A fresh activation (or activation gradient) tensor for a kernel that writes every
    /// element: not filled (see [`Device::empty`]), which saves a pass over its memory.
    pub fn output(&self, shape: Shape, like: &Tensor) -> Result<Tensor> {
        self.device
            .empty(shape, like.dtype(), Category::Activations)
    }
    /// Statistics saved for backward beside `like` (batch norm's mean and variance): kept in
    /// its compute type, f32 under mixed precision.
    pub fn statistics(&self, shape: Shape, like: &Tensor) -> Result<Tensor> {
        self.device
            .zeros(shape, like.dtype().compute(), Category::Activations)
    }
    /// Scratch space of `dtype` that lives for one kernel call, not filled: every kernel that
    /// takes workspace writes it before reading it.
    pub fn workspace(&self, elements: usize, dtype: DType) -> Result<Tensor> {
        self.device
            .empty(Shape::new([elements]), dtype, Category::Workspace)
    }
    /// A fresh activation of `shape` and `like`'s dtype whose elements `fill` computes on the
    /// host, in f64 (an op without kernels of its own: read inputs with
    /// [`Tensor::to_f64_vec`] inside `fill`). On a metering device, which holds no elements,
    /// the tensor is only allocated and `fill` does not run, so planning costs no host work.
    pub fn host_output(
        &self,
        shape: Shape,
        like: &Tensor,
        fill: impl FnOnce(&mut [f64]) -> Result<()>,
    ) -> Result<Tensor> {
        if matches!(like.storage(), Storage::Virtual(..)) {
            return self.output(shape, like);
        }
        let mut values = vec![0.0; shape.numel()];
        fill(&mut values)?;
        self.device
            .upload(shape, &values, like.dtype(), Category::Activations)
    }
    /// Adds host `values` into `t` (a parameter gradient: backward adds, so micro-batches
    /// and shared weights sum up).
    pub fn accumulate(&self, t: &mut Tensor, values: &[f64]) -> Result<()> {
        let add = self
            .device
            .upload(t.shape().clone(), values, t.dtype(), Category::Workspace)?;
        self.device
            .backend()
            .add_assign(t.storage_mut()?, add.storage())
    }
}

/// The interface of every op, built in or defined outside the crate (wrapped in [`Custom`]).
/// Tensors carry the batch as their first dimension; shapes given to `infer`, `params`,
/// `flops` and `saves` are per sample. The planner meters an op by running it on a device
/// that allocates and computes nothing, so what forward allocates and keeps (through
/// [`Ctx`]) is what the plan counts, and [`Operator::saves`] must say the same.
pub trait Operator: Send + Sync {
    /// Output shape (per sample) from input shapes, or why they are not accepted.
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String>;
    /// The parameters the op owns for inputs of these shapes (none by default).
    fn params(&self, _inputs: &[&Shape]) -> Vec<ParamSpec> {
        Vec::new()
    }
    /// Computes the output of inputs `xs` (batch included) and what backward needs.
    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)>;
    /// Gradients of the inputs asked for in `b.need`; parameter gradients are added to `grads`.
    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>>;
    /// Forward multiply-adds ×2 per sample.
    fn flops(&self, inputs: &[&Shape], output: &Shape) -> u64;
    /// What forward keeps for backward, for memory predictions.
    fn saves(&self, inputs: &[&Shape]) -> SavesFor;
    /// How it runs on tiles of split samples (see [`tiles`]); by default on whole inputs.
    fn on_tiles(&self) -> tiles::TileRule {
        tiles::TileRule::Whole
    }
    /// Whether backward computes its input gradients and its parameter gradients as separable
    /// passes (see [`Backward::weights`]), so a zero-bubble schedule can run the second later.
    /// An op that says no computes both in its input pass.
    fn splits_weights(&self) -> bool {
        false
    }
}

/// The ops a graph is made of.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// 2-d convolution.
    Conv2d(conv::Conv2d),
    /// 2-d transposed convolution (U-Net's up-convolution).
    ConvTranspose2d(conv::ConvTranspose2d),
    /// Batch normalization (optionally fused with the following ReLU).
    BatchNorm(norm::BatchNorm),
    /// max(x, 0).
    Relu(activation::Relu),
    /// SiLU, GELU (exact or tanh) or sigmoid.
    Smooth(activation::Smooth),
    /// Group normalization (one group: layer normalization over each sample's C×H×W).
    GroupNorm(groupnorm::GroupNorm),
    /// Elementwise sum of two values (residual connections), optionally fused with the
    /// following ReLU.
    Add(elementwise::Add),
    /// Max pooling.
    MaxPool(pool::MaxPool),
    /// Average pooling, padding counted.
    AvgPool(pool::AvgPool),
    /// Mean over each channel's plane.
    GlobalAvgPool(pool::GlobalAvgPool),
    /// PyTorch's `AdaptiveAvgPool2d`.
    AdaptiveAvgPool(pool::AdaptiveAvgPool),
    /// Fully connected layer.
    Linear(linear::Linear),
    /// A sample's tensor as one vector.
    Flatten(shape::Flatten),
    /// Channel-wise concatenation.
    Concat(shape::Concat),
    /// Dropout (inverted: kept values scaled by 1/(1-p)).
    Dropout(dropout::Dropout),
    /// Average pooling, padding not counted.
    AvgPoolExcludePad(pool::AvgPoolExcludePad),
    /// Zero padding of the spatial dimensions.
    Pad2d(shape::Pad2d),
    /// Bilinear resizing to a given size (PyTorch's `F.interpolate(mode="bilinear")`).
    ResizeBilinear(resize::ResizeBilinear),
    /// An op defined outside the crate.
    Custom(Custom),
}

/// An op defined outside the crate: any [`Operator`], with a label for descriptions. Clones
/// share the implementation; two are equal when they share it.
#[derive(Clone)]
pub struct Custom {
    label: String,
    op: Arc<dyn Operator>,
}

impl Custom {
    /// `op` labelled `label` (`scaled-swish`) in descriptions of the graph.
    pub fn new(label: impl Into<String>, op: impl Operator + 'static) -> Custom {
        Custom {
            label: label.into(),
            op: Arc::new(op),
        }
    }
    /// Its label.
    pub fn label(&self) -> &str {
        &self.label
    }
}

impl std::fmt::Debug for Custom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Custom({})", self.label)
    }
}

impl PartialEq for Custom {
    fn eq(&self, other: &Custom) -> bool {
        self.label == other.label && Arc::ptr_eq(&self.op, &other.op)
    }
}

impl Op {
    /// The op's implementation of [`Operator`].
    pub fn get(&self) -> &dyn Operator {
        match self {
            Op::Conv2d(o) => o,
            Op::ConvTranspose2d(o) => o,
            Op::BatchNorm(o) => o,
            Op::Relu(o) => o,
            Op::Smooth(o) => o,
            Op::GroupNorm(o) => o,
            Op::Add(o) => o,
            Op::MaxPool(o) => o,
            Op::AvgPool(o) => o,
            Op::GlobalAvgPool(o) => o,
            Op::AdaptiveAvgPool(o) => o,
            Op::Linear(o) => o,
            Op::Flatten(o) => o,
            Op::Concat(o) => o,
            Op::Dropout(o) => o,
            Op::AvgPoolExcludePad(o) => o,
            Op::Pad2d(o) => o,
            Op::ResizeBilinear(o) => o,
            Op::Custom(c) => &*c.op,
        }
    }

    /// A short description: `conv 3x3/2 64->128`.
    pub fn describe(&self) -> String {
        match self {
            Op::Conv2d(c) => c.to_string(),
            Op::ConvTranspose2d(c) => c.to_string(),
            Op::BatchNorm(b) if b.relu => "batchnorm+relu".into(),
            Op::BatchNorm(_) => "batchnorm".into(),
            Op::Relu(_) => "relu".into(),
            Op::Smooth(s) => s.0.name().replace('_', "-"),
            Op::GroupNorm(g) if g.groups == 1 => "layernorm".into(),
            Op::GroupNorm(g) => format!("groupnorm {}", g.groups),
            Op::Add(a) if a.relu => "add+relu".into(),
            Op::Add(_) => "add".into(),
            Op::MaxPool(p) => format!("maxpool {}", p.0),
            Op::AvgPool(p) => format!("avgpool {}", p.0),
            Op::GlobalAvgPool(_) => "global-avgpool".into(),
            Op::AdaptiveAvgPool(p) => format!("adaptive-avgpool {}x{}", p.out.0, p.out.1),
            Op::Linear(l) => format!("linear {}->{}", l.d_in, l.d_out),
            Op::Flatten(_) => "flatten".into(),
            Op::Concat(_) => "concat".into(),
            Op::Dropout(d) => format!("dropout p={}", d.p),
            Op::AvgPoolExcludePad(p) => format!("avgpool {} excluding padding", p.0),
            Op::Pad2d(p) => format!("pad {},{},{},{}", p.top, p.bottom, p.left, p.right),
            Op::ResizeBilinear(r) => format!(
                "bilinear {}x{}{}",
                r.out.0,
                r.out.1,
                if r.align_corners {
                    " align-corners"
                } else {
                    ""
                }
            ),
            Op::Custom(c) => c.label.clone(),
        }
    }
}

impl Op {
    /// Every tile's input rectangle in the map, for an op that reads beyond its own tile on
    /// tiles (a convolution, a pool, a transposed convolution, an adaptive pool, a bilinear
    /// resize): what its output tile reads of an `input` map, padding left out, for an
    /// `output` map split by `grid`. `None` for other ops.
    pub fn tile_needs(
        &self,
        grid: tiles::Grid,
        input: (usize, usize),
        output: (usize, usize),
    ) -> Option<Vec<tiles::Rect>> {
        let window = |stride, pad, span| {
            Some(tiles::window_needs(
                grid, input, output, stride, pad, span, true,
            ))
        };
        match self {
            Op::Conv2d(c) => window(c.stride, c.pad, c.span()),
            Op::MaxPool(pool::MaxPool(w))
            | Op::AvgPool(pool::AvgPool(w))
            | Op::AvgPoolExcludePad(pool::AvgPoolExcludePad(w)) => {
                window(w.stride, w.pad, w.kernel)
            }
            Op::ConvTranspose2d(c) => Some(c.tile_needs(grid, input, output)),
            Op::AdaptiveAvgPool(p) => Some(p.tile_needs(grid, input)),
            Op::Pad2d(p) => Some(p.tile_needs(grid, output)),
            Op::ResizeBilinear(r) => Some(r.tile_needs(grid, input)),
            _ => None,
        }
    }
}

/// Prepends the batch dimension to a per-sample shape.
pub fn batched(n: usize, per_sample: &Shape) -> Shape {
    let mut d = vec![n];
    d.extend_from_slice(per_sample.dims());
    Shape(d)
}

/// (C, H, W) of a per-sample image shape, or an error naming what was expected.
pub(crate) fn chw(s: &Shape) -> std::result::Result<(usize, usize, usize), String> {
    match s.dims() {
        [c, h, w] => Ok((*c, *h, *w)),
        _ => Err(format!("expected a C×H×W image, got {s}")),
    }
}

/// The shape of a C×H×W input resized to `out` (an adaptive pool, a resampling), or why not.
pub(crate) fn resized(
    what: &str,
    input: &Shape,
    out: (usize, usize),
) -> std::result::Result<Shape, String> {
    let (c, h, w) = chw(input)?;
    if out.0 == 0 || out.1 == 0 {
        return Err(format!("{what} output size must be positive"));
    }
    if h == 0 || w == 0 {
        return Err(format!("{what} input {h}×{w} is empty"));
    }
    Ok(Shape::new([c, out.0, out.1]))
}

/// Output size of a sliding window, or an error when the window does not fit.
pub(crate) fn window_out(
    input: usize,
    k: usize,
    stride: usize,
    pad: usize,
    dilation: usize,
) -> std::result::Result<usize, String> {
    let span = dilation * (k - 1) + 1;
    if input + 2 * pad < span {
        return Err(format!(
            "input of size {input} (padding {pad}) is smaller than the window {span}"
        ));
    }
    Ok((input + 2 * pad - span) / stride + 1)
}
