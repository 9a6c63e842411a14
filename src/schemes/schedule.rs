//! Schedules: per rank, the ordered tasks of one training step of one data-parallel group.
//! A [`Schedule`] is public data — written in Rust, loaded from JSON, or made by a built-in
//! order's builder — and every schedule goes through the same checks ([`Schedule::validate`]:
//! each task once, each on the rank holding its stage, each after what it depends on, no
//! deadlock) and the same replay under predicted costs ([`time`]), which gives the
//! [`Timeline`] the runtime runs, the meter measures and the simulator predicts.
//!
//! The built-in orders are builders: GPipe and 1F1B keep each (replica, stage) copy's pipeline
//! order and, where a rank serves several copies (MAST, MASTER), start whichever can start
//! earliest, subject to a bound on the forward passes whose activations a rank holds; ZB-H1
//! (zero-bubble, Qi et al. 2024) splits each backward into B (input gradients) and W (weight
//! gradients) and fills the pipeline's bubbles with the W passes, holding no more
//! micro-batches than 1F1B does.

use std::collections::HashMap;

use super::admission::{Admission, Holding};
use super::{Order, Scheme};
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
/// Which pass of a micro-batch a task runs.
pub enum Pass {
    /// F: forward through a stage.
    Forward,
    /// BW: backward through a stage, input and parameter gradients together.
    Backward,
    /// B: the input gradients only, sent upstream at once; the stage's parameter gradients
    /// wait for its W.
    Input,
    /// W: the parameter gradients its B left.
    Weight,
    /// SEND_F: sends what its stage's F made to the rank of the next stage (never blocks).
    SendActivations,
    /// RECV_F: receives its stage's inputs from the rank of the stage before, for its F.
    RecvActivations,
    /// SEND_B: sends the gradients of its stage's inputs, which its B or BW made, to the rank
    /// of the stage before (never blocks).
    SendGradients,
    /// RECV_B: receives the gradients of its stage's outputs from the rank of the next stage,
    /// for its B or BW.
    RecvGradients,
    /// REDUCE: a stage's parameter gradients, this rank's copies of it summed, then summed
    /// over every rank holding a copy (its data-parallel groups, its tiles, MAST's mirrored
    /// rank): a collective of those ranks, after every backward of the stage on the rank.
    Reduce,
    /// STEP: closes the step, last on every rank: the loss and the reduced gradients checked
    /// finite, BN running statistics committed, the loss scale, clipping and the optimizer.
    Step,
    /// OFFLOAD: moves what its micro-batch's backward of the stage will read — what its F
    /// saved, or what its B left for its W — to the host tier, freeing the device of it.
    Offload,
    /// PREFETCH: brings back what its OFFLOAD moved, before the micro-batch's next B, BW or W
    /// of the stage; where the device copies on a stream of its own, the copies overlap the
    /// tasks in between and that pass waits for them.
    Prefetch,
}

impl Pass {
    /// Every pass, in the order of their codes.
    pub const ALL: [Pass; 12] = [
        Pass::Forward,
        Pass::Backward,
        Pass::Input,
        Pass::Weight,
        Pass::SendActivations,
        Pass::RecvActivations,
        Pass::SendGradients,
        Pass::RecvGradients,
        Pass::Reduce,
        Pass::Step,
        Pass::Offload,
        Pass::Prefetch,
    ];

    /// Its code in schedule files: `F`, `BW`, `B`, `W`, `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`,
    /// `REDUCE`, `STEP`, `OFFLOAD`, `PREFETCH`.
    pub fn code(self) -> &'static str {
        match self {
            Pass::Forward => "F",
            Pass::Backward => "BW",
            Pass::Input => "B",
            Pass::Weight => "W",
            Pass::SendActivations => "SEND_F",
            Pass::RecvActivations => "RECV_F",
            Pass::SendGradients => "SEND_B",
            Pass::RecvGradients => "RECV_B",
            Pass::Reduce => "REDUCE",
            Pass::Step => "STEP",
            Pass::Offload => "OFFLOAD",
            Pass::Prefetch => "PREFETCH",
        }
    }

    /// Whether it computes a micro-batch's pass (F, BW, B, W).
    pub fn computes(self) -> bool {
        matches!(
            self,
            Pass::Forward | Pass::Backward | Pass::Input | Pass::Weight
        )
    }

    /// Whether it moves a message (SEND_F, RECV_F, SEND_B, RECV_B).
    pub fn is_message(self) -> bool {
        matches!(
            self,
            Pass::SendActivations
                | Pass::RecvActivations
                | Pass::SendGradients
                | Pass::RecvGradients
        )
    }

    /// Whether it copies a micro-batch's saved tensors between the device and the host tier
    /// (OFFLOAD, PREFETCH).
    pub fn copies(self) -> bool {
        matches!(self, Pass::Offload | Pass::Prefetch)
    }

    /// Whether it is a collective closing the step's work on a stage or the rank (REDUCE,
    /// STEP), rather than a pass of a micro-batch.
    pub fn is_collective(self) -> bool {
        matches!(self, Pass::Reduce | Pass::Step)
    }
}

impl std::str::FromStr for Pass {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Pass, String> {
        Pass::ALL
            .into_iter()
            .find(|p| p.code() == s)
            .ok_or_else(|| {
                let codes: Vec<&str> = Pass::ALL.iter().map(|p| p.code()).collect();
                format!("unknown task kind '{s}' ({})", codes.join(", "))
            })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
/// One unit of a schedule: a pass of one micro-batch through one stage of one replica, a
/// message of one, a stage's REDUCE (replica and micro-batch 0) or the rank's STEP (all 0).
pub struct Task {
    /// Which pass.
    pub pass: Pass,
    /// Which model replica (MAST and MASTER run more than one).
    pub replica: usize,
    /// Which pipeline stage.
    pub stage: usize,
    /// Which micro-batch of the step.
    pub micro: usize,
}

impl Task {
    /// F of `micro` through `stage` (replica 0).
    pub fn forward(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Forward,
            replica: 0,
            stage,
            micro,
        }
    }
    /// BW of `micro` through `stage` (replica 0).
    pub fn backward(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Backward,
            ..Task::forward(stage, micro)
        }
    }
    /// B of `micro` through `stage` (replica 0).
    pub fn input(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Input,
            ..Task::forward(stage, micro)
        }
    }
    /// W of `micro` through `stage` (replica 0).
    pub fn weight(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Weight,
            ..Task::forward(stage, micro)
        }
    }
    /// OFFLOAD of what `micro`'s backward through `stage` will read (replica 0).
    pub fn offload(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Offload,
            ..Task::forward(stage, micro)
        }
    }
    /// PREFETCH of what `micro`'s OFFLOAD through `stage` moved (replica 0).
    pub fn prefetch(stage: usize, micro: usize) -> Task {
        Task {
            pass: Pass::Prefetch,
            ..Task::forward(stage, micro)
        }
    }
    /// REDUCE of `stage`'s gradients.
    pub fn reduce(stage: usize) -> Task {
        Task {
            pass: Pass::Reduce,
            ..Task::forward(stage, 0)
        }
    }
    /// STEP.
    pub fn step() -> Task {
        Task {
            pass: Pass::Step,
            ..Task::forward(0, 0)
        }
    }
    /// The same task of replica `replica`.
    pub fn of_replica(self, replica: usize) -> Task {
        Task { replica, ..self }
    }
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pass {
            Pass::Reduce => return write!(f, "REDUCE of stage {}", self.stage),
            Pass::Step => return write!(f, "STEP"),
            _ => {}
        }
        write!(
            f,
            "{} of stage {}, micro-batch {}",
            self.pass.code(),
            self.stage,
            self.micro
        )?;
        if self.replica > 0 {
            write!(f, ", replica {}", self.replica)?;
        }
        Ok(())
    }
}

/// Predicted seconds of one micro-batch's passes per stage, of moving its boundary tensors
/// (activations forward, their gradients backward) from stage s to s + 1, of each stage's
/// REDUCE and of each rank's STEP.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    /// Seconds of each stage's forward.
    pub forward: Vec<f64>,
    /// Seconds of each stage's whole backward (BW).
    pub backward: Vec<f64>,
    /// Seconds of each stage's B where its backward is split: its input gradients, with the
    /// whole backward of its ops that do not split theirs. B and W called apart can cost more
    /// (or less) than BW.
    pub input: Vec<f64>,
    /// Seconds of each stage's W: the parameter gradients its B left.
    pub weight: Vec<f64>,
    /// Seconds to move a micro-batch's boundary tensors from stage s to s + 1.
    pub transfer: Vec<f64>,
    /// Seconds of each stage's REDUCE: its gradients all-reduced over the ranks holding a
    /// copy (a stage not listed: none).
    pub reduce: Vec<f64>,
    /// Seconds of each pipeline position's STEP: the optimizer over the copies it holds (a
    /// position not listed: none).
    pub step: Vec<f64>,
    /// Seconds to copy what one micro-batch's backward of each stage reads (its F's saved
    /// tensors) to the host tier or back: an OFFLOAD's or a PREFETCH's (a stage not listed:
    /// none).
    pub offload: Vec<f64>,
    /// Whether those copies run beside compute (a GPU's copy engine: the rank goes on, and
    /// the pass after a PREFETCH waits for its copies) rather than on the rank's time.
    pub copies_overlap: bool,
}

impl StageCosts {
    /// Every stage costs `f` forward and `b` backward, a third of which is W (split, B and W
    /// cost what BW does); nothing else costs time.
    pub fn uniform(stages: usize, f: f64, b: f64) -> Self {
        StageCosts {
            forward: vec![f; stages],
            backward: vec![b; stages],
            input: vec![b - b / 3.0; stages],
            weight: vec![b / 3.0; stages],
            transfer: vec![0.0; stages],
            reduce: vec![],
            step: vec![],
            offload: vec![],
            copies_overlap: false,
        }
    }

    /// The same passes `by` times as long: what computes (F, B, W, the optimizer's STEP), not
    /// what moves bytes (transfers, REDUCEs).
    pub fn slower(&self, by: f64) -> StageCosts {
        let times = |v: &[f64]| v.iter().map(|t| t * by).collect();
        StageCosts {
            forward: times(&self.forward),
            backward: times(&self.backward),
            input: times(&self.input),
            weight: times(&self.weight),
            step: times(&self.step),
            ..self.clone()
        }
    }

    /// Seconds of `t`'s pass on pipeline position `rank` (none for a message task: a send is
    /// posted, a receive's wait is its message's travel; an OFFLOAD's or PREFETCH's copies
    /// where they overlap compute).
    pub fn of(&self, t: &Task, rank: usize) -> f64 {
        let s = t.stage;
        let listed = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
        match t.pass {
            Pass::Forward => self.forward[s],
            Pass::Backward => self.backward[s],
            Pass::Input => self.input[s],
            Pass::Weight => self.weight[s],
            Pass::Reduce => listed(&self.reduce, s),
            Pass::Step => listed(&self.step, rank),
            Pass::Offload | Pass::Prefetch if !self.copies_overlap => self.copy(s),
            _ => 0.0,
        }
    }

    /// Seconds an OFFLOAD's or PREFETCH's copies of `stage` take.
    fn copy(&self, stage: usize) -> f64 {
        self.offload.get(stage).copied().unwrap_or(0.0)
    }
}

/// A task with its predicted (or measured) start and end.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timed {
    /// The task.
    pub task: Task,
    /// Seconds from the start of the step.
    pub start: f64,
    /// Seconds from the start of the step.
    pub end: f64,
}

/// Each rank's tasks with their times, for one step of one data-parallel group (all groups
/// run the same).
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Each rank's tasks in the order it runs them.
    pub ranks: Vec<Vec<Timed>>,
}

