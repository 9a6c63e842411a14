//! Dropout: zeroes elements with probability p and scales the rest by 1/(1-p) in training;
//! the identity in eval. The mask is drawn from the pass's seed, so runs repeat exactly. Each
//! element draws by its place in the whole maps, so on tiles every rank draws exactly its part
//! of the mask one device draws.

use super::tiles::TileRule;
use super::{Backward, Ctx, Operator, Saved, SavesFor};
use crate::backend::MaskGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// Inverted dropout: each value zeroed with probability `p`, the rest scaled by 1/(1-p).
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
}

impl Operator for Dropout {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(format!("dropout probability {} is not in [0, 1)", self.p));
        }
        Ok(inputs[0].clone())
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        _params: &mut [Tensor],
    ) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        if !ctx.training || self.p == 0.0 {
            return Ok((x.clone(), Saved::default()));
        }
        let be = ctx.device.backend();
        let geom = match &ctx.tiles {
            Some(t) => {
                let ((n, c, _, _), (h, w)) = (x.shape().nchw(), t.output_hw());
                MaskGeom {
                    planes: n * c,
                    h,
                    w,
                    window: t.tiles.own((h, w)).window(),
                }
            }
            None => MaskGeom::flat(x.numel()),
        };
        let mut mask = ctx.output(x.shape().clone(), x)?;
        be.dropout_mask(mask.storage_mut()?, self.p, ctx.seed, &geom)?;
        let mut y = ctx.output(x.shape().clone(), x)?;
        be.mul(x.storage(), mask.storage(), y.storage_mut()?)?;
        Ok((y, Saved(vec![mask])))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        _params: &[Tensor],
        _grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let Some(mask) = b.saved.0.first() else {
            return Ok(vec![Some(b.dy)]);
        };
        let mut dx = ctx.output(b.dy.shape().clone(), &b.dy)?;
        ctx.device
            .backend()
            .mul(b.dy.storage(), mask.storage(), dx.storage_mut()?)?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        output.numel() as u64
    }

    fn on_tiles(&self) -> TileRule {
        // Pointwise, but the mask of a tile is its window of the whole maps' mask: the op
        // needs to know its tile.
        TileRule::Tiled
    }

    fn saves(&self, inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            per_sample: inputs[0].numel(),
            ..Default::default()
        }
    }
}
