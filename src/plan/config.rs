//! What a run is: how to train (the optimizer, numerics, memory caps, where saved tensors wait,
//! the data's settings) and how to spread it (the scheme and its split). The model is not part
//! of it: every planner and runtime entry point takes the [`Graph`](crate::graph::Graph) too.

use std::sync::Arc;

use crate::backend::cuda::ConvImpl;
use crate::backend::{CopyMode, DeviceKind};
use crate::data::DataConfig;
use crate::graph::policy::SavePolicy;
use crate::optim::schedule::{Decay, LrSchedule};
use crate::optim::{LossScale, OptimizerKind, SgdConfig};
use crate::plan::calibrate::Calibration;
use crate::schemes::admission::{Admission, Budget, StageBytes};
use crate::schemes::schedule::{self, Schedule, StageCosts, Timeline};
use crate::schemes::Scheme;
use crate::tensor::{DType, Precision};
use crate::{Error, Result};

/// How to train, whatever the model and the scheme.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Images per replica pass (B).
    pub batch_size: usize,
    /// Steps the learning-rate schedule spans (and the loader prepares ahead for).
    pub steps: usize,
    /// The learning rate over the steps.
    pub schedule: LrSchedule,
    /// SGD's hyper-parameters.
    pub sgd: SgdConfig,
    /// The optimizer: SGD (with `sgd`), Adam or AdamW.
    pub optimizer: OptimizerKind,
    /// Gradients clipped to this global L2 norm over the whole model, as
    /// `torch.nn.utils.clip_grad_norm_` (`None`: not clipped).
    pub clip_grad_norm: Option<f64>,
    /// No weight decay on the norms' and biases' parameters (every optimizer).
    pub no_decay_norm_bias: bool,
    /// Seeds the weights, the data order and dropout.
    pub seed: u64,
    /// The parameters' dtype (f32 or f64); `precision` sets the activations'.
    pub dtype: DType,
    /// Device capacity in bytes (`None`: unlimited; emulated on the CPU).
    pub device_memory: Option<u64>,
    /// Capacity of the host tier that offloaded activations wait in (`None`: unlimited).
    pub host_memory: Option<u64>,
    /// How offloaded activations travel to the host tier and back.
    pub offload_copy: CopyMode,
    /// Where each node's saved tensors wait for backward.
    pub saves: SavePolicy,
    /// The loader's settings, and the source a command line names (recorded in checkpoints).
    pub data: DataConfig,
    /// What computes (rank r of a spread run on a GPU takes the r-th GPU from there on).
    pub device: DeviceKind,
    /// What activations are stored in and how products are computed (mixed precision).
    pub precision: Precision,
    /// Which kernels run convolutions on a GPU.
    pub conv: ConvImpl,
    /// fp16's first dynamic loss scale.
    pub loss_scale: f64,
    /// Each class's weight in the loss (`None`: all 1), as PyTorch's `CrossEntropyLoss(weight=)`.
    pub class_weights: Option<Vec<f64>>,
    /// How each step's per-place losses make its loss (the same under every scheme).
    pub loss_reduction: crate::ops::loss::Reduction,
}

impl TrainConfig {
    /// `batch_size` images per step for `steps` steps; SGD with momentum 0.9 and weight decay
    /// 5e-4 at a constant 0.05, no clipping; seed 0, f32 on the CPU, no capacity, synthetic data. Change
    /// the fields for anything else.
    pub fn new(batch_size: usize, steps: usize) -> TrainConfig {
        TrainConfig {
            batch_size,
            steps,
            schedule: LrSchedule {
                base: 0.05,
                decay: Decay::Constant,
                warmup: 0,
                total: steps,
            },
            sgd: SgdConfig {
                momentum: 0.9,
                weight_decay: 5e-4,
                nesterov: false,
            },
            optimizer: OptimizerKind::Sgd,
            clip_grad_norm: None,
            no_decay_norm_bias: false,
            seed: 0,
            dtype: DType::F32,
            device_memory: None,
            host_memory: None,
            offload_copy: CopyMode::default(),
            saves: SavePolicy::keep_all(),
            data: DataConfig::default(),
            device: DeviceKind::Cpu,
            precision: Precision::Fp32,
            conv: ConvImpl::Native,
            loss_scale: LossScale::INITIAL,
            class_weights: None,
            loss_reduction: crate::ops::loss::Reduction::SampleMean,
        }
    }

