//! 2-d convolution (stride, padding, dilation, groups; NCHW; optional bias).

use std::fmt;

use super::tiles::{self, TileRule};
use super::{chw, window_out, Backward, Ctx, Init, Operator, ParamSpec, Saved, SavesFor};
use crate::backend::{ChannelGeom, ConvGeom};
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// A 2-d convolution as PyTorch's `Conv2d`: weights `[c_out, c_in / groups, kh, kw]`.
pub struct Conv2d {
    /// Output channels.
    pub c_out: usize,
    /// (height, width) of the kernel.
    pub kernel: (usize, usize),
    /// (vertical, horizontal) stride.
    pub stride: (usize, usize),
    /// (vertical, horizontal) zero padding on each side.
    pub pad: (usize, usize),
    /// (vertical, horizontal) spacing of the kernel's taps.
    pub dilation: (usize, usize),
    /// Channel groups.
    pub groups: usize,
    /// Whether it adds a per-channel bias.
    pub bias: bool,
}

impl Conv2d {
    /// A square k×k convolution without bias.
    pub fn new(c_out: usize, k: usize, stride: usize, pad: usize) -> Self {
        Conv2d {
            c_out,
            kernel: (k, k),
            stride: (stride, stride),
            pad: (pad, pad),
            dilation: (1, 1),
            groups: 1,
            bias: false,
        }
    }
    /// The same convolution with its kernel's taps `d` pixels apart (PyTorch's `dilation`).
    pub fn dilation(self, d: usize) -> Self {
        Conv2d {
            dilation: (d, d),
            ..self
        }
    }
    /// The same convolution over `groups` channel groups (PyTorch's `groups`; as many as input
    /// channels: depthwise).
    pub fn groups(self, groups: usize) -> Self {
        Conv2d { groups, ..self }
    }
    /// The same convolution adding a per-channel bias.
    pub fn with_bias(self) -> Self {
        Conv2d { bias: true, ..self }
    }

    /// Its geometry on an NCHW input of shape `x`; refuses an input it does not fit.
    pub fn geom(&self, x: &Shape) -> Result<ConvGeom> {
        let (n, c_in, h, w) = x.nchw();
        let out = self
            .infer(&[&Shape::new([c_in, h, w])])
            .map_err(crate::Error::Shape)?;
        Ok(ConvGeom {
            n,
            c_in,
            h,
            w,
            c_out: self.c_out,
            kh: self.kernel.0,
            kw: self.kernel.1,
            stride: self.stride,
            pad: self.pad,
            dilation: self.dilation,
            groups: self.groups,
            h_out: out.dim(1),
            w_out: out.dim(2),
        })
    }
}

impl Conv2d {
    /// Rows and columns one window covers.
    pub fn span(&self) -> (usize, usize) {
        let span = |k: usize, d: usize| d * (k - 1) + 1;
        (
            span(self.kernel.0, self.dilation.0),
            span(self.kernel.1, self.dilation.1),
        )
    }

    /// On tiles: every rank's input rectangle, what its output tile's windows read.
    fn needs(&self, t: &tiles::OnTiles) -> Vec<tiles::Rect> {
        let (stride, pad, span) = (self.stride, self.pad, self.span());
        tiles::window_needs(
            t.tiles.grid,
            t.input_hw(0),
            t.output_hw(),
            stride,
            pad,
            span,
            true,
        )
    }

