//! Single-device training: data → forward → loss → backward → SGD, with the numbers a user
//! watches (loss, accuracy, images/s) and the memory the step used.

use std::time::Instant;

use crate::backend::cpu::splitmix64;
use crate::backend::cuda::ConvImpl;
use crate::backend::{CopyMode, Device, DeviceKind};
use crate::checkpoint::Checkpoint;
use crate::data::loader::{Batch, Loader};
use crate::data::{DataConfig, Dataset, Pipeline};
use crate::graph::policy::SavePolicy;
use crate::graph::{self, Graph, Params, ValueId};
use crate::memory::MemoryStats;
use crate::ops::{batched, loss};
use crate::runtime::optim::{LossScale, Sgd, SgdConfig};
use crate::runtime::schedule::LrSchedule;
use crate::tensor::{DType, Precision, Tensor};
use crate::{models, Error, Result};

#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub model: String,
    pub image_size: usize,
    pub classes: usize,
    pub batch_size: usize,
    pub steps: usize,
    pub schedule: LrSchedule,
    pub sgd: SgdConfig,
    pub seed: u64,
    pub dtype: DType,
    /// Emulated device capacity in bytes (`None`: unlimited).
    pub device_memory: Option<u64>,
    /// Capacity of the host tier that offloaded activations wait in (`None`: unlimited).
    pub host_memory: Option<u64>,
    /// How offloaded activations travel to the host tier and back.
    pub offload_copy: CopyMode,
    /// Where each node's saved tensors wait for backward.
    pub saves: SavePolicy,
    pub data: DataConfig,
    /// What computes (rank r of a spread run on a GPU takes the r-th GPU from there on).
    pub device: DeviceKind,
    /// What activations are stored in and how products are computed (mixed precision).
    pub precision: Precision,
    /// Which kernels run convolutions on a GPU.
    pub conv: ConvImpl,
    /// fp16's first dynamic loss scale.
    pub loss_scale: f64,
}

impl TrainConfig {
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

    /// `model` on `image_size`² images of `classes` classes, `batch_size` images per step for
    /// `steps` steps; SGD with momentum 0.9 and weight decay 5e-4 at a constant 0.05; seed 0,
    /// f32 on the CPU, no capacity, synthetic data. Change the fields for anything else.
    pub fn new(
        model: &str,
        image_size: usize,
        classes: usize,
        batch_size: usize,
        steps: usize,
    ) -> TrainConfig {
        TrainConfig {
            model: model.to_string(),
            image_size,
            classes,
            batch_size,
            steps,
            schedule: LrSchedule {
                base: 0.05,
                decay: crate::runtime::schedule::Decay::Constant,
                warmup: 0,
                total: steps,
            },
            sgd: SgdConfig {
                momentum: 0.9,
                weight_decay: 5e-4,
                nesterov: false,
            },
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
        }
    }
}

/// What one optimizer step did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    pub step: usize,
    pub loss: f64,
    /// Correct predictions of the first output in this batch.
    pub correct: usize,
    pub batch: usize,
    pub lr: f64,
    pub seconds: f64,
    /// Of which the step waited for its batch.
    pub data_wait: f64,
    /// The loss scale the gradients carried (fp16), and whether they overflowed it, so the
    /// step was skipped.
    pub loss_scale: Option<f64>,
    pub skipped: bool,
}

/// The result of [`Trainer::evaluate`].
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    pub samples: usize,
    pub loss: f64,
    pub accuracy: f64,
    pub classes: Vec<String>,
    /// `confusion[true][predicted]` counts.
    pub confusion: Vec<Vec<usize>>,
}

impl Evaluation {
    /// Samples of each true class.
    pub fn per_class(&self) -> Vec<usize> {
        self.confusion.iter().map(|row| row.iter().sum()).collect()
    }
}

/// An evaluation's running totals: the loss summed over samples, and the confusion counts.
pub(crate) struct Tally {
    pub loss: f64,
    pub confusion: Vec<Vec<usize>>,
}

impl Tally {
    pub fn new(classes: usize) -> Tally {
        Tally {
            loss: 0.0,
            confusion: vec![vec![0; classes]; classes],
        }
    }

    /// Scores one batch's logits against its labels.
    pub fn add(&mut self, device: &Device, logits: &Tensor, labels: &[u32]) -> Result<()> {
        let (l, probs) = loss::softmax_cross_entropy(device, logits, labels)?;
        self.loss += l * labels.len() as f64;
        for (&t, p) in labels.iter().zip(loss::predictions(&probs)?) {
            self.confusion[t as usize][p as usize] += 1;
        }
        Ok(())
    }

    /// The loss, then the counts row by row: what ranks sum.
    pub fn to_vec(&self) -> Vec<f64> {
        let counts = self.confusion.iter().flatten().map(|&n| n as f64);
        std::iter::once(self.loss).chain(counts).collect()
    }

