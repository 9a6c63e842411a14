//! Element-wise sum of two tensors of one shape (residual connections), optionally with the
//! ReLU after it fused: one pass over memory instead of two, and the sum never stored.

use super::activation::relu_grad;
use super::{Backward, Ctx, Operator, Saved, SavesFor};
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, Default, PartialEq)]
/// The sum of two values of one shape, or with `relu` max(a + b, 0) (the same bits as an add
/// and a ReLU op).
pub struct Add {
    /// Whether a ReLU follows the sum in the same op; backward then reads the saved output.
    pub relu: bool,
}

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
        let (a, b, be) = (xs[0].storage(), xs[1].storage(), ctx.device.backend());
        if !self.relu {
            be.add(a, b, y.storage_mut()?)?;
            return Ok((y, Saved::default()));
        }
        be.add_relu(a, b, y.storage_mut()?)?;
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
        let ds = if self.relu {
            relu_grad(ctx, &b.saved.0[0], &b.dy)?
        } else {
            b.dy
        };
        // Both inputs receive the sum's gradient itself: shared, never written in place
        // (accumulation copies).
        Ok(b.need.iter().map(|&n| n.then(|| ds.clone())).collect())
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        (1 + self.relu as u64) * output.numel() as u64
    }

    fn on_tiles(&self) -> super::tiles::TileRule {
        super::tiles::TileRule::Pointwise
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            output: self.relu,
            ..Default::default()
        }
    }
}
