//! Forward and backward over a range of a graph's nodes (the whole graph, or one pipeline
//! stage). Forward frees each value after its last use unless backward saved it; backward runs
//! in reverse and drops each node's saved tensors as soon as it has used them.

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use std::collections::HashMap;

use super::policy::{Keep, SavePolicy};
use super::{Graph, ValueId};
use crate::backend::Event;
use crate::core::rng::splitmix64;
use crate::memory::Category;
use crate::ops::norm::{BatchNorm, BatchStats};
use crate::ops::tiles::{self, Grid, OnTiles, TileRule, Tiles};
use crate::ops::{Backward, Ctx, Init, Op, Saved};
use crate::tensor::Device;
use crate::tensor::{DType, Shape, Tensor, WeakTensor};
use crate::{Error, Result};

/// Parameter values (trainable ones and buffers) and gradients of a contiguous range of
/// `Graph::params` (all of them, or one stage's), indexed from `first`.
pub struct Params {
    /// The id of `values[0]` in `Graph::params`.
    pub first: usize,
    /// The parameters' values.
    pub values: Vec<Tensor>,
    /// `Some` for trainable parameters.
    pub grads: Vec<Option<Tensor>>,
}

impl Params {
    /// Initial values drawn in parameter order from `seed`; zero gradients.
    pub fn init(graph: &Graph, device: &Device, dtype: DType, seed: u64) -> Result<Params> {
        Params::init_range(graph, device, dtype, seed, 0..graph.params.len())
    }

    /// The parameters `ids` only, with the values a whole-model initialization gives them (the
    /// random draws of earlier parameters are made and discarded).
    pub fn init_range(
        graph: &Graph,
        device: &Device,
        dtype: DType,
        seed: u64,
        ids: Range<usize>,
    ) -> Result<Params> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut values = Vec::with_capacity(ids.len());
        let mut grads = Vec::with_capacity(ids.len());
        for (id, p) in graph.params.iter().enumerate().take(ids.end) {
            let n = p.spec.shape.numel();
            // Fallibly: a model's sizes may come from anywhere (a huge class count).
            let mut data: Vec<f64> = Vec::new();
            data.try_reserve_exact(n).map_err(|_| {
                Error::Config(format!(
                    "parameter '{}' of {n} values is more than this machine can hold",
                    p.name
                ))
            })?;
            match p.spec.init {
                Init::Zeros => data.resize(n, 0.0),
                Init::Ones => data.resize(n, 1.0),
                Init::Normal(std) => {
                    let d = Normal::new(0.0, std).map_err(|e| Error::Internal(e.to_string()))?;
                    data.extend((0..n).map(|_| d.sample(&mut rng)));
                }
                Init::Uniform(b) => data.extend((0..n).map(|_| rng.random_range(-b..b))),
            }
            if id < ids.start {
                continue;
            }
            values.push(device.upload(p.spec.shape.clone(), &data, dtype, Category::Weights)?);
            grads.push(if p.spec.trainable {
                Some(device.zeros(p.spec.shape.clone(), dtype, Category::Gradients)?)
            } else {
                None
            });
        }
        Ok(Params {
            first: ids.start,
            values,
            grads,
        })
    }

    /// Where graph parameter ids `ids` sit in `values`.
    pub fn local(&self, ids: &Range<usize>) -> Range<usize> {
        ids.start - self.first..ids.end - self.first
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self, device: &Device) -> Result<()> {
        for g in self.grads.iter_mut().flatten() {
            device.backend().fill(g.storage_mut()?, 0.0)?;
        }
        Ok(())
    }
}

/// Batch statistics of node `node` from the micro-batch the forward ran on.
#[derive(Clone, Debug)]
pub struct RunningUpdate {
    /// The BN node.
    pub node: usize,
    /// Its batch statistics.
    pub stats: BatchStats,
}