impl Timeline {
    /// Seconds from the first task's start to the last one's end.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flatten()
            .map(|t| t.end)
            .fold(0.0, f64::max)
    }

    /// Seconds each rank computes (a receive's wait is idle time).
    pub fn busy(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|r| {
                (r.iter().filter(|t| t.task.pass.computes()))
                    .map(|t| t.end - t.start)
                    .sum()
            })
            .collect()
    }

    /// The share of the ranks' time spent idle while micro-batches pass, from the step's start
    /// to the last F, B, BW or W's end (the pipeline's bubble; a REDUCE among them idles its
    /// rank, those after them and the STEP are not the pipeline's).
    pub fn bubble(&self) -> f64 {
        let passes = (self.ranks.iter().flatten())
            .filter(|t| t.task.pass.computes())
            .map(|t| t.end)
            .fold(0.0, f64::max);
        let span = passes * self.ranks.len() as f64;
        if span <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy().iter().sum::<f64>() / span
    }

    /// The most micro-batches each rank holds at once (from its F to its BW or W).
    pub fn most_held(&self) -> Vec<usize> {
        (self.ranks.iter())
            .map(|r| {
                let (mut n, mut most) = (0usize, 0usize);
                for t in r {
                    match t.task.pass {
                        Pass::Forward => n += 1,
                        Pass::Backward | Pass::Weight => n -= 1,
                        _ => {}
                    }
                    most = most.max(n);
                }
                most
            })
            .collect()
    }

    /// The tasks alone, in each rank's order.
    pub fn schedule(&self, scheme: &Scheme) -> Schedule {
        Schedule {
            stages: scheme.stages,
            micro_batches: scheme.parts,
            replicas: scheme.replicas,
            placement: scheme.order,
            virtual_stages: scheme.chunks(),
            ranks: (self.ranks.iter())
                .map(|r| r.iter().map(|t| t.task).collect())
                .collect(),
        }
    }
}

/// What each rank of a pipeline runs in one step, in order: per pipeline position, a list of
/// tasks. Messages are tasks of their own (SEND_F, RECV_F, SEND_B, RECV_B): an F computes with
/// what its RECV_F received and leaves its outputs to its SEND_F, a B or BW computes with its
/// RECV_B's gradients and leaves its inputs' to its SEND_B; sends never block, receives wait
/// for their message. A schedule may list none: [`Schedule::with_messages`] then puts each
/// receive just before the task that needs it and each send just after the task that makes
/// it. Gradient sums and the optimizer step are tasks too: one REDUCE per stage a rank holds,
/// after the stage's last backward there, and a STEP closing every rank's list; a schedule
/// that lists none gets them at the end of each list ([`Schedule::with_reductions`]). Which rank
/// holds which stage is the placement of a built-in order: stage s on rank s (MAST's second
/// replica mirrored) for gpipe, 1f1b and zbh1; P·V stages looped over the ranks for
/// interleaved; 2P stages in a V for zbv.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// P: pipeline positions (ranks of a group).
    pub stages: usize,
    /// m: micro-batches per replica pass.
    pub micro_batches: usize,
    /// η: replicas per step.
    pub replicas: usize,
    /// The built-in order whose placement of stages on ranks the tasks follow.
    pub placement: Order,
    /// Model chunks per rank under that placement (the model has this many times P stages).
    pub virtual_stages: usize,
    /// Each pipeline position's tasks in the order it runs them.
    pub ranks: Vec<Vec<Task>>,
}

/// A task as a schedule file writes it: a REDUCE names its stage alone, a STEP nothing.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTask {
    kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stage: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    micro_batch: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    replica: Option<usize>,
}

/// A schedule file: the sizes, then one list of tasks per rank.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    stages: usize,
    micro_batches: usize,
    #[serde(default = "one")]
    replicas: usize,
    #[serde(default = "standard")]
    placement: String,
    #[serde(default = "one")]
    virtual_stages: usize,
    ranks: Vec<Vec<FileTask>>,
}

fn standard() -> String {
    Order::OneFOneB.to_string()
}

fn one() -> usize {
    1
}

impl Schedule {
    /// A schedule of `stages` positions and `micro_batches` micro-batches with no tasks yet
    /// (one replica; see [`Schedule::push`]).
    pub fn empty(stages: usize, micro_batches: usize) -> Schedule {
        Schedule {
            stages,
            micro_batches,
            replicas: 1,
            placement: Order::OneFOneB,
            virtual_stages: 1,
            ranks: vec![Vec::new(); stages],
        }
    }

    /// The same schedule with its stages placed as `order` places them with `virtual_stages`
    /// chunks per rank (e.g. interleaved, 2).
    pub fn placed_as(mut self, order: Order, virtual_stages: usize) -> Schedule {
        self.placement = order;
        self.virtual_stages = order.chunks(virtual_stages);
        self
    }

