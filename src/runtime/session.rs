//! A run held open for the caller's loop: one executor for every scheme (`single` is the
//! one-rank case), over ranks that are threads of this process or, one per process, MPI's.
//!
//! ```no_run
//! use gems::{models, Dataset, RunConfig, Scheme, Session, TrainConfig};
//! # fn main() -> gems::Result<()> {
//! let graph = models::build("resnet20v2", 32, 10)?;
//! let data = Dataset::synthetic(32, 10, 0);
//! let config = RunConfig::new(TrainConfig::new(8, 100), Scheme::single(1));
//! let mut session = Session::new(&graph, config, data)?;
//! for _ in 0..10 {
//!     let report = session.step()?;
//!     println!("step {}: loss {:.3}", report.step, report.loss);
//! }
//! session.save("step-10.safetensors")?;
//! # Ok(()) }
//! ```

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::backend::DeviceKind;
use crate::comm::local::{catch_panic, root_cause, World};
use crate::comm::{self, Comm};
use crate::data::{Dataset, Pipeline};
use crate::graph::Graph;
use crate::memory::MemoryStats;
use crate::plan::{Layout, RunConfig};
use crate::runtime::checkpoint::{self, Checkpoint, Lineage, OptimizerState, TrainingState};
use crate::runtime::evaluation::{held_out_samples, Evaluation};
use crate::runtime::rank::{CopyValues, Rank, RankStep};
use crate::{Error, Result};

/// What one optimizer step did, over every rank.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    /// The step's index (0 for the first step of a run).
    pub step: usize,
    /// The step's loss: Σ weight·loss over the outputs, averaged over its micro-batches.
    pub loss: f64,
    /// Correct predictions of the first output: of images, or of labelled pixels.
    pub correct: usize,
    /// Images (or labelled pixels) it scored.
    pub scored: usize,
    /// Images the step trained on: η·B·D.
    pub images: usize,
    /// The learning rate the step used.
    pub lr: f64,
    /// Wall seconds of the step (its slowest rank).
    pub seconds: f64,
    /// Seconds the ranks waited for their images, summed.
    pub data_wait: f64,
    /// Seconds the ranks waited for halos from other tiles, summed.
    pub halo_wait: f64,
    /// The loss scale the gradients carried (fp16), and whether they overflowed it, so the
    /// step was skipped on every rank.
    pub loss_scale: Option<f64>,
    /// Whether the step was skipped (its gradients overflowed fp16's scale).
    pub skipped: bool,
    /// Each rank's part: busy and wall seconds, memory, the timeline of its tasks.
    pub ranks: Vec<RankStep>,
}

