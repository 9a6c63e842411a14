//! One rank of a run: it executes its task list from the schedule on its own device: passes,
//! boundary activations sent downstream and their gradients upstream, each stage's REDUCE
//! (its gradients summed over the ranks that hold a copy of it) and the STEP (BN statistics
//! committed in the reference order, the optimizer). Every copy of a stage ends a step with
//! the same bits.
//!
//! The reference for every scheme is `single` with the same micro-batches: a step processes
//! M = D·η·m micro-batches of B/m images, numbered (group, replica, micro-batch); micro-batch g
//! of a step holds the images from the step's data position + g·(B/m) onward, each
//! micro-batch's loss counts 1/M (or, reduced as PyTorch does, its labelled pixels' share of
//! the whole step's weight, summed from the step's masks before it runs), and BN statistics
//! are committed in g order.
//!
//! A single-device run is the one-rank case. Ranks are driven one call at a time by a
//! [`Session`](super::Session); each call is collective: every rank of the world makes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::meter::ConvWorkspace;
use crate::comm::{self, Comm, Message};
use crate::core::rng::splitmix64;
use crate::data::loader::Loader;
use crate::data::{Pipeline, UNLABELLED};
use crate::graph::{self, Params, RunningUpdate, Tape, ValueId, WeightWork};
use crate::memory::{Category, Held, MemoryStats};
use crate::ops::tiles::{self, Tiles};
use crate::ops::{batched, loss};
use crate::optim::{self, LossScale, Optimizer, Stepper};
use crate::plan::{Layout, RunConfig};
use crate::runtime::checkpoint::{batchnorm_nodes, OptimizerState, TrainingState};
use crate::runtime::evaluation::{evaluated_output, Evaluation, SampleScore, Tally};
use crate::schemes::schedule::{self, Pass, Task, Timed};
use crate::schemes::Scheme;
use crate::tensor::Device;
use crate::tensor::{Shape, Storage, Tensor};
use crate::{Error, Result};

/// One copy of a stage's parameters on a rank: even replicas use orientation 0, odd ones 1.
struct Copy {
    stage: usize,
    orientation: usize,
    params: Params,
    optimizer: Stepper<Arc<dyn Optimizer>>,
    /// Batch statistics gathered this step, by global micro-batch.
    running: Vec<(usize, RunningUpdate)>,
}

/// A finished forward waiting for its backward.
struct Pending {
    tape: Tape,
    seeds: Vec<(ValueId, Tensor)>,
}

/// What one rank did in one step.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RankStep {
    /// The world rank.
    pub rank: usize,
    /// This rank's share of the step's loss (Σ weight·loss / M over its loss outputs).
    #[serde(with = "crate::runtime::f64_bits")]
    pub loss: f64,
    /// Correct predictions of the first output on this rank: of images, or of labelled pixels.
    pub correct: usize,
    /// Images (or labelled pixels) it scored.
    pub scored: usize,
    /// Wall seconds of the step on this rank, and of them computing (forward, backward, loss,
    /// optimizer).
    pub seconds: f64,
    /// Seconds of them it spent computing.
    pub busy: f64,
    /// Seconds stage-0 tasks waited for their images.
    pub data_wait: f64,
    /// Seconds it waited for halos from the other tiles (spatial parallelism): the exchange's
    /// cost that computing did not hide.
    pub halo_wait: f64,
    /// fp16's loss scale the step's gradients carried, and whether they overflowed it (on any
    /// rank), so the step was skipped.
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped.
    pub skipped: bool,
    /// The device's memory: the peak so far, and bytes by category.
    pub memory: MemoryStats,
    /// The host tier's high-water mark (offloaded activations).
    pub host_peak: u64,
    /// The step's tasks with their measured start and end (seconds from the step's start).
    pub timeline: Vec<Timed>,
    /// The device's bytes during each task of `timeline`: the most live at once, and what
    /// was live when it ended (on a metered run, exactly what a real run holds).
    pub held: Vec<Held>,
}

/// (orientation, param id, values) of every copy's parameters (or gradients) on one rank,
/// orientation 0 first.
pub type CopyValues = Vec<(usize, usize, Vec<f64>)>;

