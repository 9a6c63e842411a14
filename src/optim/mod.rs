//! Optimizers: the [`Optimizer`] trait (an update rule whose state is named tensors per
//! parameter, so checkpoints store it by name and any optimizer resumes under any scheme),
//! SGD, Adam and AdamW as PyTorch defines them, the [`Stepper`] that holds an optimizer's state
//! over a range of parameters and steps them, gradient clipping by global norm, and the dynamic
//! loss scale that fp16 training steps with.

pub mod schedule;

use crate::backend::{AdamStep, SgdStep};
use crate::graph::{Graph, Params};
use crate::memory::Category;
use crate::tensor::Device;
use crate::tensor::{Storage, Tensor};
use crate::{Error, Result};

/// What one parameter's update is given besides its tensors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Update {
    /// Learning rate.
    pub lr: f64,
    /// This parameter's weight decay: the optimizer's, or 0 where its group exempts it.
    pub weight_decay: f64,
    /// Multiplies the gradient before anything else: 1 / the loss scale the gradients carry,
    /// times the clipping factor (1 without either).
    pub grad_scale: f64,
    /// The parameter's step, counted from 1 (steps skipped under fp16 do not count).
    pub step: u64,
}

/// An update rule. Its state is a list of named tensors per parameter, each shaped like the
/// parameter and zero before the first step (PyTorch's `state[p]` names: `momentum_buffer`,
/// `exp_avg`, `exp_avg_sq`), plus the step count the [`Stepper`] keeps; checkpoints store them
/// as `optimizer.<parameter>.<name>`.
pub trait Optimizer: Send + Sync {
    /// The names of the state tensors it keeps per parameter, in the order
    /// [`Optimizer::update`] receives them.
    fn state_names(&self) -> &[&str];
    /// Its weight decay, for the parameters that decay.
    fn weight_decay(&self) -> f64;
    /// Updates `w` from `grad` and its state tensors (in [`Optimizer::state_names`] order).
    fn update(
        &self,
        device: &Device,
        w: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        u: &Update,
    ) -> Result<()>;
}

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

impl Optimizer for SgdConfig {
    fn state_names(&self) -> &[&str] {
        &["momentum_buffer"]
    }
    fn weight_decay(&self) -> f64 {
        self.weight_decay
    }
    fn update(
        &self,
        device: &Device,
        w: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        u: &Update,
    ) -> Result<()> {
        let step = SgdStep {
            lr: u.lr,
            momentum: self.momentum,
            weight_decay: u.weight_decay,
            nesterov: self.nesterov,
            grad_scale: u.grad_scale,
        };
        let [buf] = state else {
            return Err(Error::Internal("SGD keeps one state tensor".into()));
        };
        let b = device.backend();
        b.sgd_update(w.storage_mut()?, grad.storage(), buf.storage_mut()?, &step)
    }
}

/// Adam, or AdamW with `decoupled`, as `torch.optim.Adam` / `torch.optim.AdamW` define them
/// (no amsgrad, no maximize).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Decay rates of the first and second moment estimates (PyTorch: 0.9, 0.999).
    pub betas: (f64, f64),
    /// Added to the bias-corrected second moment's square root (PyTorch: 1e-8).
    pub eps: f64,
    /// Adam: an L2 term added to the gradient; AdamW: the weights shrink by `1 - lr·wd`.
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay.
    pub decoupled: bool,
}

impl AdamConfig {
    /// PyTorch's defaults for Adam (`decoupled` false; weight decay 0) or AdamW (weight decay
    /// 0.01).
    pub fn new(decoupled: bool) -> AdamConfig {
        AdamConfig {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: if decoupled { 0.01 } else { 0.0 },
            decoupled,
        }
    }
}

impl Optimizer for AdamConfig {
    fn state_names(&self) -> &[&str] {
        &["exp_avg", "exp_avg_sq"]
    }
    fn weight_decay(&self) -> f64 {
        self.weight_decay
    }
    fn update(
        &self,
        device: &Device,
        w: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        u: &Update,
    ) -> Result<()> {
        let step = AdamStep {
            lr: u.lr,
            betas: self.betas,
            eps: self.eps,
            weight_decay: u.weight_decay,
            decoupled: self.decoupled,
            step: u.step,
            grad_scale: u.grad_scale,
        };
        let [m, v] = state else {
            return Err(Error::Internal("Adam keeps two state tensors".into()));
        };
        let b = device.backend();
        b.adam_update(
            w.storage_mut()?,
            grad.storage(),
            m.storage_mut()?,
            v.storage_mut()?,
            &step,
        )
    }
}

