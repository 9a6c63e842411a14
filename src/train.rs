//! Single-device training: data → forward → loss → backward → SGD, with the numbers a user
//! watches (loss, accuracy, images/s) and the memory the step used.

use std::time::Instant;

use crate::backend::cpu::splitmix64;
use crate::backend::Device;
use crate::checkpoint::Checkpoint;
use crate::data::synthetic::Synthetic;
use crate::graph::{self, Graph, Params};
use crate::memory::{Category, MemoryStats};
use crate::ops::{batched, loss};
use crate::runtime::optim::{Sgd, SgdConfig};
use crate::runtime::schedule::LrSchedule;
use crate::tensor::DType;
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
}

impl TrainConfig {
    /// `model` on `image_size`² images of `classes` classes, `batch_size` images per step for
    /// `steps` steps; SGD with momentum 0.9 and weight decay 5e-4 at a constant 0.05; seed 0,
    /// f32, no capacity. Change the fields for anything else.
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
}

/// The result of [`Trainer::evaluate`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    pub samples: usize,
    pub loss: f64,
    pub accuracy: f64,
}

/// Salt of the held-out data stream.
const EVAL_STREAM: u64 = 0x4556_414c;

/// A model, its parameters and optimizer on one device, and its data.
pub struct Trainer {
    pub graph: Graph,
    pub params: Params,
    pub device: Device,
    pub sgd: Sgd,
    pub config: TrainConfig,
    data: Synthetic,
    step: usize,
}

impl Trainer {
    /// Builds the model and its state; fails before any work on a bad configuration.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        if config.batch_size == 0 {
            return Err(Error::Config("the batch size must be at least 1".into()));
        }
        let graph = models::build(&config.model, config.image_size, config.classes)?;
        let device = Device::cpu("cpu:0", config.device_memory);
        let params = Params::init(&graph, &device, config.dtype, config.seed)?;
        let sgd = Sgd::new(&params, &device, config.sgd)?;
        let data = Synthetic {
            seed: config.seed,
            classes: config.classes,
            image_size: config.image_size,
        };
        Ok(Trainer {
            graph,
            params,
            device,
            sgd,
            config,
            data,
            step: 0,
        })
    }

    /// Runs one optimizer step on the next batch.
    pub fn step(&mut self) -> Result<StepReport> {
        let start = Instant::now();
        let b = self.config.batch_size;
        let (pixels, labels) = self.data.batch((self.step * b) as u64, b);
        let x_shape = batched(b, self.graph.input_shape());
        let x = self
            .device
            .upload(x_shape, &pixels, self.config.dtype, Category::Activations)?;
        drop(pixels);
        self.params.zero_grads(&self.device)?;
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
            true,
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
                correct = loss::correct(&probs, &labels);
            }
            total += out.weight * l;
            seeds.push((
                out.value,
                loss::softmax_cross_entropy_backward(&self.device, &probs, &labels, out.weight)?,
            ));
        }
        graph::backward(g, &mut self.params, &self.device, tape, seeds, &[])?;
        let lr = self.config.schedule.lr(self.step);
        self.sgd.step(&mut self.params, &self.device, lr)?;
        let report = StepReport {
            step: self.step,
            loss: total,
            correct,
            batch: b,
            lr,
            seconds: start.elapsed().as_secs_f64(),
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

    /// A trainer restored from a checkpoint, with its configuration, at its step.
    pub fn resume(path: &std::path::Path, device_memory: Option<u64>) -> Result<Trainer> {
        let ckpt = Checkpoint::read(path)?;
        let mut config = ckpt.config()?;
        config.device_memory = device_memory;
        let mut t = Trainer::new(config)?;
        ckpt.restore(&mut t)?;
        Ok(t)
    }

    /// Loss and accuracy of the first output used outside training over `samples` held-out
    /// images, with BN in eval mode and no dropout (an auxiliary classifier is not computed);
    /// changes nothing.
    pub fn evaluate(&mut self, samples: usize, batch_size: usize) -> Result<Evaluation> {
        if samples == 0 || batch_size == 0 {
            return Err(Error::Config(
                "evaluation needs at least one sample and a batch of at least 1".into(),
            ));
        }
        // Held-out images: another seed's stream, never used for training.
        let held_out = Synthetic {
            seed: splitmix64(self.config.seed ^ EVAL_STREAM),
            ..self.data
        };
        let g = &self.graph;
        let out = g
            .outputs
            .iter()
            .find(|o| !o.training_only)
            .ok_or_else(|| Error::Config(format!("{} has no output to evaluate", g.name)))?
            .value;
        let (mut loss, mut correct, mut done) = (0.0, 0, 0);
        while done < samples {
            let b = batch_size.min(samples - done);
            let (pixels, labels) = held_out.batch(done as u64, b);
            let x = self.device.upload(
                batched(b, g.input_shape()),
                &pixels,
                self.config.dtype,
                Category::Activations,
            )?;
            let (logits, _) = graph::forward(
                g,
                &mut self.params,
                &self.device,
                vec![(g.input, x)],
                0..g.nodes.len(),
                &[out],
                false,
                false,
                0,
            )?;
            let (l, probs) = loss::softmax_cross_entropy(&self.device, &logits[0], &labels)?;
            loss += l * b as f64;
            correct += loss::correct(&probs, &labels);
            done += b;
        }
        Ok(Evaluation {
            samples,
            loss: loss / samples as f64,
            accuracy: correct as f64 / samples as f64,
        })
    }
}