    /// The geometry computing the output rectangle `out` of the whole map from a tensor
    /// holding the input rectangle `src` (which holds what `out`'s windows read, from their
    /// first row and column on, or from the map's edge): padding only where the windows
    /// start before the map, and `out`'s size. `x` is the shape of an input tile (its batch).
    fn rect_geom(
        &self,
        t: &tiles::OnTiles,
        x: &Shape,
        src: &tiles::Rect,
        out: &tiles::Rect,
    ) -> Result<ConvGeom> {
        let whole = Shape::new([
            x.dim(0),
            t.inputs[0].dim(0),
            t.inputs[0].dim(1),
            t.inputs[0].dim(2),
        ]);
        let first = |o: isize, s: usize, p: usize| o * s as isize - p as isize;
        let (h, w) = src.size();
        let (h_out, w_out) = out.size();
        Ok(ConvGeom {
            h,
            w,
            pad: (
                (src.rows.0 - first(out.rows.0, self.stride.0, self.pad.0)) as usize,
                (src.cols.0 - first(out.cols.0, self.stride.1, self.pad.1)) as usize,
            ),
            h_out,
            w_out,
            ..self.geom(&whole)?
        })
    }

    /// Output rectangle `out` of this rank's tile, from its input tile `x` and what `halo`
    /// received (nothing yet where `out`'s windows read only the tile).
    fn forward_rect(
        &self,
        ctx: &Ctx,
        t: &tiles::OnTiles,
        halo: &tiles::Halo,
        x: &Tensor,
        w: &Tensor,
        out: &tiles::Rect,
    ) -> Result<Tensor> {
        let reads =
            tiles::window_rect(out, t.input_hw(0), self.stride, self.pad, self.span(), true);
        let (src, at) = halo.source(ctx, x, &reads)?;
        let g = self.rect_geom(t, x.shape(), &at, out)?;
        self.forward_geom(ctx, &src, w, &g)
    }

    /// The convolution of `x` by weights `w` on geometry `g`, without bias.
    fn forward_geom(&self, ctx: &Ctx, x: &Tensor, w: &Tensor, g: &ConvGeom) -> Result<Tensor> {
        let be = ctx.device.backend();
        let mut y = ctx.output(Shape::new([g.n, g.c_out, g.h_out, g.w_out]), x)?;
        let mut ws = ctx.workspace(be.conv2d_workspace(g), x.dtype().compute())?;
        be.conv2d_forward(
            x.storage(),
            w.storage(),
            y.storage_mut()?,
            ws.storage_mut()?,
            g,
        )?;
        Ok(y)
    }

    /// Forward on tiles, the halo exchange overlapped with the interior
    /// ([`tiles::overlapped`]): the output tile and the halo's pieces (backward rebuilds the
    /// gathered input from them and `x`).
    fn forward_tiles(
        &self,
        ctx: &Ctx,
        t: &tiles::OnTiles,
        x: &Tensor,
        w: &Tensor,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let needs = self.needs(t);
        tiles::overlapped(
            ctx,
            t,
            x,
            &needs,
            self.stride,
            self.pad,
            self.span(),
            |halo, out| self.forward_rect(ctx, t, halo, x, w, out),
        )
    }
}

/// Refuses channels that do not divide into `groups`, and an empty kernel or stride.
fn check_sizes(
    c_in: usize,
    c_out: usize,
    groups: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
) -> std::result::Result<(), String> {
    if groups == 0 || !c_in.is_multiple_of(groups) || !c_out.is_multiple_of(groups) {
        return Err(format!(
            "{c_in} input and {c_out} output channels are not divisible into {groups} groups"
        ));
    }
    if stride.0 == 0 || stride.1 == 0 || kernel.0 == 0 || kernel.1 == 0 {
        return Err("kernel and stride must be positive".into());
    }
    Ok(())
}

impl fmt::Display for Conv2d {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conv {}x{}", self.kernel.0, self.kernel.1)?;
        if self.stride != (1, 1) {
            write!(f, "/{}", self.stride.0)?;
        }
        if self.dilation != (1, 1) {
            write!(f, " dil {}", self.dilation.0)?;
        }
        if self.groups != 1 {
            write!(f, " groups {}", self.groups)?;
        }
        write!(f, " ->{}", self.c_out)
    }
}

