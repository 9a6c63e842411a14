//! ReLU, whose backward reads the saved output (y > 0 exactly where x > 0), and the smooth
//! activations (SiLU, GELU, sigmoid), whose backward reads the saved input.

use super::{Backward, Ctx, Operator, Saved, SavesFor};
pub use crate::backend::Nonlinearity;
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// max(x, 0).
pub struct Relu;

impl Operator for Relu {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        Ok(inputs[0].clone())
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let mut y = ctx.output(xs[0].shape().clone(), xs[0])?;
        ctx.device
            .backend()
            .relu_forward(xs[0].storage(), y.storage_mut()?)?;
        let saved = Saved(vec![y.clone()]);
        Ok((y, saved))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(relu_grad(ctx, &b.saved.0[0], &b.dy)?)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        output.numel() as u64
    }

    fn on_tiles(&self) -> super::tiles::TileRule {
        super::tiles::TileRule::Pointwise
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            output: true,
            ..Default::default()
        }
    }
}

/// The gradient before a ReLU, from its output `y` and the gradient `dy` after it (also the
/// backward of [`super::elementwise::Add`] with its ReLU fused).
pub(super) fn relu_grad(ctx: &Ctx, y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let mut dx = ctx.output(y.shape().clone(), y)?;
    ctx.device
        .backend()
        .relu_backward(y.storage(), dy.storage(), dx.storage_mut()?)?;
    Ok(dx)
}

#[derive(Clone, Copy, Debug, PartialEq)]
/// A smooth activation, y = f(x) element by element, as PyTorch defines `f` (see
/// [`Nonlinearity`]).
pub struct Smooth(pub Nonlinearity);

impl Operator for Smooth {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        Ok(inputs[0].clone())
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let mut y = ctx.output(x.shape().clone(), x)?;
        ctx.device
            .backend()
            .nonlinearity_forward(self.0, x.storage(), y.storage_mut()?)?;
        Ok((y, Saved(vec![x.clone()])))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let x = &b.saved.0[0];
        let mut dx = ctx.output(x.shape().clone(), x)?;
        ctx.device.backend().nonlinearity_backward(
            self.0,
            x.storage(),
            b.dy.storage(),
            dx.storage_mut()?,
        )?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // Arithmetic per element, a transcendental (exp, erf, tanh) counted as one.
        let per = match self.0 {
            Nonlinearity::Sigmoid => 3,
            Nonlinearity::Silu => 4,
            Nonlinearity::Gelu => 5,
            Nonlinearity::GeluTanh => 9,
        };
        per * output.numel() as u64
    }

    fn on_tiles(&self) -> super::tiles::TileRule {
        super::tiles::TileRule::Pointwise
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }
}
