//! SGD with momentum, weight decay and Nesterov, as PyTorch defines it.

use crate::backend::{Device, SgdStep};
use crate::graph::Params;
use crate::memory::Category;
use crate::tensor::{Storage, Tensor};
use crate::Result;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub momentum: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
}

/// The optimizer and its state: one momentum buffer per trainable parameter (optimizer
/// state in the accounting; allocated up front so the first step's peak is the steady one).
pub struct Sgd {
    pub config: SgdConfig,
    buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    pub fn new(params: &Params, device: &Device, config: SgdConfig) -> Result<Sgd> {
        let buffers = params
            .grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|g| device.zeros(g.shape().clone(), g.dtype(), Category::OptimizerState))
                    .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(Sgd { config, buffers })
    }

    /// The momentum buffers, indexed like the graph's parameters.
    pub fn buffers(&self) -> &[Option<Tensor>] {
        &self.buffers
    }

    /// Replaces the momentum buffers (one per trainable parameter, in order).
    pub fn load_buffers(&mut self, device: &Device, values: Vec<Storage>) -> Result<()> {
        let mut values = values.into_iter();
        for b in self.buffers.iter_mut().flatten() {
            let v = values
                .next()
                .ok_or_else(|| crate::Error::Internal("too few momentum buffers".into()))?;
            *b = device.adopt(b.shape().clone(), v, Category::OptimizerState)?;
        }
        Ok(())
    }

    /// Updates every trainable parameter from its gradient with learning rate `lr`.
    pub fn step(&mut self, params: &mut Params, device: &Device, lr: f64) -> Result<()> {
        let step = SgdStep {
            lr,
            momentum: self.config.momentum,
            weight_decay: self.config.weight_decay,
            nesterov: self.config.nesterov,
        };
        for ((w, g), buf) in params
            .values
            .iter_mut()
            .zip(&params.grads)
            .zip(&mut self.buffers)
        {
            if let (Some(g), Some(buf)) = (g, buf) {
                device.backend().sgd_update(
                    w.storage_mut()?,
                    g.storage(),
                    buf.storage_mut()?,
                    &step,
                )?;
            }
        }
        Ok(())
    }
}