    /// Stages of the model: P times the chunks per rank.
    pub fn model_stages(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// Whether it lists its messages (any SEND or RECV task).
    pub fn has_messages(&self) -> bool {
        self.ranks.iter().flatten().any(|t| t.pass.is_message())
    }

    /// Whether it lists its gradient sums and optimizer step (any REDUCE or STEP task).
    pub fn has_reductions(&self) -> bool {
        self.ranks.iter().flatten().any(|t| t.pass.is_collective())
    }

    /// The scheme shape whose placement its tasks follow (the kind places nothing).
    fn placed(&self) -> Scheme {
        Scheme {
            stages: self.stages,
            parts: self.micro_batches,
            replicas: self.replicas,
            order: self.placement,
            virtual_stages: self.virtual_stages,
            ..Scheme::mp()
        }
    }

    /// The schedule with its gradient sums and optimizer step as tasks: its own where it lists
    /// any (checked by [`Schedule::validate`]), else at the end of every rank's list one REDUCE
    /// per stage the rank holds, in stage order (the ranks holding copies of a stage reach
    /// them in the same order), then the STEP.
    pub fn with_reductions(&self) -> Schedule {
        let mut out = self.clone();
        if !self.has_reductions() {
            let placed = self.placed();
            for (r, list) in out.ranks.iter_mut().enumerate() {
                list.extend(placed.holds(r).into_iter().map(Task::reduce));
                list.push(Task::step());
            }
        }
        out
    }

    /// The schedule with each stage's REDUCE right after the stage's last backward (BW or W)
    /// on its rank and the STEP last on every rank: what a one-replica pipeline runs, whose
    /// copies of a stage (data-parallel groups, tiles) all run the same list and so reach
    /// their REDUCEs in the same order.
    fn reducing_early(mut self) -> Schedule {
        for list in &mut self.ranks {
            let mut last: HashMap<usize, usize> = HashMap::new();
            for (i, t) in list.iter().enumerate() {
                if matches!(t.pass, Pass::Backward | Pass::Input | Pass::Weight) {
                    last.insert(t.stage, i);
                }
            }
            let mut with = Vec::with_capacity(list.len() + last.len() + 1);
            for (i, &t) in list.iter().enumerate() {
                with.push(t);
                if last.get(&t.stage) == Some(&i) {
                    with.push(Task::reduce(t.stage));
                }
            }
            with.push(Task::step());
            *list = with;
        }
        self
    }

    /// The schedule with every task it leaves implicit in place — its messages
    /// ([`Schedule::with_messages`]), then its gradient sums and step
    /// ([`Schedule::with_reductions`]) — and for each of its tasks the index in this schedule
    /// of the task it is or was put in place for (what errors name; the rank's task count for
    /// the REDUCEs and STEP put at its end).
    fn listing(&self) -> (Schedule, Vec<Vec<usize>>) {
        let (messages, mut origin) = self.listing_messages();
        let listed = messages.with_reductions();
        for (r, (list, origin)) in listed.ranks.iter().zip(&mut origin).enumerate() {
            let end = self.ranks.get(r).map_or(0, Vec::len);
            origin.resize(list.len(), end);
        }
        (listed, origin)
    }

    /// The schedule with its messages as tasks: its own where it lists any (checked by
    /// [`Schedule::validate`]), else each receive just before the task that needs it and each
    /// send just after the task that makes it.
    pub fn with_messages(&self) -> Schedule {
        self.listing_messages().0
    }

    /// [`Schedule::with_messages`], and for each of its tasks the index in this schedule of
    /// the task it is or was put in place for (what errors name).
    fn listing_messages(&self) -> (Schedule, Vec<Vec<usize>>) {
        let mut out = self.clone();
        let mut origin: Vec<Vec<usize>> = (self.ranks.iter())
            .map(|r| (0..r.len()).collect())
            .collect();
        if self.has_messages() {
            return (out, origin);
        }
        let last = |s: usize| s + 1 == self.model_stages();
        for (list, origin) in out.ranks.iter_mut().zip(&mut origin) {
            let mut with = Vec::with_capacity(2 * list.len());
            origin.clear();
            for (i, &t) in list.iter().enumerate() {
                let at = |pass| Task { pass, ..t };
                let (before, after) = match t.pass {
                    Pass::Forward => (
                        (t.stage > 0).then(|| at(Pass::RecvActivations)),
                        (!last(t.stage)).then(|| at(Pass::SendActivations)),
                    ),
                    Pass::Backward | Pass::Input => (
                        (!last(t.stage)).then(|| at(Pass::RecvGradients)),
                        (t.stage > 0).then(|| at(Pass::SendGradients)),
                    ),
                    _ => (None, None),
                };
                let n = with.len();
                with.extend(before.into_iter().chain([t]).chain(after));
                origin.extend(std::iter::repeat_n(i, with.len() - n));
            }
            *list = with;
        }
        (out, origin)
    }

    /// The schedule with what the backward of each micro-batch and stage will read offloaded
    /// where `which` picks its F: an OFFLOAD right after that F, and a PREFETCH `ahead` passes
    /// (F, B, BW, W) before the micro-batch's first backward of the stage on its rank, right
    /// after the OFFLOAD where fewer passes lie between. The device holds less while the
    /// micro-batch waits for its backward; the copies cost time where they cannot overlap
    /// compute.
    pub fn offloading(&self, which: impl Fn(&Task) -> bool, ahead: usize) -> Schedule {
        let mut out = self.clone();
        for list in &mut out.ranks {
            let mut with: Vec<Task> = Vec::with_capacity(2 * list.len());
            for &t in list.iter() {
                with.push(t);
                if t.pass == Pass::Forward && which(&t) {
                    with.push(Task {
                        pass: Pass::Offload,
                        ..t
                    });
                }
            }
            // Where each PREFETCH goes: before the task at that index of `with`.
            let mut at: Vec<(usize, Task)> = Vec::new();
            for (o, t) in with
                .iter()
                .enumerate()
                .filter(|(_, t)| t.pass == Pass::Offload)
            {
                let same =
                    |u: &Task| (u.replica, u.stage, u.micro) == (t.replica, t.stage, t.micro);
                let Some(b) = (o + 1..with.len()).find(|&i| {
                    matches!(with[i].pass, Pass::Backward | Pass::Input) && same(&with[i])
                }) else {
                    continue; // no backward here: validation names it
                };
                let (mut i, mut passes) = (b, 0);
                while passes < ahead && i > o + 1 {
                    i -= 1;
                    passes += with[i].pass.computes() as usize;
                }
                at.push((
                    i,
                    Task {
                        pass: Pass::Prefetch,
                        ..*t
                    },
                ));
            }
            at.sort_by_key(|&(i, _)| i);
            let mut placed = Vec::with_capacity(with.len() + at.len());
            let mut next = at.into_iter().peekable();
            for (i, t) in with.into_iter().enumerate() {
                while let Some((_, p)) = next.next_if(|&(j, _)| j == i) {
                    placed.push(p);
                }
                placed.push(t);
            }
            *list = placed;
        }
        out
    }

    /// Appends `task` to rank `rank`'s list.
    pub fn push(&mut self, rank: usize, task: Task) -> &mut Schedule {
        if rank >= self.ranks.len() {
            self.ranks.resize(rank + 1, Vec::new());
        }
        self.ranks[rank].push(task);
        self
    }

    /// The schedule as JSON: `{"stages": P, "micro_batches": m, "replicas": η, "ranks":
    /// [[{"kind": "F", "stage": 0, "micro_batch": 0, "replica": 0}, …, {"kind": "REDUCE",
    /// "stage": 0}, {"kind": "STEP"}], …]}`.
    pub fn to_json(&self) -> String {
        let file = File {
            stages: self.stages,
            micro_batches: self.micro_batches,
            replicas: self.replicas,
            placement: self.placement.to_string(),
            virtual_stages: self.virtual_stages,
            ranks: (self.ranks.iter())
                .map(|r| {
                    r.iter()
                        .map(|t| {
                            let pass_of_micro = !t.pass.is_collective();
                            FileTask {
                                kind: t.pass.code().into(),
                                stage: (t.pass != Pass::Step).then_some(t.stage),
                                micro_batch: pass_of_micro.then_some(t.micro),
                                replica: pass_of_micro.then_some(t.replica),
                            }
                        })
                        .collect()
                })
                .collect(),
        };
        // One task per line: a file people read and edit.
        let mut out = format!(
            "{{\n  \"stages\": {},\n  \"micro_batches\": {},\n  \"replicas\": {},\n  \"placement\": \"{}\",\n  \"virtual_stages\": {},\n  \"ranks\": [\n",
            file.stages, file.micro_batches, file.replicas, file.placement, file.virtual_stages
        );
        for (r, tasks) in file.ranks.iter().enumerate() {
            out.push_str("    [\n");
            for (i, t) in tasks.iter().enumerate() {
                let line = serde_json::to_string(t).unwrap_or_default();
                let comma = if i + 1 < tasks.len() { "," } else { "" };
                out.push_str(&format!("      {line}{comma}\n"));
            }
            let comma = if r + 1 < file.ranks.len() { "," } else { "" };
            out.push_str(&format!("    ]{comma}\n"));
        }
        out.push_str("  ]\n}\n");
        out
    }

    /// Reads a schedule written as [`Schedule::to_json`] writes it (sizes are checked by
    /// [`Schedule::validate`]): every task names its stage but a STEP, and its micro-batch but
    /// a REDUCE or STEP (ignored there), and its replica where it is not 0.
    pub fn from_json(text: &str) -> Result<Schedule> {
        let file: File = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("the schedule file is not valid: {e}")))?;
        let mut ranks = Vec::with_capacity(file.ranks.len());
        for (r, tasks) in file.ranks.into_iter().enumerate() {
            let mut list = Vec::with_capacity(tasks.len());
            for (i, t) in tasks.into_iter().enumerate() {
                let pass: Pass = t
                    .kind
                    .parse()
                    .map_err(|e| Error::Config(format!("rank {r}, task {i}: {e}")))?;
                let named = |field: Option<usize>, what: &str| {
                    field.ok_or_else(|| {
                        Error::Config(format!(
                            "rank {r}, task {i}: a {} task names its {what}",
                            pass.code()
                        ))
                    })
                };
                list.push(match pass {
                    Pass::Step => Task::step(),
                    Pass::Reduce => Task::reduce(named(t.stage, "stage")?),
                    _ => Task {
                        pass,
                        replica: t.replica.unwrap_or(0),
                        stage: named(t.stage, "stage")?,
                        micro: named(t.micro_batch, "micro_batch")?,
                    },
                });
            }
            ranks.push(list);
        }
        let placement: Order = file
            .placement
            .parse()
            .map_err(|e| Error::Config(format!("the schedule's placement: {e}")))?;
        Ok(Schedule {
            stages: file.stages,
            micro_batches: file.micro_batches,
            replicas: file.replicas,
            virtual_stages: file.virtual_stages,
            placement,
            ranks,
        })
    }

    /// Refuses a schedule that `scheme` cannot run, naming the rank, the task's index in its
    /// list and the reason: sizes other than the scheme's; a task outside them or on a rank
    /// that does not hold its stage; a micro-batch's F, its backward (one BW, or one B and one
    /// W) of some stage missing or repeated; a B or BW before its F, a W before its B on the
    /// same rank; a message missing, repeated, or on the wrong side of the task that makes or
    /// needs it (messages it does not list are put in place first: [`Schedule::with_messages`]);
    /// a REDUCE missing or repeated for a stage its rank holds, of a stage it does not hold, or
    /// before a backward of its stage on its rank; a STEP missing or not last (REDUCEs and STEPs
    /// it does not list are put in place first: [`Schedule::with_reductions`]); an OFFLOAD
    /// without its PREFETCH after it (or the reverse), before its micro-batch's F or after its
    /// last backward there, or with a pass of its micro-batch and stage between it and its
    /// PREFETCH; a rank waiting for a message no task will send, or at a REDUCE its stage's
    /// other holder does not reach in the same order (a deadlock, found by replaying the
    /// message matching and the collectives).
    pub fn validate(&self, scheme: &Scheme) -> Result<()> {
        let (listed, origin) = self.listing();
        listed.validate_listed(scheme, &origin)
    }

    /// [`Schedule::validate`] of a schedule that lists its messages, REDUCEs and STEPs, naming
    /// tasks by their `origin` index.
    fn validate_listed(&self, scheme: &Scheme, origin: &[Vec<usize>]) -> Result<()> {
        let ix = |r: usize, i: usize| origin[r][i];
        let bad = |m: String| Err(Error::Config(format!("the schedule is refused: {m}")));
        let sizes = (self.stages, self.micro_batches, self.replicas);
        if sizes != (scheme.stages, scheme.parts, scheme.replicas) {
            return bad(format!(
                "it is for {} stages, {} micro-batches and {} replicas, the run has {}, {} and {}",
                sizes.0, sizes.1, sizes.2, scheme.stages, scheme.parts, scheme.replicas
            ));
        }
        let mine = Scheme {
            order: self.placement,
            virtual_stages: self.virtual_stages,
            ..*scheme
        };
        let stages = scheme.model_stages();
        let same = mine.model_stages() == stages
            && (0..self.replicas)
                .all(|r| (0..stages).all(|s| mine.place(r, s) == scheme.place(r, s)));
        if !same {
            return bad(format!(
                "it places stages as {} with {} chunks per rank, the run as {} with {}",
                self.placement,
                self.virtual_stages,
                scheme.order,
                scheme.chunks()
            ));
        }
        if self.ranks.len() != scheme.stages {
            return bad(format!(
                "it lists {} ranks, the pipeline has {}",
                self.ranks.len(),
                scheme.stages
            ));
        }
        // Where each task sits: (rank, index).
        let mut at: HashMap<Task, (usize, usize)> = HashMap::new();
        for (r, tasks) in self.ranks.iter().enumerate() {
            for (i, t) in tasks.iter().enumerate() {
                if t.pass.is_collective() {
                    continue; // checked per rank below
                }
                let here = format!("rank {r}, task {} ({t})", ix(r, i));
                if t.stage >= stages || t.micro >= self.micro_batches || t.replica >= self.replicas
                {
                    return bad(format!("{here}: outside the schedule's sizes"));
                }
                let home = scheme.place(t.replica, t.stage);
                if home != r {
                    return bad(format!(
                        "{here}: stage {} of replica {} is held by rank {home}",
                        t.stage, t.replica
                    ));
                }
                let none = match t.pass {
                    Pass::RecvActivations if t.stage == 0 => "the first stage receives no inputs",
                    Pass::SendGradients if t.stage == 0 => "the first stage sends no gradients",
                    Pass::SendActivations if t.stage + 1 == stages => {
                        "the last stage sends no activations"
                    }
                    Pass::RecvGradients if t.stage + 1 == stages => {
                        "the last stage receives no gradients"
                    }
                    _ => "",
                };
                if !none.is_empty() {
                    return bad(format!("{here}: {none}"));
                }
                if let Some((r0, i0)) = at.insert(*t, (r, i)) {
                    return bad(format!("{here}: repeats task {} of rank {r0}", ix(r0, i0)));
                }
            }
        }
        for replica in 0..self.replicas {
            for stage in 0..stages {
                let r = scheme.place(replica, stage);
                for micro in 0..self.micro_batches {
                    let find = |pass| {
                        at.get(&Task {
                            pass,
                            replica,
                            stage,
                            micro,
                        })
                        .map(|&(_, i)| i)
                    };
                    let what = Task::forward(stage, micro).of_replica(replica);
                    let name = |pass| Task { pass, ..what };
                    let Some(f) = find(Pass::Forward) else {
                        return bad(format!("rank {r} has no {}", name(Pass::Forward)));
                    };
                    let (bw, b, w) = (find(Pass::Backward), find(Pass::Input), find(Pass::Weight));
                    let first_backward = match (bw, b, w) {
                        (Some(i), None, None) => i,
                        (None, Some(i), Some(j)) if j > i => i,
                        (None, Some(i), Some(j)) => {
                            return bad(format!(
                                "rank {r}, task {} ({}): comes before its B (task {})",
                                ix(r, j),
                                name(Pass::Weight),
                                ix(r, i)
                            ))
                        }
                        (None, Some(i), None) => {
                            return bad(format!(
                                "rank {r} has no {} for its B (task {})",
                                name(Pass::Weight),
                                ix(r, i)
                            ))
                        }
                        (None, None, Some(j)) => {
                            return bad(format!(
                                "rank {r}, task {} ({}): has no B before it",
                                ix(r, j),
                                name(Pass::Weight)
                            ))
                        }
                        (None, None, None) => {
                            return bad(format!(
                                "rank {r} has no backward (BW, or B and W) for {}",
                                name(Pass::Forward)
                            ))
                        }
                        (Some(i), _, _) => {
                            return bad(format!(
                                "rank {r}, task {} ({}): the micro-batch's backward is also split into B and W",
                                ix(r, i),
                                name(Pass::Backward)
                            ))
                        }
                    };
                    if first_backward < f {
                        let t = self.ranks[r][first_backward];
                        return bad(format!(
                            "rank {r}, task {} ({t}): comes before its F (task {})",
                            ix(r, first_backward),
                            ix(r, f)
                        ));
                    }
                    // Each message once, receives before the task that needs them, sends after
                    // the one that makes them.
                    let (first, last) = (stage == 0, stage + 1 == stages);
                    for (pass, wanted, by, before) in [
                        (Pass::RecvActivations, !first, f, true),
                        (Pass::SendActivations, !last, f, false),
                        (Pass::RecvGradients, !last, first_backward, true),
                        (Pass::SendGradients, !first, first_backward, false),
                    ] {
                        if !wanted {
                            continue;
                        }
                        let Some(i) = find(pass) else {
                            return bad(format!("rank {r} has no {}", name(pass)));
                        };
                        if (i < by) != before {
                            let side = if before { "after" } else { "before" };
                            let which = self.ranks[r][by];
                            return bad(format!(
                                "rank {r}, task {} ({}): comes {side} the {which} (task {}) it is for",
                                ix(r, i),
                                name(pass),
                                ix(r, by)
                            ));
                        }
                    }
                    // At most one OFFLOAD and its PREFETCH, between two of the micro-batch's
                    // passes of the stage, and nothing of it computing in between.
                    let passes = [Some(f), Some(first_backward), w];
                    match (find(Pass::Offload), find(Pass::Prefetch)) {
                        (None, None) => {}
                        (Some(o), None) => {
                            return bad(format!(
                                "rank {r}, task {} ({}): has no PREFETCH after it",
                                ix(r, o),
                                name(Pass::Offload)
                            ))
                        }
                        (None, Some(q)) => {
                            return bad(format!(
                                "rank {r}, task {} ({}): has no OFFLOAD before it",
                                ix(r, q),
                                name(Pass::Prefetch)
                            ))
                        }
                        (Some(o), Some(q)) if q < o => {
                            return bad(format!(
                                "rank {r}, task {} ({}): comes before its OFFLOAD (task {})",
                                ix(r, q),
                                name(Pass::Prefetch),
                                ix(r, o)
                            ))
                        }
                        (Some(o), Some(q)) => {
                            let here =
                                format!("rank {r}, task {} ({})", ix(r, o), name(Pass::Offload));
                            if o < f {
                                return bad(format!(
                                    "{here}: comes before its F (task {}): nothing is saved yet",
                                    ix(r, f)
                                ));
                            }
                            let last = passes.into_iter().flatten().max().unwrap_or(f);
                            if o > last {
                                return bad(format!(
                                    "{here}: comes after the micro-batch's last backward (task {}): nothing is left to move",
                                    ix(r, last)
                                ));
                            }
                            if let Some(c) = passes.into_iter().flatten().find(|&c| o < c && c < q)
                            {
                                return bad(format!(
                                    "rank {r}, task {} ({}): comes between the OFFLOAD (task {}) and the PREFETCH (task {}) of what it reads",
                                    ix(r, c),
                                    self.ranks[r][c],
                                    ix(r, o),
                                    ix(r, q)
                                ));
                            }
                        }
                    }
                }
            }
        }
        // Each rank's REDUCEs (one per stage it holds, after the stage's backwards there) and
        // its STEP, last.
        for (r, tasks) in self.ranks.iter().enumerate() {
            let holds = scheme.holds(r);
            let mut reduced: HashMap<usize, usize> = HashMap::new();
            for (i, t) in tasks.iter().enumerate() {
                let here = format!("rank {r}, task {} ({t})", ix(r, i));
                match t.pass {
                    Pass::Reduce if (t.replica, t.micro) != (0, 0) => {
                        return bad(format!(
                        "{here}: a REDUCE is of a stage, not of a replica or micro-batch (give 0)"
                    ))
                    }
                    Pass::Reduce if !holds.contains(&t.stage) => {
                        return bad(format!(
                            "{here}: rank {r} holds no copy of stage {}",
                            t.stage
                        ))
                    }
                    Pass::Reduce => {
                        if let Some(j) = reduced.insert(t.stage, i) {
                            return bad(format!("{here}: repeats task {}", ix(r, j)));
                        }
                        let backward = |u: &Task| {
                            u.stage == t.stage
                                && matches!(u.pass, Pass::Backward | Pass::Input | Pass::Weight)
                        };
                        if let Some(j) = (i + 1..tasks.len()).find(|&j| backward(&tasks[j])) {
                            return bad(format!(
                                "{here}: comes before the {} (task {}) whose gradients it sums",
                                tasks[j],
                                ix(r, j)
                            ));
                        }
                    }
                    Pass::Step if *t != Task::step() => {
                        return bad(format!(
                            "{here}: a STEP names no stage, replica or micro-batch (give 0)"
                        ))
                    }
                    Pass::Step if i + 1 < tasks.len() => {
                        return bad(format!("{here}: a STEP closes the rank's list, last"))
                    }
                    _ => {}
                }
            }
            if let Some(s) = holds.iter().find(|s| !reduced.contains_key(s)) {
                return bad(format!("rank {r} has no REDUCE of stage {s}"));
            }
            if tasks.last().map(|t| t.pass) != Some(Pass::Step) {
                return bad(format!(
                    "rank {r} has no STEP (the last task of every rank)"
                ));
            }
        }
        time_listed(
            scheme,
            &[StageCosts::uniform(stages, 1.0, 2.0)],
            self,
            origin,
        )
        .map(|_| ())
    }
}