impl Operator for Conv2d {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let (c, h, w) = chw(inputs[0])?;
        check_sizes(c, self.c_out, self.groups, self.kernel, self.stride)?;
        let ho = window_out(h, self.kernel.0, self.stride.0, self.pad.0, self.dilation.0)?;
        let wo = window_out(w, self.kernel.1, self.stride.1, self.pad.1, self.dilation.1)?;
        Ok(Shape::new([self.c_out, ho, wo]))
    }

    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        let c_in = inputs[0].dim(0);
        let (kh, kw) = self.kernel;
        // torchvision's ResNet init: Kaiming normal, fan-out, for ReLU.
        let std = (2.0 / (self.c_out * kh * kw) as f64).sqrt();
        let mut p = vec![ParamSpec {
            suffix: "weight",
            shape: Shape::new([self.c_out, c_in / self.groups, kh, kw]),
            init: Init::Normal(std),
            trainable: true,
        }];
        if self.bias {
            p.push(ParamSpec {
                suffix: "bias",
                shape: Shape::new([self.c_out]),
                init: Init::Zeros,
                trainable: true,
            });
        }
        p
    }

    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let (mut y, saved) = match &ctx.tiles {
            Some(t) => {
                let (y, pieces) = self.forward_tiles(ctx, t, x, &params[0])?;
                (y, [vec![x.clone()], pieces].concat())
            }
            None => (
                self.forward_geom(ctx, x, &params[0], &self.geom(x.shape())?)?,
                vec![x.clone()],
            ),
        };
        if self.bias {
            let (n, c, h, w) = y.shape().nchw();
            let cg = ChannelGeom { n, c, hw: h * w };
            let be = ctx.device.backend();
            be.add_channel_bias(y.storage_mut()?, params[1].storage(), &cg)?;
        }
        Ok((y, Saved(saved)))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        // On tiles, the input tile and the halo's pieces: the gathered input, rebuilt.
        let mut saved = b.saved.0;
        let x = saved.remove(0);
        let dy = &b.dy;
        let (x, g, tiled) = match &ctx.tiles {
            Some(t) => {
                let (hw, needs) = (t.input_hw(0), self.needs(t));
                let need = needs[t.tiles.tile()];
                let halo = tiles::Halo::received(t.tiles, hw, &needs, saved);
                let g = self.rect_geom(t, x.shape(), &need, &t.tiles.own(t.output_hw()))?;
                (halo.region(ctx, &x, &need)?, g, Some((t, hw, needs)))
            }
            None => {
                let g = self.geom(x.shape())?;
                (x, g, None)
            }
        };
        let bias = self.bias.then_some(ChannelGeom {
            n: g.n,
            c: g.c_out,
            hw: g.h_out * g.w_out,
        });
        let passes = Passes {
            need_input: b.need[0],
            weights: b.weights,
            adjoint: false,
            bias,
        };
        backward_passes(ctx, x, dy, &g, tiled, params, grads, passes)
    }

    fn flops(&self, inputs: &[&Shape], output: &Shape) -> u64 {
        let c_in = inputs[0].dim(0) / self.groups;
        let macs = output.numel() * c_in * self.kernel.0 * self.kernel.1;
        2 * macs as u64 + if self.bias { output.numel() as u64 } else { 0 }
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn splits_weights(&self) -> bool {
        true
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }
}

/// A 2-d transposed convolution as PyTorch's `ConvTranspose2d` (weights `[c_in, c_out /
/// groups, kh, kw]`): the adjoint of the [`Conv2d`] from its output back to its input, so it
/// runs on the backend's convolution kernels with their roles exchanged (forward is that
/// convolution's backward-data, backward-data its forward, the weight gradient its
/// backward-filter with input and output swapped).
#[derive(Clone, Debug, PartialEq)]
pub struct ConvTranspose2d {
    /// Output channels.
    pub c_out: usize,
    /// (height, width) of the kernel.
    pub kernel: (usize, usize),
    /// (vertical, horizontal) stride: how much larger the output is.
    pub stride: (usize, usize),
    /// (vertical, horizontal) padding removed from each side of the output.
    pub pad: (usize, usize),
    /// Rows and columns added at the bottom and right of the output (less than the stride),
    /// choosing among the output sizes a strided convolution maps to the same input size.
    pub output_padding: (usize, usize),
    /// Channel groups.
    pub groups: usize,
    /// Whether it adds a per-channel bias.
    pub bias: bool,
}

