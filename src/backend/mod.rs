//! Backends compute; ops decide shapes and allocate. A [`Device`](crate::tensor::Device) is a backend plus the
//! allocator its bytes are leased from.

pub mod cpu;
pub mod cuda;
pub mod host;
pub mod meter;
mod storage;

use std::sync::Arc;

use crate::backend::host::HostPool;
use crate::core::DType;
use crate::Result;
pub use storage::Storage;

/// Whether [`Backend::empty`] fills its storage with NaN: in debug builds and in every
/// `cargo test` (the `poison` feature), so an element a kernel fails to write shows up as NaN
/// in the results instead of silently keeping an earlier tensor's value.
pub const POISON: bool = cfg!(any(debug_assertions, feature = "poison"));

/// Geometry of a 2-d convolution over an NCHW batch (weights: c_out × c_in/groups × kh × kw).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    /// Images in the batch.
    pub n: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub c_out: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// (vertical, horizontal) stride.
    pub stride: (usize, usize),
    /// (vertical, horizontal) zero padding on each side.
    pub pad: (usize, usize),
    /// (vertical, horizontal) spacing of the kernel's taps.
    pub dilation: (usize, usize),
    /// Channel groups: each output channel sees c_in / groups inputs.
    pub groups: usize,
    /// Output height.
    pub h_out: usize,
    /// Output width.
    pub w_out: usize,
}

impl ConvGeom {
    /// Rows of the im2col matrix of one group: (c_in / groups) · kh · kw.
    pub fn col_rows(&self) -> usize {
        self.c_in / self.groups * self.kh * self.kw
    }
    /// A 1×1, stride-1, unpadded convolution reads its input as the im2col matrix directly.
    pub fn is_pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == (1, 1) && self.pad == (0, 0)
    }
}

/// Geometry of a 2-d pooling window over an NCHW batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeom {
    /// Images in the batch.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Window height.
    pub kh: usize,
    /// Window width.
    pub kw: usize,
    /// (vertical, horizontal) stride.
    pub stride: (usize, usize),
    /// (vertical, horizontal) padding on each side.
    pub pad: (usize, usize),
    /// Output height.
    pub h_out: usize,
    /// Output width.
    pub w_out: usize,
}

impl PoolGeom {
    /// Input rows (or columns) output `i` of `out` averages in an adaptive pool over `input`:
    /// [⌊i·input/out⌋, ⌈(i+1)·input/out⌉), as PyTorch's `AdaptiveAvgPool2d`.
    pub fn adaptive_window(i: usize, input: usize, out: usize) -> std::ops::Range<usize> {
        (i * input / out)..((i + 1) * input).div_ceil(out)
    }
}

/// The part of an H×W map a tensor's planes hold: rows `row..row + h` and columns
/// `col..col + w` of the whole map (a rank's tile of it, its halo, or all of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapWindow {
    /// First row, in the whole map.
    pub row: usize,
    /// First column, in the whole map.
    pub col: usize,
    /// Rows held.
    pub h: usize,
    /// Columns held.
    pub w: usize,
}

impl MapWindow {
    /// All of an `h`×`w` map.
    pub fn whole(h: usize, w: usize) -> MapWindow {
        MapWindow {
            row: 0,
            col: 0,
            h,
            w,
        }
    }

    /// Whether it lies inside an `h`×`w` map.
    fn inside(&self, h: usize, w: usize) -> bool {
        self.row + self.h <= h && self.col + self.w <= w
    }
}

/// Bilinear resizing of each plane of an NCHW batch from h × w to h_out × w_out, as PyTorch's
/// `F.interpolate(mode="bilinear")` with an output size. The kernels may compute a window of
/// the output from a window of the input (a tile and the rows and columns it reads): the
/// taps follow the whole maps' geometry, so a window's values are the whole map's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResizeGeom {
    /// Images in the batch.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Height of the whole input.
    pub h: usize,
    /// Width of the whole input.
    pub w: usize,
    /// Height of the whole output.
    pub h_out: usize,
    /// Width of the whole output.
    pub w_out: usize,
    /// PyTorch's `align_corners`: corner pixels' centres map onto each other (scale
    /// (in − 1)/(out − 1)) rather than the corners of the images (scale in/out, half-pixel
    /// offset).
    pub align_corners: bool,
    /// The part of each input plane x (and dx) holds: it must hold every row and column
    /// the output window reads ([`ResizeGeom::reads`]).
    pub input: MapWindow,
    /// The part of each output plane y (and dy) holds.
    pub output: MapWindow,
}