impl StepReport {
    /// Images per second of this step.
    pub fn images_per_second(&self) -> f64 {
        self.images as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// A job for a rank thread; its result comes back boxed.
type Job = Box<dyn FnOnce(&mut Rank) -> Box<dyn Any + Send> + Send>;

/// A rank on a thread of its own, taking jobs in order.
struct Worker {
    jobs: Option<Sender<Job>>,
    results: Receiver<Box<dyn Any + Send>>,
    thread: Option<JoinHandle<()>>,
}

enum Ranks {
    /// The one rank this process runs, on the calling thread: one MPI process's share (the
    /// communicator belongs to the thread that made it), or a whole world on one GPU (so does
    /// the driver's context).
    Here(Box<Rank>),
    /// The whole world on the CPU: its work runs on the CPU backend's worker threads (see
    /// [`Session::all`]).
    Pooled(Box<Rank>),
    /// Every rank a thread of this process.
    Threads {
        workers: Vec<Worker>,
        world: Arc<World>,
    },
}

/// A model being trained under a scheme: [`Session::step`] runs one optimizer step on every
/// rank, [`Session::evaluate`] scores held-out samples, [`Session::save`] and
/// [`Session::restore`] write and read one checkpoint that any scheme can resume from.
///
/// Every call is collective: under MPI, every process makes the same calls in the same order
/// (each process's `Session` is its rank's). After an error the session refuses further work.
pub struct Session {
    layout: Arc<Layout>,
    config: Arc<RunConfig>,
    ranks: Ranks,
    held_out: Option<Arc<Pipeline>>,
    lineage: Lineage,
    step: usize,
    broken: Option<String>,
    hooks: Vec<StepHook>,
}

/// A caller's function that sees every step's report ([`Session::on_step`]).
pub type StepHook = Box<dyn FnMut(&StepReport) + Send>;

impl Session {
    /// `config` on `graph`, every rank a thread of this process (a one-rank CPU run works on
    /// the CPU backend's worker threads), reading `data`.
    pub fn new(graph: &Graph, config: RunConfig, data: Dataset) -> Result<Session> {
        Session::start(graph, config, Some(data), None)
    }

    /// [`Session::new`] running `schedule`'s tasks instead of those of the scheme's order:
    /// refused before any work if it is not a valid schedule of `config`'s scheme (see
    /// [`Schedule::validate`](crate::schemes::schedule::Schedule::validate)).
    pub fn with_schedule(
        graph: &Graph,
        mut config: RunConfig,
        schedule: crate::schemes::schedule::Schedule,
        data: Dataset,
    ) -> Result<Session> {
        schedule.validate(&config.scheme)?;
        config.schedule = Some(Arc::new(schedule));
        Session::new(graph, config, data)
    }

    /// This process's rank of a run spread over the processes of `comm` (MPI: one process per
    /// rank); the others build theirs with the same arguments.
    pub fn on(
        graph: &Graph,
        config: RunConfig,
        data: Dataset,
        comm: Box<dyn Comm>,
    ) -> Result<Session> {
        Session::start(graph, config, Some(data), Some(comm))
    }

    fn start(
        graph: &Graph,
        config: RunConfig,
        data: Option<Dataset>,
        comm: Option<Box<dyn Comm>>,
    ) -> Result<Session> {
        let layout = Arc::new(Layout::new(graph, &config)?);
        if let Some(d) = &data {
            check_data(graph, &d.train)?;
        }
        let train = data.as_ref().map(|d| d.train.clone());
        let lineage = Lineage::fresh(data.as_ref().map_or(vec![], |d| d.classes.clone()));
        let held_out = data.and_then(|d| d.val);
        let c = Arc::new(config);
        let world_size = c.scheme.world();
        let ranks = match comm {
            Some(comm) => Ranks::Here(Box::new(Rank::new(c.clone(), layout.clone(), comm, train)?)),
            None if world_size == 1 => {
                let comm = World::new(1).1.pop().expect("one rank");
                let rank = Box::new(Rank::new(c.clone(), layout.clone(), comm, train)?);
                match c.train.device {
                    DeviceKind::Cpu => Ranks::Pooled(rank),
                    DeviceKind::Cuda { .. } => Ranks::Here(rank),
                }
            }
            None => {
                // Before the rank threads exist (see the function).
                crate::backend::cpu::tune_host_allocator();
                let (world, comms) = World::new(world_size);
                let workers: Vec<Worker> = comms
                    .into_iter()
                    .enumerate()
                    .map(|(r, comm)| {
                        spawn(r, c.clone(), layout.clone(), comm, train.clone(), &world)
                    })
                    .collect::<Result<_>>()?;
                let started = workers.iter().map(receive::<()>).collect::<Vec<_>>();
                root_cause(&world, started)?;
                Ranks::Threads { workers, world }
            }
        };
        Ok(Session {
            layout,
            config: c,
            ranks,
            held_out,
            lineage,
            step: 0,
            broken: None,
            hooks: Vec::new(),
        })
    }

    /// Runs `f` on every rank of this process (all of them for threads), returning their
    /// results in rank order; the first rank's own error if one fails.
    fn all<T: Send + 'static>(
        &mut self,
        f: impl Fn(&mut Rank) -> Result<T> + Send + Sync + 'static,
    ) -> Result<Vec<T>> {
        if let Some(why) = &self.broken {
            return Err(Error::Config(format!(
                "the session stopped at an earlier error: {why}"
            )));
        }
        let out = match &mut self.ranks {
            Ranks::Here(rank) => catch_panic(|| f(rank)).map(|v| vec![v]),
            // From a thread outside the pool, every operator would wake a worker and sleep
            // until it finished: two futex round trips per operator, a few hundred per step.
            // On a worker, operators fork onto warm threads. The one thing the rank waits for,
            // its next batch, works the pool meanwhile (`Loader::next_batch`).
            Ranks::Pooled(rank) => rayon::scope(|_| catch_panic(|| f(rank))).map(|v| vec![v]),
            Ranks::Threads { workers, world } => {
                let f = Arc::new(f);
                for (r, w) in workers.iter().enumerate() {
                    let (f, world) = (f.clone(), world.clone());
                    let job: Job = Box::new(move |rank: &mut Rank| {
                        let out = catch_panic(|| f(rank));
                        if let Err(e) = &out {
                            world.fail(r, format!("rank {r} failed: {e}"));
                        }
                        Box::new(out)
                    });
                    let lost = || Error::Internal(format!("rank {r}'s thread is gone"));
                    w.jobs
                        .as_ref()
                        .ok_or_else(lost)?
                        .send(job)
                        .map_err(|_| lost())?;
                }
                let results = workers.iter().map(receive::<T>).collect();
                root_cause(world, results)
            }
        };
        if let Err(e) = &out {
            self.broken = Some(e.to_string());
        }
        out
    }

    /// Calls `hook` with the report of every step from now on, before [`Session::step`]
    /// returns it (after the hooks given before it): for progress bars, logs and monitors.
    /// Each report carries every rank's memory and timing ([`StepReport::ranks`]). Under
    /// MPI, each process calls its own hooks with the same report.
    pub fn on_step(&mut self, hook: impl FnMut(&StepReport) + Send + 'static) {
        self.hooks.push(Box::new(hook));
    }

    /// Runs one optimizer step on every rank.
    pub fn step(&mut self) -> Result<StepReport> {
        let ranks = self
            .all(|r| {
                let mine = r.step()?;
                comm::all_gather(r.comm(), &mine)
            })?
            .swap_remove(0);
        let c = &self.config;
        let step = self.step;
        self.step += 1;
        let sum = |f: fn(&RankStep) -> f64| ranks.iter().map(f).sum::<f64>();
        let report = StepReport {
            step,
            loss: sum(|r| r.loss),
            correct: ranks.iter().map(|r| r.correct).sum(),
            scored: ranks.iter().map(|r| r.scored).sum(),
            images: c.images_per_step(),
            lr: c.train.schedule.lr(step),
            seconds: ranks.iter().map(|r| r.seconds).fold(0.0, f64::max),
            data_wait: sum(|r| r.data_wait),
            halo_wait: sum(|r| r.halo_wait),
            loss_scale: ranks[0].loss_scale,
            skipped: ranks[0].skipped,
            ranks,
        };
        for hook in &mut self.hooks {
            hook(&report);
        }
        Ok(report)
    }

    /// Loss, accuracy and confusion matrix of the first output used outside training over the
    /// first `samples` (default: all) of `data`'s order, with BN in eval mode and no dropout,
    /// in micro-batches of B/m images through the scheme's stages; changes nothing.
    pub fn evaluate(&mut self, data: &Arc<Pipeline>, samples: Option<usize>) -> Result<Evaluation> {
        self.predict(data, samples, 0)
    }

    /// [`Session::evaluate`] that also keeps each segmented sample's predicted classes at
    /// every `map_every`-th pixel each way ([`SampleScore::map`](crate::runtime::SampleScore),
    /// for prediction maps; 0 keeps none).
    pub fn predict(
        &mut self,
        data: &Arc<Pipeline>,
        samples: Option<usize>,
        map_every: usize,
    ) -> Result<Evaluation> {
        let n = held_out_samples(data, samples)?;
        check_data(&self.layout.graph, data)?;
        let data = data.clone();
        Ok(self
            .all(move |r| r.evaluate(&data, n, map_every))?
            .swap_remove(0))
    }

    /// [`Session::evaluate`] on the held-out samples of the session's data (a validation
    /// split, or synthetic data's held-out stream).
    pub fn evaluate_held_out(&mut self, samples: Option<usize>) -> Result<Evaluation> {
        let data = self.held_out.clone().ok_or_else(|| {
            Error::Config("nothing is held out: hold out a fraction of the data to validate".into())
        })?;
        self.evaluate(&data, samples)
    }

    /// Writes the whole model's state to one checkpoint at `path`, atomically, from one rank
    /// (world rank 0); returns when the file is complete, on every rank.
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path: PathBuf = path.as_ref().to_path_buf();
        let (graph, train) = (self.layout.graph.clone(), self.config.train.clone());
        let lineage = self.lineage.clone();
        self.all(move |r| {
            if let Some(state) = r.gather_state()? {
                checkpoint::save(&graph, &train, &state, &lineage, &path)?;
            }
            r.comm().barrier()
        })?;
        Ok(())
    }

