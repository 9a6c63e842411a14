//! Ops that only rearrange: flatten (a view), channel concatenation, padding and cropping.

use super::tiles::{self, Rect, TileRule};
use super::{chw, Backward, Ctx, Operator, Saved, SavesFor};
use crate::tensor::{Shape, Tensor};
use crate::Result;

/// C×H×W → C·H·W, sharing the buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Flatten;

impl Operator for Flatten {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        Ok(Shape::new([inputs[0].numel()]))
    }

    fn forward(
        &self,
        _ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let n = x.shape().dim(0);
        Ok((
            x.reshape(Shape::new([n, x.numel() / n.max(1)]))?,
            Saved::default(),
        ))
    }

    fn backward(
        &self,
        _ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(b.dy.reshape(b.inputs[0].clone())?)])
    }

    fn flops(&self, _inputs: &[&Shape], _output: &Shape) -> u64 {
        0
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}

/// Concatenation along channels of images with one H×W.
#[derive(Clone, Debug, PartialEq)]
pub struct Concat;

impl Operator for Concat {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let (_, h, w) = chw(inputs.first().ok_or("concat needs inputs")?)?;
        let mut c = 0;
        for s in inputs {
            let (ci, hi, wi) = chw(s)?;
            if (hi, wi) != (h, w) {
                return Err(format!(
                    "concat needs one image size, got {h}x{w} and {hi}x{wi}"
                ));
            }
            c += ci;
        }
        Ok(Shape::new([c, h, w]))
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let (n, _, h, w) = xs[0].shape().nchw();
        let c_total: usize = xs.iter().map(|x| x.shape().dim(1)).sum();
        let mut y = ctx.output(Shape::new([n, c_total, h, w]), xs[0])?;
        let mut off = 0;
        for x in xs {
            let c = x.shape().dim(1);
            ctx.device.backend().copy_channels(
                x.storage(),
                y.storage_mut()?,
                (c, 0),
                (c_total, off),
                c,
                n,
                h * w,
            )?;
            off += c;
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
        let (n, c_total, h, w) = b.dy.shape().nchw();
        let mut off = 0;
        let mut out = Vec::new();
        for (shape, &need) in b.inputs.iter().zip(b.need) {
            let c = shape.dim(1);
            out.push(if need {
                let mut dx = ctx.output(shape.clone(), &b.dy)?;
                ctx.device.backend().copy_channels(
                    b.dy.storage(),
                    dx.storage_mut()?,
                    (c_total, off),
                    (c, 0),
                    c,
                    n,
                    h * w,
                )?;
                Some(dx)
            } else {
                None
            });
            off += c;
        }
        Ok(out)
    }

    fn flops(&self, _inputs: &[&Shape], _output: &Shape) -> u64 {
        0
    }

    fn on_tiles(&self) -> super::tiles::TileRule {
        TileRule::Pointwise
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}

/// Zero padding of H and W per side, `(top, bottom, left, right)`, where a negative amount
/// crops instead (PyTorch's `F.pad`). AmoebaNet's factorized reduce shifts its second path by
/// one pixel with (-1, 1, -1, 1): `ZeroPad2d((0, 1, 0, 1))(x[:, :, 1:, 1:])`.
#[derive(Clone, Debug, PartialEq)]
pub struct Pad2d {
    /// Rows added above (negative: removed).
    pub top: isize,
    /// Rows added below.
    pub bottom: isize,
    /// Columns added on the left.
    pub left: isize,
    /// Columns added on the right.
    pub right: isize,
}

/// One output row's copy: output row, input row, first output column, first input column,
/// length.
type RowCopy = (usize, usize, usize, usize, usize);

impl Pad2d {
    /// The rows of the output that come from the input, for an `h×w` input and `ho×wo` output.
    fn copies(&self, (h, w): (usize, usize), (ho, wo): (usize, usize)) -> Vec<RowCopy> {
        let j0 = self.left.max(0);
        let j1 = (wo as isize).min(w as isize + self.left);
        if j1 <= j0 {
            return Vec::new();
        }
        (0..ho)
            .filter_map(|i| {
                let r = i as isize - self.top;
                (0..h as isize).contains(&r).then(|| {
                    (
                        i,
                        r as usize,
                        j0 as usize,
                        (j0 - self.left) as usize,
                        (j1 - j0) as usize,
                    )
                })
            })
            .collect()
    }
}

impl Pad2d {
    /// On tiles of an `output` map: every rank's input rectangle, its output tile moved back
    /// by the padding (reaching outside the map where the tile holds padding).
    pub fn tile_needs(&self, grid: tiles::Grid, output: (usize, usize)) -> Vec<Rect> {
        (0..grid.tiles())
            .map(|q| {
                let out = grid.owned(q, output);
                Rect {
                    rows: (out.rows.0 - self.top, out.rows.1 - self.top),
                    cols: (out.cols.0 - self.left, out.cols.1 - self.left),
                }
            })
            .collect()
    }
}

impl Operator for Pad2d {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let (c, h, w) = chw(inputs[0])?;
        let ho = h as isize + self.top + self.bottom;
        let wo = w as isize + self.left + self.right;
        if ho < 1 || wo < 1 {
            return Err(format!(
                "padding ({}, {}, {}, {}) leaves nothing of a {h}x{w} image",
                self.top, self.bottom, self.left, self.right
            ));
        }
        Ok(Shape::new([c, ho as usize, wo as usize]))
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        if let Some(t) = &ctx.tiles {
            // The output tile is the input's rectangle under it: gathered, zeros outside.
            let needs = self.tile_needs(t.tiles.grid, t.output_hw());
            let y = tiles::gather(ctx, t.tiles, x, t.input_hw(0), &needs)?;
            return Ok((y, Saved::default()));
        }
        let (n, c, h, w) = x.shape().nchw();
        let out = self
            .infer(&[&Shape::new([c, h, w])])
            .map_err(crate::Error::Shape)?;
        let (ho, wo) = (out.dim(1), out.dim(2));
        let mut y = ctx.activation(Shape::new([n, c, ho, wo]), x)?;
        // Each row segment is one strided copy over all n·c planes (elements as "channels").
        for (i, r, oj, ij, len) in self.copies((h, w), (ho, wo)) {
            ctx.device.backend().copy_channels(
                x.storage(),
                y.storage_mut()?,
                (h * w, r * w + ij),
                (ho * wo, i * wo + oj),
                len,
                n * c,
                1,
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
        if let Some(t) = &ctx.tiles {
            let needs = self.tile_needs(t.tiles.grid, t.output_hw());
            let dx = tiles::scatter_add(ctx, t.tiles, b.dy, t.input_hw(0), &needs)?;
            return Ok(vec![Some(dx)]);
        }
        let (n, c, h, w) = b.inputs[0].nchw();
        let (_, _, ho, wo) = b.dy.shape().nchw();
        // Every input element lands in at most one output element: copy back, zeros elsewhere.
        let mut dx = ctx.activation(b.inputs[0].clone(), &b.dy)?;
        for (i, r, oj, ij, len) in self.copies((h, w), (ho, wo)) {
            ctx.device.backend().copy_channels(
                b.dy.storage(),
                dx.storage_mut()?,
                (ho * wo, i * wo + oj),
                (h * w, r * w + ij),
                len,
                n * c,
                1,
            )?;
        }
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], _output: &Shape) -> u64 {
        0
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
