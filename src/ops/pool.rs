//! Max, average, global-average and adaptive-average pooling.

use std::fmt;

use super::tiles::{self, OnTiles, Rect, TileRule};
use super::{chw, resized, window_out, Backward, Ctx, Operator, Saved, SavesFor};
use crate::backend::PoolGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

/// A pooling window: kernel, stride, padding, and how a partial last window is treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// (height, width) of the window.
    pub kernel: (usize, usize),
    /// (vertical, horizontal) stride.
    pub stride: (usize, usize),
    /// (vertical, horizontal) padding on each side.
    pub pad: (usize, usize),
    /// PyTorch's `ceil_mode`: round the output size up, so a last window that starts inside
    /// the input (or the left padding) but runs past the padded input still counts; such
    /// windows are clipped at the border. `false` (floor) drops them.
    pub ceil_mode: bool,
}

impl Window {
    /// A k×k window, floor mode.
    pub fn square(k: usize, stride: usize, pad: usize) -> Self {
        Window {
            kernel: (k, k),
            stride: (stride, stride),
            pad: (pad, pad),
            ceil_mode: false,
        }
    }

    /// The same window in ceil mode.
    pub fn ceil(self) -> Self {
        Window {
            ceil_mode: true,
            ..self
        }
    }

    /// Output size along one axis (PyTorch's `pooling_output_shape`).
    fn out(
        &self,
        input: usize,
        k: usize,
        stride: usize,
        pad: usize,
    ) -> std::result::Result<usize, String> {
        let floor = window_out(input, k, stride, pad, 1)?;
        if !self.ceil_mode {
            return Ok(floor);
        }
        let mut out = (input + 2 * pad - k).div_ceil(stride) + 1;
        // The last window must start inside the input or the left padding.
        if (out - 1) * stride >= input + pad {
            out -= 1;
        }
        Ok(out)
    }

    fn infer(&self, s: &Shape) -> std::result::Result<Shape, String> {
        let (c, h, w) = chw(s)?;
        if 2 * self.pad.0 > self.kernel.0 || 2 * self.pad.1 > self.kernel.1 {
            return Err("pool padding must be at most half the kernel".into());
        }
        if self.stride.0 == 0 || self.stride.1 == 0 {
            return Err("pool stride must be positive".into());
        }
        let ho = self.out(h, self.kernel.0, self.stride.0, self.pad.0)?;
        let wo = self.out(w, self.kernel.1, self.stride.1, self.pad.1)?;
        Ok(Shape::new([c, ho, wo]))
    }

    fn geom(&self, x: &Shape) -> Result<PoolGeom> {
        let (n, c, h, w) = x.nchw();
        let out = self
            .infer(&Shape::new([c, h, w]))
            .map_err(crate::Error::Shape)?;
        Ok(PoolGeom {
            n,
            c,
            h,
            w,
            kh: self.kernel.0,
            kw: self.kernel.1,
            stride: self.stride,
            pad: self.pad,
            h_out: out.dim(1),
            w_out: out.dim(2),
        })
    }
}

impl Window {
    /// On tiles: every rank's input rectangle, what its output tile's windows read. With
    /// `counted_padding` (average pools) a rectangle holds the padding as zeros, so a window's
    /// divisor is what it is on the whole map; otherwise padding stays implicit.
    fn tile_needs(&self, t: &OnTiles, counted_padding: bool) -> Vec<Rect> {
        tiles::window_needs(
            t.tiles.grid,
            t.input_hw(0),
            t.output_hw(),
            self.stride,
            self.pad,
            self.kernel,
            !counted_padding,
        )
    }

    /// The geometry computing output rectangle `out` of the whole map from a tensor holding
    /// the input rectangle `src` (what `out`'s windows read, from their first row and column
    /// on, or from the map's edge): padding only where the windows start before `src`, and
    /// `out`'s size, for a batch of `n` images of `c` channels.
    fn rect_geom(&self, n: usize, c: usize, src: &Rect, out: &Rect) -> PoolGeom {
        let first = |o: isize, s: usize, p: usize| o * s as isize - p as isize;
        let ((h, w), (h_out, w_out)) = (src.size(), out.size());
        PoolGeom {
            n,
            c,
            h,
            w,
            kh: self.kernel.0,
            kw: self.kernel.1,
            stride: self.stride,
            pad: (
                (src.rows.0 - first(out.rows.0, self.stride.0, self.pad.0)) as usize,
                (src.cols.0 - first(out.cols.0, self.stride.1, self.pad.1)) as usize,
            ),
            h_out,
            w_out,
        }
    }

