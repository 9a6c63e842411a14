//! Fully connected layer: y = x·Wᵀ + b with W of shape (out, in), as in PyTorch.

use super::{Backward, Ctx, Init, Operator, ParamSpec, Saved, SavesFor};
use crate::backend::ChannelGeom;
use crate::tensor::{Shape, Tensor};
use crate::Result;

#[derive(Clone, Debug, PartialEq)]
/// A fully connected layer, y = x·Wᵀ + b (weights `[d_out, d_in]`), of each sample's
/// elements as one vector.
pub struct Linear {
    /// Input features.
    pub d_in: usize,
    /// Output features.
    pub d_out: usize,
    /// Whether it adds a bias.
    pub bias: bool,
}

impl Operator for Linear {
    fn infer(&self, inputs: &[&Shape]) -> std::result::Result<Shape, String> {
        // Row-major elements are the flattened vector: any shape of d_in elements is read as
        // one ([C, 1, 1] after a global pool).
        if inputs[0].numel() == self.d_in {
            Ok(Shape::new([self.d_out]))
        } else {
            Err(format!(
                "linear expects {} elements per sample, got {}",
                self.d_in, inputs[0]
            ))
        }
    }

    fn params(&self, _inputs: &[&Shape]) -> Vec<ParamSpec> {
        // PyTorch's default: U(-1/√in, 1/√in) for weight and bias.
        let bound = 1.0 / (self.d_in as f64).sqrt();
        let mut p = vec![ParamSpec {
            suffix: "weight",
            shape: Shape::new([self.d_out, self.d_in]),
            init: Init::Uniform(bound),
            trainable: true,
        }];
        if self.bias {
            p.push(ParamSpec {
                suffix: "bias",
                shape: Shape::new([self.d_out]),
                init: Init::Uniform(bound),
                trainable: true,
            });
        }
        p
    }

    fn forward(&self, ctx: &Ctx, xs: &[&Tensor], params: &mut [Tensor]) -> Result<(Tensor, Saved)> {
        let x = xs[0];
        let n = x.shape().dim(0);
        let be = ctx.device.backend();
        let mut y = ctx.output(Shape::new([n, self.d_out]), x)?;
        be.linear_forward(
            x.storage(),
            params[0].storage(),
            y.storage_mut()?,
            n,
            self.d_in,
            self.d_out,
        )?;
        if self.bias {
            be.add_channel_bias(
                y.storage_mut()?,
                params[1].storage(),
                &ChannelGeom {
                    n,
                    c: self.d_out,
                    hw: 1,
                },
            )?;
        }
        Ok((y, Saved(vec![x.clone()])))
    }

    fn backward(
        &self,
        ctx: &Ctx,
        b: Backward,
        params: &[Tensor],
        grads: &mut [Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let x = &b.saved.0[0];
        let n = x.shape().dim(0);
        let be = ctx.device.backend();
        let mut dx = if b.need[0] {
            Some(ctx.output(x.shape().clone(), x)?)
        } else {
            None
        };
        let dx_storage = match dx.as_mut() {
            Some(t) => Some(t.storage_mut()?),
            None => None,
        };
        be.linear_backward(
            x.storage(),
            params[0].storage(),
            b.dy.storage(),
            dx_storage,
            grads[0].storage_mut()?,
            n,
            self.d_in,
            self.d_out,
        )?;
        if self.bias {
            be.channel_sum(
                b.dy.storage(),
                grads[1].storage_mut()?,
                &ChannelGeom {
                    n,
                    c: self.d_out,
                    hw: 1,
                },
            )?;
        }
        Ok(vec![dx])
    }

    fn flops(&self, _inputs: &[&Shape], _output: &Shape) -> u64 {
        (2 * self.d_in * self.d_out + if self.bias { self.d_out } else { 0 }) as u64
    }

    fn saves(&self, _inputs: &[&Shape]) -> SavesFor {
        SavesFor {
            inputs: true,
            ..Default::default()
        }
    }
}