impl ResizeGeom {
    /// The whole maps: an h×w input to h_out×w_out.
    pub fn whole(
        (n, c): (usize, usize),
        (h, w): (usize, usize),
        (h_out, w_out): (usize, usize),
        align_corners: bool,
    ) -> ResizeGeom {
        ResizeGeom {
            n,
            c,
            h,
            w,
            h_out,
            w_out,
            align_corners,
            input: MapWindow::whole(h, w),
            output: MapWindow::whole(h_out, w_out),
        }
    }

    /// The input rows (or columns) of an axis of `len` that the taps of outputs `out` (of
    /// `out_len`) read: from the first output's source index to the last's, and the row
    /// after it. A row of margin on each side (two after) holds the taps however the source
    /// position rounds in the kernels' floating point (within a row of the exact quotient),
    /// so a window this wide never reads outside itself.
    pub fn reads(
        out: std::ops::Range<usize>,
        len: usize,
        out_len: usize,
        align_corners: bool,
    ) -> std::ops::Range<usize> {
        if out.is_empty() || len == 0 {
            return 0..0;
        }
        // ⌊src(o)⌋ exactly, in integers: (len − 1)·o / (out_len − 1) with align_corners,
        // else (len·(2o + 1) − out_len) / (2·out_len), at least 0.
        let floor = |o: usize| -> usize {
            let (o, len, out_len) = (o as u128, len as u128, out_len as u128);
            let f = match align_corners {
                true if out_len > 1 => (len - 1) * o / (out_len - 1),
                true => 0,
                false => (len * (2 * o + 1)).saturating_sub(out_len) / (2 * out_len),
            };
            f as usize
        };
        floor(out.start).saturating_sub(1)..(floor(out.end - 1) + 3).min(len)
    }

    /// Whether the windows lie in their maps and the input window holds what the output
    /// window reads, or what is wrong.
    pub fn check(&self) -> Result<()> {
        let (i, o) = (&self.input, &self.output);
        let rows = Self::reads(o.row..o.row + o.h, self.h, self.h_out, self.align_corners);
        let cols = Self::reads(o.col..o.col + o.w, self.w, self.w_out, self.align_corners);
        let holds = |r: &std::ops::Range<usize>, at: usize, len: usize| {
            r.is_empty() || (at <= r.start && r.end <= at + len)
        };
        if !i.inside(self.h, self.w)
            || !o.inside(self.h_out, self.w_out)
            || !holds(&rows, i.row, i.h)
            || !holds(&cols, i.col, i.w)
        {
            return Err(crate::Error::Shape(format!(
                "bilinear resize {}x{} -> {}x{}: input window {i:?} does not hold rows \
                 {rows:?} and columns {cols:?} that output window {o:?} reads",
                self.h, self.w, self.h_out, self.w_out
            )));
        }
        Ok(())
    }
}

/// Where a dropout mask's elements lie in the mask of the whole maps: `planes` planes
/// (samples × channels) of an `h`×`w` map, of which the mask holds `window` of each. Element
/// (plane, r, c) of the mask takes draw (plane·h + window.row + r)·w + window.col + c, so a
/// pixel's mask is the same whether its map is whole or split into tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaskGeom {
    /// Planes of the mask (samples × channels).
    pub planes: usize,
    /// Height of the whole map.
    pub h: usize,
    /// Width of the whole map.
    pub w: usize,
    /// The part of each plane the mask holds.
    pub window: MapWindow,
}

impl MaskGeom {
    /// A whole mask of `numel` elements, element i taking draw i.
    pub fn flat(numel: usize) -> MaskGeom {
        MaskGeom {
            planes: 1,
            h: 1,
            w: numel,
            window: MapWindow::whole(1, numel),
        }
    }

    /// Whether a mask of `numel` elements fits the geometry, or what is wrong.
    pub fn check(&self, numel: usize) -> Result<()> {
        let held = self.planes * self.window.h * self.window.w;
        if held != numel || !self.window.inside(self.h, self.w) {
            return Err(crate::Error::Shape(format!(
                "dropout mask of {numel} elements against {} planes of window {:?} of a \
                 {}x{} map",
                self.planes, self.window, self.h, self.w
            )));
        }
        Ok(())
    }
}