    /// The output of `pool` (a kernel computing an output from an input and its geometry)
    /// on `x`, and on tiles the halo's pieces: the output tile computed rectangle by
    /// rectangle, the halo exchange overlapped with the interior ([`tiles::overlapped`]).
    fn forward(
        &self,
        ctx: &Ctx,
        x: &Tensor,
        counted_padding: bool,
        pool: impl Fn(&Tensor, &PoolGeom) -> Result<Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let Some(t) = &ctx.tiles else {
            return Ok((pool(x, &self.geom(x.shape())?)?, Vec::new()));
        };
        let (n, c, _, _) = x.shape().nchw();
        let hw = t.input_hw(0);
        let needs = self.tile_needs(t, counted_padding);
        tiles::overlapped(
            ctx,
            t,
            x,
            &needs,
            self.stride,
            self.pad,
            self.kernel,
            |halo, out| {
                let reads = tiles::window_rect(
                    out,
                    hw,
                    self.stride,
                    self.pad,
                    self.kernel,
                    !counted_padding,
                );
                let (src, at) = halo.source(ctx, x, &reads)?;
                pool(&src, &self.rect_geom(n, c, &at, out))
            },
        )
    }

    /// The geometry backward runs with, for an input of shape `x` (a tile on tiles: from the
    /// rank's input rectangle to its output tile), and on tiles every rank's rectangle.
    fn backward_geom(
        &self,
        ctx: &Ctx,
        x: &Shape,
        counted_padding: bool,
    ) -> Result<(PoolGeom, Option<Vec<Rect>>)> {
        match &ctx.tiles {
            Some(t) => {
                let (n, c, _, _) = x.nchw();
                let needs = self.tile_needs(t, counted_padding);
                let out = t.tiles.own(t.output_hw());
                let g = self.rect_geom(n, c, &needs[t.tiles.tile()], &out);
                Ok((g, Some(needs)))
            }
            None => Ok((self.geom(x)?, None)),
        }
    }
}

/// The input gradient from the gradient of what forward read: on tiles, the halo's gradients
/// returned to their owners.
fn to_input(ctx: &Ctx, dx: Tensor, needs: Option<Vec<Rect>>) -> Result<Tensor> {
    match (&ctx.tiles, needs) {
        (Some(t), Some(needs)) => tiles::scatter_add(ctx, t.tiles, dx, t.input_hw(0), &needs),
        _ => Ok(dx),
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}/{}", self.kernel.0, self.kernel.1, self.stride.0)?;
        if self.ceil_mode {
            write!(f, " ceil")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq)]
/// The maximum of each window (padding never wins).
pub struct MaxPool(pub Window);

#[derive(Clone, Debug, PartialEq)]
/// The mean of each window, padding counted (PyTorch's `count_include_pad=True`).
pub struct AvgPool(pub Window);

/// Mean over H×W: C×H×W → C×1×1.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalAvgPool;

