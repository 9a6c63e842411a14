//! Runs a scheme: each rank executes its task list from the schedule on its own device, sends
//! boundary activations downstream and their gradients upstream, then sums the gradients of
//! each stage over the ranks that hold a copy of it, commits BN statistics in the reference
//! order, and steps the optimizer. Every copy of a stage ends a step with the same bits.
//!
//! The reference for every scheme is `single` with the same micro-batches: a step processes
//! M = D·η·m micro-batches of B/m images, numbered (group, replica, micro-batch); micro-batch g
//! of step t holds images t·M·(B/m) + g·(B/m) onward, each micro-batch's loss counts 1/M, and
//! BN statistics are committed in g order.
//!
//! Evaluation on held-out samples runs a forward-only task list between steps (see
//! `Rank::evaluate`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::cpu::splitmix64;
use crate::backend::meter::ConvWorkspace;
use crate::backend::Device;
use crate::comm::{Comm, Message};
use crate::data::loader::Loader;
use crate::data::Pipeline;
use crate::graph::{self, Graph, Output, Params, RunningUpdate, Tape, ValueId};
use crate::memory::{Category, MemoryStats};
use crate::ops::{batched, loss};
use crate::plan::cost::{DeviceProfile, NodeCosts};
use crate::plan::partition::{self, Partition};
use crate::runtime::optim::{LossScale, Sgd};
use crate::schemes::schedule::{self, Pass, Schedule, Task, Timed};
use crate::schemes::Scheme;
use crate::tensor::{Shape, Storage, Tensor};
use crate::train::{evaluated_output, held_out_samples, Evaluation, Tally, TrainConfig};
use crate::{models, Error, Result};

/// A run: what to train, and how to spread it.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// `batch_size` is B: images per replica pass.
    pub train: TrainConfig,
    pub scheme: Scheme,
    /// Segments per stage; when absent, balanced by predicted cost among the splits that fit
    /// `train.device_memory`.
    pub balance: Option<Vec<usize>>,
    /// Forward passes whose activations a rank may hold at once (`None`: no bound).
    pub max_in_flight: Option<usize>,
    /// Hand every rank's final parameters back in its report (for checks).
    pub return_params: bool,
    /// Allocate everything, compute nothing: predicts each rank's memory exactly.
    pub metered: bool,
    /// Measured node costs to balance and schedule with (the analytical CPU model otherwise).
    pub calibration: Option<std::sync::Arc<crate::plan::calibrate::Calibration>>,
    /// With `train.data.val` > 0, evaluate on the held-out samples after the last step and
    /// after every this many steps before it (what `gems train --val-every` asks for).
    pub val_every: Option<usize>,
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
            return_params: false,
            metered: false,
            calibration: None,
            val_every: None,
        }
    }
}

/// Everything all ranks agree on: the graph, its stages and the schedule.
pub struct Layout {
    pub graph: Graph,
    pub partition: Partition,
    /// Values entering each stage (the boundary before it), in a fixed order.
    pub inputs: Vec<Vec<ValueId>>,
    /// Values leaving each stage for the next.
    pub outputs: Vec<Vec<ValueId>>,
    /// Loss outputs each stage produces.
    pub losses: Vec<Vec<Output>>,
    /// What each node costs: measured (a calibration) or predicted (the analytical CPU model).
    pub costs: NodeCosts,
    /// Seconds of one optimizer step over the whole model (0 without a calibration).
    pub optimizer: f64,
    pub schedule: Schedule,
}

