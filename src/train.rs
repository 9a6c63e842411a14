//! Single-device training: data → forward → loss → backward → SGD, with the numbers a user
//! watches (loss, accuracy, images/s) and the memory the step used.

use std::time::Instant;

use crate::backend::cpu::splitmix64;
use crate::backend::Device;
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
        let (logits, tape) = graph::forward(
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
}