impl Operator for MaxPool {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        self.0.infer(inputs[0])
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let (y, pieces) = self.0.forward(ctx, x, false, |src, g| {
            let mut y = ctx.output(Shape::new([g.n, g.c, g.h_out, g.w_out]), src)?;
            ctx.device
                .backend()
                .max_pool_forward(src.storage(), y.storage_mut()?, g)?;
            Ok(y)
        })?;
        Ok((y, Saved([vec![x.clone()], pieces].concat())))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        // On tiles, the input tile and the halo's pieces: the input forward read, rebuilt.
        let mut saved = b.saved.0;
        let x = saved.remove(0);
        let (g, needs) = self.0.backward_geom(ctx, &b.inputs[0], false)?;
        let x = match (&ctx.tiles, &needs) {
            (Some(t), Some(needs)) => {
                let hw = t.input_hw(0);
                let halo = tiles::Halo::received(t.tiles, hw, needs, saved);
                halo.region(ctx, &x, &needs[t.tiles.tile()])?
            }
            _ => x,
        };
        let mut dx = ctx.output(x.shape().clone(), &x)?;
        ctx.device.backend().max_pool_backward(
            x.storage(),
            b.dy.storage(),
            dx.storage_mut()?,
            &g,
        )?;
        Ok(vec![Some(to_input(ctx, dx, needs)?)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        (output.numel() * self.0.kernel.0 * self.0.kernel.1) as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }
}

impl Operator for AvgPool {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        self.0.infer(inputs[0])
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let (y, _) = self.0.forward(ctx, xs[0], true, |src, g| {
            let mut y = ctx.output(Shape::new([g.n, g.c, g.h_out, g.w_out]), src)?;
            ctx.device
                .backend()
                .avg_pool_forward(src.storage(), y.storage_mut()?, g)?;
            Ok(y)
        })?;
        Ok((y, Saved::default()))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (g, needs) = self.0.backward_geom(ctx, &b.inputs[0], true)?;
        let mut dx = ctx.output(Shape::new([g.n, g.c, g.h, g.w]), &b.dy)?;
        ctx.device
            .backend()
            .avg_pool_backward(b.dy.storage(), dx.storage_mut()?, &g)?;
        Ok(vec![Some(to_input(ctx, dx, needs)?)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        (output.numel() * self.0.kernel.0 * self.0.kernel.1) as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}

impl GlobalAvgPool {
    /// The whole image as one average-pool window.
    fn geom(x: &Shape) -> PoolGeom {
        let (n, c, h, w) = x.nchw();
        PoolGeom {
            n,
            c,
            h,
            w,
            kh: h,
            kw: w,
            stride: (1, 1),
            pad: (0, 0),
            h_out: 1,
            w_out: 1,
        }
    }
}

impl GlobalAvgPool {
    /// A tile's share of the whole map's pixels.
    fn share(t: &OnTiles, g: &PoolGeom) -> f64 {
        let (h, w) = t.input_hw(0);
        (g.h * g.w) as f64 / (h * w) as f64
    }
}

impl Operator for GlobalAvgPool {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let (c, _, _) = chw(inputs[0])?;
        Ok(Shape::new([c, 1, 1]))
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let g = Self::geom(x.shape());
        let mut y = ctx.output(Shape::new([g.n, g.c, 1, 1]), x)?;
        ctx.device
            .backend()
            .avg_pool_forward(x.storage(), y.storage_mut()?, &g)?;
        if let Some(t) = &ctx.tiles {
            // The whole map's mean: the tiles' means weighed by their shares of the map.
            let share = Self::share(t, &g);
            let mine = y.to_f64_vec()?.iter().map(|m| m * share).collect();
            let mean = t.tiles.sum(mine)?;
            y = ctx.device.upload(
                y.shape().clone(),
                &mean,
                y.dtype(),
                crate::memory::Category::Activations,
            )?;
        }
        Ok((y, Saved::default()))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let g = Self::geom(&b.inputs[0]);
        let mut dx = ctx.output(b.inputs[0].clone(), &b.dy)?;
        // On tiles, dy (whole, the same on every rank) spreads over the whole map: a tile's
        // pixels get dy / (H·W), the tile's mean's gradient weighed by its share.
        let dy = match &ctx.tiles {
            Some(t) => {
                let share = Self::share(t, &g);
                let scaled: Vec<f64> = b.dy.to_f64_vec()?.iter().map(|d| d * share).collect();
                ctx.device.upload(
                    b.dy.shape().clone(),
                    &scaled,
                    b.dy.dtype(),
                    crate::memory::Category::Activations,
                )?
            }
            None => b.dy,
        };
        ctx.device
            .backend()
            .avg_pool_backward(dy.storage(), dx.storage_mut()?, &g)?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, inputs: &[&Shape], _output: &Shape) -> u64 {
        inputs[0].numel() as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Reduces
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}

/// PyTorch's `AdaptiveAvgPool2d((oh, ow))`: C×H×W → C×oh×ow, output row i averaging input rows
/// [⌊i·H/oh⌋, ⌈(i+1)·H/oh⌉) (columns alike). Windows may overlap, and repeat rows when the
/// output is larger than the input.
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveAvgPool {
    /// (height, width) of the output.
    pub out: (usize, usize),
}

impl AdaptiveAvgPool {
    /// The geometry the backend reads: kernel, stride and padding are unused.
    fn geom(&self, x: &Shape) -> PoolGeom {
        let (n, c, h, w) = x.nchw();
        let (ho, wo) = self.out;
        Self::rect_geom(n, c, &Rect::new(0..h, 0..w), &Rect::new(0..ho, 0..wo))
    }

    /// On tiles of an `input` map: the input rectangle output rectangle `out` reads, and the
    /// output rectangle (holding `out`) the pool over just that input computes exactly
    /// ([`tiles::adaptive_rows`]).
    fn tile_rects(&self, out: &Rect, input: (usize, usize)) -> (Rect, Rect) {
        let (rows, out_rows) = tiles::adaptive_rows(out.rows, input.0, self.out.0);
        let (cols, out_cols) = tiles::adaptive_rows(out.cols, input.1, self.out.1);
        (
            Rect { rows, cols },
            Rect {
                rows: out_rows,
                cols: out_cols,
            },
        )
    }

    /// On tiles: every rank's input rectangle.
    pub fn tile_needs(&self, grid: tiles::Grid, input: (usize, usize)) -> Vec<Rect> {
        (0..grid.tiles())
            .map(|q| self.tile_rects(&grid.owned(q, self.out), input).0)
            .collect()
    }

    /// The pool's geometry from input rectangle `src` to output rectangle `out` (windows as
    /// on a map of `src`'s size), for a batch of `n` images of `c` channels.
    fn rect_geom(n: usize, c: usize, src: &Rect, out: &Rect) -> PoolGeom {
        let ((h, w), (h_out, w_out)) = (src.size(), out.size());
        PoolGeom {
            n,
            c,
            h,
            w,
            kh: 0,
            kw: 0,
            stride: (0, 0),
            pad: (0, 0),
            h_out,
            w_out,
        }
    }
}

impl Operator for AdaptiveAvgPool {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        resized("adaptive pool", inputs[0], self.out)
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let be = ctx.device.backend();
        let Some(t) = &ctx.tiles else {
            let g = self.geom(x.shape());
            let mut y = ctx.output(Shape::new([g.n, g.c, g.h_out, g.w_out]), x)?;
            be.adaptive_avg_pool_forward(x.storage(), y.storage_mut()?, &g)?;
            return Ok((y, Saved::default()));
        };
        // The pool over the input rows and columns of whole periods around this rank's
        // output tile, then the tile cut from it.
        let (n, c, _, _) = x.shape().nchw();
        let hw = t.input_hw(0);
        let needs = self.tile_needs(t.tiles.grid, hw);
        let own = t.tiles.own(t.output_hw());
        let (need, wide) = self.tile_rects(&own, hw);
        let src = tiles::gather(ctx, t.tiles, x, hw, &needs)?;
        let g = Self::rect_geom(n, c, &need, &wide);
        let mut y = ctx.output(Shape::new([n, c, g.h_out, g.w_out]), x)?;
        be.adaptive_avg_pool_forward(src.storage(), y.storage_mut()?, &g)?;
        drop(src);
        if wide == own {
            return Ok((y, Saved::default()));
        }
        Ok((
            tiles::within(ctx.device, &y, &wide, &own)?,
            Saved::default(),
        ))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let be = ctx.device.backend();
        let Some(t) = &ctx.tiles else {
            let g = self.geom(&b.inputs[0]);
            let mut dx = ctx.output(b.inputs[0].clone(), &b.dy)?;
            be.adaptive_avg_pool_backward(b.dy.storage(), dx.storage_mut()?, &g)?;
            return Ok(vec![Some(dx)]);
        };
        // The output tile's gradient within the whole periods forward computed (zeros
        // outside the tile), to the input rectangle they read, whose halo goes back.
        let (n, c, _, _) = b.dy.shape().nchw();
        let hw = t.input_hw(0);
        let own = t.tiles.own(t.output_hw());
        let (need, wide) = self.tile_rects(&own, hw);
        let dy = match wide == own {
            true => b.dy,
            false => tiles::embed(ctx.device, &b.dy, &own, &wide)?,
        };
        let g = Self::rect_geom(n, c, &need, &wide);
        let mut dsrc = ctx.output(Shape::new([n, c, g.h, g.w]), &dy)?;
        be.adaptive_avg_pool_backward(dy.storage(), dsrc.storage_mut()?, &g)?;
        drop(dy);
        let needs = self.tile_needs(t.tiles.grid, hw);
        Ok(vec![Some(tiles::scatter_add(
            ctx, t.tiles, dsrc, hw, &needs,
        )?)])
    }

    fn flops(&self, inputs: &[&Shape], _output: &Shape) -> u64 {
        // One add per element of each window (windows overlap, so more than the input).
        let span = |input: usize, out: usize| -> usize {
            (0..out)
                .map(|i| PoolGeom::adaptive_window(i, input, out).len())
                .sum()
        };
        let (c, h, w) = (inputs[0].dim(0), inputs[0].dim(1), inputs[0].dim(2));
        (c * span(h, self.out.0) * span(w, self.out.1)) as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}

/// Average pooling that divides by the input elements a window covers, padding not counted
/// (PyTorch's `count_include_pad=False`, as AmoebaNet's pools use); floor mode only. Computed
/// as the padding-counted average times kh·kw / (elements covered) per output position.
#[derive(Clone, Debug, PartialEq)]
pub struct AvgPoolExcludePad(pub Window);

impl AvgPoolExcludePad {
    /// kh·kw / (input elements covered) for every element of `like` (an output, or its
    /// gradient, of the input `x`), as workspace: on tiles, of this rank's output tile of the
    /// whole map's windows.
    fn scale(&self, ctx: &Ctx, x: &Shape, like: &Tensor) -> Result<Tensor> {
        let (n, c, h, w) = x.nchw();
        let (_, _, h_out, w_out) = like.shape().nchw();
        let ((h, w), first) = match &ctx.tiles {
            Some(t) => {
                let out = t.tiles.own(t.output_hw());
                (t.input_hw(0), (out.rows.0 as usize, out.cols.0 as usize))
            }
            None => ((h, w), (0, 0)),
        };
        let whole = self.0.geom(&Shape::new([n, c, h, w]))?;
        let covered = |o: usize, s: usize, p: usize, k: usize, n: usize| {
            let start = (o * s) as isize - p as isize;
            ((start + k as isize).min(n as isize) - start.max(0)) as f64
        };
        let mut plane = Vec::with_capacity(h_out * w_out);
        for oh in first.0..first.0 + h_out {
            let rows = covered(oh, whole.stride.0, whole.pad.0, whole.kh, whole.h);
            for ow in first.1..first.1 + w_out {
                let cols = covered(ow, whole.stride.1, whole.pad.1, whole.kw, whole.w);
                plane.push((whole.kh * whole.kw) as f64 / (rows * cols));
            }
        }
        let hw = h_out * w_out;
        let plane = ctx.device.upload(
            Shape::new([hw]),
            &plane,
            like.dtype(),
            crate::memory::Category::Workspace,
        )?;
        let mut all = ctx.workspace(n * c * hw, like.dtype())?;
        // Source stride 0: the one plane repeated for every (n, c).
        ctx.device.backend().copy_channels(
            plane.storage(),
            all.storage_mut()?,
            (0, 0),
            (1, 0),
            1,
            n * c,
            hw,
        )?;
        Ok(all)
    }
}

impl Operator for AvgPoolExcludePad {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let out = self.0.infer(inputs[0])?;
        let (_, h, w) = chw(inputs[0])?;
        let floor = (
            window_out(h, self.0.kernel.0, self.0.stride.0, self.0.pad.0, 1)?,
            window_out(w, self.0.kernel.1, self.0.stride.1, self.0.pad.1, 1)?,
        );
        if (out.dim(1), out.dim(2)) != floor {
            return Err("average pooling without padding counted needs floor mode".into());
        }
        Ok(out)
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let be = ctx.device.backend();
        let (mean, _) = self.0.forward(ctx, xs[0], true, |src, g| {
            let mut y = ctx.output(Shape::new([g.n, g.c, g.h_out, g.w_out]), src)?;
            be.avg_pool_forward(src.storage(), y.storage_mut()?, g)?;
            Ok(y)
        })?;
        let scale = self.scale(ctx, xs[0].shape(), &mean)?;
        let mut y = ctx.output(mean.shape().clone(), &mean)?;
        be.mul(mean.storage(), scale.storage(), y.storage_mut()?)?;
        Ok((y, Saved::default()))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (g, needs) = self.0.backward_geom(ctx, &b.inputs[0], true)?;
        let be = ctx.device.backend();
        let scale = self.scale(ctx, &b.inputs[0], &b.dy)?;
        let mut dsum = ctx.workspace(b.dy.numel(), b.dy.dtype())?;
        be.mul(b.dy.storage(), scale.storage(), dsum.storage_mut()?)?;
        drop(scale);
        let mut dx = ctx.output(Shape::new([g.n, g.c, g.h, g.w]), &b.dy)?;
        be.avg_pool_backward(dsum.storage(), dx.storage_mut()?, &g)?;
        drop(dsum);
        Ok(vec![Some(to_input(ctx, dx, needs)?)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        (output.numel() * (self.0.kernel.0 * self.0.kernel.1 + 1)) as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