pub(crate) struct Rank {
    c: Arc<RunConfig>,
    layout: Arc<Layout>,
    comm: Box<dyn Comm>,
    /// The ranks holding copies of this rank's stages (its MAST pair, across groups).
    holders: Box<dyn Comm>,
    device: Device,
    group: usize,
    /// This rank's pipeline position in its group, and its tile there (0 where it has none).
    slot: usize,
    tile: usize,
    /// The ranks holding the other tiles of this rank's samples, where they are split.
    tiles: Option<Tiles>,
    /// Ranks of this process whose operators share its CPU pool (every rank, for threads).
    pub(crate) pool_sharers: usize,
    copies: Vec<Copy>,
    /// The training data, where this rank makes images (stage 0) or scores a loss.
    data: Option<Arc<Pipeline>>,
    /// Prepares this rank's stage-0 micro-batches in the order its tasks take them.
    loader: Option<Loader>,
    /// Forwards waiting for their backward, by (replica, stage, micro-batch).
    pending: HashMap<(usize, usize, usize), Pending>,
    /// Split backwards (B) waiting for their weight pass (W), by the same key.
    weights: HashMap<(usize, usize, usize), WeightWork>,
    /// What RECV_F and RECV_B tasks received, waiting for the F or backward that computes with
    /// it, by the receive task.
    received: HashMap<Task, Vec<(ValueId, Tensor)>>,
    /// An F's outputs waiting for its SEND_F, by that task.
    activations_out: HashMap<Task, Vec<Tensor>>,
    /// A backward's input gradients (none where an input takes none) waiting for its SEND_B,
    /// by that task.
    gradients_out: HashMap<Task, Vec<Option<Tensor>>>,
    /// fp16's dynamic loss scale (the same on every rank: they skip steps together).
    loss_scale: Option<LossScale>,
    /// Steps done, and the position in the data's epoch order of the next step's first image.
    step: usize,
    position: u64,
    /// Each BN node's `num_batches_tracked` (see [`TrainingState::batches_tracked`]).
    batches_tracked: Vec<u64>,
    /// The step being run.
    current: RankStep,
    /// The step's total weight of labelled places, where this rank scores a loss reduced as
    /// PyTorch does (see [`loss::Norm::Total`]).
    step_weight: f64,
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
    let stages = s.model_stages();
    let t = ((((p * s.replicas + replica) * stages + stage) * s.parts + micro) * 8 + vi) as u64;
    if t >= crate::comm::COLLECTIVE_TAG {
        return Err(Error::Config(format!(
            "{} replicas × {} stages × {} micro-batches are too many to tag messages",
            s.replicas, stages, s.parts
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

/// Tag of the messages that gather a checkpoint's tensors at world rank 0.
const STATE_TAG: u64 = crate::comm::COLLECTIVE_TAG + 48;

impl Rank {
    /// This process's or thread's rank of `comm`, with `data` where it makes images or scores
    /// a loss (a metered run reads nothing).
    pub fn new(
        c: Arc<RunConfig>,
        layout: Arc<Layout>,
        comm: Box<dyn Comm>,
        data: Option<Arc<Pipeline>>,
    ) -> Result<Rank> {
        let s = c.scheme;
        if comm.size() != s.world() {
            return Err(Error::Config(format!(
                "the world has {} ranks but the scheme needs {} ({} per group × D = {})",
                comm.size(),
                s.world(),
                s.group_size(),
                s.dp,
            )));
        }
        let (group, local) = (comm.rank() / s.group_size(), comm.rank() % s.group_size());
        let (slot, tile) = s.slot_of(local);
        // One device is named as such; ranks by their number.
        let name = match (s.world(), c.train.device) {
            (1, crate::backend::DeviceKind::Cpu) => "cpu:0".to_string(),
            (1, gpu) => gpu.to_string(),
            _ => format!("rank {}", comm.rank()),
        };
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
        let mut comm = comm;
        comm.attach(&device)?;
        let color = if s.replicas >= 2 {
            slot.min(s.stages - 1 - slot)
        } else {
            slot
        };
        let holders = comm.split(color, comm.rank())?;
        // Every rank splits the world (a collective); the tiles of one position of one group
        // form a group, rank t holding tile t.
        let tile_group = comm.split(group * s.stages + slot, tile)?;
        let tiles = s.tiled(slot).then(|| Tiles::new(tile_group, s.spatial));
        let mut copies = Vec::new();
        for orientation in 0..s.replicas.min(2) {
            for stage in s.stages_at(orientation, slot) {
                let params = Params::init_range(
                    &layout.graph,
                    &device,
                    c.train.dtype,
                    c.train.seed,
                    layout.param_ids(stage),
                )?;
                let rule = c.train.optimizer.optimizer(c.train.sgd);
                let mut optimizer = Stepper::new(&params, &device, rule)?;
                if c.train.no_decay_norm_bias {
                    let (g, first) = (&layout.graph, params.first);
                    optimizer =
                        optimizer.exempt_from_decay(|i| optim::is_norm_or_bias(g, first + i));
                }
                copies.push(Copy {
                    stage,
                    orientation,
                    params,
                    optimizer,
                    running: Vec::new(),
                });
            }
        }
        // Only ranks that make images or score losses read data (never a metered run).
        let tasks = &layout.schedule.ranks[slot];
        let reads = tasks.iter().any(|t| {
            t.task.pass == Pass::Forward
                && (t.task.stage == 0 || !layout.losses[t.task.stage].is_empty())
        });
        let data = data.filter(|_| reads && !c.metered);
        if reads && !c.metered && data.is_none() {
            return Err(Error::Config(format!(
                "rank {} makes images or scores losses but was given no data",
                comm.rank()
            )));
        }
        let loss_scale = c
            .train
            .precision
            .scales_loss()
            .then(|| LossScale::new(c.train.loss_scale));
        let batchnorms = batchnorm_nodes(&layout.graph).count();
        Ok(Rank {
            c,
            layout,
            comm,
            holders,
            device,
            group,
            slot,
            tile,
            tiles,
            pool_sharers: 1,
            copies,
            data,
            loader: None,
            pending: HashMap::new(),
            weights: HashMap::new(),
            received: HashMap::new(),
            activations_out: HashMap::new(),
            gradients_out: HashMap::new(),
            loss_scale,
            step: 0,
            position: 0,
            batches_tracked: vec![0; batchnorms],
            current: RankStep::default(),
            step_weight: 0.0,
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn comm(&self) -> &dyn Comm {
        &*self.comm
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn micro_size(&self) -> usize {
        self.c.micro_batch()
    }

    /// Position (in the data's epoch order) of the first image of global micro-batch `gm` of
    /// the step being run: consecutive micro-batches take consecutive runs of positions, so
    /// the groups of a data-parallel run share out each epoch's samples, each used once.
    fn first_image(&self, gm: usize) -> u64 {
        self.position + (gm * self.micro_size()) as u64
    }

    /// The loader of this rank's stage-0 micro-batches from the current step on, open-ended:
    /// request i is the (i mod k)-th of the k stage-0 tasks of step i / k from now.
    fn start_loader(&self) -> Option<Loader> {
        let data = self.data.as_ref()?;
        let s = self.c.scheme;
        let group = self.group;
        let firsts: Vec<usize> = self.layout.schedule.ranks[self.slot]
            .iter()
            .filter(|t| t.task.pass == Pass::Forward && t.task.stage == 0)
            .map(|t| s.global_micro(group, t.task.replica, t.task.micro))
            .collect();
        if firsts.is_empty() {
            return None;
        }
        let (mb, per_step, start) = (
            self.micro_size() as u64,
            (s.micro_batches_per_step() * self.micro_size()) as u64,
            self.position,
        );
        let requests = move |i: usize| {
            let (step, k) = ((i / firsts.len()) as u64, firsts[i % firsts.len()] as u64);
            Some((start + step * per_step + k * mb, mb as usize))
        };
        let d = &self.c.train.data;
        Some(Loader::new(
            data.clone(),
            Box::new(requests),
            d.workers,
            d.prefetch,
        ))
    }

    /// The total weight of the labelled places of all the step's images (every group's and
    /// replica's: what one device training the same batch sees), where this rank scores a
    /// loss; 1 for a metered run, which computes nothing.
    fn step_weight(&self) -> Result<f64> {
        let layout = &self.layout;
        let scores = layout.schedule.ranks[self.slot]
            .iter()
            .any(|t| t.task.pass == Pass::Forward && !layout.losses[t.task.stage].is_empty());
        match &self.data {
            // One image's masks at a time: a step of large images holds many pixels.
            Some(d) if scores => {
                let weights = self.c.train.class_weights.as_deref();
                let images = self.position..self.position + self.c.images_per_step() as u64;
                images
                    .map(|at| {
                        let targets = d.targets(at, 1)?;
                        loss::total_weight(&targets, layout.graph.classes(), weights)
                    })
                    .sum()
            }
            _ => Ok(1.0),
        }
    }

    /// Runs one step: this rank's tasks, the gradient sums and the optimizer among them.
    pub fn step(&mut self) -> Result<RankStep> {
        self.current = RankStep {
            rank: self.rank(),
            loss_scale: self.loss_scale.as_ref().map(LossScale::factor),
            ..RankStep::default()
        };
        if self.loader.is_none() {
            self.loader = self.start_loader();
        }
        if self.c.train.loss_reduction == loss::Reduction::Pytorch {
            self.step_weight = self.step_weight()?;
        }
        // The last step's gradients stay readable until this one starts.
        for copy in &mut self.copies {
            copy.params.zero_grads(&self.device)?;
        }
        let tasks: Vec<Task> = self.layout.schedule.ranks[self.slot]
            .iter()
            .map(|t| t.task)
            .collect();
        let step_start = Instant::now();
        let mut timeline = Vec::with_capacity(tasks.len());
        let mut held = Vec::with_capacity(tasks.len());
        self.device.mark();
        for t in tasks {
            let computing = match t.pass {
                Pass::Forward => self.on_pool(|r| r.forward(t))?,
                Pass::Backward => self.on_pool(|r| r.backward(t, false))?,
                Pass::Input => self.on_pool(|r| r.backward(t, true))?,
                Pass::Weight => self.on_pool(|r| r.weight(t))?,
                Pass::RecvActivations => {
                    let start = Instant::now();
                    let feeds = self.receive(t, t.micro)?;
                    self.received.insert(t, feeds);
                    start
                }
                Pass::RecvGradients => self.receive_gradients(t)?,
                Pass::SendActivations => {
                    let start = Instant::now();
                    let outs = self.activations_out.remove(&t).ok_or_else(|| {
                        Error::Internal(format!("{t} before the F that makes its activations"))
                    })?;
                    self.send(t, t.micro, &outs)?;
                    start
                }
                Pass::SendGradients => self.send_gradients(t)?,
                Pass::Reduce => {
                    let start = Instant::now();
                    self.reduce(t.stage)?;
                    start
                }
                Pass::Step => self.step_optimizer()?,
                Pass::Offload | Pass::Prefetch => {
                    let start = Instant::now();
                    self.move_saved(t)?;
                    start
                }
            };
            timeline.push(Timed {
                task: t,
                start: (computing - step_start).as_secs_f64(),
                end: step_start.elapsed().as_secs_f64(),
            });
            held.push(self.device.mark());
        }
        self.step += 1;
        self.position += (self.c.images_per_step()) as u64;
        // Each BN's running statistics took one update from the step's whole batch.
        self.batches_tracked.iter_mut().for_each(|n| *n += 1);
        let mut done = std::mem::take(&mut self.current);
        done.halo_wait = self.tiles.as_ref().map_or(0.0, Tiles::take_waited);
        done.seconds = step_start.elapsed().as_secs_f64();
        done.memory = self.device.memory();
        done.host_peak = self.device.host_memory().peak;
        done.timeline = timeline;
        done.held = held;
        Ok(done)
    }

    /// Runs a compute task on one of the CPU pool's workers ([`crate::backend::cpu::on_worker`])
    /// when this rank's thread is not one (ranks as threads, an MPI process's main thread): from
    /// outside the pool its operators cost 10–15% more of a small model's step on 2 cores. Only
    /// where every rank of the process can have a worker of its own: with more ranks than
    /// workers, a worker waiting inside one rank's task runs another rank's whole task before
    /// it returns (4 ranks on 2 threads measured 15% slower so). A rank whose compute waits on
    /// other ranks (halos of tiles) stays on its thread: on a worker it could be waiting under
    /// another rank's task, which waits for it.
    fn on_pool(&mut self, f: impl FnOnce(&mut Rank) -> Result<Instant> + Send) -> Result<Instant> {
        let cpu = self.c.train.device == crate::backend::DeviceKind::Cpu;
        let own_worker = self.pool_sharers <= rayon::current_num_threads();
        match cpu && own_worker && self.tiles.is_none() {
            true => crate::backend::cpu::on_worker(|| f(self)),
            false => f(self),
        }
    }

    pub fn loss_scale(&self) -> Option<&LossScale> {
        self.loss_scale.as_ref()
    }

    /// Every copy's parameters as (orientation, param id, values), orientation 0 first.
    pub fn parameters(&self) -> Result<CopyValues> {
        let mut out = Vec::new();
        for copy in &self.copies {
            for (i, v) in copy.params.values.iter().enumerate() {
                out.push((copy.orientation, copy.params.first + i, v.to_f64_vec()?));
            }
        }
        Ok(out)
    }

    /// The last step's gradients of every copy's trainable parameters, summed over the
    /// copies of each stage (and carrying fp16's loss scale), as (orientation, param id,
    /// values).
    pub fn gradients(&self) -> Result<CopyValues> {
        let mut out = Vec::new();
        for copy in &self.copies {
            for (i, g) in copy.params.grads.iter().enumerate() {
                if let Some(g) = g {
                    out.push((copy.orientation, copy.params.first + i, g.to_f64_vec()?));
                }
            }
        }
        Ok(out)
    }

    /// The whole model's state at world rank 0 (`None` on the others): each stage's values and
    /// optimizer state from the rank of data-parallel group 0 that holds its orientation-0
    /// copy, the progress and the loss scale. Collective.
    pub fn gather_state(&self) -> Result<Option<TrainingState>> {
        let s = self.c.scheme;
        let host = |t: &Tensor| -> Result<Message> {
            Ok(Message {
                shape: t.shape().clone(),
                storage: t.storage().to_host()?,
            })
        };
        let n = self.layout.graph.params.len();
        let mut values: Vec<Option<Storage>> = (0..n).map(|_| None).collect();
        let mut optimizer: Vec<Option<OptimizerState>> = (0..n).map(|_| None).collect();
        let mine: Vec<&Copy> = self.copies.iter().filter(|c| c.orientation == 0).collect();
        let first = mine
            .first()
            .ok_or_else(|| Error::Internal("no orientation-0 copy".into()))?;
        let names = first.optimizer.optimizer.state_names();
        for copy in mine.iter().filter(|_| self.group == 0 && self.tile == 0) {
            // Per parameter: its values, then for a trainable one its steps and state tensors.
            for (i, v) in copy.params.values.iter().enumerate() {
                let id = copy.params.first + i;
                let state = copy.optimizer.states()[i].as_ref();
                if self.rank() == 0 {
                    values[id] = Some(host(v)?.storage);
                    optimizer[id] = state
                        .map(|st| -> Result<OptimizerState> {
                            let tensors = names.iter().zip(&st.tensors);
                            Ok(OptimizerState {
                                steps: st.steps,
                                tensors: tensors
                                    .map(|(n, t)| Ok((n.to_string(), host(t)?.storage)))
                                    .collect::<Result<_>>()?,
                            })
                        })
                        .transpose()?;
                    continue;
                }
                self.comm.send_message(host(v)?, 0, STATE_TAG)?;
                if let Some(st) = state {
                    let steps = Message {
                        shape: Shape::new([1]),
                        storage: Storage::F64(vec![st.steps as f64]),
                    };
                    self.comm.send_message(steps, 0, STATE_TAG)?;
                    for t in &st.tensors {
                        self.comm.send_message(host(t)?, 0, STATE_TAG)?;
                    }
                }
            }
        }
        if self.rank() != 0 {
            return Ok(None);
        }
        for stage in (0..s.model_stages()).filter(|&st| s.place(0, st) != 0) {
            let from = s.first_rank(s.place(0, stage));
            for id in self.layout.param_ids(stage) {
                values[id] = Some(self.comm.recv_message(from, STATE_TAG)?.storage);
                if self.layout.graph.params[id].spec.trainable {
                    let Storage::F64(steps) = self.comm.recv_message(from, STATE_TAG)?.storage
                    else {
                        return Err(Error::Internal("optimizer steps".into()));
                    };
                    let tensors = names
                        .iter()
                        .map(|n| {
                            let t = self.comm.recv_message(from, STATE_TAG)?.storage;
                            Ok((n.to_string(), t))
                        })
                        .collect::<Result<_>>()?;
                    optimizer[id] = Some(OptimizerState {
                        steps: steps[0] as u64,
                        tensors,
                    });
                }
            }
        }
        let values = values
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::Internal("a parameter no rank holds".into()))?;
        Ok(Some(TrainingState {
            values,
            optimizer,
            step: self.step,
            position: self.position,
            loss_scale: self.loss_scale.clone(),
            batches_tracked: self.batches_tracked.clone(),
        }))
    }

    /// Takes up `state`: each copy's values and optimizer state, the progress and the loss
    /// scale. Not collective.
    pub fn load_state(&mut self, state: &TrainingState) -> Result<()> {
        let g = &self.layout.graph;
        for copy in &mut self.copies {
            let ids = copy.params.first..copy.params.first + copy.params.values.len();
            for (v, id) in copy.params.values.iter_mut().zip(ids.clone()) {
                let data = state.values[id].try_clone()?;
                *v = self
                    .device
                    .adopt(g.params[id].spec.shape.clone(), data, Category::Weights)?;
            }
            let states = ids
                .filter_map(|id| state.optimizer[id].as_ref())
                .map(|o| Ok((o.steps, o.try_clone()?.tensors)))
                .collect::<Result<Vec<_>>>()?;
            copy.optimizer.load_states(&self.device, states)?;
        }
        (self.step, self.position) = (state.step, state.position);
        self.batches_tracked.clone_from(&state.batches_tracked);
        if let (Some(mine), Some(theirs)) = (&mut self.loss_scale, &state.loss_scale) {
            *mine = theirs.clone();
        }
        // The data continue from the new position.
        self.loader = None;
        Ok(())
    }

    /// Runs a forward task; returns when its computation started (after its inputs arrived).
    fn forward(&mut self, t: Task) -> Result<Instant> {
        let (c, layout) = (Arc::clone(&self.c), Arc::clone(&self.layout));
        let s = &c.scheme;
        let g = &layout.graph;
        let gm = s.global_micro(self.group, t.replica, t.micro);
        let mb = self.micro_size();
        let feeds: Vec<(ValueId, Tensor)> = if t.stage == 0 {
            let x = if c.metered {
                let shape = self.input_shape(mb);
                self.device
                    .zeros(shape, c.train.activations(), Category::Activations)?
            } else {
                let loader = self.loader.as_mut().ok_or_else(|| {
                    Error::Internal("a stage-0 task on a rank without a loader".into())
                })?;
                let batch = loader.next_batch()?;
                self.current.data_wait += batch.waited.as_secs_f64();
                self.input(mb, batch.pixels)?
            };
            vec![(g.input, x)]
        } else {
            self.take_received(Task {
                pass: Pass::RecvActivations,
                ..t
            })?
        };
        let start = Instant::now();
        let losses = &layout.losses[t.stage];
        let keep: Vec<ValueId> = layout.outputs[t.stage]
            .iter()
            .copied()
            .chain(losses.iter().map(|o| o.value))
            .collect();
        let seed = splitmix64(c.train.seed ^ (self.step * s.micro_batches_per_step() + gm) as u64);
        let held = self.copy_of(&t)?;
        let copy = &mut self.copies[held];
        let range = layout.partition.stages[t.stage].clone();
        let (outs, mut tape) = graph::forward(
            g,
            &mut copy.params,
            &self.device,
            feeds,
            range,
            &keep,
            Some(&c.train.saves),
            t.stage > 0,
            seed,
            self.tiles.as_ref(),
        )?;
        copy.running.extend(tape.running.drain(..).map(|u| (gm, u)));
        let mut seeds = Vec::new();
        let n_out = layout.outputs[t.stage].len();
        if !losses.is_empty() {
            let targets = match &self.data {
                Some(d) => d.targets(self.first_image(gm), mb)?,
                // A metered run computes nothing: any targets do. Its sizes may be anything a
                // caller asks about, so a batch the host cannot even label is an error.
                None => {
                    let count = mb.checked_mul(g.positions());
                    let mut targets = Vec::new();
                    count
                        .and_then(|n| targets.try_reserve_exact(n).ok())
                        .ok_or_else(|| {
                            Error::Config(format!(
                                "a micro-batch of {mb} images is more than this machine can hold"
                            ))
                        })?;
                    targets.resize(count.unwrap_or(0), 0);
                    targets
                }
            };
            // What each micro-batch's Σ w·ℓ is divided by, and then its loss, to make its part
            // of the step's.
            let (norm, parts) = match c.train.loss_reduction {
                loss::Reduction::SampleMean => {
                    (loss::Norm::PerSample, s.micro_batches_per_step() as f64)
                }
                loss::Reduction::Pytorch => (loss::Norm::Total(self.step_weight), 1.0),
            };
            let weights = c.train.class_weights.as_deref();
            for (o, logits) in losses.iter().zip(&outs[n_out..]) {
                // Logits split into tiles are scored on each tile, as parts of the whole
                // maps; the loss and the counts are summed over the tile group.
                let shape = &g.values[o.value].shape;
                let tiled = self
                    .tiles
                    .as_ref()
                    .filter(|_| self.split_at(self.slot, o.value));
                let (ce, labels) = match tiled {
                    Some(t) => {
                        let hw = (shape.dim(1), shape.dim(2));
                        let own = t.own(hw);
                        let ce = loss::softmax_cross_entropy_part(
                            &self.device,
                            logits,
                            &targets,
                            hw,
                            &own,
                            weights,
                            norm,
                        )?;
                        (ce, loss::part_of(&targets, hw, &own))
                    }
                    None => {
                        let ce = loss::softmax_cross_entropy(
                            &self.device,
                            logits,
                            &targets,
                            weights,
                            norm,
                        )?;
                        (ce, targets.clone())
                    }
                };
                let (mut correct, mut scored) = (0, 0);
                if g.outputs.first() == Some(o) && self.data.is_some() {
                    let predicted = loss::predictions(&ce.probs)?;
                    for (&p, &t) in predicted.iter().zip(&labels) {
                        correct += usize::from(p == t);
                        scored += usize::from(t != UNLABELLED);
                    }
                }
                let mut sums = vec![ce.loss, correct as f64, scored as f64];
                if let Some(t) = tiled {
                    sums = t.sum(sums)?;
                }
                // Every tile of a group has the same sums; the first reports them.
                if self.tile == 0 {
                    self.current.loss += o.weight * sums[0] / parts;
                    self.current.correct += sums[1] as usize;
                    self.current.scored += sums[2] as usize;
                }
                let scale = self.loss_scale.as_ref().map_or(1.0, LossScale::factor);
                let d = ce.backward(
                    &self.device,
                    o.weight / parts * scale,
                    c.train.activations(),
                )?;
                seeds.push((o.value, d));
            }
        }
        self.device.backend().synchronize()?;
        self.current.busy += start.elapsed().as_secs_f64();
        if t.stage + 1 < s.model_stages() {
            let send = Task {
                pass: Pass::SendActivations,
                ..t
            };
            self.activations_out.insert(send, outs[..n_out].to_vec());
        }
        self.pending
            .insert((t.replica, t.stage, t.micro), Pending { tape, seeds });
        Ok(start)
    }

    /// The values entering task `t`'s stage, from the position of the stage before (messages
    /// tagged as micro-batch `micro`).
    fn receive(&self, t: Task, micro: usize) -> Result<Vec<(ValueId, Tensor)>> {
        let from = self.c.scheme.place(t.replica, t.stage - 1);
        let mut feeds = Vec::new();
        for (vi, &v) in self.layout.inputs[t.stage].iter().enumerate() {
            let tg = tag(&self.c.scheme, Pass::Forward, t.replica, t.stage, micro, vi)?;
            let x = self.receive_value(v, from, tg)?;
            feeds.push((
                v,
                x.ok_or_else(|| Error::Internal(format!("value %{v} arrived empty")))?,
            ));
        }
        Ok(feeds)
    }

    /// Sends the values leaving task `t`'s stage to the position of the next (see
    /// [`Rank::receive`]).
    fn send(&self, t: Task, micro: usize, outs: &[Tensor]) -> Result<()> {
        let to = self.c.scheme.place(t.replica, t.stage + 1);
        for (vi, (out, &v)) in outs.iter().zip(&self.layout.outputs[t.stage]).enumerate() {
            let tg = tag(
                &self.c.scheme,
                Pass::Forward,
                t.replica,
                t.stage + 1,
                micro,
                vi,
            )?;
            self.send_value(v, Some(out), to, tg)?;
        }
        Ok(())
    }

    /// The world rank of tile `tile` (0 where it has none) at pipeline position `slot` of this
    /// rank's group.
    fn rank_at(&self, slot: usize, tile: usize) -> usize {
        let s = &self.c.scheme;
        self.group * s.group_size() + s.first_rank(slot) + tile
    }

    /// Whether value `v` is held as tiles on the ranks at position `slot`.
    fn split_at(&self, slot: usize, v: ValueId) -> bool {
        let s = &self.c.scheme;
        s.tiled(slot) && s.spatial.splits(&self.layout.graph.values[v].shape)
    }

    /// Sends value `v` (or, for a gradient that does not exist, an empty message) from this
    /// rank to the ranks at position `to` that take it: a tile to the same tile, or to a rank
    /// that holds the whole map; a whole map cut into the tiles of the ranks that split it. A
    /// value whole on every tile of this position is sent once, by tile 0.
    fn send_value(&self, v: ValueId, x: Option<&Tensor>, to: usize, tg: u64) -> Result<()> {
        let s = &self.c.scheme;
        let send = |x: Option<Tensor>, r: usize| match x {
            Some(x) => self.comm.send(&x, r, tg),
            None => self.comm.send_message(empty(), r, tg),
        };
        match (self.split_at(self.slot, v), self.split_at(to, v)) {
            (true, true) => send(x.cloned(), self.rank_at(to, self.tile)),
            (true, false) => send(x.cloned(), self.rank_at(to, 0)),
            (false, true) => {
                for q in 0..s.spatial.tiles() {
                    let piece = x
                        .map(|x| tiles::cut(&self.device, x, s.spatial, q))
                        .transpose()?;
                    send(piece, self.rank_at(to, q))?;
                }
                Ok(())
            }
            (false, false) if self.tile != 0 && !s.tiled(to) => Ok(()),
            (false, false) => {
                let tiles = if s.tiled(to) && !s.tiled(self.slot) {
                    s.spatial.tiles()
                } else {
                    1
                };
                let first = if s.tiled(to) && s.tiled(self.slot) {
                    self.tile
                } else {
                    0
                };
                for q in first..first + tiles {
                    send(x.cloned(), self.rank_at(to, q))?;
                }
                Ok(())
            }
        }
    }

    /// Receives value `v` from the ranks at position `from` (see [`Rank::send_value`]); `None`
    /// for an empty message (a gradient that does not exist).
    fn receive_value(&self, v: ValueId, from: usize, tg: u64) -> Result<Option<Tensor>> {
        let s = &self.c.scheme;
        let recv = |r: usize| -> Result<Option<Tensor>> {
            let m = self.comm.recv_message(r, tg)?;
            if m.shape.numel() == 0 {
                return Ok(None);
            }
            Ok(Some(self.device.adopt(
                m.shape,
                m.storage,
                Category::Communication,
            )?))
        };
        let same = s.tiled(from) && s.tiled(self.slot);
        match (self.split_at(from, v), self.split_at(self.slot, v)) {
            (true, false) => {
                let pieces = (0..s.spatial.tiles())
                    .map(|q| recv(self.rank_at(from, q)))
                    .collect::<Result<Option<Vec<Tensor>>>>()?;
                let shape = &self.layout.graph.values[v].shape;
                pieces
                    .map(|p| {
                        tiles::assemble(&self.device, &p, s.spatial, (shape.dim(1), shape.dim(2)))
                    })
                    .transpose()
            }
            _ if same => recv(self.rank_at(from, self.tile)),
            _ => recv(self.rank_at(from, 0)),
        }
    }

    /// The shape of this rank's part of a micro-batch of `mb` images: its tile of them where
    /// they are split.
    fn input_shape(&self, mb: usize) -> Shape {
        let g = &self.layout.graph;
        match &self.tiles {
            Some(t) if t.grid.splits(g.input_shape()) => {
                let d = g.input_shape().dims();
                let (h, w) = t.own((d[1], d[2])).size();
                Shape::new([mb, d[0], h, w])
            }
            _ => batched(mb, g.input_shape()),
        }
    }

    /// A micro-batch of `mb` images (N×C×H×W pixels) on the device: this rank's tile of them
    /// where they are split.
    fn input(&self, mb: usize, pixels: Vec<f32>) -> Result<Tensor> {
        let g = &self.layout.graph;
        let dtype = self.c.train.activations();
        match &self.tiles {
            Some(t) if t.grid.splits(g.input_shape()) => {
                let d = g.input_shape().dims();
                let own = t.own((d[1], d[2]));
                let (h, w) = own.size();
                let (r0, c0) = (own.rows.0 as usize, own.cols.0 as usize);
                let mut tile = Vec::new();
                tile.try_reserve_exact(mb * d[0] * h * w).map_err(|_| {
                    Error::Config(format!(
                        "a tile of {mb} images is more than this machine can hold"
                    ))
                })?;
                for plane in pixels.chunks(d[1] * d[2]) {
                    for row in r0..r0 + h {
                        tile.extend_from_slice(&plane[row * d[2] + c0..row * d[2] + c0 + w]);
                    }
                }
                self.device.input(Shape::new([mb, d[0], h, w]), tile, dtype)
            }
            _ => self
                .device
                .input(batched(mb, g.input_shape()), pixels, dtype),
        }
    }

    /// Loss, accuracy and confusion counts over the first `n` samples of `data`'s order, the
    /// same on every rank. The samples go in micro-batches of B/m images, consecutive runs of
    /// them to each group, forward through replica 0's stages in eval mode (nothing saved, no
    /// statistics gathered); each rank adds what it scored (nothing unless it holds the
    /// evaluated output) into one sum over the world. That sum also holds every rank until all
    /// have finished evaluating, so the next step's messages never meet evaluation's.
    pub fn evaluate(
        &mut self,
        data: &Arc<Pipeline>,
        n: usize,
        map_every: usize,
    ) -> Result<Evaluation> {
        let (c, layout) = (Arc::clone(&self.c), Arc::clone(&self.layout));
        let (s, g) = (&c.scheme, &layout.graph);
        let mb = self.micro_size();
        let micro = n.div_ceil(mb);
        let per_group = micro.div_ceil(s.dp);
        let first = self.group * per_group;
        let costs = layout
            .tiles
            .stage_costs(&layout.costs, &layout.partition.stages);
        let schedule = schedule::evaluation(s, &costs, per_group.min(micro.saturating_sub(first)))?;
        let tasks: Vec<Task> = schedule.ranks[self.slot].iter().map(|t| t.task).collect();
        // Positions of the held-out order (first, count) of this group's micro-batch `j`.
        let span = |j: usize| {
            let at = (first + j) * mb;
            (at as u64, mb.min(n - at))
        };
        let missing = || Error::Internal("an evaluation task on a rank without the data".into());
        let mut loader = match tasks.iter().any(|t| t.stage == 0) {
            true => {
                let spans: Vec<(u64, usize)> = tasks.iter().map(|t| span(t.micro)).collect();
                Some(Loader::new(
                    data.clone(),
                    Box::new(move |i| spans.get(i).copied()),
                    c.train.data.workers,
                    c.train.data.prefetch,
                ))
            }
            false => None,
        };
        let out = evaluated_output(g)?;
        let classes = g.classes();
        let mut tally = Tally::new(classes, map_every);
        for t in tasks {
            let (at, len) = span(t.micro);
            let feeds = if t.stage == 0 {
                let batch = loader.as_mut().ok_or_else(missing)?.next_batch()?;
                self.current.data_wait += batch.waited.as_secs_f64();
                vec![(g.input, self.input(len, batch.pixels)?)]
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
            let held = self.copy_of(&t)?;
            let (outs, _) = graph::forward(
                g,
                &mut self.copies[held].params,
                &self.device,
                feeds,
                layout.partition.stages[t.stage].clone(),
                &keep,
                None,
                false,
                0,
                self.tiles.as_ref(),
            )?;
            if scores {
                // Logits split into tiles are scored on each tile, the counts summed over the
                // group; whole ones are scored the same on every tile.
                let shape = &g.values[out].shape;
                let tile = self
                    .tiles
                    .as_ref()
                    .filter(|_| self.split_at(self.slot, out))
                    .map(|t| (t, (shape.dim(1), shape.dim(2))));
                let targets = data.targets(at, len)?;
                let weights = c.train.class_weights.as_deref();
                tally.add(&self.device, &outs[n_out], &targets, weights, at, tile)?;
            }
            self.device.backend().synchronize()?;
            self.current.busy += start.elapsed().as_secs_f64();
            self.send(t, 0, &outs[..n_out])?;
        }
        // Every tile of a group ends with the same tally; the first reports it.
        if self.tile != 0 {
            tally = Tally::new(classes, map_every);
        }
        let mine = std::mem::take(&mut tally.samples);
        let sum = self.comm.sum_f64(tally.to_vec())?;
        let mut samples: Vec<SampleScore> = comm::all_gather(self.comm.as_ref(), &mine)?
            .into_iter()
            .flatten()
            .collect();
        samples.sort_by_key(|s| s.position);
        let per_pixel = g.positions() > 1;
        Ok(Tally::from_vec(&sum, classes).finish(data.classes(), samples, per_pixel))
    }

    /// Runs a backward task (BW, or with `split` a B that leaves its weight gradients to a
    /// W); returns when its computation started.
    fn backward(&mut self, t: Task, split: bool) -> Result<Instant> {
        let (c, layout) = (Arc::clone(&self.c), Arc::clone(&self.layout));
        let s = &c.scheme;
        let key = (t.replica, t.stage, t.micro);
        let Pending { tape, mut seeds } = self
            .pending
            .remove(&key)
            .ok_or_else(|| Error::Internal(format!("{t} before its F")))?;
        if t.stage + 1 < s.model_stages() {
            seeds.extend(self.take_received(Task {
                pass: Pass::RecvGradients,
                ..t
            })?);
        }
        let start = Instant::now();
        let want: &[ValueId] = if t.stage > 0 {
            &layout.inputs[t.stage]
        } else {
            &[]
        };
        let held = self.copy_of(&t)?;
        let copy = &mut self.copies[held];
        let (grads, work) = graph::backward(
            &layout.graph,
            &mut copy.params,
            &self.device,
            tape,
            seeds,
            want,
            self.tiles.as_ref(),
            split,
        )?;
        if split {
            self.weights.insert(key, work);
        }
        self.device.backend().synchronize()?;
        self.current.busy += start.elapsed().as_secs_f64();
        if t.stage > 0 {
            let send = Task {
                pass: Pass::SendGradients,
                ..t
            };
            self.gradients_out.insert(send, grads);
        }
        Ok(start)
    }

    /// What receive task `t` received, for the task that computes with it.
    fn take_received(&mut self, t: Task) -> Result<Vec<(ValueId, Tensor)>> {
        self.received
            .remove(&t)
            .ok_or_else(|| Error::Internal(format!("a task that needs {t} ran before it")))
    }

    /// Runs a RECV_B task: the gradients of its stage's outputs from the rank of the next
    /// stage (none for an output that takes none); returns when it started waiting.
    fn receive_gradients(&mut self, t: Task) -> Result<Instant> {
        let start = Instant::now();
        let (c, layout) = (Arc::clone(&self.c), Arc::clone(&self.layout));
        let s = &c.scheme;
        let from = s.place(t.replica, t.stage + 1);
        let mut seeds = Vec::new();
        for (vi, &v) in layout.outputs[t.stage].iter().enumerate() {
            let tg = tag(s, Pass::Backward, t.replica, t.stage, t.micro, vi)?;
            if let Some(d) = self.receive_value(v, from, tg)? {
                seeds.push((v, d));
            }
        }
        self.received.insert(t, seeds);
        Ok(start)
    }

    /// Runs a SEND_B task: the gradients its backward made of its stage's inputs, to the rank
    /// of the stage before; returns when it started.
    fn send_gradients(&mut self, t: Task) -> Result<Instant> {
        let start = Instant::now();
        let grads = self.gradients_out.remove(&t).ok_or_else(|| {
            Error::Internal(format!("{t} before the backward that makes its gradients"))
        })?;
        let s = &self.c.scheme;
        let to = s.place(t.replica, t.stage - 1);
        for (vi, (gr, &v)) in grads.iter().zip(&self.layout.inputs[t.stage]).enumerate() {
            let tg = tag(s, Pass::Backward, t.replica, t.stage - 1, t.micro, vi)?;
            self.send_value(v, gr.as_ref(), to, tg)?;
        }
        Ok(start)
    }

    /// Which of this rank's copies runs task `t`.
    fn copy_of(&self, t: &Task) -> Result<usize> {
        self.copies
            .iter()
            .position(|c| c.stage == t.stage && c.orientation == t.replica % 2)
            .ok_or_else(|| Error::Internal(format!("rank {} holds no copy for {t}", self.rank())))
    }

    /// Runs an OFFLOAD or PREFETCH task: what its micro-batch's next backward pass of the
    /// stage reads — the F's tape before a B or BW, what a B left for its W after it — to the
    /// host tier or back.
    fn move_saved(&mut self, t: Task) -> Result<()> {
        let key = (t.replica, t.stage, t.micro);
        let out = t.pass == Pass::Offload;
        let device = &self.device;
        match (self.pending.get_mut(&key), self.weights.get_mut(&key)) {
            (Some(p), _) if out => p.tape.offload(device),
            (Some(p), _) => p.tape.prefetch(device),
            (None, Some(w)) if out => w.offload(device),
            (None, Some(w)) => w.prefetch(device),
            (None, None) => Err(Error::Internal(format!(
                "{t}: its micro-batch holds nothing for a backward of the stage here"
            ))),
        }
    }

    /// Runs a W task: the weight gradients its B left; returns when it started.
    fn weight(&mut self, t: Task) -> Result<Instant> {
        let work = self
            .weights
            .remove(&(t.replica, t.stage, t.micro))
            .ok_or_else(|| Error::Internal(format!("{t} before its B")))?;
        let start = Instant::now();
        let held = self.copy_of(&t)?;
        let copy = &mut self.copies[held];
        graph::weight_gradients(&self.layout.graph, &mut copy.params, &self.device, work)?;
        self.device.backend().synchronize()?;
        self.current.busy += start.elapsed().as_secs_f64();
        Ok(start)
    }

    /// REDUCE of `stage`: the gradients of this rank's copies of it summed, then summed over
    /// the ranks holding copies of it (a collective of `holders`), so that every copy holds the
    /// step's whole gradient. A tile other than the first keeps only its share first.
    fn reduce(&mut self, stage: usize) -> Result<()> {
        let idx: Vec<usize> = (0..self.copies.len())
            .filter(|&i| self.copies[i].stage == stage)
            .collect();
        let Some(&first) = idx.first() else {
            return Err(Error::Internal(format!(
                "a REDUCE of stage {stage}, which this rank holds no copy of"
            )));
        };
        if self.tile > 0 {
            self.keep_tile_shares(&idx)?;
        }
        for p in 0..self.copies[first].params.grads.len() {
            if self.copies[first].params.grads[p].is_none() {
                continue;
            }
            // Copies on this rank first (orientation order), then over the holders.
            let mut acc = self.copies[first].params.grads[p]
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
            self.copies[first].params.grads[p] = Some(acc);
        }
        Ok(())
    }

    /// STEP, the rank's last task: checks that every task ran, then the loss and the reduced
    /// gradients finite everywhere, commits BN statistics, and steps the optimizer. Returns
    /// when it started.
    fn step_optimizer(&mut self) -> Result<Instant> {
        let start = Instant::now();
        let left = self.received.len() + self.activations_out.len() + self.gradients_out.len();
        if !self.pending.is_empty() || !self.weights.is_empty() || left > 0 {
            return Err(Error::Internal(
                "the step ended with tasks left undone (a schedule without every backward or message)".into(),
            ));
        }
        // A non-finite loss or gradient anywhere (a sum keeps it non-finite, so the reduced
        // gradients show every rank's): fp16 skips the step (below); any other run stops here,
        // before a statistic or a weight changes.
        let mut here = !self.current.loss.is_finite();
        for copy in &self.copies {
            here |= LossScale::overflowed(&copy.params, &self.device)?;
        }
        let anywhere = self.comm.sum_f64(vec![here as u8 as f64])?[0] > 0.0;
        if anywhere && self.loss_scale.is_none() {
            return Err(Error::Diverged {
                step: self.step + 1,
                what: "the loss or a gradient is infinite or NaN".into(),
            });
        }
        let mut stages: Vec<usize> = self.copies.iter().map(|c| c.stage).collect();
        stages.sort_unstable();
        stages.dedup();
        for stage in stages {
            let idx: Vec<usize> = (0..self.copies.len())
                .filter(|&i| self.copies[i].stage == stage)
                .collect();
            // Every tile holds the same statistics (the whole batch's): the first sends them.
            let mine: Vec<(usize, RunningUpdate)> = idx
                .iter()
                .flat_map(|&i| std::mem::take(&mut self.copies[i].running))
                .filter(|_| self.tile == 0)
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
        let optimizer = Instant::now();
        let lr = self.c.train.schedule.lr(self.step);
        let unscale = 1.0 / self.loss_scale.as_ref().map_or(1.0, LossScale::factor);
        let apply = match &mut self.loss_scale {
            // Every rank skips together: an overflow anywhere is an overflow of the step.
            Some(scale) => {
                scale.update(anywhere)?;
                self.current.skipped = anywhere;
                !anywhere
            }
            None => true,
        };
        let clip = match self.c.train.clip_grad_norm {
            Some(max_norm) if apply => {
                optim::clip_factor(&self.squared_norms()?, unscale, max_norm)
            }
            _ => 1.0,
        };
        for copy in &mut self.copies {
            if apply {
                let grad_scale = unscale * clip;
                copy.optimizer
                    .step(&mut copy.params, &self.device, lr, grad_scale)?;
            }
        }
        self.device.backend().synchronize()?;
        self.current.busy += optimizer.elapsed().as_secs_f64();
        Ok(start)
    }

    /// The squared norm of every parameter's summed gradient, indexed by parameter id, the
    /// same on every rank. After the sums over copies every holder of a stage has its whole
    /// gradient: each parameter is counted once, by its orientation-0 copy in data-parallel
    /// group 0 on tile 0, and the others add zeros (exactly). Collective.
    fn squared_norms(&self) -> Result<Vec<f64>> {
        let mut squared = vec![0.0; self.layout.graph.params.len()];
        let counts = self.group == 0 && self.tile == 0;
        for copy in self.copies.iter().filter(|c| counts && c.orientation == 0) {
            let mine = optim::squared_norms(&copy.params)?;
            squared[copy.params.first..][..mine.len()].copy_from_slice(&mine);
        }
        self.comm.sum_f64(squared)
    }

    /// On a tile other than the first: zeros the gradients of parameters of nodes that ran on
    /// whole values (the same on every tile) in the copies `idx`, so that summing over the
    /// tiles counts them once and the gradients of nodes that ran on tiles (each tile's share)
    /// in full.
    fn keep_tile_shares(&mut self, idx: &[usize]) -> Result<()> {
        let (g, grid) = (&self.layout.graph, self.c.scheme.spatial);
        for &i in idx {
            let copy = &mut self.copies[i];
            for node in self.layout.partition.stages[copy.stage].clone() {
                if graph::runs_on_tiles(g, grid, node) {
                    continue;
                }
                for p in g.nodes[node].params.clone() {
                    if let Some(grad) = &mut copy.params.grads[p - copy.params.first] {
                        self.device.backend().fill(grad.storage_mut()?, 0.0)?;
                    }
                }
            }
        }
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
}