/// The compute tasks `t` waits for, messages left implicit (what the builders order): on its
/// own rank (its F, its B) and from other ranks (the activations of the stage before, the
/// gradients of the stage after).
fn depends(t: &Task, stages: usize) -> impl Iterator<Item = Task> {
    let at = |pass, stage| Task { pass, stage, ..*t };
    let (mut local, mut remote) = (None, None);
    match t.pass {
        Pass::Forward if t.stage > 0 => remote = Some(at(Pass::Forward, t.stage - 1)),
        Pass::Forward => {}
        Pass::Backward | Pass::Input => {
            local = Some(at(Pass::Forward, t.stage));
            if t.stage + 1 < stages {
                // Either backward of the next stage sends the gradients.
                remote = Some(at(Pass::Input, t.stage + 1));
            }
        }
        Pass::Weight => local = Some(at(Pass::Input, t.stage)),
        _ => {}
    }
    local.into_iter().chain(remote)
}

/// The tasks `t` waits for in a schedule that lists its messages: on its own rank, the task
/// whose results it sends, or the receives it computes with (and an F before its B, a B
/// before its W); a receive, its send on another rank.
fn needs(t: &Task, stages: usize) -> Vec<Task> {
    let at = |pass, stage| Task { pass, stage, ..*t };
    let later = t.stage + 1 < stages;
    match t.pass {
        Pass::Forward if t.stage > 0 => vec![at(Pass::RecvActivations, t.stage)],
        Pass::Forward => vec![],
        Pass::SendActivations => vec![at(Pass::Forward, t.stage)],
        Pass::RecvActivations => (t.stage.checked_sub(1))
            .map(|s| at(Pass::SendActivations, s))
            .into_iter()
            .collect(),
        Pass::Backward | Pass::Input if later => {
            vec![at(Pass::Forward, t.stage), at(Pass::RecvGradients, t.stage)]
        }
        Pass::Backward | Pass::Input => vec![at(Pass::Forward, t.stage)],
        Pass::SendGradients | Pass::Weight => vec![at(Pass::Input, t.stage)],
        Pass::RecvGradients => vec![at(Pass::SendGradients, t.stage + 1)],
        // What they wait for is the other ranks reaching them (see `time_listed`).
        Pass::Reduce | Pass::Step => vec![],
        // Their own rank's order puts them after what they move (checked by `validate`).
        Pass::Offload | Pass::Prefetch => vec![],
    }
}

/// When a task's gradients are ready, whichever backward (BW or B) sent them.
fn finished(done: &HashMap<Task, f64>, t: &Task) -> Option<f64> {
    done.get(t).copied().or_else(|| match t.pass {
        Pass::Input => done
            .get(&Task {
                pass: Pass::Backward,
                ..*t
            })
            .copied(),
        _ => None,
    })
}

/// Replays `schedule`'s fixed per-rank orders, its messages, REDUCEs and STEP listed
/// ([`Schedule::with_messages`], [`Schedule::with_reductions`]), under `costs`: each task
/// starts when its rank is free and what it waits for has ended (a receive's message, plus its
/// transfer from another rank); a collective starts when every rank taking part has reached it
/// (a REDUCE: the ranks of the pipeline holding its stage, MAST's mirrored pair; the STEP:
/// every rank, whose finite check is a sum over the world). A schedule whose ranks all wait —
/// for messages no task can send, or at collectives the others reach in another order — is a
/// deadlock, reported with each waiting rank's task.
pub fn time(scheme: &Scheme, costs: &StageCosts, schedule: &Schedule) -> Result<Timeline> {
    time_shared(scheme, std::slice::from_ref(costs), schedule)
}

/// [`time`] for ranks that share one processor's threads: `costs[k - 1]` is what each task
/// costs while k of the ranks run tasks at once (the last entry for more), so a rank that
/// computes while others wait runs on the threads they leave (processor sharing). A task's
/// work left carries over when the number running changes.
pub fn time_shared(scheme: &Scheme, costs: &[StageCosts], schedule: &Schedule) -> Result<Timeline> {
    let (listed, origin) = schedule.listing();
    time_listed(scheme, costs, &listed, &origin)
}

/// [`time_shared`] of a schedule that lists its messages, REDUCEs and STEP, naming tasks by
/// their `origin` index.
fn time_listed(
    scheme: &Scheme,
    costs: &[StageCosts],
    schedule: &Schedule,
    origin: &[Vec<usize>],
) -> Result<Timeline> {
    let (p, stages) = (schedule.ranks.len(), scheme.model_stages());
    let sharing = |k: usize| &costs[k.clamp(1, costs.len()) - 1];
    // The ranks of the pipeline that take part in collective `t` of rank `r`: the data-parallel
    // groups and tiles holding the same stages run the same list.
    let takes_part = |t: &Task, r: usize| -> Vec<usize> {
        match t.pass {
            Pass::Step => (0..p).collect(),
            _ if scheme.replicas >= 2 && p - 1 - r != r => vec![r, p - 1 - r],
            _ => vec![r],
        }
    };
    let mut next = vec![0usize; p];
    // Each running rank's task: its start and when it ends if as many keep running.
    let mut running: Vec<Option<(f64, f64)>> = vec![None; p];
    let mut done: HashMap<Task, f64> = HashMap::new();
    // Copies beside compute: when an OFFLOAD's copies end, and a PREFETCH's, which the
    // micro-batch's next pass of the stage waits for; by (replica, stage, micro-batch).
    let overlap = costs[0].copies_overlap;
    let key = |t: &Task| (t.replica, t.stage, t.micro);
    let (mut offloaded, mut arriving) = (HashMap::new(), HashMap::new());
    let mut out: Vec<Vec<Timed>> = vec![Vec::new(); p];
    let (mut now, mut busy) = (0.0f64, 0usize);
    let mut left: usize = schedule.ranks.iter().map(Vec::len).sum();
    while left > 0 {
        // Start what can start now (a message task ends as it starts; a collective starts on
        // every rank taking part once all have reached it); note when the next input arrives.
        let mut arrival = f64::INFINITY;
        let mut started = true;
        while started {
            started = false;
            for r in 0..p {
                let Some(&t) = schedule.ranks[r].get(next[r]) else {
                    continue;
                };
                if running[r].is_some() {
                    continue;
                }
                if t.pass.is_collective() {
                    let parts = takes_part(&t, r);
                    let there = |q: usize| {
                        running[q].is_none() && schedule.ranks[q].get(next[q]) == Some(&t)
                    };
                    if parts.iter().all(|&q| there(q)) {
                        for q in parts {
                            running[q] = Some((now, f64::NAN));
                        }
                        started = true;
                    }
                    continue;
                }
                let mut ready = Some(0.0f64);
                for d in needs(&t, stages) {
                    let end = finished(&done, &d);
                    let moved = match scheme.place(d.replica, d.stage) == r {
                        true => 0.0,
                        false => costs[0].transfer[t.stage.min(d.stage)],
                    };
                    ready = ready.zip(end).map(|(a, e)| a.max(e + moved));
                }
                if t.pass.computes() {
                    if let Some(&at) = arriving.get(&key(&t)) {
                        ready = ready.map(|a: f64| a.max(at));
                    }
                }
                match ready {
                    Some(at) if at > now => arrival = arrival.min(at),
                    Some(_) if t.pass.computes() || (t.pass.copies() && !overlap) => {
                        arriving.remove(&key(&t));
                        running[r] = Some((now, f64::NAN));
                        started = true;
                    }
                    Some(_) => {
                        let copy = costs[0].copy(t.stage);
                        match t.pass {
                            Pass::Offload => _ = offloaded.insert(key(&t), now + copy),
                            Pass::Prefetch => {
                                let out = offloaded.get(&key(&t)).copied().unwrap_or(now);
                                arriving.insert(key(&t), out.max(now) + copy);
                            }
                            _ => {}
                        }
                        next[r] += 1;
                        left -= 1;
                        done.insert(t, now);
                        out[r].push(Timed {
                            task: t,
                            start: now,
                            end: now,
                        });
                        started = true;
                    }
                    None => {}
                }
            }
        }
        // Re-project the running ranks' ends at the new share of the threads.
        let before = sharing(busy);
        busy = running.iter().flatten().count();
        let after = sharing(busy);
        for r in 0..p {
            if let Some((_, end)) = &mut running[r] {
                let t = &schedule.ranks[r][next[r]];
                *end = match end.is_nan() {
                    true => now + after.of(t, r),
                    false if std::ptr::eq(before, after) => *end,
                    false => now + (*end - now) / before.of(t, r) * after.of(t, r),
                };
            }
        }
        let ending = (running.iter().flatten())
            .map(|&(_, end)| end)
            .fold(f64::INFINITY, f64::min);
        if ending.is_infinite() && arrival.is_infinite() {
            let stuck: Vec<String> = (0..p)
                .filter_map(|r| {
                    let t = schedule.ranks[r].get(next[r])?;
                    let absent = (t.pass.is_collective())
                        .then(|| {
                            let there = |&q: &usize| schedule.ranks[q].get(next[q]) == Some(t);
                            takes_part(t, r).into_iter().find(|q| !there(q))
                        })
                        .flatten()
                        .map(|q| format!(", waiting for rank {q} to reach it"));
                    let on = absent
                        .or_else(|| {
                            needs(t, stages)
                                .into_iter()
                                .find(|d| finished(&done, d).is_none())
                                .map(|d| format!(", waiting for {d}"))
                        })
                        .unwrap_or_default();
                    Some(format!("rank {r} at task {} ({t}{on})", origin[r][next[r]]))
                })
                .collect();
            return Err(Error::Config(format!(
                "the schedule is refused: it deadlocks: {}",
                stuck.join("; ")
            )));
        }
        now = ending.min(arrival);
        for r in 0..p {
            if let Some((start, end)) = running[r].filter(|&(_, end)| end <= now) {
                let task = schedule.ranks[r][next[r]];
                next[r] += 1;
                left -= 1;
                running[r] = None;
                done.insert(task, end);
                out[r].push(Timed { task, start, end });
            }
        }
    }
    Ok(Timeline { ranks: out })
}