impl Layout {
    pub fn new(c: &RunConfig) -> Result<Layout> {
        let t = &c.train;
        c.scheme.validate(t.batch_size)?;
        t.precision.check(t.dtype).map_err(Error::Config)?;
        let graph = models::build(&t.model, t.image_size, t.classes)?;
        let micro = t.batch_size / c.scheme.parts;
        let costs = match &c.calibration {
            Some(cal) => {
                cal.check(&t.model, t.image_size, t.classes, micro, t.activations())?;
                cal.costs()
            }
            None => NodeCosts::analytic(&graph, micro, t.activations(), &DeviceProfile::CPU),
        };
        let partition = match &c.balance {
            Some(b) if b.len() != c.scheme.stages => {
                return Err(Error::Config(format!(
                    "--balance lists {} stages but --split is {}",
                    b.len(),
                    c.scheme.stages
                )))
            }
            Some(b) => partition::from_balance(&graph, b)?,
            None => crate::plan::memory::split(c, &graph, &costs)?,
        };
        let stages = &partition.stages;
        let inputs = stages
            .iter()
            .map(|r| partition::crossing(&graph, r.start))
            .collect();
        let outputs = stages
            .iter()
            .enumerate()
            .map(|(s, r)| {
                if s + 1 < stages.len() {
                    partition::crossing(&graph, r.end)
                } else {
                    vec![]
                }
            })
            .collect();
        let losses = stages
            .iter()
            .map(|r| {
                graph
                    .outputs
                    .iter()
                    .filter(|o| {
                        graph.values[o.value]
                            .producer
                            .is_some_and(|p| r.contains(&p))
                    })
                    .copied()
                    .collect()
            })
            .collect();
        let schedule = schedule::build(&c.scheme, &costs.stage_costs(stages), c.max_in_flight)?;
        Ok(Layout {
            graph,
            partition,
            inputs,
            outputs,
            losses,
            costs,
            optimizer: c.calibration.as_ref().map_or(0.0, |cal| cal.optimizer),
            schedule,
        })
    }

    /// Predicted seconds of a step: the schedule, then the optimizer. When the ranks share one
    /// device (threads on one CPU), they also share its throughput: the step lasts at least as
    /// long as all their work done one after another.
    pub fn predicted_step(&self, shared_device: bool) -> f64 {
        let busy = self.schedule.busy();
        if shared_device {
            self.schedule.makespan().max(busy.iter().sum()) + self.optimizer
        } else {
            let total: usize = self.graph.params.len().max(1);
            let most = (0..self.partition.stages.len())
                .map(|s| self.param_ids(s).len())
                .max()
                .unwrap_or(0);
            self.schedule.makespan() + self.optimizer * most as f64 / total as f64
        }
    }

    /// Bytes each stage saves for backward per micro-batch of `micro` images.
    pub fn saved_per_micro_batch(&self, dtype: crate::tensor::DType, micro: usize) -> Vec<u64> {
        self.partition
            .stages
            .iter()
            .map(|r| crate::graph::saved_bytes(&self.graph, r.clone(), dtype) * micro as u64)
            .collect()
    }

    /// The param ids of stage `s`'s nodes.
    fn param_ids(&self, s: usize) -> std::ops::Range<usize> {
        let r = &self.partition.stages[s];
        let nodes = &self.graph.nodes[r.clone()];
        let first = nodes.first().map_or(0, |n| n.params.start);
        let last = nodes.last().map_or(first, |n| n.params.end);
        first..last
    }
}

/// One copy of a stage's parameters on a rank: even replicas use orientation 0, odd ones 1.
struct Copy {
    stage: usize,
    orientation: usize,
    params: Params,
    sgd: Sgd,
    /// Batch statistics gathered this step, by global micro-batch.
    running: Vec<(usize, RunningUpdate)>,
}

/// A finished forward waiting for its backward.
struct Pending {
    tape: Tape,
    seeds: Vec<(ValueId, Tensor)>,
}

/// What one rank measured.
#[derive(Clone, Debug)]
pub struct RankReport {
    pub rank: usize,
    /// Seconds computing (forward, backward, loss, optimizer), summed over steps and
    /// evaluations.
    pub busy: f64,
    pub wall: f64,
    /// Seconds stage-0 tasks waited for their images.
    pub data_wait: f64,
    pub memory: MemoryStats,
    /// The host tier's high-water mark (offloaded activations).
    pub host_peak: u64,
    /// Per step: this rank's share of the loss (Σ weight·loss / M over its loss outputs).
    pub losses: Vec<f64>,
    /// Per step: correct predictions of the first output, and images it scored.
    pub correct: Vec<(usize, usize)>,
    /// Per step: wall seconds on this rank.
    pub step_seconds: Vec<f64>,
    /// The last step's tasks with their measured start and end (seconds from the step's start).
    pub timeline: Vec<Timed>,
    /// (param id, values) of every copy, orientation 0 first.
    pub params: Vec<(usize, usize, Vec<f64>)>,
    /// (steps done, evaluation) of each evaluation on the held-out samples; the same on every
    /// rank that reads them (world rank 0 among them), empty on the others.
    pub validation: Vec<(usize, Evaluation)>,
    /// Steps skipped because their gradients overflowed fp16's loss scale.
    pub skipped_steps: usize,
}