impl ConvTranspose2d {
    /// A square k×k transposed convolution with bias, as U-Net's up-convolution (k = stride = 2).
    pub fn new(c_out: usize, k: usize, stride: usize) -> Self {
        ConvTranspose2d {
            c_out,
            kernel: (k, k),
            stride: (stride, stride),
            pad: (0, 0),
            output_padding: (0, 0),
            groups: 1,
            bias: true,
        }
    }

    /// The geometry of the adjoint convolution on an NCHW input of shape `x`: that
    /// convolution's input is this op's output and its output this op's input.
    pub fn geom(&self, x: &Shape) -> Result<ConvGeom> {
        let (n, c_in, h, w) = x.nchw();
        let out = self
            .infer(&[&Shape::new([c_in, h, w])])
            .map_err(crate::Error::Shape)?;
        Ok(ConvGeom {
            n,
            c_in: self.c_out,
            h: out.dim(1),
            w: out.dim(2),
            c_out: c_in,
            kh: self.kernel.0,
            kw: self.kernel.1,
            stride: self.stride,
            pad: self.pad,
            dilation: (1, 1),
            groups: self.groups,
            h_out: h,
            w_out: w,
        })
    }

    /// On tiles of an `input` map whose output is `output`: every rank's input rectangle, the
    /// input pixels that add into its output tile.
    pub fn tile_needs(
        &self,
        grid: tiles::Grid,
        input: (usize, usize),
        output: (usize, usize),
    ) -> Vec<tiles::Rect> {
        let (s, p, k) = (self.stride, self.pad, self.kernel);
        (0..grid.tiles())
            .map(|q| {
                let out = grid.owned(q, output);
                tiles::Rect {
                    rows: tiles::transposed_rows(out.rows, s.0, p.0, k.0, input.0),
                    cols: tiles::transposed_rows(out.cols, s.1, p.1, k.1, input.1),
                }
            })
            .collect()
    }

    /// The adjoint convolution's geometry computing output rectangle `out` of the whole map
    /// from the input rectangle `src` (what adds into `out`): the adjoint's input is `out`,
    /// padded where `src`'s first pixel adds before `out`'s first, its output `src`. `x` is
    /// the shape of an input tile (its batch).
    fn rect_geom(
        &self,
        t: &tiles::OnTiles,
        x: &Shape,
        src: &tiles::Rect,
        out: &tiles::Rect,
    ) -> Result<ConvGeom> {
        let whole = Shape::new([
            x.dim(0),
            t.inputs[0].dim(0),
            t.inputs[0].dim(1),
            t.inputs[0].dim(2),
        ]);
        let before =
            |o: isize, i: isize, s: usize, p: usize| (o + p as isize - i * s as isize) as usize;
        let ((h, w), (h_out, w_out)) = (out.size(), src.size());
        Ok(ConvGeom {
            h,
            w,
            h_out,
            w_out,
            pad: (
                before(out.rows.0, src.rows.0, self.stride.0, self.pad.0),
                before(out.cols.0, src.cols.0, self.stride.1, self.pad.1),
            ),
            ..self.geom(&whole)?
        })
    }
}

impl fmt::Display for ConvTranspose2d {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conv-transpose {}x{}", self.kernel.0, self.kernel.1)?;
        if self.stride != (1, 1) {
            write!(f, "/{}", self.stride.0)?;
        }
        if self.groups != 1 {
            write!(f, " groups {}", self.groups)?;
        }
        write!(f, " ->{}", self.c_out)
    }
}