/// One stage's passes over `m` micro-batches in GPipe's order, or else 1F1B's.
fn stage_sequence(order: Order, stages: usize, stage: usize, m: usize) -> Vec<(Pass, usize)> {
    match order {
        Order::GPipe => (0..m)
            .map(|k| (Pass::Forward, k))
            .chain((0..m).rev().map(|k| (Pass::Backward, k)))
            .collect(),
        _ => {
            let warm = (stages - 1 - stage).min(m);
            let mut seq: Vec<_> = (0..warm).map(|k| (Pass::Forward, k)).collect();
            for k in 0..m - warm {
                seq.push((Pass::Forward, warm + k));
                seq.push((Pass::Backward, k));
            }
            seq.extend((m - warm..m).map(|k| (Pass::Backward, k)));
            seq
        }
    }
}

/// Builds the schedule of `scheme`'s order under `costs`, its forwards admitted as
/// `admission` says (ZB-H1 and ZB-V hold what 1F1B holds; interleaved 1F1B follows
/// Megatron-LM's order). Under a count, replicas enter each rank in replica order (a later
/// replica's forward waits until the earlier ones' forwards there are done); by bytes, a
/// later replica's forward starts when the rank's free bytes hold it beside the most the
/// earlier replicas will still hold there. Either way the first replica is never starved.
/// With one replica each stage's REDUCE follows its last backward on its rank; MAST's and
/// MASTER's mirrored ranks reach theirs at the end, in stage order.
pub fn build(scheme: &Scheme, costs: &StageCosts, admission: &Admission) -> Result<Timeline> {
    let order = match scheme.order {
        Order::ZbH1 | Order::ZbV => zero_bubble(scheme, costs)?.schedule(scheme),
        Order::Interleaved => interleaved(scheme),
        Order::GPipe | Order::OneFOneB => replay(scheme, costs, admission, false)?.schedule(scheme),
    };
    let order = match scheme.replicas {
        1 => order.reducing_early(),
        _ => order.with_reductions(),
    };
    // Replayed with its messages as tasks: the times the order was built with, its REDUCEs'
    // and STEPs' added.
    time(scheme, costs, &order)
}

/// The task list of an evaluation on one group: `micro` micro-batches' forwards through replica
/// 0's stages, in order, with no backward. One replica is enough: every copy of a stage holds
/// the same weights, and a second would only shorten a pass that is short already.
pub fn evaluation(scheme: &Scheme, costs: &StageCosts, micro: usize) -> Result<Timeline> {
    let one = Scheme {
        replicas: 1,
        parts: micro,
        ..*scheme
    };
    replay(&one, costs, &Admission::Free, true)
}

/// Zero-bubble orders on one replica (ZB-H1 with one stage per rank, ZB-V with two in a V):
/// every rank runs, whenever it is free, the first of these that can start: a B whose
/// gradients have arrived (oldest first, then the deeper stage), the next F of one of its
/// stages (the deeper first) if the rank holds fewer micro-batches than 1F1B would (P − r on
/// rank r for ZB-H1; 2P stage passes, 1F1B's first rank, on every rank for ZB-V; a micro-batch
/// is held from its F until its W, and a micro-batch entering the rank's first chunk counts
/// its later chunks there at once, so it can always come back), else the oldest W. The W passes so fill the time a rank
/// would wait, and a rank short of room for an F frees it with a W first. With equal F, B and
/// W, ZB-H1's step takes m(F + B + W) + (P − 1)(F + B), against 1F1B's
/// m(F + B + W) + (P − 1)(F + B + W): gradients travel upstream at B's pace instead of BW's.
fn zero_bubble(scheme: &Scheme, costs: &StageCosts) -> Result<Timeline> {
    if scheme.replicas != 1 {
        return Err(Error::Config(format!(
            "the {} order runs one replica per step (mp, dp or single)",
            scheme.order
        )));
    }
    let (p, m, stages) = (scheme.stages, scheme.parts, scheme.model_stages());
    let mine: Vec<Vec<usize>> = (0..p)
        .map(|r| scheme.stages_at(0, r).into_iter().rev().collect())
        .collect();
    let bound = |r: usize| match scheme.chunks() {
        1 => p - r,
        _ => 2 * p,
    };
    let mut free_at = vec![0.0f64; p];
    let (mut next_f, mut next_b) = (vec![0usize; stages], vec![0usize; stages]);
    let mut held = vec![0usize; p];
    let mut ws: Vec<std::collections::VecDeque<Task>> = vec![Default::default(); p];
    let mut done: HashMap<Task, f64> = HashMap::new();
    let mut out: Vec<Vec<Timed>> = vec![Vec::new(); p];
    for _ in 0..3 * stages * m {
        // Each rank's choice at the earliest time it could start something.
        let mut best: Option<(f64, usize, Task)> = None;
        for r in 0..p {
            let ready_at = |t: &Task| -> Option<f64> {
                depends(t, stages).try_fold(free_at[r], |acc, d| {
                    let e = finished(&done, &d)?;
                    let hop = match scheme.place(0, d.stage) == r {
                        true => 0.0,
                        false => costs.transfer[t.stage.min(d.stage)],
                    };
                    Some(acc.max(e + hop))
                })
            };
            let mut options: Vec<(f64, u8, Task)> = Vec::new();
            for &s in &mine[r] {
                if next_b[s] < m {
                    let b = Task::input(s, next_b[s]);
                    if let Some(at) = ready_at(&b) {
                        options.push((at, 0, b));
                    }
                }
            }
            options.sort_by(|a, b| {
                (a.0, a.2.micro)
                    .partial_cmp(&(b.0, b.2.micro))
                    .expect("finite")
            });
            // Room kept for the later chunks of micro-batches the rank's first chunk started,
            // so that every started micro-batch can come back through this rank.
            let first = *mine[r].last().expect("a rank holds a stage");
            let reserved: usize = mine[r].iter().map(|&s| next_f[first] - next_f[s]).sum();
            for &s in &mine[r] {
                let room = match s == first {
                    true => held[r] + reserved + mine[r].len() <= bound(r),
                    false => next_f[s] < next_f[first],
                };
                if next_f[s] < m && room {
                    let f = Task::forward(s, next_f[s]);
                    if let Some(at) = ready_at(&f) {
                        options.push((at, 1, f));
                    }
                }
            }
            if let Some(&w) = ws[r].front() {
                options.push((free_at[r], 2, w));
            }
            // What can start soonest; at the same time, B before F before W.
            let choice = options
                .into_iter()
                .min_by(|a, b| (a.0, a.1).partial_cmp(&(b.0, b.1)).expect("finite times"));
            if let Some((at, _, t)) = choice {
                if best.is_none_or(|b| at < b.0) {
                    best = Some((at, r, t));
                }
            }
        }
        let Some((start, r, t)) = best else {
            break;
        };
        match t.pass {
            Pass::Forward => {
                next_f[t.stage] += 1;
                held[r] += 1;
            }
            Pass::Input => {
                next_b[t.stage] += 1;
                ws[r].push_back(Task {
                    pass: Pass::Weight,
                    ..t
                });
            }
            _ => {
                ws[r].pop_front();
                held[r] -= 1;
            }
        }
        let end = start + costs.of(&t, r);
        free_at[r] = end;
        done.insert(t, end);
        out[r].push(Timed {
            task: t,
            start,
            end,
        });
    }
    let timeline = Timeline { ranks: out };
    timeline.schedule(scheme).validate(scheme)?;
    Ok(timeline)
}

/// Interleaved 1F1B's order (Megatron-LM's): rank r's k-th forward is chunk (k / P) mod V of
/// micro-batch (k / PV)·P + k mod P, its backwards the same with the chunks reversed; a
/// warm-up of 2(P − r − 1) + (V − 1)P forwards, then one forward and one backward in turn.
fn interleaved(scheme: &Scheme) -> Schedule {
    let (p, v, m) = (scheme.stages, scheme.chunks(), scheme.parts);
    let total = m * v;
    let chunk = |k: usize| (k / p) % v;
    let micro = |k: usize| (k / (p * v)) * p + k % p;
    let mut s = Timeline { ranks: vec![] }.schedule(scheme);
    s.ranks = vec![Vec::new(); p];
    for r in 0..p {
        let warm = match v {
            1 => p - r - 1,
            _ => 2 * (p - r - 1) + (v - 1) * p,
        }
        .min(total);
        let f = |k: usize| Task::forward(chunk(k) * p + r, micro(k));
        let b = |k: usize| Task::backward((v - 1 - chunk(k)) * p + r, micro(k));
        let list = &mut s.ranks[r];
        list.extend((0..warm).map(f));
        for i in 0..total - warm {
            list.push(f(warm + i));
            list.push(b(i));
        }
        list.extend((total - warm..total).map(b));
    }
    s
}