    /// Writes the whole model's weights and BN statistics as a plain state_dict at `path`
    /// (torchvision's names, no optimizer state; see [`checkpoint::save_weights`]), from world
    /// rank 0; returns when the file is complete, on every rank.
    pub fn save_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path: PathBuf = path.as_ref().to_path_buf();
        let (graph, dtype) = (self.layout.graph.clone(), self.config.train.dtype);
        self.all(move |r| {
            if let Some(state) = r.gather_state()? {
                checkpoint::save_weights(&graph, dtype, &state, &path)?;
            }
            r.comm().barrier()
        })?;
        Ok(())
    }

    /// Takes up the state in the checkpoint at `path`, whatever scheme wrote it: weights,
    /// the optimizer's state, BN statistics, the loss scale, the step and the data position; the session
    /// continues the checkpoint's run ([`Session::lineage`]). Refuses, by name, a checkpoint of
    /// another model, image side or class count, or whose classes have other names than the
    /// session's data.
    pub fn restore(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let ckpt = Checkpoint::read(path.as_ref())?;
        let state = Arc::new(ckpt.state(&self.layout.graph, self.config.train.dtype)?);
        let classes = self.lineage.classes.clone();
        if let Some(theirs) = ckpt.class_names()? {
            if !classes.is_empty() && theirs != classes {
                return Err(Error::BadInput {
                    path: path.as_ref().to_path_buf(),
                    why: format!(
                        "trained on classes {}, but this session's data has {}",
                        theirs.join(", "),
                        classes.join(", ")
                    ),
                });
            }
        }
        let lineage = Lineage::resumed(&ckpt, classes)?;
        let step = state.step;
        self.all(move |r| r.load_state(&state))?;
        self.step = step;
        self.lineage = lineage;
        Ok(())
    }

    /// Starts from the weights of the safetensors state_dict at `path` (torchvision's names;
    /// see [`checkpoint::read_weights`]) instead of the model's initialization: parameters
    /// and BN running statistics and `num_batches_tracked`, with the optimizer's state zero.
    /// Before the first step only.
    pub fn load_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        if self.step > 0 {
            return Err(Error::Config(
                "initial weights are loaded before the first step".into(),
            ));
        }
        let (g, dtype) = (&self.layout.graph, self.config.train.dtype);
        let (values, batches_tracked) = checkpoint::read_weights(path.as_ref(), g, dtype)?;
        let t = &self.config.train;
        let names = t
            .optimizer
            .optimizer(t.sgd)
            .state_names()
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>();
        let optimizer = g
            .params
            .iter()
            .zip(&values)
            .map(|(p, v)| {
                let zeros = vec![0.0; v.len()];
                p.spec
                    .trainable
                    .then(|| {
                        let tensors = names
                            .iter()
                            .map(|n| {
                                let cpu = &crate::backend::cpu::Cpu;
                                let z = crate::backend::Backend::upload(cpu, &zeros, dtype)?;
                                Ok((n.clone(), z))
                            })
                            .collect::<Result<_>>()?;
                        Ok(OptimizerState { steps: 0, tensors })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let state = Arc::new(TrainingState {
            values,
            optimizer,
            step: 0,
            position: 0,
            loss_scale: None,
            batches_tracked,
        });
        self.all(move |r| r.load_state(&state))?;
        Ok(())
    }

    /// The run this session is (kept from a restored checkpoint) and its data's class names,
    /// as its checkpoints record them.
    pub fn lineage(&self) -> &Lineage {
        &self.lineage
    }

    /// fp16's dynamic loss scale as it stands (`None` for other precisions).
    pub fn loss_scale(&mut self) -> Result<Option<crate::optim::LossScale>> {
        Ok(self.all(|r| Ok(r.loss_scale().cloned()))?.swap_remove(0))
    }

    /// Optimizer steps done (including those of a restored checkpoint).
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Every copy's parameters on the ranks of this process, per rank: (orientation, param
    /// id, values), orientation 0 first.
    pub fn parameters(&mut self) -> Result<Vec<CopyValues>> {
        self.all(|r| r.parameters())
    }

    /// The last step's gradients on the ranks of this process, per rank: (orientation, param
    /// id, values) of each trainable parameter, summed over the step's micro-batches and the
    /// copies of its stage, and multiplied by fp16's loss scale where one is used.
    pub fn gradients(&mut self) -> Result<Vec<CopyValues>> {
        self.all(|r| r.gradients())
    }

    /// The memory of each rank of this process: peak so far, and bytes by category.
    pub fn memory(&mut self) -> Result<Vec<MemoryStats>> {
        self.all(|r| Ok(r.device().memory()))
    }

    /// The host tier's high-water mark, offload pool counters and convolution algorithms of
    /// the first rank of this process's device (what a one-device run's summary shows).
    pub fn device_summary(&mut self) -> Result<DeviceSummary> {
        Ok(self
            .all(|r| {
                let d = r.device();
                Ok(DeviceSummary {
                    name: d.backend().name(),
                    host: d.host_memory(),
                    pool: d.host_pool(),
                    conv_algorithms: d.backend().conv_algorithms(),
                })
            })?
            .swap_remove(0))
    }

    /// The model the session runs.
    pub fn graph(&self) -> &Graph {
        &self.layout.graph
    }

    /// How the model is split over the ranks and scheduled.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The run's configuration.
    pub fn config(&self) -> &RunConfig {
        &self.config
    }
}

/// What a device reports beside its memory.
#[derive(Clone, Debug)]
pub struct DeviceSummary {
    /// The device's report name.
    pub name: String,
    /// The host tier's memory (offloaded activations).
    pub host: MemoryStats,
    /// The pinned pool's blocks: allocated, reused, bytes.
    pub pool: crate::backend::host::PoolStats,
    /// cuDNN's choices per convolution shape (empty for other kernels).
    pub conv_algorithms: Vec<String>,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Ranks::Threads { workers, .. } = &mut self.ranks {
            for w in workers.iter_mut() {
                w.jobs = None;
            }
            for w in workers.iter_mut() {
                if let Some(t) = w.thread.take() {
                    let _ = t.join();
                }
            }
        }
    }
}

/// Starts rank `r`'s thread, which builds the rank (its device belongs to the thread) and
/// then runs jobs until the session ends.
fn spawn(
    r: usize,
    c: Arc<RunConfig>,
    layout: Arc<Layout>,
    comm: Box<dyn Comm>,
    data: Option<Arc<Pipeline>>,
    world: &Arc<World>,
) -> Result<Worker> {
    let (jobs, inbox) = channel::<Job>();
    let (outbox, results) = channel::<Box<dyn Any + Send>>();
    let world = world.clone();
    let thread = std::thread::Builder::new()
        .name(format!("rank {r}"))
        .spawn(move || {
            let sharers = c.scheme.world();
            let rank = catch_panic(|| Rank::new(c, layout, comm, data));
            let mut rank = match rank {
                Ok(mut rank) => {
                    rank.pool_sharers = sharers;
                    rank
                }
                Err(e) => {
                    world.fail(r, format!("rank {r} failed: {e}"));
                    let _ = outbox.send(Box::new(Err::<(), Error>(e)));
                    return;
                }
            };
            if outbox.send(Box::new(Ok::<(), Error>(()))).is_err() {
                return;
            }
            while let Ok(job) = inbox.recv() {
                if outbox.send(job(&mut rank)).is_err() {
                    return;
                }
            }
        })
        .map_err(|e| Error::Internal(format!("cannot start rank {r}'s thread: {e}")))?;
    Ok(Worker {
        jobs: Some(jobs),
        results,
        thread: Some(thread),
    })
}

/// A worker's next result.
fn receive<T: 'static>(w: &Worker) -> Result<T> {
    let lost = || Error::Internal("a rank's thread ended unexpectedly".into());
    let out = w.results.recv().map_err(|_| lost())?;
    *out.downcast::<Result<T>>().map_err(|_| lost())?
}