    /// Refuses, before any work, hyper-parameters no run can train with: what is not finite,
    /// or negative where only a size makes sense.
    pub fn check(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::Config("the batch size must be at least 1".into()));
        }
        let s = &self.schedule;
        let bad = |what: &str, v: f64, allowed: &str| {
            Err(Error::Config(format!(
                "the {what} is {v}; it must be {allowed}"
            )))
        };
        if !(s.base.is_finite() && s.base >= 0.0) {
            return bad("learning rate", s.base, "a finite number ≥ 0");
        }
        if !(self.sgd.momentum.is_finite() && (0.0..1.0).contains(&self.sgd.momentum)) {
            return bad("momentum", self.sgd.momentum, "in [0, 1)");
        }
        if !(self.sgd.weight_decay.is_finite() && self.sgd.weight_decay >= 0.0) {
            return bad("weight decay", self.sgd.weight_decay, "a finite number ≥ 0");
        }
        if let OptimizerKind::Adam(a) = self.optimizer {
            let (b1, b2) = a.betas;
            if let Some(b) = [b1, b2].into_iter().find(|b| !(0.0..1.0).contains(b)) {
                return bad("beta (--betas)", b, "in [0, 1)");
            }
            if !(a.eps.is_finite() && a.eps > 0.0) {
                return bad("epsilon (--eps)", a.eps, "a finite number > 0");
            }
            if !(a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
                return bad("weight decay", a.weight_decay, "a finite number ≥ 0");
            }
        }
        if let Some(n) = self.clip_grad_norm {
            if !(n.is_finite() && n > 0.0) {
                return bad("clipping norm (--clip-grad-norm)", n, "a finite number > 0");
            }
        }
        if let Decay::Step { gamma, .. } = s.decay {
            if !(gamma.is_finite() && gamma > 0.0) {
                return bad("step schedule's factor", gamma, "a finite number > 0");
            }
        }
        if !(self.loss_scale.is_finite() && self.loss_scale > 0.0) {
            return bad("first loss scale", self.loss_scale, "a finite number > 0");
        }
        let weights = self.class_weights.iter().flatten();
        if let Some(&w) = weights.clone().find(|w| !(w.is_finite() && **w >= 0.0)) {
            return bad("class weight", w, "a finite number ≥ 0");
        }
        if self.class_weights.is_some() && weights.sum::<f64>() == 0.0 {
            return Err(Error::Config(
                "the class weights are all 0: no class would count in the loss".into(),
            ));
        }
        Ok(())
    }

    /// The dtype of activations and their gradients (`dtype` is the parameters').
    pub fn activations(&self) -> DType {
        self.precision.activations(self.dtype)
    }

    /// The numbers a run computes with, for headers: `f32`, `f32 (tf32 products)`, or the
    /// activations' and the weights' types.
    pub fn numerics(&self) -> String {
        let weights = self.dtype.name();
        match self.precision {
            Precision::Fp32 => weights.to_string(),
            Precision::Tf32 => format!("{weights} (tf32 products)"),
            Precision::Bf16 => format!("bf16 activations, {weights} weights"),
            Precision::Fp16 => format!(
                "f16 activations (loss scale from {}), {weights} weights",
                self.loss_scale
            ),
        }
    }
}

