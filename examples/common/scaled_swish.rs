//! An op written outside the crate against gems' public op interface: a Swish with a learnable
//! slope per channel, y = x·σ(β_c·x), β starting at 1. It computes on the host in f64 through
//! `Ctx::host_output`, so it runs on every device, and on the metering device (which holds no
//! elements) only allocates: the planner counts it like a built-in op. Shared by
//! examples/custom_op.rs and tests/custom_op.rs.

use gems::ops::tiles::TileRule;
use gems::ops::{Backward, Ctx, Init, Operator, ParamSpec, Saved, SavesFor};
use gems::{Shape, Tensor};

/// y = x·σ(β_c·x) with a learnable β per channel.
pub struct ScaledSwish;

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// The channel of element `i` of an N×C×H×W tensor.
fn channel_of(i: usize, x: &Tensor) -> usize {
    let (_, c, h, w) = x.shape().nchw();
    i / (h * w) % c
}

impl Operator for ScaledSwish {
    fn infer(&self, inputs: &[&Shape]) -> Result<Shape, String> {
        match inputs[0].dims() {
            [_, _, _] => Ok(inputs[0].clone()),
            _ => Err(format!("scaled swish expects C×H×W, got {}", inputs[0])),
        }
    }

    fn params(&self, inputs: &[&Shape]) -> Vec<ParamSpec> {
        vec![ParamSpec {
            suffix: "beta",
            shape: Shape::new([inputs[0].dim(0)]),
            init: Init::Ones,
            trainable: true,
        }]
    }

    fn forward(
        &self,
        ctx: &Ctx,
        xs: &[&Tensor],
        params: &mut [Tensor],
    ) -> gems::Result<(Tensor, Saved)> {
        let x = xs[0];
        let y = ctx.host_output(x.shape().clone(), x, |y| {
            let (xv, beta) = (x.to_f64_vec()?, params[0].to_f64_vec()?);
            for (i, y) in y.iter_mut().enumerate() {
                *y = xv[i] * sigmoid(beta[channel_of(i, x)] * xv[i]);
            }
            Ok(())
        })?;
        // Backward recomputes σ from the input: the input is all it keeps.
        Ok((y, Saved(vec![x.clone()])))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> gems::Result<Vec<Option<Tensor>>> {
        let x = &b.saved.0[0];
        let mut dbeta = vec![0.0; x.shape().dim(1)];
        let dx = ctx.host_output(x.shape().clone(), x, |dx| {
            let (xv, dy, beta) = (x.to_f64_vec()?, b.dy.to_f64_vec()?, params[0].to_f64_vec()?);
            for (i, dx) in dx.iter_mut().enumerate() {
                let (c, xi) = (channel_of(i, x), xv[i]);
                let s = sigmoid(beta[c] * xi);
                let ds = s * (1.0 - s);
                *dx = dy[i] * (s + beta[c] * xi * ds);
                dbeta[c] += dy[i] * xi * xi * ds;
            }
            Ok(())
        })?;
        // Parameter gradients add up over micro-batches.
        ctx.accumulate(&mut grads[0], &dbeta)?;
        Ok(vec![Some(dx)])
    }

    fn flops(&self, _inputs: &[&Shape], output: &Shape) -> u64 {
        // A multiply for β·x, about 4 for the sigmoid, one for x·σ.
        6 * output.numel() as u64
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }

    fn on_tiles(&self) -> TileRule {
        // Each output pixel from the same input pixel: it runs as it is on tiles.
        TileRule::Pointwise
    }
}