/// What a training forward leaves for backward.
pub struct Tape {
    /// Batch statistics to commit to BN running statistics, in node order.
    pub running: Vec<RunningUpdate>,
    nodes: Range<usize>,
    /// Per node of the range: what it saved, on the device, or in the host tier where
    /// `keep` says so; `None` for a node that did not run or is recomputed.
    saved: Vec<Option<Saved>>,
    keep: Vec<Keep>,
    /// Whether each node ran (recomputation runs the same ones).
    ran: Vec<bool>,
    /// The inputs of each run of recomputed nodes, by the run's first node (range index).
    checkpoints: HashMap<usize, Vec<(ValueId, Tensor)>>,
    /// Whether those inputs wait in the host tier (an [`Tape::offload`]).
    checkpoints_on_host: bool,
    /// Per node (range index): the copies its bundle, or the inputs of the recomputed run it
    /// starts, are still arriving by (on a copy stream).
    arriving: HashMap<usize, Vec<Event>>,
    /// Offloaded bundles are brought back this many nodes ahead of their backward.
    prefetch: usize,
    /// Input shapes (batch included) of each node.
    input_shapes: Vec<Vec<Shape>>,
    requires_grad: Vec<bool>,
    seed: u64,
    /// How each node ran on tiles (all `Plain` without tiles).
    runs: Vec<Run>,
}

impl Tape {
    /// Moves what the tape holds on the device for backward — the saved bundles and the
    /// inputs of recomputed runs — to the host tier, each buffer once (an OFFLOAD task).
    pub fn offload(&mut self, device: &Device) -> Result<()> {
        let mut copies = Copies::default();
        for (saved, keep) in self.saved.iter_mut().zip(&mut self.keep) {
            if *keep == Keep::Device {
                if let Some(bundle) = saved.take() {
                    *saved = Some(copies.bundle(bundle, |t| device.to_host(t))?);
                    *keep = Keep::Host;
                }
            }
        }
        if !self.checkpoints_on_host {
            for kept in self.checkpoints.values_mut() {
                for (_, t) in kept.iter_mut() {
                    *t = copies.copy(t, |t| device.to_host(t))?;
                }
            }
            self.checkpoints_on_host = true;
        }
        Ok(())
    }

    /// Brings back everything the tape holds in the host tier (a PREFETCH task); backward
    /// waits for each node's copies when it reaches the node.
    pub fn prefetch(&mut self, device: &Device) -> Result<()> {
        let mut copies = Copies::default();
        for j in 0..self.saved.len() {
            self.fetch(j, &mut copies, device)?;
        }
        if self.checkpoints_on_host {
            for (&first, kept) in self.checkpoints.iter_mut() {
                let events = self.arriving.entry(first).or_default();
                for (_, t) in kept.iter_mut() {
                    *t = copies.copy(t, |t| {
                        let (d, e) = device.from_host(t)?;
                        events.extend(e);
                        Ok(d)
                    })?;
                }
            }
            self.checkpoints_on_host = false;
        }
        Ok(())
    }

    /// Brings node `j`'s bundle back to the device if it waits in the host tier, noting the
    /// copies it arrives by.
    fn fetch(&mut self, j: usize, copies: &mut Copies, device: &Device) -> Result<()> {
        if self.keep[j] != Keep::Host {
            return Ok(());
        }
        if let Some(host) = self.saved[j].take() {
            let events = self.arriving.entry(j).or_default();
            self.saved[j] = Some(copies.bundle(host, |t| {
                let (d, e) = device.from_host(t)?;
                events.extend(e);
                Ok(d)
            })?);
            self.keep[j] = Keep::Device;
        }
        Ok(())
    }
}

/// How a node ran where samples are split into tiles.
#[derive(Clone, Debug, Default, PartialEq)]
enum Run {
    /// As on one device: no tiles, or no split value near it.
    #[default]
    Plain,
    /// On this rank's tiles (the op's [`TileRule`] says how).
    Tiled(TileRule),
    /// On whole inputs, gathered from the tiles where `gathered` says so; with `cropped`, its
    /// output kept as this rank's tile.
    Whole { gathered: Vec<bool>, cropped: bool },
}