/// A batch seen per channel: n × c × hw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelGeom {
    /// Images.
    pub n: usize,
    /// Channels.
    pub c: usize,
    /// Values per channel plane (height × width).
    pub hw: usize,
}

/// A batch seen per group of channels (group normalization): n samples of c channels in
/// `groups` groups of c / groups consecutive channels, hw values per plane. A sample's group
/// is one contiguous run of (c / groups)·hw values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupGeom {
    /// Images.
    pub n: usize,
    /// Channels (a multiple of `groups`).
    pub c: usize,
    /// Groups of channels normalized together.
    pub groups: usize,
    /// Values per channel plane (height × width).
    pub hw: usize,
}

impl GroupGeom {
    /// Values one (sample, group) pair normalizes over: (c / groups)·hw.
    pub fn group_len(&self) -> usize {
        self.c / self.groups * self.hw
    }
}

/// A smooth element-wise activation (its gradient computed from its input).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nonlinearity {
    /// x·σ(x) (PyTorch's `SiLU`, swish).
    Silu,
    /// x·Φ(x) with the exact normal CDF, ½x(1 + erf(x/√2)) (PyTorch's `GELU()`).
    Gelu,
    /// ½x(1 + tanh(√(2/π)(x + 0.044715x³))) (PyTorch's `GELU(approximate='tanh')`).
    GeluTanh,
    /// σ(x) = 1/(1 + e^(−x)).
    Sigmoid,
}

impl Nonlinearity {
    /// Every one.
    pub const ALL: [Nonlinearity; 4] = [
        Nonlinearity::Silu,
        Nonlinearity::Gelu,
        Nonlinearity::GeluTanh,
        Nonlinearity::Sigmoid,
    ];

    /// Its name, also the stem of its kernels (`gelu_tanh_forward_f32`).
    pub fn name(self) -> &'static str {
        match self {
            Nonlinearity::Silu => "silu",
            Nonlinearity::Gelu => "gelu",
            Nonlinearity::GeluTanh => "gelu_tanh",
            Nonlinearity::Sigmoid => "sigmoid",
        }
    }
}

/// n samples of k classes scored at `positions` places each: 1 for a classifier's N×K logits,
/// H·W for per-pixel N×K×H×W logits. Logits, probabilities and their gradient are laid out
/// n × k × positions (class stride `positions`); labels and weights n × positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossGeom {
    /// Samples.
    pub n: usize,
    /// Classes.
    pub k: usize,
    /// Places scored per sample.
    pub positions: usize,
}

impl LossGeom {
    /// Places scored in all: n · positions.
    pub fn places(&self) -> usize {
        self.n * self.positions
    }
}

/// SGD hyper-parameters for one update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdStep {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Multiplies the gradient before anything else: 1 / the loss scale (1 without one).
    pub grad_scale: f64,
}

/// Adam or AdamW hyper-parameters for one update of one parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the bias-corrected second moment's square root.
    pub eps: f64,
    /// Weight decay: an L2 term added to the gradient (Adam), or the weights shrunk by
    /// `1 - lr·weight_decay` before the update (AdamW, `decoupled`).
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay instead of Adam's L2 term.
    pub decoupled: bool,
    /// The parameter's step, counted from 1: the bias corrections' exponent.
    pub step: u64,
    /// Multiplies the gradient before anything else: 1 / the loss scale times the clipping
    /// factor (1 without either).
    pub grad_scale: f64,
}

impl AdamStep {
    /// `lr / (1 - beta1^step)` and `sqrt(1 - beta2^step)`, in f64 as PyTorch computes them
    /// (in Python floats).
    pub fn bias_corrections(&self) -> (f64, f64) {
        let t = self.step as f64;
        let step_size = self.lr / (1.0 - self.betas.0.powf(t));
        (step_size, (1.0 - self.betas.1.powf(t)).sqrt())
    }

    /// Adam's L2 term on the gradient and the factor AdamW multiplies the weights by (0 and 1
    /// where they do not apply).
    pub fn decay_terms(&self) -> (f64, f64) {
        match self.decoupled {
            true => (0.0, 1.0 - self.lr * self.weight_decay),
            false => (self.weight_decay, 1.0),
        }
    }
}

