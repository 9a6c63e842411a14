//! Bilinear resizing (PyTorch's `F.interpolate(mode="bilinear")` to an output size), U-Net's
//! parameter-free upsampling.

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
    fn geom(&self, x: &Shape) -> ResizeGeom {
        let (n, c, h, w) = x.nchw();
        ResizeGeom {
            n,
            c,
            h,
            w,
            h_out: self.out.0,
            w_out: self.out.1,
            align_corners: self.align_corners,
        }
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
        let x = xs[0];
        let g = self.geom(x.shape());
        let mut y = ctx.activation(Shape::new([g.n, g.c, g.h_out, g.w_out]), x)?;
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
        let g = self.geom(&b.inputs[0]);
        let mut dx = ctx.activation(b.inputs[0].clone(), &b.dy)?;
        ctx.device
            .backend()
            .resize_bilinear_backward(b.dy.storage(), dx.storage_mut()?, &g)?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // Four weighted taps per output element, a multiply-add each.
        8 * output.numel() as u64
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