/// A run: what to train, and how to spread it.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// `batch_size` is B: images per replica pass.
    pub train: TrainConfig,
    /// How the run is spread over ranks.
    pub scheme: Scheme,
    /// Segments per stage; when absent, balanced by predicted cost among the splits that fit
    /// `train.device_memory`.
    pub balance: Option<Vec<usize>>,
    /// A bound by count: forward passes whose activations a rank may hold at once. `None`:
    /// bounded by bytes where replicas share a rank under `train.device_memory` (a replica's
    /// forward starts when the rank's free bytes hold it), else not bounded.
    pub max_in_flight: Option<usize>,
    /// Allocate everything, compute nothing: predicts each rank's memory exactly.
    pub metered: bool,
    /// Measured node costs to balance and schedule with (the fitted CPU model otherwise).
    pub calibration: Option<Arc<Calibration>>,
    /// The tasks each rank runs, where the caller writes them; the scheme's order builds them
    /// otherwise.
    pub schedule: Option<Arc<Schedule>>,
}

impl RunConfig {
    /// `train` spread by `scheme`: split balanced by cost, no bound on activations held, a
    /// real (not metered) run without calibration.
    pub fn new(train: TrainConfig, scheme: Scheme) -> RunConfig {
        RunConfig {
            train,
            scheme,
            balance: None,
            max_in_flight: None,
            metered: false,
            calibration: None,
            schedule: None,
        }
    }

    /// Refuses, before any work, a run no machine can do: hyper-parameters no run trains
    /// with ([`TrainConfig::check`]), scheme sizes that do not fit together or with the batch
    /// ([`Scheme::validate`]), and more images per step (η·B·D) than can be counted.
    pub fn check(&self) -> Result<()> {
        self.train.check()?;
        self.scheme.validate(self.train.batch_size)?;
        let s = &self.scheme;
        s.replicas
            .checked_mul(self.train.batch_size)
            .and_then(|n| n.checked_mul(s.dp))
            .ok_or_else(|| {
                Error::Config(format!(
                    "η·B·D = {}·{}·{} images per step is more than can be counted",
                    s.replicas, self.train.batch_size, s.dp
                ))
            })?;
        Ok(())
    }

    /// The run's tasks with their times under `costs`: its own schedule, checked and replayed,
    /// or the one its order builds, its forwards admitted as [`RunConfig::admission`] says
    /// with stages holding `stages` (where the footprint model gives them).
    pub fn timeline(&self, costs: &StageCosts, stages: Option<&[StageBytes]>) -> Result<Timeline> {
        match &self.schedule {
            Some(s) => {
                s.validate(&self.scheme)?;
                schedule::time(&self.scheme, costs, s)
            }
            None => schedule::build(&self.scheme, costs, &self.admission(stages)),
        }
    }

    /// Whether the run admits forwards by bytes: replicas share its ranks, a capacity is set
    /// and no count bounds them.
    pub fn packs_by_bytes(&self) -> bool {
        self.scheme.replicas >= 2
            && self.train.device_memory.is_some()
            && self.max_in_flight.is_none()
    }

    /// What admits a forward pass on a rank: the user's count, else where the run packs by
    /// bytes and the stages' bytes are known, their bytes against the device memory, else
    /// nothing.
    pub fn admission(&self, stages: Option<&[StageBytes]>) -> Admission {
        match (self.max_in_flight, self.train.device_memory, stages) {
            (Some(n), _, _) => Admission::Count(n),
            (None, Some(cap), Some(stages)) if self.packs_by_bytes() => {
                Admission::Bytes(Budget::new(&self.scheme, cap, stages))
            }
            _ => Admission::Free,
        }
    }

    /// Images of one micro-batch (B/m).
    pub fn micro_batch(&self) -> usize {
        self.train.batch_size / self.scheme.parts
    }

    /// Images one step trains on: η·B·D.
    pub fn images_per_step(&self) -> usize {
        self.scheme.replicas * self.train.batch_size * self.scheme.dp
    }

    /// Host bytes a loading rank's data loader holds at most for `image_size`² inputs: the
    /// prefetched micro-batches and the one being trained on, pixels (f32) and labels
    /// (saturating: sizes from a command line can be anything).
    pub fn loader_bytes(&self, image_size: usize) -> u64 {
        let per_image = (crate::data::CHANNELS * image_size * image_size * 4 + 4) as u64;
        [
            self.train.data.prefetch as u64 + 1,
            self.micro_batch() as u64,
            per_image,
        ]
        .into_iter()
        .fold(1, u64::saturating_mul)
    }
}