/// Whether node `id` runs on tiles of samples split by `grid`, so that its parameters'
/// gradients are this tile's share (summed over the tiles), not the whole batch's (the same on
/// every tile of a node that runs on whole inputs).
pub fn runs_on_tiles(graph: &Graph, grid: Grid, id: usize) -> bool {
    matches!(run_of(graph, grid, id), Run::Tiled(_))
}

/// How node `id` runs on samples split by `grid`: on tiles where its inputs are split and its
/// op can (an output map large enough for the grid stays in tiles), else on whole inputs.
fn run_of(graph: &Graph, grid: Grid, id: usize) -> Run {
    let n = &graph.nodes[id];
    let split = |v: ValueId| grid.splits(&graph.values[v].shape);
    let inputs: Vec<bool> = n.inputs.iter().map(|&v| split(v)).collect();
    let output = split(n.output);
    if !inputs.contains(&true) && !output {
        return Run::Plain;
    }
    let rule = n.op.get().on_tiles();
    let tiled = match rule {
        TileRule::Reduces => !output,
        TileRule::Pointwise | TileRule::Tiled => output,
        TileRule::Whole => false,
    };
    if tiled && !inputs.contains(&false) {
        Run::Tiled(rule)
    } else {
        Run::Whole {
            gathered: inputs,
            cropped: output,
        }
    }
}

/// What an op running on tiles is told of node `id`'s whole maps.
fn on_tiles<'a>(graph: &'a Graph, tiles: &'a Tiles, id: usize) -> OnTiles<'a> {
    let n = &graph.nodes[id];
    OnTiles {
        tiles,
        inputs: n.inputs.iter().map(|&v| &graph.values[v].shape).collect(),
        output: &graph.values[n.output].shape,
    }
}

/// The tiles context of a node that runs [`Run::Tiled`] by an op that needs it.
fn ctx_tiles<'a>(
    graph: &'a Graph,
    tiles: Option<&'a Tiles>,
    id: usize,
    run: &Run,
) -> Option<OnTiles<'a>> {
    match (run, tiles) {
        (Run::Tiled(TileRule::Tiled | TileRule::Reduces), Some(t)) => Some(on_tiles(graph, t, id)),
        _ => None,
    }
}

/// Copies between the device and its host tier, each buffer once however many bundles (or
/// views) share it.
#[derive(Default)]
struct Copies {
    /// Source buffer → (source, which keeps the key unique, and its copy, which may be gone).
    done: HashMap<usize, (WeakTensor, WeakTensor)>,
}

impl Copies {
    fn copy(
        &mut self,
        t: &Tensor,
        mut make: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let key = t.buffer_key();
        if let Some(copy) = self.done.get(&key).and_then(|(_, c)| c.upgrade()) {
            return copy.reshape(t.shape().clone());
        }
        let copy = make(t)?;
        self.done.insert(key, (t.downgrade(), copy.downgrade()));
        Ok(copy)
    }