    pub fn from_vec(v: &[f64], classes: usize) -> Tally {
        Tally {
            loss: v[0],
            confusion: v[1..]
                .chunks(classes)
                .map(|row| row.iter().map(|&n| n as usize).collect())
                .collect(),
        }
    }

    /// The evaluation over the samples scored: their count comes from the tally, so a batch
    /// scored twice or not at all shows.
    pub fn finish(self, classes: &[String]) -> Evaluation {
        let samples: usize = self.confusion.iter().flatten().sum();
        let correct: usize = (0..classes.len()).map(|c| self.confusion[c][c]).sum();
        let n = samples.max(1) as f64;
        Evaluation {
            samples,
            loss: self.loss / n,
            accuracy: correct as f64 / n,
            classes: classes.to_vec(),
            confusion: self.confusion,
        }
    }
}

/// Samples an evaluation of `data` covers: `samples` of them (default: all), or an error for an
/// endless stream without a count.
pub(crate) fn held_out_samples(data: &Pipeline, samples: Option<usize>) -> Result<usize> {
    let samples = match (samples, data.samples()) {
        (Some(n), Some(len)) => n.min(len),
        (Some(n), None) | (None, Some(n)) => n,
        (None, None) => {
            return Err(Error::Config(
                "say how many samples to evaluate of an endless stream".into(),
            ))
        }
    };
    if samples == 0 {
        return Err(Error::Config("evaluation needs at least one sample".into()));
    }
    Ok(samples)
}

/// The output evaluation scores: the first one used outside training.
pub(crate) fn evaluated_output(g: &Graph) -> Result<ValueId> {
    g.outputs
        .iter()
        .find(|o| !o.training_only)
        .map(|o| o.value)
        .ok_or_else(|| Error::Config(format!("{} has no output to evaluate", g.name)))
}

/// A model, its parameters and optimizer on one device, and its data.
pub struct Trainer {
    pub graph: Graph,
    pub params: Params,
    pub device: Device,
    pub sgd: Sgd,
    pub config: TrainConfig,
    pub data: Dataset,
    /// Prepares the coming steps' batches.
    loader: Option<Loader>,
    step: usize,
    /// fp16's dynamic loss scale.
    pub loss_scale: Option<LossScale>,
}

