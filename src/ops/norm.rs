//! Batch normalization over channels: batch statistics in training, running statistics in eval.
//! Training forward does not touch the running statistics: it leaves its batch statistics in
//! what it saves, and the runtime commits them ([`BatchNorm::commit`], PyTorch's momentum
//! rule) in the order of the reference run, which pipelines and replicas need.
//!
//! With `relu`, the ReLU after it runs in the same op (the models' BN→ReLU pairs): one pass
//! writes max(BN(x), 0), so the normalized tensor before the ReLU never exists, and backward
//! recomputes the ReLU's mask from x, so the op keeps only x, as a plain BN does. The same
//! numbers as the two ops in turn.

use super::{Backward, Ctx, Init, Operator, ParamSpec, Saved, SavesFor};
use crate::backend::ChannelGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// Batch normalization over (N, H, W) per channel, with learned scale and shift and running statistics.
pub struct BatchNorm {
    /// Added to the variance before the square root.
    pub eps: f64,
    /// Weight of the new batch's statistics in the running ones (PyTorch's momentum).
    pub momentum: f64,
    /// A ReLU fused after the normalization.
    pub relu: bool,
}

impl Default for BatchNorm {
    fn default() -> Self {
        BatchNorm {
            eps: 1e-5,
            momentum: 0.1,
            relu: false,
        }
    }
}

fn geom(x: &Tensor) -> ChannelGeom {
    let d = x.shape().dims();
    ChannelGeom {
        n: d[0],
        c: d[1],
        hw: d[2..].iter().product(),
    }
}

/// One training forward's batch statistics, to be committed to the running statistics.
#[derive(Clone, Debug)]
pub struct BatchStats {
    /// Mean per channel.
    pub mean: Tensor,
    /// Biased variance.
    pub var: Tensor,
    /// Elements per channel they were taken over.
    pub count: usize,
}

impl BatchNorm {
    /// The batch statistics a training forward saved.
    pub fn batch_stats(saved: &Saved) -> Option<BatchStats> {
        let [x, mean, var] = &saved.0[..] else {
            return None;
        };
        let d = x.shape().dims();
        Some(BatchStats {
            mean: mean.clone(),
            var: var.clone(),
            count: d[0] * d[2..].iter().product::<usize>(),
        })
    }

    /// running = (1 - momentum)·running + momentum·batch (unbiased variance), on this node's
    /// parameters [weight, bias, running_mean, running_var].
    pub fn commit(
        &self,
        device: &crate::tensor::Device,
        params: &mut [Tensor],
        stats: &BatchStats,
    ) -> Result<()> {
        let [_, _, rmean, rvar] = params else {
            return Err(crate::Error::Internal(
                "batchnorm expects 4 parameters".into(),
            ));
        };
        device.backend().batchnorm_update_running(
            rmean.storage_mut()?,
            rvar.storage_mut()?,
            stats.mean.storage(),
            stats.var.storage(),
            self.momentum,
            stats.count,
        )
    }
}

impl Operator for BatchNorm {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        if inputs[0].rank() == 0 {
            return Err("batchnorm needs a channel dimension".into());
        }
        Ok(inputs[0].clone())
    }

    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        let c = Shape::new([inputs[0].dim(0)]);
        let spec = |suffix, init, trainable| ParamSpec {
            suffix,
            shape: c.clone(),
            init,
            trainable,
        };
        vec![
            spec("weight", Init::Ones, true),
            spec("bias", Init::Zeros, true),
            spec("running_mean", Init::Zeros, false),
            spec("running_var", Init::Ones, false),
        ]
    }

    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let g = geom(x);
        let be = ctx.device.backend();
        let mut y = ctx.output(x.shape().clone(), x)?;
        let [gamma, beta, rmean, rvar] = &params[..] else {
            return Err(crate::Error::Internal(
                "batchnorm expects 4 parameters".into(),
            ));
        };
        if !ctx.training {
            // Evaluation is not where memory binds: the normalized tensor goes through scratch.
            let mut normalized = match self.relu {
                true => Some(ctx.workspace(x.numel(), x.dtype())?),
                false => None,
            };
            be.batchnorm_forward_eval(
                x.storage(),
                gamma.storage(),
                beta.storage(),
                rmean.storage(),
                rvar.storage(),
                match &mut normalized {
                    Some(t) => t.storage_mut()?,
                    None => y.storage_mut()?,
                },
                self.eps,
                &g,
            )?;
            if let Some(t) = normalized {
                be.relu_forward(t.storage(), y.storage_mut()?)?;
            }
            return Ok((y, Saved::default()));
        }
        let mut mean = ctx.statistics(Shape::new([g.c]), x)?;
        let mut var = ctx.statistics(Shape::new([g.c]), x)?;
        let forward = match self.relu {
            true => crate::backend::Backend::batchnorm_relu_forward_train,
            false => crate::backend::Backend::batchnorm_forward_train,
        };
        forward(
            be,
            x.storage(),
            gamma.storage(),
            beta.storage(),
            y.storage_mut()?,
            mean.storage_mut()?,
            var.storage_mut()?,
            self.eps,
            &g,
        )?;
        Ok((y, Saved(vec![x.clone(), mean, var])))
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
                "batchnorm backward needs the training-mode forward".into(),
            ));
        };
        let g = geom(x);
        let mut dx = ctx.output(x.shape().clone(), x)?;
        let (dgamma, rest) = grads.split_at_mut(1);
        let be = ctx.device.backend();
        let (dy, gamma, beta) = (b.dy.storage(), params[0].storage(), params[1].storage());
        let (dgamma, dbeta) = (dgamma[0].storage_mut()?, rest[0].storage_mut()?);
        let (mean, var, eps) = (mean.storage(), var.storage(), self.eps);
        let x = x.storage();
        match self.relu {
            true => be.batchnorm_relu_backward(
                x,
                dy,
                gamma,
                beta,
                mean,
                var,
                dx.storage_mut()?,
                dgamma,
                dbeta,
                eps,
                &g,
            )?,
            false => be.batchnorm_backward(
                x,
                dy,
                gamma,
                mean,
                var,
                dx.storage_mut()?,
                dgamma,
                dbeta,
                eps,
                &g,
            )?,
        }
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // statistics (2 passes) and the affine map, and the ReLU's max
        (4 + self.relu as u64) * output.numel() as u64
    }

    fn saves(&self, inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            per_batch: 2 * inputs[0].dim(0),
            ..Default::default()
        }
    }
}