/// The kernels a device runs. Inputs and outputs are storages of one dtype; gradients of
/// parameters are accumulated (`+=`) so micro-batches and shared weights add up.
/// `ws` is workspace leased by the caller with the size the backend asked for.
pub trait Backend: Send + Sync {
    /// The device's name for reports, e.g. `cpu (2 threads)`.
    fn name(&self) -> String;
    /// Zero-filled storage.
    fn zeros(&self, numel: usize, dtype: DType) -> Result<Storage>;
    /// Storage whose every element the caller overwrites before anything reads it: not
    /// filled, so it holds whatever its memory held (NaN under [`POISON`]).
    fn empty(&self, numel: usize, dtype: DType) -> Result<Storage>;
    /// `data` converted to `dtype` on this backend.
    fn upload(&self, data: &[f64], dtype: DType) -> Result<Storage>;
    /// `s` (elements in host memory, or already this backend's) as this backend's storage:
    /// moved where it can be, copied to the device where it must.
    fn adopt(&self, s: Storage) -> Result<Storage>;
    /// Zero-filled host storage for the offload tier: a block of `pool` (pinned where the
    /// backend has DMA) or, without a pool, ordinary memory.
    fn host_zeros(
        &self,
        numel: usize,
        dtype: DType,
        pool: Option<&Arc<HostPool>>,
    ) -> Result<Storage>;
    /// Copies this backend's `src` into host storage `dst`. With `on_copy_stream` the copy is
    /// queued after the work queued so far, on a stream of its own, and the event that marks
    /// its end is returned; `None` means the copy is complete.
    fn copy_out(
        &self,
        src: &Storage,
        dst: &mut Storage,
        on_copy_stream: bool,
    ) -> Result<Option<Event>>;
    /// Copies host storage `src` into this backend's `dst`, likewise. Work that reads `dst`
    /// must first [`Backend::wait`] for the event.
    fn copy_in(
        &self,
        src: &Storage,
        dst: &mut Storage,
        on_copy_stream: bool,
    ) -> Result<Option<Event>>;
    /// Copies `dst.len()` bytes of this backend's device storage `src`, from byte `offset`,
    /// into host memory `dst` on the copy stream, after the work queued so far, and returns the
    /// event that ends the copy: a piece of a tensor staged through a pinned buffer (MPI
    /// without CUDA support). The caller keeps `src` and `dst` alive, and reads `dst` only
    /// after the event. Backends whose storage is host memory refuse (nothing to stage).
    fn copy_out_bytes(&self, src: &Storage, offset: usize, dst: &mut [u8]) -> Result<Event> {
        let _ = (offset, dst);
        Err(crate::Error::Internal(format!(
            "{} has no device memory to copy {} elements out of",
            self.name(),
            src.len()
        )))
    }
    /// Copies host bytes `src` into this backend's device storage `dst` from byte `offset`, on
    /// the copy stream after the work queued so far, and returns the event that ends it (see
    /// [`Backend::copy_out_bytes`]); work that reads `dst` must first [`Backend::wait`] for it.
    fn copy_in_bytes(&self, src: &[u8], dst: &mut Storage, offset: usize) -> Result<Event> {
        let _ = (src, offset);
        Err(crate::Error::Internal(format!(
            "{} has no device memory to copy {} elements into",
            self.name(),
            dst.len()
        )))
    }
    /// Orders the work queued after this call behind `event`.
    fn wait(&self, event: &Event) -> Result<()>;
    /// dst = src (same length).
    fn copy(&self, src: &Storage, dst: &mut Storage) -> Result<()>;
    /// Returns when all work queued so far has finished (for timings; a no-op where every
    /// call runs to completion before it returns).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// Workspace elements for the convolution passes of `g`.
    fn conv2d_workspace(&self, g: &ConvGeom) -> usize;
    /// What the backend chose at run time for each convolution geometry (cuDNN's algorithms),
    /// one line each, for reports; nothing where it chooses nothing.
    fn conv_algorithms(&self) -> Vec<String> {
        Vec::new()
    }
    /// y = conv(x, w) (`ws`: [`Backend::conv2d_workspace`] elements).
    fn conv2d_forward(
        &self,
        x: &Storage,
        w: &Storage,
        y: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()>;
    /// dx = the gradient of the convolution's input from dy (overwritten, not accumulated).
    fn conv2d_backward_data(
        &self,
        dy: &Storage,
        w: &Storage,
        dx: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()>;
    /// dw += the gradient of the weights from x and dy.
    fn conv2d_backward_filter(
        &self,
        x: &Storage,
        dy: &Storage,
        dw: &mut Storage,
        ws: &mut Storage,
        g: &ConvGeom,
    ) -> Result<()>;
    /// `y[n, c, ...] += bias[c]`.
    fn add_channel_bias(&self, y: &mut Storage, bias: &Storage, g: &ChannelGeom) -> Result<()>;
    /// `db[c] += Σ dy[n, c, ...]`.
    fn channel_sum(&self, dy: &Storage, db: &mut Storage, g: &ChannelGeom) -> Result<()>;

    /// Batch statistics (mean, biased variance) per channel, and the normalized output.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_forward_train(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    /// Normalizes with the running statistics `mean` and `var` (inference).
    fn batchnorm_forward_eval(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        mean: &Storage,
        var: &Storage,
        y: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    /// Batch normalization's backward in training mode, from the batch statistics of its
    /// forward: dx overwritten, dγ and dβ accumulated.
    fn batchnorm_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    /// Batch normalization and ReLU in one pass: y = max(BN(x), 0), with the batch
    /// statistics (mean, biased variance) per channel.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_relu_forward_train(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    /// The fused op's backward from its input alone: `dy` where the output was positive
    /// (recomputed from x, gamma, beta and the batch statistics exactly as the forward
    /// computed it), then BN's backward.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_relu_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        beta: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    /// Per channel (mean, biased variance) of x, on the host: one part's statistics of a batch
    /// split across ranks (the tiles of a spatially split sample), which the caller combines.
    fn batchnorm_statistics(&self, x: &Storage, g: &ChannelGeom) -> Result<Vec<(f64, f64)>>;
    /// Per channel (Σdy, Σ dy·x̂) over x's planes, on the host, x̂ from `mean` and `var`: one
    /// part's share of batch normalization's backward sums. With a fused ReLU's `relu_beta`,
    /// dy counts only where that op's output was positive.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_backward_sums(
        &self,
        x: &Storage,
        dy: &Storage,
        relu_beta: Option<&Storage>,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<Vec<(f64, f64)>>;
    /// dx (overwritten) of batch normalization from the sums of
    /// [`Backend::batchnorm_backward_sums`] over the whole batch of `count` values per channel,
    /// of which x's planes are a part.
    #[allow(clippy::too_many_arguments)]
    fn batchnorm_backward_dx(
        &self,
        x: &Storage,
        dy: &Storage,
        relu_beta: Option<&Storage>,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        sums: &[(f64, f64)],
        count: usize,
        dx: &mut Storage,
        eps: f64,
        g: &ChannelGeom,
    ) -> Result<()>;
    /// running = (1 - momentum)·running + momentum·batch, with the unbiased batch variance.
    fn batchnorm_update_running(
        &self,
        running_mean: &mut Storage,
        running_var: &mut Storage,
        mean: &Storage,
        var: &Storage,
        momentum: f64,
        count: usize,
    ) -> Result<()>;

    /// Group normalization's forward (training and evaluation alike: the statistics are each
    /// sample's own): per (sample, group) the mean and biased variance over the group's values
    /// (written to `mean` and `var`, n × groups), and `y = (x − mean)/√(var + eps)·γ[c] + β[c]`.
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_forward(
        &self,
        x: &Storage,
        gamma: &Storage,
        beta: &Storage,
        y: &mut Storage,
        mean: &mut Storage,
        var: &mut Storage,
        eps: f64,
        g: &GroupGeom,
    ) -> Result<()>;
    /// Group normalization's backward from its forward's statistics: dx overwritten, dγ and
    /// dβ accumulated.
    #[allow(clippy::too_many_arguments)]
    fn groupnorm_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        gamma: &Storage,
        mean: &Storage,
        var: &Storage,
        dx: &mut Storage,
        dgamma: &mut Storage,
        dbeta: &mut Storage,
        eps: f64,
        g: &GroupGeom,
    ) -> Result<()>;

    /// y = f(x), element by element.
    fn nonlinearity_forward(&self, f: Nonlinearity, x: &Storage, y: &mut Storage) -> Result<()>;
    /// dx = f′(x)·dy, from the input x.
    fn nonlinearity_backward(
        &self,
        f: Nonlinearity,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
    ) -> Result<()>;

    /// y = max(x, 0).
    fn relu_forward(&self, x: &Storage, y: &mut Storage) -> Result<()>;
    /// dx = dy where y > 0.
    fn relu_backward(&self, y: &Storage, dy: &Storage, dx: &mut Storage) -> Result<()>;
    /// y = a + b.
    fn add(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()>;
    /// y = max(a + b, 0): a residual connection and the ReLU after it, in one pass.
    fn add_relu(&self, a: &Storage, b: &Storage, y: &mut Storage) -> Result<()>;
    /// y += x.
    fn add_assign(&self, y: &mut Storage, x: &Storage) -> Result<()>;
    /// y = x · mask (dropout).
    fn mul(&self, x: &Storage, mask: &Storage, y: &mut Storage) -> Result<()>;
    /// mask = 0 with probability p, else 1/(1-p); each element's draw depends only on the
    /// seed and its index in the whole maps' mask (see [`MaskGeom`]).
    fn dropout_mask(&self, mask: &mut Storage, p: f64, seed: u64, g: &MaskGeom) -> Result<()>;

    /// The maximum of each window.
    fn max_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()>;
    /// Routes each output gradient to the first maximum of its window (recomputed from x).
    fn max_pool_backward(
        &self,
        x: &Storage,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()>;
    /// Average over the window, padding counted (PyTorch's `count_include_pad=True`).
    /// The divisor is the window clipped to the padded input (a ceil-mode last window can run
    /// past it), as PyTorch does.
    fn avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()>;
    /// Spreads each output gradient evenly over its window (padding counted, as forward).
    fn avg_pool_backward(&self, dy: &Storage, dx: &mut Storage, g: &PoolGeom) -> Result<()>;
    /// PyTorch's `AdaptiveAvgPool2d` to `g.h_out × g.w_out` (windows from
    /// [`PoolGeom::adaptive_window`]; kernel, stride and padding unused).
    fn adaptive_avg_pool_forward(&self, x: &Storage, y: &mut Storage, g: &PoolGeom) -> Result<()>;
    /// Spreads each output gradient evenly over its adaptive window.
    fn adaptive_avg_pool_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &PoolGeom,
    ) -> Result<()>;

    /// Each plane resized bilinearly: the output window of the input window (see
    /// [`ResizeGeom`]).
    fn resize_bilinear_forward(&self, x: &Storage, y: &mut Storage, g: &ResizeGeom) -> Result<()>;
    /// dx (overwritten) = the adjoint of the resize applied to dy, the same bits every run:
    /// the gradient of the input window from the output window's alone.
    fn resize_bilinear_backward(
        &self,
        dy: &Storage,
        dx: &mut Storage,
        g: &ResizeGeom,
    ) -> Result<()>;

    /// y (n × out) = x (n × in) · wᵀ (w: out × in).
    fn linear_forward(
        &self,
        x: &Storage,
        w: &Storage,
        y: &mut Storage,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()>;
    /// dx = dy · w (when asked) and dw += dyᵀ · x.
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        x: &Storage,
        w: &Storage,
        dy: &Storage,
        dx: Option<&mut Storage>,
        dw: &mut Storage,
        n: usize,
        d_in: usize,
        d_out: usize,
    ) -> Result<()>;

    /// Copies channels [src_off, src_off + count) of `src` (n × src_c × hw) into channels
    /// [dst_off, dst_off + count) of `dst` (n × dst_c × hw).
    #[allow(clippy::too_many_arguments)]
    fn copy_channels(
        &self,
        src: &Storage,
        dst: &mut Storage,
        src_c: (usize, usize),
        dst_c: (usize, usize),
        count: usize,
        n: usize,
        hw: usize,
    ) -> Result<()>;

    /// Σ over the n·positions places q of `weights[q] · (−log softmax(logits)[labels[q]])`,
    /// summed in f64 whatever the logits' dtype; writes the probabilities. Every label is < k
    /// (the host gives unlabelled places label 0 and weight 0). Weights are f64 because the host
    /// folds each sample's normalisation into them and the f64 reference must stay exact.
    fn softmax_cross_entropy(
        &self,
        logits: &Storage,
        labels: &[u32],
        weights: &[f64],
        probs: &mut Storage,
        g: &LossGeom,
    ) -> Result<f64>;
    /// `dlogits = scale · weights[q] · (probs − onehot(labels[q]))` at every class of place q.
    fn softmax_cross_entropy_backward(
        &self,
        probs: &Storage,
        labels: &[u32],
        weights: &[f64],
        dlogits: &mut Storage,
        scale: f64,
        g: &LossGeom,
    ) -> Result<()>;

    /// One SGD update of `w` from `grad`, with its momentum buffer.
    fn sgd_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        momentum_buf: &mut Storage,
        step: &SgdStep,
    ) -> Result<()>;
    /// One Adam or AdamW update of `w` from `grad`, with its first and second moments.
    fn adam_update(
        &self,
        w: &mut Storage,
        grad: &Storage,
        exp_avg: &mut Storage,
        exp_avg_sq: &mut Storage,
        step: &AdamStep,
    ) -> Result<()>;
    /// Sets every element to `value`.
    fn fill(&self, s: &mut Storage, value: f64) -> Result<()>;
    /// Whether no element is infinite or NaN (the loss scale's overflow check).
    fn all_finite(&self, s: &Storage) -> Result<bool>;
}

/// Which kind of device a run computes on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    #[default]
    /// The host's cores (the reference backend).
    Cpu,
    /// GPU `ordinal`; in a spread run rank r takes the ordinal r places further on (modulo the
    /// GPUs there are).
    Cuda {
        /// The GPU's index in the CUDA driver's numbering.
        ordinal: usize,
    },
}

impl DeviceKind {
    /// Parses `cpu`, `cuda`, `cuda:N` or `auto` (a GPU when one is usable, else the CPU).
    pub fn parse(s: &str) -> Result<DeviceKind> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda { ordinal: 0 }),
            "auto" => Ok(match cuda::device_count() {
                Ok(n) if n > 0 => DeviceKind::Cuda { ordinal: 0 },
                _ => DeviceKind::Cpu,
            }),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| DeviceKind::Cuda { ordinal })
                .ok_or_else(|| {
                    crate::Error::Config(format!("unknown device '{s}' (auto, cpu, cuda, cuda:N)"))
                }),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceKind::Cpu => write!(f, "cpu"),
            DeviceKind::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// The end of a copy queued on a copy stream.