struct Rank<'a> {
    c: &'a RunConfig,
    layout: &'a Layout,
    comm: &'a dyn Comm,
    /// The ranks holding copies of this rank's stages (its MAST pair, across groups).
    holders: Box<dyn Comm>,
    device: Device,
    group: usize,
    local: usize,
    copies: Vec<Copy>,
    /// The training data, where this rank makes images (stage 0) or scores a loss.
    data: Option<Arc<Pipeline>>,
    /// The held-out samples, where this rank has the training data and the run validates.
    val: Option<Arc<Pipeline>>,
    /// How many samples are held out (0 when the run does not validate).
    held_out: usize,
    /// Prepares this rank's stage-0 micro-batches in the order its tasks take them.
    loader: Option<Loader>,
    pending: HashMap<(usize, usize), Pending>,
    busy: f64,
    /// fp16's dynamic loss scale (the same on every rank: they skip steps together).
    loss_scale: Option<LossScale>,
}

/// Position (in the data's epoch order) of the first image of global micro-batch `gm` of
/// step `step`: consecutive micro-batches take consecutive runs of positions, so the groups
/// of a data-parallel run share out each epoch's samples, each used once.
fn first_image(c: &RunConfig, step: usize, gm: usize) -> u64 {
    let micro = c.train.batch_size / c.scheme.parts;
    ((step * c.scheme.micro_batches_per_step() + gm) * micro) as u64
}

/// Tag of value `vi` of (pass, replica, stage, micro).
fn tag(
    s: &Scheme,
    pass: Pass,
    replica: usize,
    stage: usize,
    micro: usize,
    vi: usize,
) -> Result<u64> {
    let p = matches!(pass, Pass::Backward) as usize;
    let t = ((((p * s.replicas + replica) * s.stages + stage) * s.parts + micro) * 8 + vi) as u64;
    if t >= crate::comm::COLLECTIVE_TAG {
        return Err(Error::Config(format!(
            "{} replicas × {} stages × {} micro-batches are too many to tag messages",
            s.replicas, s.stages, s.parts
        )));
    }
    Ok(t)
}

fn empty() -> Message {
    Message {
        shape: Shape::new([0]),
        storage: Storage::F32(vec![]),
    }
}

