//! SGD with momentum, weight decay and Nesterov, as PyTorch defines it, and the dynamic loss
//! scale that fp16 training steps it with.

pub mod schedule;

use crate::backend::SgdStep;
use crate::graph::Params;
use crate::memory::Category;
use crate::tensor::Device;
use crate::tensor::{Storage, Tensor};
use crate::Result;

#[derive(Clone, Copy, Debug, PartialEq)]
/// SGD as PyTorch defines it (no dampening).
pub struct SgdConfig {
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// The optimizer and its state: one momentum buffer per trainable parameter (optimizer
/// state in the accounting; allocated up front so the first step's peak is the steady one).
pub struct Sgd {
    /// Its hyper-parameters.
    pub config: SgdConfig,
    buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// An optimizer for `params` with zeroed momentum buffers on `device`.
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

    /// Updates every trainable parameter from its gradient times `grad_scale` (1 / the loss
    /// scale the gradients carry) with learning rate `lr`.
    pub fn step(
        &mut self,
        params: &mut Params,
        device: &Device,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let step = SgdStep {
            lr,
            momentum: self.config.momentum,
            weight_decay: self.config.weight_decay,
            nesterov: self.config.nesterov,
            grad_scale,
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

/// Dynamic loss scaling, as PyTorch's `GradScaler`: the loss gradient is multiplied by the
/// scale so that small gradients stay representable in f16; the optimizer divides it out. A
/// step whose gradients hold an infinity or NaN (the scale was too large) is skipped and the
/// scale halved; after [`LossScale::GROWTH_INTERVAL`] clean steps in a row it doubles. Powers
/// of two, so scaling and unscaling are exact. Gradients that overflow even at
/// [`LossScale::FLOOR`] are not a matter of scale (activations beyond f16's range, a loss
/// that is already infinite): that is an error, not an endless run of skipped steps.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScale {
    scale: f64,
    /// Clean steps since the scale last changed.
    clean: usize,
    /// Steps skipped so far.
    skipped: usize,
}

impl LossScale {
    /// PyTorch's default first scale, 2^16.
    pub const INITIAL: f64 = 65536.0;
    /// Clean steps after which the scale doubles (PyTorch's default).
    pub const GROWTH_INTERVAL: usize = 2000;
    /// The smallest scale, 2^-16: gradients as large as f16's range over this cannot be real.
    pub const FLOOR: f64 = 1.0 / 65536.0;

    /// A scale starting at `initial` (rounded down to a power of two, at least the floor).
    pub fn new(initial: f64) -> LossScale {
        LossScale {
            scale: 2f64.powi(initial.max(Self::FLOOR).log2().floor() as i32),
            clean: 0,
            skipped: 0,
        }
    }

    /// What the loss gradient is multiplied by this step.
    pub fn factor(&self) -> f64 {
        self.scale
    }

    /// Steps skipped so far because their gradients overflowed.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Records whether this step's gradients overflowed; returns whether to apply the step.
    pub fn update(&mut self, overflowed: bool) -> Result<bool> {
        if overflowed {
            if self.scale <= Self::FLOOR {
                return Err(crate::Error::Config(format!(
                    "fp16 gradients overflow even at loss scale {} ({} steps skipped): \
                     activations or the loss are beyond f16's range (65504); train in bf16, \
                     which has f32's range",
                    self.scale, self.skipped
                )));
            }
            self.scale /= 2.0;
            self.clean = 0;
            self.skipped += 1;
            return Ok(false);
        }
        self.clean += 1;
        if self.clean == Self::GROWTH_INTERVAL {
            self.scale *= 2.0;
            self.clean = 0;
        }
        Ok(true)
    }

    /// Whether any gradient in `params` holds an infinity or NaN.
    pub fn overflowed(params: &Params, device: &Device) -> Result<bool> {
        for g in params.grads.iter().flatten() {
            if !device.backend().all_finite(g.storage())? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::LossScale;

    #[test]
    fn loss_scale_halves_on_overflow_and_doubles_after_clean_steps() {
        assert_eq!(LossScale::new(100.0).factor(), 64.0);
        assert_eq!(LossScale::new(0.0).factor(), LossScale::FLOOR);
        let mut s = LossScale::new(LossScale::INITIAL);
        let update = |s: &mut LossScale, overflowed| s.update(overflowed).unwrap();
        assert!(!update(&mut s, true));
        assert_eq!((s.factor(), s.skipped()), (LossScale::INITIAL / 2.0, 1));
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            assert!(update(&mut s, false));
        }
        assert_eq!(s.factor(), LossScale::INITIAL / 2.0);
        assert!(update(&mut s, false));
        assert_eq!(s.factor(), LossScale::INITIAL);
        // An overflow resets the count of clean steps.
        for _ in 0..10 {
            update(&mut s, false);
        }
        update(&mut s, true);
        for _ in 0..LossScale::GROWTH_INTERVAL - 1 {
            update(&mut s, false);
        }
        assert_eq!(s.factor(), LossScale::INITIAL / 2.0);
        // Down to the floor (2^15 to 2^-16: 31 halvings), then an overflow is an error.
        for _ in 0..31 {
            assert!(!update(&mut s, true));
        }
        assert_eq!((s.factor(), s.skipped()), (LossScale::FLOOR, 33));
        let e = s.update(true).unwrap_err().to_string();
        assert!(e.contains("train in bf16"), "{e}");
    }
}