impl<O: Optimizer + ?Sized> Optimizer for std::sync::Arc<O> {
    fn state_names(&self) -> &[&str] {
        (**self).state_names()
    }
    fn weight_decay(&self) -> f64 {
        (**self).weight_decay()
    }
    fn update(
        &self,
        device: &Device,
        w: &mut Tensor,
        grad: &Tensor,
        state: &mut [Tensor],
        u: &Update,
    ) -> Result<()> {
        (**self).update(device, w, grad, state, u)
    }
}

/// An update rule of the caller's own for a run: stepped on every rank like the built-in
/// ones, its state checkpointed under its names (and restored by them), its `name` recorded
/// in checkpoints.
#[derive(Clone)]
pub struct CustomOptimizer {
    name: String,
    rule: std::sync::Arc<dyn Optimizer>,
}

impl CustomOptimizer {
    /// `rule`, named `name` in checkpoints.
    pub fn new(name: impl Into<String>, rule: impl Optimizer + 'static) -> CustomOptimizer {
        CustomOptimizer {
            name: name.into(),
            rule: std::sync::Arc::new(rule),
        }
    }
}

impl std::fmt::Debug for CustomOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomOptimizer({})", self.name)
    }
}

impl PartialEq for CustomOptimizer {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && std::sync::Arc::ptr_eq(&self.rule, &other.rule)
    }
}

/// Which optimizer a run steps with.
#[derive(Clone, Debug, PartialEq)]
pub enum OptimizerKind {
    /// SGD, with the training configuration's [`SgdConfig`].
    Sgd,
    /// Adam or AdamW.
    Adam(AdamConfig),
    /// The caller's own.
    Custom(CustomOptimizer),
}

impl OptimizerKind {
    /// The update rule, taking SGD's hyper-parameters from `sgd`.
    pub fn optimizer(&self, sgd: SgdConfig) -> std::sync::Arc<dyn Optimizer> {
        match self {
            OptimizerKind::Sgd => std::sync::Arc::new(sgd),
            OptimizerKind::Adam(adam) => std::sync::Arc::new(*adam),
            OptimizerKind::Custom(c) => c.rule.clone(),
        }
    }

    /// Its name on the command line and in checkpoints: `sgd`, `adam`, `adamw`, or a custom
    /// optimizer's.
    pub fn name(&self) -> &str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adam(a) if a.decoupled => "adamw",
            OptimizerKind::Adam(_) => "adam",
            OptimizerKind::Custom(c) => &c.name,
        }
    }
}

/// Whether a parameter is exempt from weight decay when norms and biases are (the usual two
/// PyTorch parameter groups): a norm's scale and shift and every bias are the parameters with
/// at most one dimension.
pub fn is_norm_or_bias(graph: &Graph, id: usize) -> bool {
    graph.params[id].spec.shape.dims().len() <= 1
}

/// One parameter's optimizer state: its named tensors and the steps it has taken.
pub struct ParamState {
    /// Steps taken (the next update is step `steps + 1`).
    pub steps: u64,
    /// The state tensors, in the optimizer's [`Optimizer::state_names`] order.
    pub tensors: Vec<Tensor>,
}

/// An optimizer with its state over a range of parameters (a copy of a stage, or a whole
/// model): state tensors are allocated up front as optimizer state in the accounting, so the
/// first step's peak is the steady one.
pub struct Stepper<O> {
    /// The update rule.
    pub optimizer: O,
    states: Vec<Option<ParamState>>,
    /// Per parameter, whether it decays (all do unless exempted).
    decays: Vec<bool>,
}

/// SGD over a range of parameters.
pub type Sgd = Stepper<SgdConfig>;