/// The data must be what the model takes: its images' side, its task (a class per image, or
/// per pixel) and its classes.
fn check_data(g: &Graph, data: &Pipeline) -> Result<()> {
    if data.image_size() != g.image_size() {
        return Err(Error::Config(format!(
            "the data makes {}² images but {} takes {}²",
            data.image_size(),
            g.name,
            g.image_size()
        )));
    }
    if data.positions() != g.positions() {
        let what = |places: usize| match places {
            1 => "a class per image",
            _ => "a class per pixel",
        };
        return Err(Error::Config(format!(
            "the data labels {} but {} predicts {}",
            what(data.positions()),
            g.name,
            what(g.positions())
        )));
    }
    let names = data.classes();
    if names.len() == g.classes() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "the data has {} classes ({}) but {} has {} outputs",
        names.len(),
        names.join(", "),
        g.name,
        g.classes()
    )))
}

/// Each rank's part of one step of `config` on `graph` from a metered run: every allocation
/// of the real task lists on devices that compute nothing. Its memory (the peak, by category)
/// and its bytes during each task are the exact memory model the planner's choices (`fit`)
/// are made with; its times mean nothing.
pub fn meter(graph: &Graph, mut config: RunConfig) -> Result<Vec<RankStep>> {
    config.metered = true;
    let mut s = Session::start(graph, config, None, None)?;
    Ok(s.step()?.ranks)
}