impl<'a> Rank<'a> {
    fn new(c: &'a RunConfig, layout: &'a Layout, comm: &'a dyn Comm) -> Result<Rank<'a>> {
        let s = &c.scheme;
        let (group, local) = (comm.rank() / s.stages, comm.rank() % s.stages);
        let name = format!("rank {}", comm.rank());
        let device = if c.metered {
            Device::meter(
                &name,
                c.train.device_memory,
                ConvWorkspace::of(c.train.device),
            )
        } else {
            Device::open(
                c.train.device,
                c.train.precision,
                c.train.conv,
                &name,
                comm.rank(),
                c.train.device_memory,
            )?
        }
        .with_host_tier(c.train.host_memory, c.train.offload_copy)?;
        let mirrored = s.replicas >= 2;
        let color = if mirrored {
            local.min(s.stages - 1 - local)
        } else {
            local
        };
        let holders = comm.split(color, comm.rank())?;
        let mut copies = Vec::new();
        for orientation in 0..s.replicas.min(2) {
            let stage = s.place(orientation, local);
            let params = Params::init_range(
                &layout.graph,
                &device,
                c.train.dtype,
                c.train.seed,
                layout.param_ids(stage),
            )?;
            let sgd = Sgd::new(&params, &device, c.train.sgd)?;
            copies.push(Copy {
                stage,
                orientation,
                params,
                sgd,
                running: Vec::new(),
            });
        }
        // Only ranks that make images or score losses read data (never a metered run).
        let tasks = &layout.schedule.ranks[local];
        let first_stage: Vec<&Timed> = tasks
            .iter()
            .filter(|t| t.task.pass == Pass::Forward && t.task.stage == 0)
            .collect();
        let scores = tasks
            .iter()
            .any(|t| !layout.losses[t.task.stage].is_empty());
        let validates = !c.metered && c.train.data.val > 0.0;
        let (data, val) = if c.metered || (first_stage.is_empty() && !scores) {
            (None, None)
        } else {
            let t = &c.train;
            let d = crate::data::open(&t.data, t.image_size, t.classes, t.seed)?;
            crate::train::check_classes(t, &d.classes)?;
            (Some(d.train), d.val.filter(|_| validates))
        };
        // Every rank needs the held-out count for its evaluation tasks; world rank 0 makes
        // images, so it has the data to count (the others add 0).
        let held_out = if validates {
            let n = match &val {
                Some(v) if comm.rank() == 0 => held_out_samples(v, None)?,
                _ => 0,
            };
            comm.sum_f64(vec![n as f64])?[0] as usize
        } else {
            0
        };
        let mb = c.train.batch_size / s.parts;
        let loader = match &data {
            Some(d) if !first_stage.is_empty() => {
                let requests = (0..c.train.steps)
                    .flat_map(|step| {
                        first_stage.iter().map(move |t| {
                            let gm = s.global_micro(group, t.task.replica, t.task.micro);
                            (first_image(c, step, gm), mb)
                        })
                    })
                    .collect();
                Some(Loader::new(
                    d.clone(),
                    requests,
                    c.train.data.workers,
                    c.train.data.prefetch,
                ))
            }
            _ => None,
        };
        Ok(Rank {
            c,
            layout,
            comm,
            holders,
            device,
            group,
            local,
            copies,
            data,
            val,
            held_out,
            loader,
            pending: HashMap::new(),
            busy: 0.0,
            loss_scale: c
                .train
                .precision
                .scales_loss()
                .then(|| LossScale::new(c.train.loss_scale)),
        })
    }

    fn world_rank(&self, replica: usize, stage: usize) -> usize {
        self.group * self.c.scheme.stages + self.c.scheme.place(replica, stage)
    }

    fn micro_size(&self) -> usize {
        self.c.train.batch_size / self.c.scheme.parts
    }

    /// Runs a forward task; returns when its computation started (after its inputs arrived).
    fn forward(&mut self, step: usize, t: Task, report: &mut RankReport) -> Result<Instant> {
        let (s, layout) = (&self.c.scheme, self.layout);
        let g = &layout.graph;
        let gm = s.global_micro(self.group, t.replica, t.micro);
        let mb = self.micro_size();
        let feeds: Vec<(ValueId, Tensor)> = if t.stage == 0 {
            let shape = batched(mb, g.input_shape());
            let x = if self.c.metered {
                self.device
                    .zeros(shape, self.c.train.activations(), Category::Activations)?
            } else {
                let loader = self.loader.as_mut().ok_or_else(|| {
                    Error::Internal("a stage-0 task on a rank without a loader".into())
                })?;
                let batch = loader.next_batch()?;
                report.data_wait += batch.waited.as_secs_f64();
                self.device
                    .input(shape, batch.pixels, self.c.train.activations())?
            };
            vec![(g.input, x)]
        } else {
            self.receive(t, t.micro)?
        };
        let start = Instant::now();
        let losses = &layout.losses[t.stage];
        let keep: Vec<ValueId> = layout.outputs[t.stage]
            .iter()
            .copied()
            .chain(losses.iter().map(|o| o.value))
            .collect();
        let seed = splitmix64(self.c.train.seed ^ (step * s.micro_batches_per_step() + gm) as u64);
        let copy = &mut self.copies[t.replica % 2];
        debug_assert_eq!(copy.stage, t.stage);
        let range = layout.partition.stages[t.stage].clone();
        let (outs, mut tape) = graph::forward(
            g,
            &mut copy.params,
            &self.device,
            feeds,
            range,
            &keep,
            Some(&self.c.train.saves),
            t.stage > 0,
            seed,
        )?;
        copy.running.extend(tape.running.drain(..).map(|u| (gm, u)));
        let mut seeds = Vec::new();
        let n_out = layout.outputs[t.stage].len();
        if !losses.is_empty() {
            let labels = match &self.data {
                Some(d) => d.labels(first_image(self.c, step, gm), mb)?,
                // A metered run computes nothing: any labels do.
                None => vec![0; mb],
            };
            let m_total = s.micro_batches_per_step() as f64;
            for (o, logits) in losses.iter().zip(&outs[n_out..]) {
                let (l, probs) = loss::softmax_cross_entropy(&self.device, logits, &labels)?;
                *report.losses.last_mut().expect("a step is open") += o.weight * l / m_total;
                if g.outputs.first() == Some(o) {
                    let c = report.correct.last_mut().expect("a step is open");
                    c.0 += loss::correct(&probs, &labels)?;
                    c.1 += mb;
                }
                seeds.push((
                    o.value,
                    loss::softmax_cross_entropy_backward(
                        &self.device,
                        &probs,
                        &labels,
                        o.weight / m_total
                            * self.loss_scale.as_ref().map_or(1.0, LossScale::factor),
                        self.c.train.activations(),
                    )?,
                ));
            }
        }
        self.device.backend().synchronize()?;
        self.busy += start.elapsed().as_secs_f64();
        self.send(t, t.micro, &outs[..n_out])?;
        self.pending
            .insert((t.replica, t.micro), Pending { tape, seeds });
        Ok(start)
    }

    /// The values entering task `t`'s stage, from the rank of the stage before (messages tagged
    /// as micro-batch `micro`).
    fn receive(&self, t: Task, micro: usize) -> Result<Vec<(ValueId, Tensor)>> {
        let from = self.world_rank(t.replica, t.stage - 1);
        let mut feeds = Vec::new();
        for (vi, &v) in self.layout.inputs[t.stage].iter().enumerate() {
            let tg = tag(&self.c.scheme, Pass::Forward, t.replica, t.stage, micro, vi)?;
            feeds.push((
                v,
                self.comm
                    .recv(from, tg, &self.device, Category::Communication)?,
            ));
        }
        Ok(feeds)
    }

    /// Sends the values leaving task `t`'s stage to the rank of the next (see [`Rank::receive`]).
    fn send(&self, t: Task, micro: usize, outs: &[Tensor]) -> Result<()> {
        if outs.is_empty() {
            return Ok(());
        }
        let to = self.world_rank(t.replica, t.stage + 1);
        for (vi, out) in outs.iter().enumerate() {
            let tg = tag(
                &self.c.scheme,
                Pass::Forward,
                t.replica,
                t.stage + 1,
                micro,
                vi,
            )?;
            self.comm.send(out, to, tg)?;
        }
        Ok(())
    }

    /// Loss, accuracy and confusion counts over the held-out samples, on the ranks that read
    /// them (`None` on the others). The samples go in micro-batches of B/m images, consecutive
    /// runs of them to each group, forward through replica 0's stages in eval mode (nothing
    /// saved, no statistics gathered); each rank adds what it scored (nothing unless it holds
    /// the evaluated output) into one sum over the world. That sum also holds every rank until
    /// all have finished evaluating, so the next step's messages never meet evaluation's.
    fn evaluate(&mut self, report: &mut RankReport) -> Result<Option<Evaluation>> {
        let (c, layout) = (self.c, self.layout);
        let (s, g) = (&c.scheme, &layout.graph);
        let (n, mb) = (self.held_out, self.micro_size());
        let micro = n.div_ceil(mb);
        let per_group = micro.div_ceil(s.dp);
        let first = self.group * per_group;
        let costs = layout.costs.stage_costs(&layout.partition.stages);
        let schedule = schedule::evaluation(s, &costs, per_group.min(micro.saturating_sub(first)))?;
        let tasks: Vec<Task> = schedule.ranks[self.local].iter().map(|t| t.task).collect();
        // Positions of the held-out order (first, count) of this group's micro-batch `j`.
        let span = |j: usize| {
            let at = (first + j) * mb;
            (at as u64, mb.min(n - at))
        };
        let missing = || Error::Internal("an evaluation task on a rank without the data".into());
        let mut loader = match &self.val {
            Some(v) if tasks.iter().any(|t| t.stage == 0) => Some(Loader::new(
                v.clone(),
                tasks.iter().map(|t| span(t.micro)).collect(),
                c.train.data.workers,
                c.train.data.prefetch,
            )),
            _ => None,
        };
        let out = evaluated_output(g)?;
        let mut tally = Tally::new(c.train.classes);
        for t in tasks {
            let (at, len) = span(t.micro);
            let feeds = if t.stage == 0 {
                let batch = loader.as_mut().ok_or_else(missing)?.next_batch()?;
                report.data_wait += batch.waited.as_secs_f64();
                let shape = batched(len, g.input_shape());
                let x = self
                    .device
                    .input(shape, batch.pixels, c.train.activations())?;
                vec![(g.input, x)]
            } else {
                // Micro-batches follow one another between two ranks under one tag (training's
                // for micro-batch 0): both transports deliver a sender's messages of a tag in
                // order, and the sender sent this step's training message first.
                self.receive(t, 0)?
            };
            let start = Instant::now();
            let scores = layout.losses[t.stage].iter().any(|o| o.value == out);
            let n_out = layout.outputs[t.stage].len();
            let keep: Vec<ValueId> = layout.outputs[t.stage]
                .iter()
                .copied()
                .chain(scores.then_some(out))
                .collect();
            let (outs, _) = graph::forward(
                g,
                &mut self.copies[t.replica % 2].params,
                &self.device,
                feeds,
                layout.partition.stages[t.stage].clone(),
                &keep,
                None,
                false,
                0,
            )?;
            if scores {
                let labels = self.val.as_ref().ok_or_else(missing)?.labels(at, len)?;
                tally.add(&self.device, &outs[n_out], &labels)?;
            }
            self.device.backend().synchronize()?;
            self.busy += start.elapsed().as_secs_f64();
            self.send(t, 0, &outs[..n_out])?;
        }
        let sum = self.comm.sum_f64(tally.to_vec())?;
        // The class names are the data's: ranks without it only help.
        Ok(self
            .val
            .as_ref()
            .map(|v| Tally::from_vec(&sum, c.train.classes).finish(v.classes())))
    }

    /// Runs a backward task; returns when its computation started.
    fn backward(&mut self, t: Task) -> Result<Instant> {
        let (s, layout) = (&self.c.scheme, self.layout);
        let Pending { tape, mut seeds } = self
            .pending
            .remove(&(t.replica, t.micro))
            .ok_or_else(|| Error::Internal(format!("backward before forward: {t:?}")))?;
        if t.stage + 1 < s.stages {
            let from = self.world_rank(t.replica, t.stage + 1);
            for (vi, &v) in layout.outputs[t.stage].iter().enumerate() {
                let m = self.comm.recv_message(
                    from,
                    tag(s, Pass::Backward, t.replica, t.stage, t.micro, vi)?,
                )?;
                if m.shape.numel() > 0 {
                    seeds.push((
                        v,
                        self.device
                            .adopt(m.shape, m.storage, Category::Communication)?,
                    ));
                }
            }
        }
        let start = Instant::now();
        let want: &[ValueId] = if t.stage > 0 {
            &layout.inputs[t.stage]
        } else {
            &[]
        };
        let copy = &mut self.copies[t.replica % 2];
        let grads = graph::backward(
            &layout.graph,
            &mut copy.params,
            &self.device,
            tape,
            seeds,
            want,
        )?;
        self.device.backend().synchronize()?;
        self.busy += start.elapsed().as_secs_f64();
        if t.stage > 0 {
            let to = self.world_rank(t.replica, t.stage - 1);
            for (vi, gr) in grads.iter().enumerate() {
                let tg = tag(s, Pass::Backward, t.replica, t.stage - 1, t.micro, vi)?;
                match gr {
                    Some(gr) => self.comm.send(gr, to, tg)?,
                    None => self.comm.send_message(empty(), to, tg)?,
                }
            }
        }
        Ok(start)
    }

    /// Sums each stage's gradients over its copies, commits BN statistics in reference order,
    /// and steps the optimizer.
    fn synchronize(&mut self, step: usize, report: &mut RankReport) -> Result<()> {
        let mut stages: Vec<usize> = self.copies.iter().map(|c| c.stage).collect();
        stages.sort_unstable();
        stages.dedup();
        for stage in stages {
            let idx: Vec<usize> = (0..self.copies.len())
                .filter(|&i| self.copies[i].stage == stage)
                .collect();
            let n = self.copies[idx[0]].params.grads.len();
            for p in 0..n {
                if self.copies[idx[0]].params.grads[p].is_none() {
                    continue;
                }
                // Copies on this rank first (orientation order), then over the holders.
                let mut acc = self.copies[idx[0]].params.grads[p]
                    .take()
                    .expect("trainable");
                for &i in &idx[1..] {
                    let other = self.copies[i].params.grads[p].as_ref().expect("trainable");
                    self.device
                        .backend()
                        .add_assign(acc.storage_mut()?, other.storage())?;
                }
                if self.holders.size() > 1 {
                    self.holders.all_reduce_sum(&mut acc, &self.device)?;
                }
                for &i in &idx[1..] {
                    let grad = self.copies[i].params.grads[p]
                        .as_mut()
                        .expect("trainable")
                        .storage_mut()?;
                    self.device.backend().copy(acc.storage(), grad)?;
                }
                self.copies[idx[0]].params.grads[p] = Some(acc);
            }
            let mine: Vec<(usize, RunningUpdate)> = idx
                .iter()
                .flat_map(|&i| std::mem::take(&mut self.copies[i].running))
                .collect();
            let all = self.gather_running(mine)?;
            for &i in &idx {
                let updates: Vec<RunningUpdate> = all.iter().map(|(_, u)| u.clone()).collect();
                graph::commit_running(
                    &self.layout.graph,
                    &mut self.copies[i].params,
                    &self.device,
                    &updates,
                )?;
            }
        }
        let start = Instant::now();
        let lr = self.c.train.schedule.lr(step);
        let unscale = 1.0 / self.loss_scale.as_ref().map_or(1.0, LossScale::factor);
        let apply = match &mut self.loss_scale {
            // Every rank skips together: an overflow anywhere is an overflow of the step.
            Some(scale) => {
                let mut here = false;
                for copy in &self.copies {
                    here |= LossScale::overflowed(&copy.params, &self.device)?;
                }
                let anywhere = self.comm.sum_f64(vec![here as u8 as f64])?[0] > 0.0;
                if !scale.update(anywhere)? {
                    report.skipped_steps += 1;
                }
                !anywhere
            }
            None => true,
        };
        for copy in &mut self.copies {
            if apply {
                copy.sgd.step(&mut copy.params, &self.device, lr, unscale)?;
            }
            copy.params.zero_grads(&self.device)?;
        }
        self.device.backend().synchronize()?;
        self.busy += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Every holder's batch statistics of one stage, sorted by (micro-batch, node): the order
    /// the reference commits them in.
    fn gather_running(
        &self,
        mine: Vec<(usize, RunningUpdate)>,
    ) -> Result<Vec<(usize, RunningUpdate)>> {
        let h = &*self.holders;
        let tag = crate::comm::COLLECTIVE_TAG + 16;
        let encode = |list: &[(usize, RunningUpdate)]| -> Result<Vec<Message>> {
            let header: Vec<f64> = list
                .iter()
                .flat_map(|(gm, u)| [*gm as f64, u.node as f64, u.stats.count as f64])
                .collect();
            let mut msgs = vec![Message {
                shape: Shape::new([header.len()]),
                storage: Storage::F64(header),
            }];
            for (_, u) in list {
                for t in [&u.stats.mean, &u.stats.var] {
                    msgs.push(Message {
                        shape: t.shape().clone(),
                        storage: t.storage().try_clone()?,
                    });
                }
            }
            Ok(msgs)
        };
        let decode = |from: usize| -> Result<Vec<(usize, RunningUpdate)>> {
            let Storage::F64(header) = h.recv_message(from, tag)?.storage else {
                return Err(Error::Internal("statistics header".into()));
            };
            let mut out = Vec::new();
            for e in header.chunks(3) {
                let mean = h.recv(from, tag, &self.device, Category::Activations)?;
                let var = h.recv(from, tag, &self.device, Category::Activations)?;
                let stats = crate::ops::norm::BatchStats {
                    mean,
                    var,
                    count: e[2] as usize,
                };
                out.push((
                    e[0] as usize,
                    RunningUpdate {
                        node: e[1] as usize,
                        stats,
                    },
                ));
            }
            Ok(out)
        };
        let send = |list: &[(usize, RunningUpdate)], to: usize| -> Result<()> {
            for m in encode(list)? {
                h.send_message(m, to, tag)?;
            }
            Ok(())
        };
        let mut all = if h.rank() == 0 {
            let mut all = mine;
            for r in 1..h.size() {
                all.extend(decode(r)?);
            }
            all.sort_by_key(|(gm, u)| (*gm, u.node));
            for r in 1..h.size() {
                send(&all, r)?;
            }
            all
        } else {
            send(&mine, 0)?;
            decode(0)?
        };
        all.sort_by_key(|(gm, u)| (*gm, u.node));
        Ok(all)
    }

    fn step(&mut self, step: usize, report: &mut RankReport) -> Result<()> {
        report.losses.push(0.0);
        report.correct.push((0, 0));
        let tasks: Vec<Task> = self.layout.schedule.ranks[self.local]
            .iter()
            .map(|t| t.task)
            .collect();
        let step_start = Instant::now();
        report.timeline.clear();
        for t in tasks {
            let computing = match t.pass {
                Pass::Forward => self.forward(step, t, report)?,
                Pass::Backward => self.backward(t)?,
            };
            let (start, end) = (
                (computing - step_start).as_secs_f64(),
                step_start.elapsed().as_secs_f64(),
            );
            report.timeline.push(Timed {
                task: t,
                start,
                end,
            });
        }
        self.synchronize(step, report)
    }
}

/// Runs `steps` steps of `c` as one rank of `comm` (the world), returning what it measured.
pub fn run_rank(c: &RunConfig, layout: &Layout, comm: &dyn Comm) -> Result<RankReport> {
    if comm.size() != c.scheme.world() {
        return Err(Error::Config(format!(
            "the world has {} ranks but the scheme needs P·D = {}·{} = {}",
            comm.size(),
            c.scheme.stages,
            c.scheme.dp,
            c.scheme.world()
        )));
    }
    if c.val_every == Some(0) {
        return Err(Error::Config("--val-every must be at least 1".into()));
    }
    let started = Instant::now();
    let rank = comm.rank();
    let mut r = Rank::new(c, layout, comm)?;
    let mut report = RankReport {
        rank,
        busy: 0.0,
        wall: 0.0,
        data_wait: 0.0,
        memory: r.device.memory(),
        host_peak: 0,
        losses: vec![],
        correct: vec![],
        step_seconds: vec![],
        timeline: vec![],
        params: vec![],
        validation: vec![],
        skipped_steps: 0,
    };
    let steps = c.train.steps;
    for step in 0..steps {
        let start = Instant::now();
        r.step(step, &mut report)?;
        report.step_seconds.push(start.elapsed().as_secs_f64());
        let done = step + 1;
        if r.held_out > 0 && (done == steps || c.val_every.is_some_and(|n| done % n == 0)) {
            if let Some(e) = r.evaluate(&mut report)? {
                report.validation.push((done, e));
            }
        }
    }
    report.busy = r.busy;
    report.wall = started.elapsed().as_secs_f64();
    report.memory = r.device.memory();
    report.host_peak = r.device.host_memory().peak;
    if c.return_params {
        for copy in &r.copies {
            for (i, v) in copy.params.values.iter().enumerate() {
                report
                    .params
                    .push((copy.orientation, copy.params.first + i, v.to_f64_vec()?));
            }
        }
    }
    Ok(report)
}

/// Runs `c` with every rank a thread of this process.
pub fn run_local(c: &RunConfig) -> Result<Vec<RankReport>> {
    // Before the rank threads exist (see the function).
    crate::backend::cpu::tune_host_allocator();
    let layout = Arc::new(Layout::new(c)?);
    crate::comm::local::run(c.scheme.world(), |comm| run_rank(c, &layout, &*comm))
}

/// Every rank's report at rank 0 (`None` elsewhere), parameters left out.
pub fn gather_reports(comm: &dyn Comm, mine: RankReport) -> Result<Option<Vec<RankReport>>> {
    let tag = crate::comm::COLLECTIVE_TAG + 32;
    let encode = |r: &RankReport| -> Vec<f64> {
        let m = &r.memory;
        let mut v = vec![
            r.rank as f64,
            r.busy,
            r.wall,
            r.data_wait,
            r.host_peak as f64,
            m.peak as f64,
            m.capacity.map_or(-1.0, |c| c as f64),
        ];
        v.extend(m.at_peak.0.iter().chain(&m.live.0).map(|&b| b as f64));
        v.push(r.losses.len() as f64);
        v.extend(&r.losses);
        v.extend(r.correct.iter().flat_map(|&(c, n)| [c as f64, n as f64]));
        v
    };
    let skipped_steps = mine.skipped_steps;
    let decode = |v: &[f64]| -> RankReport {
        let bytes = |s: &[f64]| crate::memory::ByCategory(std::array::from_fn(|i| s[i] as u64));
        let steps = v[19] as usize;
        let losses = v[20..20 + steps].to_vec();
        let correct = v[20 + steps..]
            .chunks(2)
            .map(|c| (c[0] as usize, c[1] as usize))
            .collect();
        RankReport {
            rank: v[0] as usize,
            busy: v[1],
            wall: v[2],
            data_wait: v[3],
            host_peak: v[4] as u64,
            memory: MemoryStats {
                peak: v[5] as u64,
                capacity: (v[6] >= 0.0).then_some(v[6] as u64),
                at_peak: bytes(&v[7..13]),
                live: bytes(&v[13..19]),
            },
            losses,
            correct,
            step_seconds: vec![],
            timeline: vec![],
            params: vec![],
            validation: vec![],
            // Every rank skips the same steps.
            skipped_steps,
        }
    };
    if comm.rank() != 0 {
        let v = encode(&mine);
        comm.send_message(
            Message {
                shape: Shape::new([v.len()]),
                storage: Storage::F64(v),
            },
            0,
            tag,
        )?;
        return Ok(None);
    }
    let mut all = vec![mine];
    for r in 1..comm.size() {
        let Storage::F64(v) = comm.recv_message(r, tag)?.storage else {
            return Err(Error::Internal("report message".into()));
        };
        all.push(decode(&v));
    }
    Ok(Some(all))
}