impl Operator for ConvTranspose2d {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let (c, h, w) = chw(inputs[0])?;
        check_sizes(c, self.c_out, self.groups, self.kernel, self.stride)?;
        if self.output_padding.0 >= self.stride.0 || self.output_padding.1 >= self.stride.1 {
            return Err("output padding must be smaller than the stride".into());
        }
        if h == 0 || w == 0 {
            return Err("an empty input".into());
        }
        // PyTorch: (in - 1)·s - 2p + k + output_padding, which the convolution maps back.
        let size = |input: usize, k: usize, s: usize, p: usize, extra: usize| {
            ((input - 1) * s + k + extra)
                .checked_sub(2 * p)
                .filter(|&o| o > 0)
                .ok_or_else(|| format!("padding {p} leaves no output of a {k}-wide kernel"))
        };
        let ho = size(
            h,
            self.kernel.0,
            self.stride.0,
            self.pad.0,
            self.output_padding.0,
        )?;
        let wo = size(
            w,
            self.kernel.1,
            self.stride.1,
            self.pad.1,
            self.output_padding.1,
        )?;
        Ok(Shape::new([self.c_out, ho, wo]))
    }

    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        let c_in = inputs[0].dim(0);
        let (kh, kw) = self.kernel;
        // PyTorch's default: U(±1/√fan_in), fan_in = (c_out / groups)·kh·kw for this layout.
        let bound = 1.0 / ((self.c_out / self.groups * kh * kw) as f64).sqrt();
        let mut p = vec![ParamSpec {
            suffix: "weight",
            shape: Shape::new([c_in, self.c_out / self.groups, kh, kw]),
            init: Init::Uniform(bound),
            trainable: true,
        }];
        if self.bias {
            p.push(ParamSpec {
                suffix: "bias",
                shape: Shape::new([self.c_out]),
                init: Init::Uniform(bound),
                trainable: true,
            });
        }
        p
    }

    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        // On tiles: the input pixels that add into this rank's output tile, gathered; the
        // halo's pieces are kept, backward rebuilds the gathered input from them and `x`.
        let (src, g, pieces) = match &ctx.tiles {
            Some(t) => {
                let (hw, needs) = (
                    t.input_hw(0),
                    self.tile_needs(t.tiles.grid, t.input_hw(0), t.output_hw()),
                );
                let need = needs[t.tiles.tile()];
                let mut halo = tiles::Halo::send(ctx, t.tiles, x, hw, &needs)?;
                halo.receive(ctx, t.tiles)?;
                let src = halo.region(ctx, x, &need)?;
                let g = self.rect_geom(t, x.shape(), &need, &t.tiles.own(t.output_hw()))?;
                (src, g, halo.into_pieces())
            }
            None => (x.clone(), self.geom(x.shape())?, Vec::new()),
        };
        let be = ctx.device.backend();
        let mut y = ctx.output(Shape::new([g.n, g.c_in, g.h, g.w]), x)?;
        let mut ws = ctx.workspace(be.conv2d_workspace(&g), x.dtype().compute())?;
        be.conv2d_backward_data(
            src.storage(),
            params[0].storage(),
            y.storage_mut()?,
            ws.storage_mut()?,
            &g,
        )?;
        if self.bias {
            let cg = ChannelGeom {
                n: g.n,
                c: g.c_in,
                hw: g.h * g.w,
            };
            be.add_channel_bias(y.storage_mut()?, params[1].storage(), &cg)?;
        }
        Ok((y, Saved([vec![x.clone()], pieces].concat())))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let mut saved = b.saved.0;
        let x = saved.remove(0);
        let dy = &b.dy;
        let (x, g, tiled) = match &ctx.tiles {
            Some(t) => {
                let hw = t.input_hw(0);
                let needs = self.tile_needs(t.tiles.grid, hw, t.output_hw());
                let need = needs[t.tiles.tile()];
                let halo = tiles::Halo::received(t.tiles, hw, &needs, saved);
                let g = self.rect_geom(t, x.shape(), &need, &t.tiles.own(t.output_hw()))?;
                (halo.region(ctx, &x, &need)?, g, Some((t, hw, needs)))
            }
            None => {
                let g = self.geom(x.shape())?;
                (x, g, None)
            }
        };
        let bias = self.bias.then_some(ChannelGeom {
            n: g.n,
            c: g.c_in,
            hw: g.h * g.w,
        });
        let passes = Passes {
            need_input: b.need[0],
            weights: b.weights,
            adjoint: true,
            bias,
        };
        backward_passes(ctx, x, dy, &g, tiled, params, grads, passes)
    }

    fn flops(&self, inputs: &[&Shape], output: &Shape) -> u64 {
        let c_out = self.c_out / self.groups;
        let macs = inputs[0].numel() * c_out * self.kernel.0 * self.kernel.1;
        2 * macs as u64 + if self.bias { output.numel() as u64 } else { 0 }
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn splits_weights(&self) -> bool {
        true
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }
}

