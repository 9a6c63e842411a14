//! Bilinear resizing (PyTorch's `F.interpolate(mode="bilinear")` to an output size), U-Net's
//! parameter-free upsampling. On tiles, a rank computes its output tile from the input rows
//! and columns its taps read (its tile and a halo, [`ResizeGeom::reads`]), and backward
//! returns the halo's gradients to their owners.

use super::tiles::{self, Rect, TileRule};
use super::{resized, Backward, Ctx, Operator, Saved, SavesFor};
use crate::backend::ResizeGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

/// C×H×W → C×Ho×Wo by bilinear interpolation, with PyTorch's `align_corners` (see
/// [`ResizeGeom::align_corners`]). Linear in its input, so backward needs only shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeBilinear {
    /// (height, width) of the output, each ≥ 1.
    pub out: (usize, usize),
    /// PyTorch's `align_corners`.
    pub align_corners: bool,
}

impl ResizeBilinear {
    /// The input rectangle of an `input` map that the taps of output rectangle `out` read.
    fn reads(&self, out: &Rect, input: (usize, usize)) -> Rect {
        let axis = |(first, end): (isize, isize), len: usize, out_len: usize| {
            let r = ResizeGeom::reads(
                first as usize..end as usize,
                len,
                out_len,
                self.align_corners,
            );
            (r.start as isize, r.end as isize)
        };
        Rect {
            rows: axis(out.rows, input.0, self.out.0),
            cols: axis(out.cols, input.1, self.out.1),
        }
    }

    /// On tiles of an `input` map: every rank's input rectangle.
    pub fn tile_needs(&self, grid: tiles::Grid, input: (usize, usize)) -> Vec<Rect> {
        (0..grid.tiles())
            .map(|q| self.reads(&grid.owned(q, self.out), input))
            .collect()
    }

    /// The geometry for inputs of shape `x` (a tile on tiles): on tiles, from this rank's
    /// input rectangle to its output tile, with every rank's input rectangle; else the whole
    /// maps.
    fn geom(&self, ctx: &Ctx, x: &Shape) -> (ResizeGeom, Option<Vec<Rect>>) {
        let (n, c, h, w) = x.nchw();
        let whole = ResizeGeom::whole((n, c), (h, w), self.out, self.align_corners);
        let Some(t) = &ctx.tiles else {
            return (whole, None);
        };
        let (h, w) = t.input_hw(0);
        let needs = self.tile_needs(t.tiles.grid, (h, w));
        let g = ResizeGeom {
            h,
            w,
            input: needs[t.tiles.tile()].window(),
            output: t.tiles.own(self.out).window(),
            ..whole
        };
        (g, Some(needs))
    }
}

impl Operator for ResizeBilinear {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        resized("bilinear resize", inputs[0], self.out)
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let (g, needs) = self.geom(ctx, xs[0].shape());
        let x = match (&ctx.tiles, &needs) {
            (Some(t), Some(needs)) => tiles::gather(ctx, t.tiles, xs[0], t.input_hw(0), needs)?,
            _ => xs[0].clone(),
        };
        let out = Shape::new([g.n, g.c, g.output.h, g.output.w]);
        let mut y = ctx.output(out, &x)?;
        ctx.device
            .backend()
            .resize_bilinear_forward(x.storage(), y.storage_mut()?, &g)?;
        Ok((y, Saved::default()))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (g, needs) = self.geom(ctx, &b.inputs[0]);
        let read = Shape::new([g.n, g.c, g.input.h, g.input.w]);
        let mut dx = ctx.output(read, &b.dy)?;
        ctx.device
            .backend()
            .resize_bilinear_backward(b.dy.storage(), dx.storage_mut()?, &g)?;
        drop(b.dy);
        let dx = match (&ctx.tiles, needs) {
            (Some(t), Some(needs)) => tiles::scatter_add(ctx, t.tiles, dx, t.input_hw(0), &needs)?,
            _ => dx,
        };
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // Four weighted taps per output element, a multiply-add each.
        8 * output.numel() as u64
    }

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
