//! Ops that only rearrange: flatten (a view) and channel concatenation.

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
        let mut y = ctx.activation(Shape::new([n, c_total, h, w]), xs[0])?;
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
                let mut dx = ctx.activation(shape.clone(), &b.dy)?;
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

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