impl<O: Optimizer> Stepper<O> {
    /// `optimizer` for the trainable parameters of `params`, with zeroed state on `device`;
    /// every parameter decays.
    pub fn new(params: &Params, device: &Device, optimizer: O) -> Result<Stepper<O>> {
        let n = optimizer.state_names().len();
        let states = params
            .grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|g| {
                        let tensors = (0..n)
                            .map(|_| {
                                device.zeros(g.shape().clone(), g.dtype(), Category::OptimizerState)
                            })
                            .collect::<Result<_>>()?;
                        Ok(ParamState { steps: 0, tensors })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let decays = vec![true; states.len()];
        Ok(Stepper {
            optimizer,
            states,
            decays,
        })
    }

    /// The same with no weight decay on the parameters `exempt` names (by index in the range):
    /// a second parameter group with `weight_decay` 0, as PyTorch users make for norms and
    /// biases ([`is_norm_or_bias`]).
    pub fn exempt_from_decay(mut self, exempt: impl Fn(usize) -> bool) -> Self {
        for (i, d) in self.decays.iter_mut().enumerate() {
            *d = !exempt(i);
        }
        self
    }

    /// The state of each parameter (`None` for those not trained), indexed like the
    /// parameters.
    pub fn states(&self) -> &[Option<ParamState>] {
        &self.states
    }

    /// Replaces the state of each trainable parameter, in order: its steps and its tensors by
    /// name; refuses a state that lacks a tensor the optimizer keeps, naming it.
    pub fn load_states(
        &mut self,
        device: &Device,
        states: Vec<(u64, Vec<(String, Storage)>)>,
    ) -> Result<()> {
        let mut states = states.into_iter();
        let names = self.optimizer.state_names();
        for (i, mine) in self.states.iter_mut().enumerate() {
            let Some(mine) = mine else { continue };
            let (steps, mut tensors) = states
                .next()
                .ok_or_else(|| Error::Internal("too few optimizer states".into()))?;
            for (name, t) in names.iter().zip(&mut mine.tensors) {
                let at = tensors.iter().position(|(n, _)| n == name).ok_or_else(|| {
                    Error::Config(format!(
                        "the optimizer keeps '{name}' for each parameter, but the state of \
                         parameter {i} of this range lacks it (written by another optimizer?)"
                    ))
                })?;
                let (_, data) = tensors.swap_remove(at);
                *t = device.adopt(t.shape().clone(), data, Category::OptimizerState)?;
            }
            mine.steps = steps;
        }
        Ok(())
    }

    /// Updates every trainable parameter from its gradient times `grad_scale` (1 / the loss
    /// scale the gradients carry, times a clipping factor) with learning rate `lr`.
    pub fn step(
        &mut self,
        params: &mut Params,
        device: &Device,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        let weight_decay = self.optimizer.weight_decay();
        for (((w, g), state), &decays) in params
            .values
            .iter_mut()
            .zip(&params.grads)
            .zip(&mut self.states)
            .zip(&self.decays)
        {
            if let (Some(g), Some(state)) = (g, state) {
                state.steps += 1;
                let u = Update {
                    lr,
                    weight_decay: if decays { weight_decay } else { 0.0 },
                    grad_scale,
                    step: state.steps,
                };
                self.optimizer
                    .update(device, w, g, &mut state.tensors, &u)?;
            }
        }
        Ok(())
    }
}

/// The squared L2 norm of each trainable parameter's gradient in `params` (0 for the others),
/// summed in f64 on the host in element order, so every scheme computes the same numbers
/// from the same gradients.
pub fn squared_norms(params: &Params) -> Result<Vec<f64>> {
    params
        .grads
        .iter()
        .map(|g| match g {
            Some(g) => Ok(g.to_f64_vec()?.iter().map(|x| x * x).sum()),
            None => Ok(0.0),
        })
        .collect()
}

/// `torch.nn.utils.clip_grad_norm_`'s factor for gradients whose parameters' squared norms
/// are `squared` (the whole model's, in parameter order) and carry `grad_scale` (1 / the loss
/// scale): min(1, max_norm / (total norm + 1e-6)).
pub fn clip_factor(squared: &[f64], grad_scale: f64, max_norm: f64) -> f64 {
    let norm = squared.iter().sum::<f64>().sqrt() * grad_scale;
    (max_norm / (norm + 1e-6)).min(1.0)
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
