//! Group normalization, PyTorch's `nn.GroupNorm(groups, C, eps)` (always affine, its
//! default): the channels of each sample fall into `groups` groups of C/groups consecutive
//! channels, each group is normalized by its own mean and biased variance over its channels
//! and planes, then scaled and shifted per channel (`weight`, `bias`).
//!
//! One group is the layer normalization CNNs use: `nn.GroupNorm(1, C)`, each sample's whole
//! C×H×W normalized together, with a scale and shift per channel (not ConvNeXt's
//! `LayerNorm2d`, which normalizes each pixel's C values).
//!
//! The statistics are each sample's own, so training and evaluation compute the same thing,
//! nothing depends on the batch and there are no running statistics. On tiles a group's
//! statistics would need sums over the tiles, as batch norm's do; the op does not implement
//! them: it ends a tiled region ([`TileRule::Whole`], the default), and the samples are whole
//! from it on.
//!
//! [`TileRule::Whole`]: crate::ops::tiles::TileRule::Whole

use super::{Backward, Ctx, Init, Operator, ParamSpec, Saved, SavesFor};
use crate::backend::GroupGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// Group normalization over each sample's groups of channels (see the module).
pub struct GroupNorm {
    /// Groups the channels fall into (1: layer normalization).
    pub groups: usize,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl GroupNorm {
    /// `groups` groups with PyTorch's eps, 1e-5.
    pub fn new(groups: usize) -> GroupNorm {
        GroupNorm { groups, eps: 1e-5 }
    }

    fn geom(&self, x: &Tensor) -> GroupGeom {
        let d = x.shape().dims();
        GroupGeom {
            n: d[0],
            c: d[1],
            groups: self.groups,
            hw: d[2..].iter().product(),
        }
    }
}

impl Operator for GroupNorm {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        let s = inputs[0];
        if s.rank() == 0 {
            return Err("group norm needs a channel dimension".into());
        }
        if s.numel() == 0 {
            return Err(format!("group norm of an empty input {s}"));
        }
        let c = s.dim(0);
        if self.groups == 0 || !c.is_multiple_of(self.groups) {
            return Err(format!(
                "{c} channels do not divide into {} groups",
                self.groups
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(format!(
                "group norm's eps must be positive, got {}",
                self.eps
            ));
        }
        Ok(s.clone())
    }

    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        let c = Shape::new([inputs[0].dim(0)]);
        let spec = |suffix, init| ParamSpec {
            suffix,
            shape: c.clone(),
            init,
            trainable: true,
        };
        vec![spec("weight", Init::Ones), spec("bias", Init::Zeros)]
    }

    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let g = self.geom(x);
        let [gamma, beta] = &params[..] else {
            return Err(crate::Error::Internal(
                "group norm expects 2 parameters".into(),
            ));
        };
        let mut y = ctx.output(x.shape().clone(), x)?;
        let mut mean = ctx.statistics(Shape::new([g.n, g.groups]), x)?;
        let mut var = ctx.statistics(Shape::new([g.n, g.groups]), x)?;
        ctx.device.backend().groupnorm_forward(
            x.storage(),
            gamma.storage(),
            beta.storage(),
            y.storage_mut()?,
            mean.storage_mut()?,
            var.storage_mut()?,
            self.eps,
            &g,
        )?;
        let saved = match ctx.training {
            true => Saved(vec![x.clone(), mean, var]),
            false => Saved::default(),
        };
        Ok((y, saved))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, mean, var] = &b.saved.0[..] else {
            return Err(crate::Error::Internal(
                "group norm backward needs the training-mode forward".into(),
            ));
        };
        let [dgamma, dbeta] = grads else {
            return Err(crate::Error::Internal(
                "group norm expects 2 gradients".into(),
            ));
        };
        let mut dx = ctx.output(x.shape().clone(), x)?;
        ctx.device.backend().groupnorm_backward(
            x.storage(),
            b.dy.storage(),
            params[0].storage(),
            mean.storage(),
            var.storage(),
            dx.storage_mut()?,
            dgamma.storage_mut()?,
            dbeta.storage_mut()?,
            self.eps,
            &self.geom(x),
        )?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // statistics (2 passes) and the affine map, as batch norm
        4 * output.numel() as u64
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            stats_per_sample: 2 * self.groups,
            ..Default::default()
        }
    }
}
