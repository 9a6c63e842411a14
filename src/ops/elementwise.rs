//! Element-wise sum of two tensors of one shape (residual connections).

use super::{Backward, Ctx, Operator, Saved, SavesFor};
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// The sum of two values of one shape.
pub struct Add;

impl Operator for Add {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        if inputs.len() != 2 || inputs[0] != inputs[1] {
            let s: Vec<String> = inputs.iter().map(|s| s.to_string()).collect();
            return Err(format!(
                "add needs two equal shapes, got {}",
                s.join(" and ")
            ));
        }
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
            .add(xs[0].storage(), xs[1].storage(), y.storage_mut()?)?;
        Ok((y, Saved::default()))
    }

    fn backward(
        &self,
        _ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        // Both inputs receive dy itself: shared, never written in place (accumulation copies).
        Ok(b.need.iter().map(|&n| n.then(|| b.dy.clone())).collect())
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        output.numel() as u64
    }

    fn on_tiles(&self) -> super::tiles::TileRule {
        super::tiles::TileRule::Pointwise
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor::default()
    }
}