    fn bundle(
        &mut self,
        saved: Saved,
        mut make: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<Saved> {
        let moved = saved
            .0
            .iter()
            .map(|t| self.copy(t, &mut make))
            .collect::<Result<_>>()?;
        Ok(Saved(moved))
    }
}

/// The seed of node `node`'s randomness in the pass seeded `seed`.
fn node_seed(seed: u64, node: usize) -> u64 {
    splitmix64(seed ^ splitmix64(node as u64 + 1))
}

/// Runs the nodes of `nodes` that `keep` depends on, from `feeds`, returning the values in
/// `keep`. When `training` (with the policy saying where saved tensors wait), the tape holds
/// what backward needs; `input_grads` makes the fed values want gradients (a pipeline stage
/// sends them upstream).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    graph: &Graph,
    params: &mut Params,
    device: &Device,
    feeds: Vec<(ValueId, Tensor)>,
    nodes: Range<usize>,
    keep: &[ValueId],
    training: Option<&SavePolicy>,
    input_grads: bool,
    seed: u64,
    tiles: Option<&Tiles>,
) -> Result<(Vec<Tensor>, Tape)> {
    let policy = training;
    let training = policy.is_some();
    let nv = graph.values.len();
    let mut values: Vec<Option<Tensor>> = vec![None; nv];
    let mut uses = vec![0usize; nv];
    let mut requires_grad = vec![false; nv];
    // Only the nodes `keep` depends on run (eval skips an auxiliary classifier).
    let mut wanted = vec![false; nv];
    keep.iter().for_each(|&v| wanted[v] = true);
    let mut needed = vec![false; graph.nodes.len()];
    for id in nodes.clone().rev() {
        let n = &graph.nodes[id];
        if wanted[n.output] {
            needed[id] = true;
            n.inputs.iter().for_each(|&v| {
                wanted[v] = true;
                uses[v] += 1;
            });
        }
    }
    for (v, t) in feeds {
        requires_grad[v] = input_grads;
        values[v] = Some(t);
    }
    graph.mark_requires_grad(nodes.clone(), &mut requires_grad);
    let keep_of = |id: usize| policy.map_or(Keep::Device, |p| p.of(id));
    let mut tape = Tape {
        running: Vec::new(),
        nodes: nodes.clone(),
        saved: Vec::with_capacity(nodes.len()),
        keep: nodes.clone().map(keep_of).collect(),
        ran: nodes.clone().map(|id| needed[id]).collect(),
        checkpoints: HashMap::new(),
        checkpoints_on_host: false,
        arriving: HashMap::new(),
        prefetch: policy.map_or(0, |p| p.prefetch),
        input_shapes: Vec::with_capacity(nodes.len()),
        requires_grad: Vec::new(),
        seed,
        runs: Vec::with_capacity(nodes.len()),
    };
    let mut offloaded = Copies::default();
    for (i, id) in nodes.clone().enumerate() {
        let node = &graph.nodes[id];
        if training
            && tape.keep[i] == Keep::Recompute
            && (i == 0 || tape.keep[i - 1] != Keep::Recompute)
        {
            // A run of recomputed nodes starts: keep what flows into it from before.
            let end = (i..tape.keep.len())
                .find(|&j| tape.keep[j] != Keep::Recompute)
                .unwrap_or(tape.keep.len());
            let mut inputs: Vec<ValueId> = (i..end)
                .filter(|&j| tape.ran[j])
                .flat_map(|j| graph.nodes[nodes.start + j].inputs.iter().copied())
                .filter(|&v| graph.values[v].producer.is_none_or(|p| p < id))
                .collect();
            inputs.sort_unstable();
            inputs.dedup();
            let kept = inputs
                .into_iter()
                .map(|v| {
                    let t = values[v].clone().ok_or_else(|| {
                        Error::Internal(format!("{}: input %{v} is not available", node.name))
                    })?;
                    Ok((v, t))
                })
                .collect::<Result<_>>()?;
            tape.checkpoints.insert(i, kept);
        }
        if !needed[id] {
            if training {
                tape.input_shapes.push(Vec::new());
                tape.saved.push(None);
                tape.runs.push(Run::Plain);
            }
            continue;
        }
        let run = tiles.map_or(Run::Plain, |t| run_of(graph, t.grid, id));
        let plain = Ctx {
            device,
            training,
            seed: node_seed(seed, id),
            tiles: None,
        };
        let mut ins: Vec<Tensor> = node
            .inputs
            .iter()
            .map(|&v| {
                values[v].clone().ok_or_else(|| {
                    Error::Internal(format!("{}: input %{v} is not available", node.name))
                })
            })
            .collect::<Result<_>>()?;
        if let (Run::Whole { gathered, .. }, Some(t)) = (&run, tiles) {
            for ((x, &v), _) in ins
                .iter_mut()
                .zip(&node.inputs)
                .zip(gathered)
                .filter(|(_, &g)| g)
            {
                let s = &graph.values[v].shape;
                *x = tiles::all_gather(&plain, t, x, (s.dim(1), s.dim(2)))?;
            }
        }
        let ctx = Ctx {
            tiles: ctx_tiles(graph, tiles, id, &run),
            ..plain
        };
        let local = params.local(&node.params);
        let refs: Vec<&Tensor> = ins.iter().collect();
        let (mut y, saved) = node
            .op
            .get()
            .forward(&ctx, &refs, &mut params.values[local])?;
        if let (Run::Whole { cropped: true, .. }, Some(t)) = (&run, tiles) {
            y = tiles::crop(&ctx, t, &y)?;
        }
        if let (true, Op::BatchNorm(_)) = (training, &node.op) {
            let sample = &graph.values[node.inputs[0]].shape;
            let stats = BatchNorm::batch_stats(&saved, sample)
                .ok_or_else(|| Error::Internal(format!("{}: no batch statistics", node.name)))?;
            tape.running.push(RunningUpdate { node: id, stats });
        }
        drop(refs);
        if training {
            tape.runs.push(run);
            tape.input_shapes
                .push(ins.iter().map(|t| t.shape().clone()).collect());
            tape.saved.push(match tape.keep[i] {
                Keep::Device => Some(saved),
                Keep::Host => Some(offloaded.bundle(saved, |t| device.to_host(t))?),
                Keep::Recompute => None,
            });
        }
        drop(ins);
        values[node.output] = Some(y);
        for &v in &node.inputs {
            uses[v] -= 1;
            if uses[v] == 0 && !keep.contains(&v) {
                values[v] = None;
            }
        }
    }
    tape.requires_grad = requires_grad;
    let out = keep
        .iter()
        .map(|&v| {
            values[v]
                .clone()
                .ok_or_else(|| Error::Internal(format!("value %{v} was not computed")))
        })
        .collect::<Result<_>>()?;
    Ok((out, tape))
}