/// [`build`], or with `forward_only` its forward tasks alone.
fn replay(
    scheme: &Scheme,
    costs: &StageCosts,
    admission: &Admission,
    forward_only: bool,
) -> Result<Timeline> {
    let (p, stages) = (scheme.stages, scheme.model_stages());
    // An evaluation's forwards run in GPipe's order whatever the training's.
    let order = if forward_only {
        Order::GPipe
    } else {
        scheme.order
    };
    // Per rank, its copies' sequences: a copy is one orientation (even or odd replicas) of one
    // stage; its replicas run one after another on it.
    let mut seqs: Vec<Vec<Vec<Task>>> = vec![Vec::new(); p];
    for orientation in 0..scheme.replicas.min(2) {
        for stage in 0..stages {
            let mut seq = Vec::new();
            for replica in (orientation..scheme.replicas).step_by(2) {
                for (pass, micro) in stage_sequence(order, stages, stage, scheme.parts) {
                    if forward_only && pass == Pass::Backward {
                        continue;
                    }
                    seq.push(Task {
                        pass,
                        replica,
                        stage,
                        micro,
                    });
                }
            }
            seqs[scheme.place(orientation, stage)].push(seq);
        }
    }
    let total: usize = seqs.iter().flatten().map(Vec::len).sum();
    let mut next: Vec<Vec<usize>> = seqs.iter().map(|r| vec![0; r.len()]).collect();
    let mut free_at = vec![0.0f64; p];
    // Per rank and copy: micro-batches held (from forward to backward) and run forward.
    let mut held = vec![[0usize; 2]; p];
    let mut forwarded = vec![[0usize; 2]; p];
    // Forward passes not yet scheduled, per rank and replica.
    let mut forwards_left = vec![vec![scheme.parts; scheme.replicas]; p];
    let mut done: std::collections::HashMap<Task, f64> = std::collections::HashMap::new();
    let mut out: Vec<Vec<Timed>> = vec![Vec::new(); p];
    for _ in 0..total {
        let mut best: Option<(f64, usize, usize, usize)> = None; // (start, replica, rank, copy)
        for rank in 0..p {
            for (c, seq) in seqs[rank].iter().enumerate() {
                let Some(&t) = seq.get(next[rank][c]) else {
                    continue;
                };
                let dep = match t.pass {
                    Pass::Forward if t.stage > 0 => Some(Task {
                        stage: t.stage - 1,
                        ..t
                    }),
                    Pass::Backward if t.stage + 1 < stages => Some(Task {
                        stage: t.stage + 1,
                        ..t
                    }),
                    _ => None,
                };
                let ready = match dep {
                    Some(d) => match done.get(&d) {
                        Some(&e) => e + costs.transfer[t.stage.min(d.stage)],
                        None => continue,
                    },
                    None => 0.0,
                };
                let admitted = t.pass != Pass::Forward
                    || match admission {
                        Admission::Free => true,
                        Admission::Count(b) => {
                            held[rank].iter().sum::<usize>() < *b
                                && forwards_left[rank][..t.replica].iter().all(|&n| n == 0)
                        }
                        Admission::Bytes(budget) => {
                            let left = |k: usize| &seqs[rank][k][next[rank][k]..];
                            let first = (0..seqs[rank].len())
                                .filter_map(|k| left(k).first().map(|t| t.replica))
                                .min();
                            // The earliest replica with tasks left on the rank runs as it
                            // would alone; a later one waits for room beside what the earlier
                            // ones will still hold here.
                            first == Some(t.replica) || {
                                let after: Vec<Holding> = (0..seqs[rank].len())
                                    .map(|k| {
                                        let now = Holding {
                                            held: held[rank][k],
                                            forwarded: forwarded[rank][k],
                                            forwards: false,
                                        };
                                        if k == c {
                                            return Holding {
                                                held: now.held + 1,
                                                forwarded: now.forwarded + 1,
                                                forwards: true,
                                            };
                                        }
                                        let earlier =
                                            left(k).iter().take_while(|e| e.replica < t.replica);
                                        let (mut most, mut n) = (now, now.held);
                                        for e in earlier {
                                            if e.pass == Pass::Forward {
                                                n += 1;
                                                most.forwarded += 1;
                                                most.forwards = true;
                                            } else {
                                                n -= 1;
                                            }
                                            most.held = most.held.max(n);
                                        }
                                        most
                                    })
                                    .collect();
                                budget.admits(rank, &after)
                            }
                        }
                    };
                if !admitted {
                    continue;
                }
                let start = free_at[rank].max(ready);
                if best.is_none_or(|b| (start, t.replica, rank) < (b.0, b.1, b.2)) {
                    best = Some((start, t.replica, rank, c));
                }
            }
        }
        let Some((start, _, rank, c)) = best else {
            return Err(Error::Config(match admission {
                Admission::Count(b) => format!(
                    "no schedule holds at most {b} forward passes per rank: the bound is too small"
                ),
                _ => "no schedule admits the forward passes left".into(),
            }));
        };
        let t = seqs[rank][c][next[rank][c]];
        next[rank][c] += 1;
        let end = start + costs.of(&t, rank);
        free_at[rank] = end;
        match t.pass {
            Pass::Forward => {
                held[rank][c] += 1;
                forwarded[rank][c] += 1;
                forwards_left[rank][t.replica] -= 1;
            }
            _ => held[rank][c] -= 1,
        }
        done.insert(t, end);
        out[rank].push(Timed {
            task: t,
            start,
            end,
        });
    }
    Ok(Timeline { ranks: out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schemes::admission::{held_bytes, Budget, Moment, StageBytes};
    use crate::schemes::Kind;

    /// Compute tasks (F, BW, B, W) of a rank's list.
    fn computed(tasks: &[Timed]) -> usize {
        tasks.iter().filter(|t| t.task.pass.computes()).count()
    }

    fn scheme(kind: Kind, stages: usize, parts: usize, replicas: usize, order: Order) -> Scheme {
        Scheme::new(kind, stages, parts, replicas, 1, order)
    }

    const F: f64 = 1.0;
    const B: f64 = 2.0;

    #[test]
    fn mp_basic_takes_p_times_f_plus_b_per_sample() {
        for p in [2, 3, 4, 8] {
            let s = build(
                &scheme(Kind::Mp, p, 1, 1, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                &Admission::Free,
            )
            .unwrap();
            assert_eq!(s.makespan(), p as f64 * (F + B));
        }
    }

    #[test]
    fn gpipe_and_1f1b_fill_and_drain() {
        for order in [Order::GPipe, Order::OneFOneB] {
            let (p, m) = (4, 8);
            let s = build(
                &scheme(Kind::Mp, p, m, 1, order),
                &StageCosts::uniform(p, F, B),
                &Admission::Free,
            )
            .unwrap();
            // (m + P - 1) slots of f + b: the pipeline bubble of both orders.
            assert_eq!(s.makespan(), (m + p - 1) as f64 * (F + B), "{order:?}");
            let held = |r: &Vec<Timed>| {
                let mut n: i32 = 0;
                let mut most = 0;
                for t in r.iter().filter(|t| t.task.pass.computes()) {
                    n += if t.task.pass == Pass::Forward { 1 } else { -1 };
                    most = most.max(n);
                }
                most
            };
            // 1F1B holds at most P - s micro-batches on stage s; GPipe all m.
            let want = |s: usize| if order == Order::GPipe { m } else { p - s };
            for (rank, r) in s.ranks.iter().enumerate() {
                assert_eq!(held(r) as usize, want(rank), "{order:?} rank {rank}");
            }
        }
    }

    #[test]
    fn mast_with_room_for_both_replicas_overlaps_fully() {
        for p in [2, 4, 8] {
            let s = build(
                &scheme(Kind::Mast, p, 1, 2, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                &Admission::Free,
            )
            .unwrap();
            // Replica B starts at time 0 on rank P-1 while A starts on rank 0 ...
            let first = |rank: usize, replica: usize| {
                s.ranks[rank]
                    .iter()
                    .find(|t| t.task.replica == replica)
                    .unwrap()
                    .start
            };
            assert_eq!(first(0, 0), 0.0);
            assert_eq!(first(p - 1, 1), 0.0);
            // ... and two samples take what MP-Basic needs for one.
            assert_eq!(s.makespan(), p as f64 * (F + B), "P = {p}");
        }
        // An odd P works too: the middle rank serves both replicas of its stage in turn.
        let s = build(
            &scheme(Kind::Mast, 3, 1, 2, Order::GPipe),
            &StageCosts::uniform(3, F, B),
            &Admission::Free,
        )
        .unwrap();
        assert_eq!(computed(&s.ranks[1]), 4);
        assert!(s.makespan() < 2.0 * 3.0 * (F + B));
    }

    #[test]
    fn mast_with_room_for_one_replica_waits_for_the_first() {
        for p in [2, 4, 8] {
            let s = build(
                &scheme(Kind::Mast, p, 1, 2, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                &Admission::Count(1),
            )
            .unwrap();
            assert_eq!(
                s.makespan(),
                (p + 1) as f64 * F + 2.0 * p as f64 * B,
                "P = {p}"
            );
            // MP-Basic would take 2P(f + b) for the same two samples.
            assert!(s.makespan() < 2.0 * p as f64 * (F + B));
            for r in &s.ranks {
                let mut n = 0;
                for t in r {
                    n += if t.task.pass == Pass::Forward { 1 } else { -1 };
                    assert!(n <= 1);
                }
            }
        }
    }

    /// Per rank, the most micro-batches held at once and the most bytes held at any moment of
    /// its task list, its copies holding `budget`'s bytes.
    fn held_by(t: &Timeline, budget: &Budget) -> Vec<(usize, u64)> {
        (t.ranks.iter().enumerate())
            .map(|(rank, tasks)| {
                let (mut held, mut forwarded, mut most) = ([0usize; 2], [0usize; 2], (0, 0));
                for t in tasks.iter().filter(|t| t.task.pass.computes()) {
                    let c = t.task.replica % 2;
                    let backward = t.task.pass != Pass::Forward;
                    if !backward {
                        held[c] += 1;
                        forwarded[c] += 1;
                    }
                    let m = Moment {
                        held,
                        forwarded,
                        running: c,
                        backward,
                    };
                    let bytes = held_bytes(&budget.ranks[rank], &[m]);
                    most = (most.0.max(held[0] + held[1]), most.1.max(bytes));
                    if backward {
                        held[c] -= 1;
                    }
                }
                most
            })
            .collect()
    }

    #[test]
    fn mast_packed_by_bytes_holds_what_the_free_memory_holds() {
        // Stage s saves 10 + s per micro-batch (its forward and backward hold 2 more) beside
        // 100 of parameters: the mirrored copies hold different bytes.
        let stage = |s: usize| StageBytes {
            params: 50,
            stats: 1,
            saved: 10 + s as u64,
            forward: 12 + s as u64,
            backward: 12 + s as u64,
        };
        let mut more_somewhere = false;
        for (p, m, order) in [
            (2, 4, Order::GPipe),
            (4, 4, Order::GPipe),
            (4, 8, Order::OneFOneB),
            (3, 4, Order::GPipe),
        ] {
            let sch = scheme(Kind::Mast, p, m, 2, order);
            let costs = StageCosts::uniform(p, F, B);
            let stages: Vec<_> = (0..p).map(stage).collect();
            let count = build(&sch, &costs, &Admission::Count(m)).unwrap();
            let free = build(&sch, &costs, &Admission::Free).unwrap();
            let at = |capacity: u64| Budget::new(&sch, capacity, &stages);
            // What the count rule's schedule needs, and the overlapped pair's.
            let need = |t: &Timeline| {
                let b = at(u64::MAX);
                held_by(t, &b).iter().map(|h| h.1).max().unwrap()
            };
            let (low, high) = (need(&count), need(&free));
            assert!(low < high, "P {p} m {m} {order:?}");
            let (mut more, mut faster) = (false, false);
            for capacity in [low, (low + high) / 2, high - 1] {
                let budget = at(capacity);
                let packed = build(&sch, &costs, &Admission::Bytes(budget.clone())).unwrap();
                packed.schedule(&sch).validate(&sch).unwrap();
                let held = held_by(&packed, &budget);
                let what = format!("P {p} m {m} {order:?} capacity {capacity}: {held:?}");
                // Every moment within the capacity, never slower than the count rule (faster
                // where it holds more) ...
                assert!(held.iter().all(|h| h.1 <= capacity), "{what}");
                assert!(packed.makespan() <= count.makespan(), "{what}");
                faster |= packed.makespan() < count.makespan();
                assert!(packed.makespan() >= free.makespan(), "{what}");
                // ... and more micro-batches in flight than it allows where the memory holds
                // them.
                more |= held.iter().any(|h| h.0 > m);
            }
            // More than the count rule holds only where the overlapped pair does.
            assert!(!more || free.most_held().iter().any(|&h| h > m));
            more_somewhere |= more;
            // Room for everything: the overlapped pair itself.
            let roomy = build(&sch, &costs, &Admission::Bytes(at(u64::MAX))).unwrap();
            assert_eq!(roomy, free, "P {p} m {m} {order:?}");
            assert!(faster || !more, "P {p} m {m} {order:?}");
        }
        assert!(more_somewhere);
    }

    #[test]
    fn master_runs_rounds_of_the_pair() {
        let s = build(
            &scheme(Kind::Master, 4, 2, 4, Order::GPipe),
            &StageCosts::uniform(4, F, B),
            &Admission::Free,
        )
        .unwrap();
        let tasks: usize = s.ranks.iter().map(|r| computed(r)).sum();
        assert_eq!(tasks, 4 * 4 * 2 * 2); // replicas · stages · micro-batches · (F, B)
        assert!(build(
            &scheme(Kind::Mast, 2, 1, 2, Order::GPipe),
            &StageCosts::uniform(2, F, B),
            &Admission::Count(0)
        )
        .is_err());
    }

    #[test]
    fn evaluation_runs_replica_0_forwards_in_order() {
        for (kind, replicas) in [(Kind::Mp, 1), (Kind::Mast, 2), (Kind::Master, 4)] {
            let (p, m) = (3, 5);
            let s = evaluation(
                &scheme(kind, p, 2, replicas, Order::OneFOneB),
                &StageCosts::uniform(p, F, B),
                m,
            )
            .unwrap();
            for (rank, tasks) in s.ranks.iter().enumerate() {
                let got: Vec<Task> = tasks.iter().map(|t| t.task).collect();
                let want: Vec<Task> = (0..m)
                    .map(|micro| Task {
                        pass: Pass::Forward,
                        replica: 0,
                        stage: rank,
                        micro,
                    })
                    .collect();
                assert_eq!(got, want, "{kind:?} rank {rank}");
            }
            // Forwards pipelined: the last stage finishes P - 1 slots after the first.
            assert_eq!(s.makespan(), (m + p - 1) as f64 * F);
        }
        // A group with nothing to evaluate has nothing to do.
        let s = evaluation(
            &scheme(Kind::Mp, 2, 1, 1, Order::GPipe),
            &StageCosts::uniform(2, F, B),
            0,
        )
        .unwrap();
        assert!(s.ranks.iter().all(Vec::is_empty));
    }

    fn most_held(t: &Timeline) -> Vec<usize> {
        t.most_held()
    }

    #[test]
    fn zbh1_fills_1f1b_bubble_with_w_at_1f1b_memory() {
        // F = B = W = 1: 1F1B takes m·3 + (P - 1)·(F + B + W); ZB-H1, holding no more
        // micro-batches than 1F1B (each until its W), m·3 + (P - 1)·(F + B).
        let costs = |p| StageCosts {
            input: vec![1.0; p],
            weight: vec![1.0; p],
            ..StageCosts::uniform(p, 1.0, 2.0)
        };
        for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 8)] {
            let one_f = build(
                &scheme(Kind::Mp, p, m, 1, Order::OneFOneB),
                &costs(p),
                &Admission::Free,
            )
            .unwrap();
            let zb = build(
                &scheme(Kind::Mp, p, m, 1, Order::ZbH1),
                &costs(p),
                &Admission::Free,
            )
            .unwrap();
            assert_eq!(one_f.makespan(), ((m + p - 1) * 3) as f64, "P {p} m {m}");
            assert_eq!(zb.makespan(), (m * 3 + (p - 1) * 2) as f64, "P {p} m {m}");
            assert!(zb.bubble() < one_f.bubble());
            assert_eq!(most_held(&zb), most_held(&one_f), "P {p} m {m}");
            // Every task once, in an order the ranks can run.
            let s = zb.schedule(&scheme(Kind::Mp, p, m, 1, Order::ZbH1));
            s.validate(&scheme(Kind::Mp, p, m, 1, Order::ZbH1)).unwrap();
        }
    }

    #[test]
    fn interleaved_and_zbv_shrink_the_bubble() {
        for (p, m) in [(2, 4), (4, 8), (4, 16)] {
            let one_f = build(
                &scheme(Kind::Mp, p, m, 1, Order::OneFOneB),
                &StageCosts::uniform(p, 2.0, 4.0),
                &Admission::Free,
            )
            .unwrap();
            for (order, v) in [
                (Order::Interleaved, 2),
                (Order::Interleaved, 4),
                (Order::ZbV, 2),
            ] {
                let sch = scheme(Kind::Mp, p, m, 1, order).with_virtual_stages(v);
                // Each chunk costs its share of a 1F1B stage.
                let chunk = StageCosts::uniform(p * v, 2.0 / v as f64, 4.0 / v as f64);
                let t = build(&sch, &chunk, &Admission::Free).unwrap();
                t.schedule(&sch).validate(&sch).unwrap();
                assert!(
                    t.makespan() < one_f.makespan(),
                    "{order:?} V {v} P {p} m {m}: {} against 1F1B's {}",
                    t.makespan(),
                    one_f.makespan()
                );
                // Chunk c of rank r is stage c·P + r (interleaved), or in a V.
                for (r, tasks) in t.ranks.iter().enumerate() {
                    let staged = tasks.iter().filter(|t| t.task.pass != Pass::Step);
                    assert!(staged.clone().all(|t| sch.place(0, t.task.stage) == r));
                }
            }
            // ZB-V holds at most 2P chunk passes on any rank: 1F1B's first rank.
            let sch = scheme(Kind::Mp, p, m, 1, Order::ZbV);
            let t = build(
                &sch,
                &StageCosts::uniform(2 * p, 1.0, 2.0),
                &Admission::Free,
            )
            .unwrap();
            assert!(
                most_held(&t).iter().all(|&h| h <= 2 * p),
                "{:?}",
                most_held(&t)
            );
        }
    }

    #[test]
    fn ranks_sharing_threads_take_what_the_waiting_ones_leave() {
        // Perfect sharing: k ranks computing at once each run k times slower. Some rank always
        // computes (whatever the others wait for is running), so every order's step is the
        // pipeline's whole work at one rank's speed, bubbles or not.
        for (order, v) in [
            (Order::GPipe, 1),
            (Order::OneFOneB, 1),
            (Order::Interleaved, 2),
            (Order::ZbH1, 1),
            (Order::ZbV, 2),
        ] {
            // Interleaved takes micro-batches in rounds of P.
            let (p, m) = (3, 6);
            let sch = scheme(Kind::Mp, p, m, 1, order).with_virtual_stages(v);
            let n = sch.model_stages();
            let alone = StageCosts::uniform(n, 1.0 / v as f64, 2.0 / v as f64);
            let s = build(&sch, &alone, &Admission::Free)
                .unwrap()
                .schedule(&sch);
            let sharing: Vec<StageCosts> = (1..=p).map(|k| alone.slower(k as f64)).collect();
            let shared = time_shared(&sch, &sharing, &s).unwrap();
            let work = (m * p) as f64 * 3.0;
            assert!(
                (shared.makespan() - work).abs() < 1e-9 * work,
                "{order:?}: {} against the work's {work}",
                shared.makespan()
            );
            // Every rank at a third of the threads throughout pays for the bubble.
            let thirds = time(&sch, &alone.slower(p as f64), &s).unwrap();
            assert!(
                thirds.makespan() > work * 1.1,
                "{order:?}: {}",
                thirds.makespan()
            );
            // The same tasks in the same order on each rank.
            assert_eq!(shared.schedule(&sch), s.with_messages());
        }
    }

    #[test]
    fn schedules_round_trip_through_json() {
        let sch = scheme(Kind::Mast, 3, 2, 2, Order::OneFOneB);
        let s = build(&sch, &StageCosts::uniform(3, F, B), &Admission::Free)
            .unwrap()
            .schedule(&sch);
        let back = Schedule::from_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        back.validate(&sch).unwrap();
        // A fixed order replayed gives the times the builder gave it.
        let t = time(&sch, &StageCosts::uniform(3, F, B), &s).unwrap();
        assert_eq!(
            t.makespan(),
            build(&sch, &StageCosts::uniform(3, F, B), &Admission::Free)
                .unwrap()
                .makespan()
        );
    }

    /// Messages are tasks: a schedule that lists none gets each receive just before the task
    /// that needs it and each send just after the one that makes it; one that lists them keeps
    /// its own order, and each must be there once, on the right side of its task, and match.
    #[test]
    fn messages_are_tasks_put_in_place_or_checked() {
        let sch = scheme(Kind::Mp, 2, 2, 1, Order::OneFOneB);
        let mut bare = Schedule::empty(2, 2);
        for t in [Task::forward(0, 0), Task::forward(0, 1)] {
            bare.push(0, t);
        }
        for t in [Task::backward(0, 0), Task::backward(0, 1)] {
            bare.push(0, t);
        }
        for k in 0..2 {
            bare.push(1, Task::forward(1, k))
                .push(1, Task::backward(1, k));
        }
        let listed = bare.with_messages();
        let codes = |r: usize| -> Vec<String> {
            let list = &listed.ranks[r];
            list.iter()
                .map(|t| format!("{}{}", t.pass.code(), t.micro))
                .collect()
        };
        assert_eq!(
            codes(0),
            ["F0", "SEND_F0", "F1", "SEND_F1", "RECV_B0", "BW0", "RECV_B1", "BW1"]
        );
        assert_eq!(
            codes(1),
            ["RECV_F0", "F0", "BW0", "SEND_B0", "RECV_F1", "F1", "BW1", "SEND_B1"]
        );
        listed.validate(&sch).unwrap();
        assert_eq!(listed.with_messages(), listed, "a listing is kept");
        // Both receives of rank 1 posted first: valid, and slower, as receives block: F0
        // waits until micro-batch 1's activations have come too.
        let mut early = listed.clone();
        let second = early.ranks[1].remove(4);
        early.ranks[1].insert(1, second);
        early.validate(&sch).unwrap();
        let costs = StageCosts::uniform(2, F, B);
        let span = |s: &Schedule| time(&sch, &costs, s).unwrap().makespan();
        assert_eq!(span(&early), span(&listed) + F);
        // A JSON file carries them.
        assert_eq!(Schedule::from_json(&early.to_json()).unwrap(), early);
        let refused = |s: &Schedule| s.validate(&sch).unwrap_err().to_string();
        // A send dropped.
        let mut s = listed.clone();
        s.ranks[0].remove(1);
        let e = refused(&s);
        assert!(
            e.contains("rank 0 has no SEND_F of stage 0, micro-batch 0"),
            "{e}"
        );
        // A receive after the F it is for.
        let mut s = listed.clone();
        s.ranks[1].swap(0, 1);
        let e = refused(&s);
        assert!(
            e.contains("rank 1, task 1 (RECV_F of stage 1, micro-batch 0): comes after the F"),
            "{e}"
        );
        // A send before the backward that makes its gradients.
        let mut s = listed.clone();
        s.ranks[1].swap(2, 3);
        let e = refused(&s);
        assert!(
            e.contains("rank 1, task 2 (SEND_B of stage 1, micro-batch 0): comes before"),
            "{e}"
        );
        // A message the stage does not have.
        let mut s = listed.clone();
        s.ranks[0].insert(
            0,
            Task {
                pass: Pass::RecvActivations,
                ..Task::forward(0, 0)
            },
        );
        let e = refused(&s);
        assert!(
            e.contains("rank 0, task 0") && e.contains("the first stage receives no inputs"),
            "{e}"
        );
        // A receive before its send on a rank that must send first: rank 0 waits for the
        // gradients of micro-batch 0 before sending micro-batch 0's activations.
        let mut s = listed.clone();
        let recv = s.ranks[0].remove(4);
        s.ranks[0].insert(1, recv);
        let e = refused(&s);
        assert!(
            e.contains("deadlocks") && e.contains("rank 0 at task 1 (RECV_B"),
            "{e}"
        );
        // A compute-only schedule's errors name its own indices.
        let mut s = bare.clone();
        s.ranks[1].swap(2, 3);
        let e = refused(&s);
        assert!(
            e.contains(
                "rank 1, task 2 (BW of stage 1, micro-batch 1): comes before its F (task 3)"
            ),
            "{e}"
        );
    }

    #[test]
    fn the_validator_names_rank_task_and_reason() {
        let sch = scheme(Kind::Mp, 2, 2, 1, Order::OneFOneB);
        let good = build(&sch, &StageCosts::uniform(2, F, B), &Admission::Free)
            .unwrap()
            .schedule(&sch);
        good.validate(&sch).unwrap();
        let refused = |s: &Schedule| s.validate(&sch).unwrap_err().to_string();
        // A task missing.
        let mut s = good.clone();
        s.ranks[1].retain(|t| *t != Task::backward(1, 1));
        assert!(
            refused(&s).contains("rank 1 has no backward"),
            "{}",
            refused(&s)
        );
        // A backward before its forward.
        let mut s = good.clone();
        let i = s.ranks[1]
            .iter()
            .position(|t| *t == Task::backward(1, 0))
            .unwrap();
        s.ranks[1].swap(i - 1, i);
        assert!(refused(&s).contains("before its F"), "{}", refused(&s));
        // A stage on the wrong rank.
        let mut s = good.clone();
        let t = s.ranks[1].remove(0);
        s.ranks[0].insert(0, t);
        assert!(refused(&s).contains("rank 0, task 0") && refused(&s).contains("held by rank 1"));
        // A swapped pair that deadlocks: rank 0 waits for a gradient rank 1 sends only after
        // a forward that waits for rank 0.
        let mut s = Schedule::empty(2, 2);
        for t in [
            Task::forward(0, 0),
            Task::backward(0, 0),
            Task::forward(0, 1),
            Task::backward(0, 1),
        ] {
            s.push(0, t);
        }
        for t in [
            Task::forward(1, 1),
            Task::forward(1, 0),
            Task::backward(1, 0),
            Task::backward(1, 1),
        ] {
            s.push(1, t);
        }
        let e = refused(&s);
        assert!(
            e.contains("deadlocks")
                && e.contains("rank 0 at task 1")
                && e.contains("rank 1 at task 0"),
            "{e}"
        );
        // A W without its B, and a W before its B.
        let mut s = good.clone();
        let i = s.ranks[0]
            .iter()
            .position(|t| *t == Task::backward(0, 0))
            .unwrap();
        s.ranks[0][i] = Task::weight(0, 0);
        assert!(
            refused(&s).contains("has no B before it"),
            "{}",
            refused(&s)
        );
        s.ranks[0].insert(i + 1, Task::input(0, 0));
        assert!(
            refused(&s).contains("comes before its B"),
            "{}",
            refused(&s)
        );
    }

    /// The gradient sums and the optimizer step are tasks: a one-replica order reduces each
    /// stage right after its last backward, MAST at the end in stage order, a schedule listing
    /// none gets them at the end; each REDUCE once per stage held, after the stage's backwards,
    /// the STEP last, and the mirrored ranks reach their REDUCEs in the same order.
    #[test]
    fn reductions_and_the_step_are_tasks_put_in_place_or_checked() {
        let codes = |list: &[Task]| -> Vec<String> {
            list.iter()
                .filter(|t| !t.pass.is_message())
                .map(|t| match t.pass {
                    Pass::Reduce => format!("R{}", t.stage),
                    Pass::Step => "S".into(),
                    _ => format!("{}{}.{}", t.pass.code(), t.stage, t.micro),
                })
                .collect()
        };
        // ZB-V on 2 ranks: each rank holds two stages, the later one's W finishing first.
        let zbv = scheme(Kind::Mp, 2, 2, 1, Order::ZbV);
        let built = build(&zbv, &StageCosts::uniform(4, F, B), &Admission::Free)
            .unwrap()
            .schedule(&zbv);
        let rank0 = codes(&built.ranks[0]);
        let at = |c: &str| rank0.iter().position(|x| x == c).unwrap();
        assert_eq!(at("R3"), at("W3.1").max(at("W3.0")) + 1, "{rank0:?}");
        assert!(at("R3") < at("W0.1"), "{rank0:?}");
        assert_eq!(rank0.last().unwrap(), "S");
        assert_eq!(Schedule::from_json(&built.to_json()).unwrap(), built);
        let refused = |s: &Schedule, sch: &Scheme| s.validate(sch).unwrap_err().to_string();
        // A REDUCE before its stage's W.
        let mut s = built.clone();
        let r = s.ranks[0]
            .iter()
            .position(|t| t.pass == Pass::Reduce)
            .unwrap();
        let reduce = s.ranks[0].remove(r);
        let w = (s.ranks[0].iter())
            .rposition(|t| t.pass == Pass::Weight && t.stage == 3)
            .unwrap();
        s.ranks[0].insert(w, reduce);
        let e = refused(&s, &zbv);
        assert!(
            e.contains(&format!(
                "rank 0, task {w} (REDUCE of stage 3): comes before the W"
            )) && e.contains("whose gradients it sums"),
            "{e}"
        );
        // A missing STEP, a STEP not last, a REDUCE missing, repeated, or of a stage the rank
        // does not hold.
        let mut s = built.clone();
        s.ranks[1].pop();
        assert!(
            refused(&s, &zbv).contains("rank 1 has no STEP"),
            "{}",
            refused(&s, &zbv)
        );
        s.ranks[1].insert(0, Task::step());
        let e = refused(&s, &zbv);
        assert!(e.contains("rank 1, task 0 (STEP): a STEP closes"), "{e}");
        let mut s = built.clone();
        s.ranks[0].retain(|t| *t != Task::reduce(0));
        let e = refused(&s, &zbv);
        assert!(e.contains("rank 0 has no REDUCE of stage 0"), "{e}");
        let mut s = built.clone();
        let last = s.ranks[0].len() - 1;
        s.ranks[0].insert(last, Task::reduce(0));
        let e = refused(&s, &zbv);
        assert!(
            e.contains(&format!("rank 0, task {last} (REDUCE of stage 0): repeats")),
            "{e}"
        );
        s.ranks[0][last] = Task::reduce(1);
        let e = refused(&s, &zbv);
        assert!(e.contains("rank 0 holds no copy of stage 1"), "{e}");

        // MAST on 2 ranks: each rank holds both stages; the REDUCEs close the lists in stage
        // order, as they are put in place for a schedule that lists none.
        let mast = scheme(Kind::Mast, 2, 2, 2, Order::GPipe);
        let built = build(&mast, &StageCosts::uniform(2, F, B), &Admission::Free)
            .unwrap()
            .schedule(&mast);
        for list in &built.ranks {
            let end = [Task::reduce(0), Task::reduce(1), Task::step()];
            assert_eq!(list[list.len() - 3..], end);
        }
        let mut bare = built.clone();
        bare.ranks
            .iter_mut()
            .for_each(|l| l.retain(|t| t.pass.computes()));
        assert_eq!(bare.with_messages().with_reductions(), built);
        // Swapped on one of the mirrored ranks: each waits at a REDUCE the other reaches
        // second.
        let mut s = built.clone();
        let n = s.ranks[1].len();
        s.ranks[1].swap(n - 3, n - 2);
        let e = refused(&s, &mast);
        assert!(
            e.contains("deadlocks")
                && e.contains(&format!(
                    "rank 0 at task {} (REDUCE of stage 0, waiting for rank 1 to reach it)",
                    s.ranks[0].len() - 3
                ))
                && e.contains("(REDUCE of stage 1, waiting for rank 0 to reach it)"),
            "{e}"
        );
    }

    /// A REDUCE costs its stage's all-reduce and starts when its stage's other holder reaches
    /// it; the STEP costs each rank's optimizer and starts when every rank has reached it; the
    /// bubble is the passes'.
    #[test]
    fn offloads_take_the_rank_s_time_or_overlap_and_hold_back_the_pass_after() {
        // One stage, two micro-batches in GPipe's order; micro-batch 0's saved tensors out
        // after its F, back one pass before its backward (before micro-batch 1's).
        let one = scheme(Kind::Mp, 1, 2, 1, Order::GPipe);
        let mut s = Schedule::empty(1, 2);
        for t in [
            Task::forward(0, 0),
            Task::forward(0, 1),
            Task::backward(0, 1),
            Task::backward(0, 0),
        ] {
            s.push(0, t);
        }
        let s = s.offloading(|t| t.micro == 0, 1);
        assert_eq!(
            s.ranks[0],
            [
                Task::forward(0, 0),
                Task::offload(0, 0),
                Task::forward(0, 1),
                Task::prefetch(0, 0),
                Task::backward(0, 1),
                Task::backward(0, 0)
            ]
        );
        s.validate(&one).unwrap();
        let spans = |costs: &StageCosts| -> Vec<(Pass, f64, f64)> {
            time(&one, costs, &s).unwrap().ranks[0]
                .iter()
                .map(|t| (t.task.pass, t.start, t.end))
                .collect()
        };
        let copying = |secs: f64, copies_overlap| StageCosts {
            offload: vec![secs],
            copies_overlap,
            ..StageCosts::uniform(1, F, B)
        };
        use Pass::*;
        // On the CPU a copy is the rank's work.
        assert_eq!(
            spans(&copying(0.5, false))[..6],
            [
                (Forward, 0.0, 1.0),
                (Offload, 1.0, 1.5),
                (Forward, 1.5, 2.5),
                (Prefetch, 2.5, 3.0),
                (Backward, 3.0, 5.0),
                (Backward, 5.0, 7.0)
            ]
        );
        // Beside compute it costs nothing while it is done in time...
        assert_eq!(
            spans(&copying(0.5, true))[..6],
            [
                (Forward, 0.0, 1.0),
                (Offload, 1.0, 1.0),
                (Forward, 1.0, 2.0),
                (Prefetch, 2.0, 2.0),
                (Backward, 2.0, 4.0),
                (Backward, 4.0, 6.0)
            ]
        );
        // ...and holds back the pass that reads it while it is not: out by 4, back by 7.
        assert_eq!(spans(&copying(3.0, true))[5], (Backward, 7.0, 9.0));
    }

    #[test]
    fn reductions_and_the_step_take_their_costs() {
        // GPipe, P = 2, m = 1: rank 0's BW ends at 6, rank 1's at 4.
        let mp = scheme(Kind::Mp, 2, 1, 1, Order::GPipe);
        let plain = StageCosts::uniform(2, F, B);
        let costs = StageCosts {
            reduce: vec![0.5, 1.0],
            step: vec![0.25, 0.75],
            ..plain.clone()
        };
        let (free, costed) = (
            build(&mp, &plain, &Admission::Free).unwrap(),
            build(&mp, &costs, &Admission::Free).unwrap(),
        );
        assert_eq!(free.makespan(), 6.0);
        let at = |t: &Timeline, r: usize, task: Task| {
            let x = t.ranks[r].iter().find(|x| x.task == task).unwrap();
            (x.start, x.end)
        };
        assert_eq!(at(&costed, 0, Task::reduce(0)), (6.0, 6.5));
        assert_eq!(at(&costed, 1, Task::reduce(1)), (4.0, 5.0));
        assert_eq!(at(&costed, 0, Task::step()), (6.5, 6.75));
        assert_eq!(at(&costed, 1, Task::step()), (6.5, 7.25));
        assert_eq!(costed.makespan(), 7.25);
        assert_eq!(costed.bubble(), free.bubble());
        // MAST, P = 2: the mirrored ranks run each REDUCE together.
        let mast = scheme(Kind::Mast, 2, 1, 2, Order::GPipe);
        let t = build(&mast, &costs, &Admission::Free).unwrap();
        for stage in 0..2 {
            assert_eq!(
                at(&t, 0, Task::reduce(stage)),
                at(&t, 1, Task::reduce(stage))
            );
        }
        let (start, end) = at(&t, 0, Task::reduce(1));
        assert_eq!(end - start, 1.0);
    }

    #[test]
    fn validation() {
        let ok = scheme(Kind::Mast, 4, 2, 2, Order::GPipe);
        assert!(ok.validate(4).is_ok());
        assert!(ok
            .validate(3)
            .unwrap_err()
            .to_string()
            .contains("micro-batches"));
        assert!(scheme(Kind::Master, 4, 1, 3, Order::GPipe)
            .validate(1)
            .unwrap_err()
            .to_string()
            .contains("even"));
        assert!(scheme(Kind::Mast, 4, 1, 4, Order::GPipe)
            .validate(1)
            .is_err());
        assert!(scheme(Kind::Mp, 4, 1, 2, Order::GPipe).validate(1).is_err());
    }
}