#[derive(Clone, Debug)]
pub struct Event(pub Arc<cudarc::driver::CudaEvent>);

impl Event {
    /// Whether the copy has finished (never blocks).
    pub fn is_complete(&self) -> bool {
        self.0.is_complete()
    }
    /// Blocks until the copy has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.0
            .synchronize()
            .map_err(|e| crate::Error::Device(format!("CUDA event: {e}")))
    }
}

/// How offloaded tensors travel between the device and the host tier (GEMS's four modes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyMode {
    /// Ordinary host memory, blocking copies.
    Naive,
    /// Pinned memory from the pool, blocking copies.
    Pinned,
    /// Ordinary host memory, copies on a copy stream.
    Async,
    /// Pinned memory from the pool, copies on a copy stream overlapping compute, ordered by
    /// events.
    #[default]
    PinnedAsync,
}

impl CopyMode {
    /// Whether the host side is pinned memory from the pool.
    pub fn pinned(self) -> bool {
        matches!(self, CopyMode::Pinned | CopyMode::PinnedAsync)
    }
    /// Whether copies run on the copy stream, overlapping compute.
    pub fn on_copy_stream(self) -> bool {
        matches!(self, CopyMode::Async | CopyMode::PinnedAsync)
    }
}

impl std::str::FromStr for CopyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "naive" => Ok(CopyMode::Naive),
            "pinned" => Ok(CopyMode::Pinned),
            "async" => Ok(CopyMode::Async),
            "pinned-async" => Ok(CopyMode::PinnedAsync),
            _ => Err(format!(
                "unknown copy mode '{s}' (naive, pinned, async, pinned-async)"
            )),
        }
    }
}

impl std::fmt::Display for CopyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyMode::Naive => "naive",
            CopyMode::Pinned => "pinned",
            CopyMode::Async => "async",
            CopyMode::PinnedAsync => "pinned-async",
        })
    }
}