/// Commits batch statistics to the running statistics of their BN nodes, in the given order.
pub fn commit_running(
    graph: &Graph,
    params: &mut Params,
    device: &Device,
    updates: &[RunningUpdate],
) -> Result<()> {
    for u in updates {
        let node = &graph.nodes[u.node];
        let Op::BatchNorm(bn) = &node.op else {
            return Err(Error::Internal(format!("{} is not a batchnorm", node.name)));
        };
        let local = params.local(&node.params);
        bn.commit(device, &mut params.values[local], &u.stats)?;
    }
    Ok(())
}

/// Adds `g` into `slot`, in place when a buffer is not shared.
fn accumulate(device: &Device, slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    let Some(mut acc) = slot.take() else {
        *slot = Some(g);
        return Ok(());
    };
    let mut g = g;
    let be = device.backend();
    if let Ok(s) = acc.storage_mut() {
        be.add_assign(s, g.storage())?;
    } else if let Ok(s) = g.storage_mut() {
        be.add_assign(s, acc.storage())?;
        acc = g;
    } else {
        let mut sum = device.empty(acc.shape().clone(), acc.dtype(), Category::Activations)?;
        be.add(acc.storage(), g.storage(), sum.storage_mut()?)?;
        acc = sum;
    }
    *slot = Some(acc);
    Ok(())
}

/// Re-runs the run of recomputed nodes that ends at range index `last` from its kept inputs,
/// putting what each node saves back on the tape (the same bits: same inputs, same seeds).
fn recompute(
    graph: &Graph,
    params: &mut Params,
    device: &Device,
    tape: &mut Tape,
    last: usize,
    tiles: Option<&Tiles>,
) -> Result<()> {
    let first = (0..=last)
        .rev()
        .find(|&j| j == 0 || tape.keep[j - 1] != Keep::Recompute)
        .unwrap_or(0);
    if tape.checkpoints_on_host {
        return Err(Error::Internal(
            "recomputing from inputs left in the host tier (an OFFLOAD without its PREFETCH)"
                .into(),
        ));
    }
    for e in tape.arriving.remove(&first).unwrap_or_default() {
        device.backend().wait(&e)?;
    }
    let feeds = tape
        .checkpoints
        .remove(&first)
        .ok_or_else(|| Error::Internal(format!("no kept inputs to recompute from node {first}")))?;
    let start = tape.nodes.start;
    let outputs: Vec<ValueId> = (first..=last)
        .filter(|&j| tape.ran[j])
        .map(|j| graph.nodes[start + j].output)
        .collect();
    let (_, mut again) = forward(
        graph,
        params,
        device,
        feeds,
        start + first..start + last + 1,
        &outputs,
        Some(&SavePolicy::keep_all()),
        false,
        tape.seed,
        tiles,
    )?;
    for (k, saved) in again.saved.drain(..).enumerate() {
        tape.saved[first + k] = saved;
    }
    Ok(())
}

