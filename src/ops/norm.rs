//! Batch normalization over channels: batch statistics in training, running statistics in eval.
//! Training forward does not touch the running statistics: it leaves its batch statistics in
//! what it saves, and the runtime commits them ([`BatchNorm::commit`], PyTorch's momentum
//! rule) in the order of the reference run, which pipelines and replicas need.
//!
//! With `relu`, the ReLU after it runs in the same op (the models' BN→ReLU pairs): one pass
//! writes max(BN(x), 0), so the normalized tensor before the ReLU never exists, and backward
//! recomputes the ReLU's mask from x, so the op keeps only x, as a plain BN does. The same
//! numbers as the two ops in turn.

use super::tiles::{OnTiles, TileRule};
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
    /// The batch statistics a training forward saved, of an input whose whole samples have
    /// shape `sample` (on tiles, the statistics are the whole map's).
    pub fn batch_stats(saved: &Saved, sample: &Shape) -> Option<BatchStats> {
        let [x, mean, var] = &saved.0[..] else {
            return None;
        };
        Some(BatchStats {
            mean: mean.clone(),
            var: var.clone(),
            count: x.shape().dim(0) * sample.dims()[1..].iter().product::<usize>(),
        })
    }

    /// On tiles: the whole batch's statistics from every tile's (Chan's combination of
    /// (count, mean, variance), in tile order), as tensors beside `x`.
    fn tile_statistics(&self, ctx: &Ctx, t: &OnTiles, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let g = geom(x);
        let grid = t.tiles.grid;
        let mine = ctx.device.backend().batchnorm_statistics(x.storage(), &g)?;
        let mut slots = vec![0.0; grid.tiles() * 2 * g.c];
        let me = t.tiles.tile() * 2 * g.c;
        for (c, (m, v)) in mine.iter().enumerate() {
            (slots[me + 2 * c], slots[me + 2 * c + 1]) = (*m, *v);
        }
        let all = t.tiles.sum(slots)?;
        let whole = t.input_hw(0);
        let counts: Vec<f64> = (0..grid.tiles())
            .map(|q| {
                let (h, w) = grid.owned(q, whole).size();
                (g.n * h * w) as f64
            })
            .collect();
        let total = (g.n * whole.0 * whole.1) as f64;
        let at = |q: usize, c: usize| (all[(q * g.c + c) * 2], all[(q * g.c + c) * 2 + 1]);
        let mut mean = vec![0.0; g.c];
        let mut var = vec![0.0; g.c];
        for c in 0..g.c {
            mean[c] = (0..grid.tiles())
                .map(|q| counts[q] * at(q, c).0)
                .sum::<f64>()
                / total;
            var[c] = (0..grid.tiles())
                .map(|q| {
                    let (m, v) = at(q, c);
                    counts[q] * (v + (m - mean[c]) * (m - mean[c]))
                })
                .sum::<f64>()
                / total;
        }
        let upload = |v: &[f64]| {
            ctx.device.upload(
                Shape::new([g.c]),
                v,
                x.dtype().compute(),
                crate::memory::Category::Activations,
            )
        };
        Ok((upload(&mean)?, upload(&var)?))
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

impl BatchNorm {
    /// Backward on tiles: this tile's sums go into dγ and dβ (which the runtime sums over the
    /// tiles), and dx uses the sums over the whole batch.
    #[allow(clippy::too_many_arguments)]
    fn tile_backward(
        &self,
        ctx: &Ctx,
        t: &OnTiles,
        x: &Tensor,
        dy: &Tensor,
        mean: &Tensor,
        var: &Tensor,
        params: &[Tensor],
        grads: &mut [Tensor],
        dx: &mut Tensor,
    ) -> Result<()> {
        let g = geom(x);
        let be = ctx.device.backend();
        let (gamma, beta) = (params[0].storage(), params[1].storage());
        let relu_beta = self.relu.then_some(beta);
        let (x, dy, mean, var) = (x.storage(), dy.storage(), mean.storage(), var.storage());
        let mine = be.batchnorm_backward_sums(x, dy, relu_beta, gamma, mean, var, self.eps, &g)?;
        for (k, grad) in grads.iter_mut().take(2).enumerate() {
            // dγ takes Σ dy·x̂, dβ Σ dy.
            let part: Vec<f64> = mine
                .iter()
                .map(|s| if k == 0 { s.1 } else { s.0 })
                .collect();
            let part = ctx.device.upload(
                Shape::new([g.c]),
                &part,
                grad.dtype(),
                crate::memory::Category::Workspace,
            )?;
            be.add_assign(grad.storage_mut()?, part.storage())?;
        }
        let flat = t
            .tiles
            .sum(mine.iter().flat_map(|&(a, b)| [a, b]).collect())?;
        let sums: Vec<(f64, f64)> = flat.chunks(2).map(|s| (s[0], s[1])).collect();
        let (h, w) = t.input_hw(0);
        be.batchnorm_backward_dx(
            x,
            dy,
            relu_beta,
            gamma,
            mean,
            var,
            &sums,
            g.n * h * w,
            dx.storage_mut()?,
            self.eps,
            &g,
        )
    }
}

impl BatchNorm {
    /// x normalized with the given statistics (then the fused ReLU): evaluation with the
    /// running ones, tiles with the whole batch's. Memory does not bind where this runs: the
    /// normalized tensor before the ReLU goes through scratch.
    fn normalize(
        &self,
        ctx: &Ctx,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        mean: &Tensor,
        var: &Tensor,
    ) -> Result<Tensor> {
        let be = ctx.device.backend();
        let mut y = ctx.output(x.shape().clone(), x)?;
        let mut normalized = match self.relu {
            true => Some(ctx.workspace(x.numel(), x.dtype())?),
            false => None,
        };
        be.batchnorm_forward_eval(
            x.storage(),
            gamma.storage(),
            beta.storage(),
            mean.storage(),
            var.storage(),
            match &mut normalized {
                Some(t) => t.storage_mut()?,
                None => y.storage_mut()?,
            },
            self.eps,
            &geom(x),
        )?;
        if let Some(t) = normalized {
            be.relu_forward(t.storage(), y.storage_mut()?)?;
        }
        Ok(y)
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
        let [gamma, beta, rmean, rvar] = &params[..] else {
            return Err(crate::Error::Internal(
                "batchnorm expects 4 parameters".into(),
            ));
        };
        if !ctx.training {
            let y = self.normalize(ctx, x, gamma, beta, rmean, rvar)?;
            return Ok((y, Saved::default()));
        }
        if let Some(t) = &ctx.tiles {
            let (mean, var) = self.tile_statistics(ctx, t, x)?;
            let y = self.normalize(ctx, x, gamma, beta, &mean, &var)?;
            return Ok((y, Saved(vec![x.clone(), mean, var])));
        }
        let mut y = ctx.output(x.shape().clone(), x)?;
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
        if let Some(t) = &ctx.tiles {
            self.tile_backward(ctx, t, x, &b.dy, mean, var, params, grads, &mut dx)?;
            return Ok(vec![Some(dx)]);
        }
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

    fn on_tiles(&self) -> TileRule {
        TileRule::Tiled
    }

    fn saves(&self, inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            per_batch: 2 * inputs[0].dim(0),
            ..Default::default()
        }
    }
}