impl Trainer {
    /// Builds the model and its state; fails before any work on a bad configuration.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        if config.batch_size == 0 {
            return Err(Error::Config("the batch size must be at least 1".into()));
        }
        config
            .precision
            .check(config.dtype)
            .map_err(Error::Config)?;
        let data = crate::data::open(&config.data, config.image_size, config.classes, config.seed)?;
        check_classes(&config, &data.classes)?;
        let graph = models::build(&config.model, config.image_size, config.classes)?;
        let name = match config.device {
            DeviceKind::Cpu => "cpu:0".to_string(),
            gpu => gpu.to_string(),
        };
        let device = Device::open(
            config.device,
            config.precision,
            config.conv,
            &name,
            0,
            config.device_memory,
        )?
        .with_host_tier(config.host_memory, config.offload_copy)?;
        let params = Params::init(&graph, &device, config.dtype, config.seed)?;
        let sgd = Sgd::new(&params, &device, config.sgd)?;
        let loss_scale = config
            .precision
            .scales_loss()
            .then(|| LossScale::new(config.loss_scale));
        Ok(Trainer {
            graph,
            params,
            device,
            sgd,
            config,
            data,
            loader: None,
            step: 0,
            loss_scale,
        })
    }

    /// Step `self.step`'s batch, from a loader preparing the batches up to the last step.
    fn next_batch(&mut self) -> Result<Batch> {
        let b = self.config.batch_size;
        let first = (self.step * b) as u64;
        let loader = match &mut self.loader {
            Some(l) if l.upcoming() == Some(first) => l,
            _ => {
                let d = &self.config.data;
                let requests = (self.step..self.config.steps.max(self.step + 1))
                    .map(|s| ((s * b) as u64, b))
                    .collect();
                self.loader.insert(Loader::new(
                    self.data.train.clone(),
                    requests,
                    d.workers,
                    d.prefetch,
                ))
            }
        };
        loader.next_batch()
    }

    /// Runs one optimizer step on the next batch.
    pub fn step(&mut self) -> Result<StepReport> {
        let start = Instant::now();
        let b = self.config.batch_size;
        let Batch {
            pixels,
            labels,
            waited,
        } = self.next_batch()?;
        let x_shape = batched(b, self.graph.input_shape());
        let x = self
            .device
            .input(x_shape, pixels, self.config.activations())?;
        self.params.zero_grads(&self.device)?;
        let scale = self.loss_scale.as_ref().map_or(1.0, LossScale::factor);
        let g = &self.graph;
        let outputs: Vec<_> = g.outputs.iter().collect();
        let keep: Vec<usize> = outputs.iter().map(|o| o.value).collect();
        let seed = splitmix64(self.config.seed ^ self.step as u64);
        let (logits, mut tape) = graph::forward(
            g,
            &mut self.params,
            &self.device,
            vec![(g.input, x)],
            0..g.nodes.len(),
            &keep,
            Some(&self.config.saves),
            false,
            seed,
        )?;
        let running = std::mem::take(&mut tape.running);
        graph::commit_running(g, &mut self.params, &self.device, &running)?;
        drop(running);
        let mut total = 0.0;
        let mut correct = 0;
        let mut seeds = Vec::new();
        for (i, (out, logits)) in outputs.iter().zip(logits).enumerate() {
            let (l, probs) = loss::softmax_cross_entropy(&self.device, &logits, &labels)?;
            drop(logits);
            if i == 0 {
                correct = loss::correct(&probs, &labels)?;
            }
            total += out.weight * l;
            seeds.push((
                out.value,
                loss::softmax_cross_entropy_backward(
                    &self.device,
                    &probs,
                    &labels,
                    out.weight * scale,
                    self.config.activations(),
                )?,
            ));
        }
        graph::backward(g, &mut self.params, &self.device, tape, seeds, &[])?;
        let lr = self.config.schedule.lr(self.step);
        let apply = match &mut self.loss_scale {
            Some(s) => s.update(LossScale::overflowed(&self.params, &self.device)?)?,
            None => true,
        };
        if apply {
            self.sgd
                .step(&mut self.params, &self.device, lr, 1.0 / scale)?;
        }
        self.device.backend().synchronize()?;
        let report = StepReport {
            step: self.step,
            loss: total,
            correct,
            batch: b,
            lr,
            seconds: start.elapsed().as_secs_f64(),
            data_wait: waited.as_secs_f64(),
            loss_scale: self.loss_scale.as_ref().map(|_| scale),
            skipped: !apply,
        };
        self.step += 1;
        Ok(report)
    }

    pub fn memory(&self) -> MemoryStats {
        self.device.memory()
    }

    /// Optimizer steps taken so far.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Continues from step `step` (after restoring a checkpoint).
    pub fn set_step(&mut self, step: usize) {
        self.step = step;
    }

    /// A trainer restored from a checkpoint, with its configuration (changed by `adjust`:
    /// the capacity, the loader's settings), at its step.
    pub fn resume(
        path: &std::path::Path,
        adjust: impl FnOnce(&mut TrainConfig),
    ) -> Result<Trainer> {
        let ckpt = Checkpoint::read(path)?;
        let mut config = ckpt.config()?;
        adjust(&mut config);
        let mut t = Trainer::new(config)?;
        ckpt.restore(&mut t)?;
        Ok(t)
    }

    /// Loss, accuracy and confusion matrix of the first output used outside training over
    /// the held-out samples (all of a validation split, or `samples` of synthetic data's
    /// held-out stream), with BN in eval mode and no dropout; changes nothing.
    pub fn evaluate(&mut self, samples: Option<usize>, batch_size: usize) -> Result<Evaluation> {
        let val = self.data.val.clone().ok_or_else(|| {
            Error::Config("nothing is held out: train with --val to hold out a split".into())
        })?;
        self.evaluate_on(&val, samples, batch_size)
    }

    /// [`Trainer::evaluate`] over the first `samples` (default: all) of `data`'s epoch order.
    pub fn evaluate_on(
        &mut self,
        data: &std::sync::Arc<Pipeline>,
        samples: Option<usize>,
        batch_size: usize,
    ) -> Result<Evaluation> {
        let samples = held_out_samples(data, samples)?;
        if batch_size == 0 {
            return Err(Error::Config(
                "evaluation needs a batch of at least 1".into(),
            ));
        }
        check_classes(&self.config, data.classes())?;
        let g = &self.graph;
        let out = evaluated_output(g)?;
        let mut tally = Tally::new(self.config.classes);
        let requests = (0..samples)
            .step_by(batch_size)
            .map(|first| (first as u64, batch_size.min(samples - first)))
            .collect();
        let d = &self.config.data;
        let mut loader = Loader::new(data.clone(), requests, d.workers, d.prefetch);
        for _ in (0..samples).step_by(batch_size) {
            let Batch { pixels, labels, .. } = loader.next_batch()?;
            let b = labels.len();
            let x = self.device.input(
                batched(b, g.input_shape()),
                pixels,
                self.config.activations(),
            )?;
            let (logits, _) = graph::forward(
                g,
                &mut self.params,
                &self.device,
                vec![(g.input, x)],
                0..g.nodes.len(),
                &[out],
                None,
                false,
                0,
            )?;
            tally.add(&self.device, &logits[0], &labels)?;
        }
        Ok(tally.finish(data.classes()))
    }
}

/// The model's classes must be the data's.
pub(crate) fn check_classes(config: &TrainConfig, names: &[String]) -> Result<()> {
    if names.len() == config.classes {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{} has {} classes but the model has {} outputs",
        config.data.source,
        names.len(),
        config.classes
    )))
}