/// The parameter gradients a split backward left for its weight pass: each node whose op
/// [splits its backward](crate::ops::Operator::splits_weights), with what that pass reads
/// again (what forward saved, and the gradient of the node's output), held until then.
#[derive(Default)]
pub struct WeightWork {
    nodes: Vec<WeightNode>,
    /// Whether what the nodes read waits in the host tier (an [`WeightWork::offload`]).
    on_host: bool,
}

struct WeightNode {
    id: usize,
    saved: Saved,
    dy: Tensor,
    inputs: Vec<Shape>,
    seed: u64,
    /// The copies bringing `saved` and `dy` back (a PREFETCH's, on a copy stream).
    arriving: Vec<Event>,
}

impl WeightWork {
    /// Whether nothing was left for the weight pass.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Moves what the weight pass reads to the host tier, each buffer once (an OFFLOAD task).
    pub fn offload(&mut self, device: &Device) -> Result<()> {
        if self.on_host {
            return Ok(());
        }
        let mut copies = Copies::default();
        for w in &mut self.nodes {
            w.saved = copies.bundle(std::mem::take(&mut w.saved), |t| device.to_host(t))?;
            w.dy = copies.copy(&w.dy, |t| device.to_host(t))?;
        }
        self.on_host = true;
        Ok(())
    }

    /// Brings back what [`WeightWork::offload`] moved (a PREFETCH task); the weight pass
    /// waits for each node's copies when it reaches the node.
    pub fn prefetch(&mut self, device: &Device) -> Result<()> {
        if !self.on_host {
            return Ok(());
        }
        let mut copies = Copies::default();
        for w in &mut self.nodes {
            let events = &mut w.arriving;
            let mut back = |t: &Tensor| {
                let (d, e) = device.from_host(t)?;
                events.extend(e);
                Ok(d)
            };
            w.saved = copies.bundle(std::mem::take(&mut w.saved), &mut back)?;
            w.dy = copies.copy(&w.dy, &mut back)?;
        }
        self.on_host = false;
        Ok(())
    }
}