/// What a convolution's backward computes: the input's gradient, the filter's, and the
/// bias's over these channels; `adjoint` for a transposed convolution, whose geometry `g` is
/// the convolution it is the adjoint of (its output is `g`'s input).
struct Passes {
    need_input: bool,
    weights: bool,
    adjoint: bool,
    bias: Option<ChannelGeom>,
}

/// Every tile's input rectangle, with the whole input's (H, W), where the op runs on tiles.
type TiledInput<'a, 'b> = Option<(&'a tiles::OnTiles<'b>, (usize, usize), Vec<tiles::Rect>)>;

/// The backward passes both convolutions share once `x` (on tiles, its gathered region) and
/// `g` are known: the input's gradient first, so that its halo travels back while the
/// filter's is computed, then the filter's and the bias's, then the returned halo added.
#[allow(clippy::too_many_arguments)]
fn backward_passes(
    ctx: &Ctx,
    x: Tensor,
    dy: &Tensor,
    g: &ConvGeom,
    tiled: TiledInput,
    params: &[Tensor],
    grads: &mut [Tensor],
    p: Passes,
) -> Result<Vec<Option<Tensor>>> {
    let be = ctx.device.backend();
    let mut ws = ctx.workspace(be.conv2d_workspace(g), x.dtype().compute())?;
    let (mut dx, mut returning) = (None, None);
    if p.need_input {
        let mut d = ctx.output(x.shape().clone(), &x)?;
        let (w, out, ws) = (params[0].storage(), d.storage_mut()?, ws.storage_mut()?);
        match p.adjoint {
            false => be.conv2d_backward_data(dy.storage(), w, out, ws, g)?,
            // The adjoint's input gradient is the convolution of dy.
            true => be.conv2d_forward(dy.storage(), w, out, ws, g)?,
        }
        match &tiled {
            Some((t, hw, needs)) => {
                returning = Some(tiles::Returning::send(ctx, t.tiles, d, *hw, needs)?)
            }
            None => dx = Some(d),
        }
    }
    if p.weights {
        // The adjoint's weight gradient: its input is dy, its output gradient x.
        let (input, output_grad) = match p.adjoint {
            false => (&x, dy),
            true => (dy, &x),
        };
        be.conv2d_backward_filter(
            input.storage(),
            output_grad.storage(),
            grads[0].storage_mut()?,
            ws.storage_mut()?,
            g,
        )?;
        if let Some(cg) = &p.bias {
            be.channel_sum(dy.storage(), grads[1].storage_mut()?, cg)?;
        }
    }
    drop((ws, x));
    if let (Some(r), Some((t, _, needs))) = (returning, &tiled) {
        dx = Some(r.add_received(ctx, t.tiles, needs)?);
    }
    Ok(vec![dx])
}