/// Back-propagates `seeds` (gradients of values the forward produced) through the tape,
/// adding parameter gradients into `params.grads`; returns the gradients of `want`. With
/// `split`, nodes whose op splits its backward compute only their input gradients here and
/// leave their parameter gradients to [`weight_gradients`] (zero-bubble schedules run that
/// later); a node that ran on tiles computes both here.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    graph: &Graph,
    params: &mut Params,
    device: &Device,
    mut tape: Tape,
    seeds: Vec<(ValueId, Tensor)>,
    want: &[ValueId],
    tiles: Option<&Tiles>,
    split: bool,
) -> Result<(Vec<Option<Tensor>>, WeightWork)> {
    let mut work = WeightWork::default();
    let mut grads: Vec<Option<Tensor>> = vec![None; graph.values.len()];
    for (v, g) in seeds {
        accumulate(device, &mut grads[v], g)?;
    }
    let mut fetched = Copies::default();
    for (i, id) in tape.nodes.clone().enumerate().rev() {
        let node = &graph.nodes[id];
        // Offloaded bundles come back `prefetch` nodes ahead; a run of recomputed nodes is
        // recomputed when backward reaches its last node.
        for j in i.saturating_sub(tape.prefetch)..=i {
            tape.fetch(j, &mut fetched, device)?;
        }
        // The copies overlapped the work queued since; this node's work waits for its own.
        for e in tape.arriving.remove(&i).unwrap_or_default() {
            device.backend().wait(&e)?;
        }
        if tape.keep[i] == Keep::Recompute && tape.ran[i] && tape.saved[i].is_none() {
            recompute(graph, params, device, &mut tape, i, tiles)?;
        }
        let saved = tape.saved[i].take().unwrap_or_default();
        let Some(mut dy) = grads[node.output].take() else {
            continue;
        };
        let run = std::mem::take(&mut tape.runs[i]);
        let need: Vec<bool> = node.inputs.iter().map(|&v| tape.requires_grad[v]).collect();
        let trainable: Vec<usize> = node
            .params
            .clone()
            .filter(|&p| params.grads[p - params.first].is_some())
            .collect();
        if trainable.is_empty() && !need.contains(&true) {
            continue;
        }
        let mut pgrads: Vec<Tensor> = trainable
            .iter()
            .map(|&p| params.grads[p - params.first].take().expect("trainable"))
            .collect();
        let ctx = Ctx {
            device,
            training: true,
            seed: node_seed(tape.seed, id),
            tiles: ctx_tiles(graph, tiles, id, &run),
        };
        if let (Run::Whole { cropped: true, .. }, Some(t)) = (&run, tiles) {
            let s = &graph.values[node.output].shape;
            dy = tiles::all_gather(&ctx, t, &dy, (s.dim(1), s.dim(2)))?;
        }
        let defer = split && run == Run::Plain && node.op.get().splits_weights();
        if defer && !trainable.is_empty() {
            work.nodes.push(WeightNode {
                id,
                saved: Saved(saved.0.clone()),
                dy: dy.clone(),
                inputs: tape.input_shapes[i].clone(),
                seed: ctx.seed,
                arriving: Vec::new(),
            });
        }
        let b = Backward {
            saved,
            dy,
            inputs: &tape.input_shapes[i],
            need: &need,
            weights: !defer,
        };
        let result = node.op.get().backward(
            &ctx,
            b,
            &params.values[params.local(&node.params)],
            &mut pgrads,
        );
        for (&p, g) in trainable.iter().zip(pgrads) {
            params.grads[p - params.first] = Some(g);
        }
        for (k, ((&v, g), &needed)) in node.inputs.iter().zip(result?).zip(&need).enumerate() {
            if let (Some(mut g), true) = (g, needed) {
                if let (Run::Whole { gathered, .. }, Some(t)) = (&run, tiles) {
                    if gathered[k] {
                        g = tiles::crop(&ctx, t, &g)?;
                    }
                }
                accumulate(device, &mut grads[v], g)?;
            }
        }
    }
    device.settle()?;
    Ok((want.iter().map(|&v| grads[v].take()).collect(), work))
}

/// Adds the parameter gradients a split [`backward`] left in `work` into `params.grads`,
/// freeing what each node held for it.
pub fn weight_gradients(
    graph: &Graph,
    params: &mut Params,
    device: &Device,
    work: WeightWork,
) -> Result<()> {
    if work.on_host {
        return Err(Error::Internal(
            "a weight pass over tensors left in the host tier (an OFFLOAD without its PREFETCH)"
                .into(),
        ));
    }
    for w in work.nodes {
        for e in &w.arriving {
            device.backend().wait(e)?;
        }
        let node = &graph.nodes[w.id];
        let trainable: Vec<usize> = node
            .params
            .clone()
            .filter(|&p| params.grads[p - params.first].is_some())
            .collect();
        let mut pgrads: Vec<Tensor> = trainable
            .iter()
            .map(|&p| params.grads[p - params.first].take().expect("trainable"))
            .collect();
        let ctx = Ctx {
            device,
            training: true,
            seed: w.seed,
            tiles: None,
        };
        let need = vec![false; node.inputs.len()];
        let b = Backward {
            saved: w.saved,
            dy: w.dy,
            inputs: &w.inputs,
            need: &need,
            weights: true,
        };
        let result = node.op.get().backward(
            &ctx,
            b,
            &params.values[params.local(&node.params)],
            &mut pgrads,
        );
        for (&p, g) in trainable.iter().zip(pgrads) {
            params.grads[p - params.first] = Some(g);
        }
        result?;
    }
    device.settle()?;
    Ok(())
}
