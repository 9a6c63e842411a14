//! The analytic memory model: what a pipeline stage holds, from the graph alone, in O(1) per
//! node range once the graph has been scanned, so that the partitioner can weigh every
//! candidate stage. The metered run ([`crate::fit::per_rank`]) stays the exact check.
//!
//! A stage (a node range) holds
//! - its parameters' weights and buffers, gradients and momentum;
//! - the batch statistics of every micro-batch it has run forward (until the step commits them);
//! - for every micro-batch in flight, the tensors its nodes save for backward (each once);
//! - while one micro-batch runs, the most its forward or backward holds beyond that: values not
//!   saved but still to be used, gradients, and the running op's output and workspace.
//!
//! Which micro-batches a rank holds when comes from its task list ([`moments`]); a rank's
//! peak is the worst of those moments ([`held_bytes`]). Saved tensors are taken to stay on the
//! device (no offload or recompute policy).
//!
//! The last term comes from a liveness scan of the whole graph (forward frees a value after its
//! last use unless saved; backward holds a value's gradient from its last consumer to its
//! producer, and drops a node's saved tensors after its backward), corrected at the stage's
//! first node for the at most two values a cut carries, and from metering each op once on its
//! own (output, workspace, input gradients), so no op's allocations are restated here.

use std::ops::Range;

use crate::backend::meter::ConvWorkspace;
use crate::graph::Graph;
use crate::memory::Category;
use crate::ops::{batched, Backward, Ctx};
use crate::plan::cuts::{carried, MAX_CUT_VALUES};
use crate::schemes::admission::rank_copies;
pub use crate::schemes::admission::{held_bytes, Moment, StageBytes};
use crate::schemes::schedule::{Pass, Timeline};
use crate::schemes::Scheme;
use crate::tensor::DType;
use crate::tensor::Device;
use crate::Result;

/// A value that crosses a boundary and was saved before it: a stage starting there receives it
/// and holds it for as long as it uses or saves it.
#[derive(Clone, Copy, Debug)]
struct Carried {
    bytes: u64,
    last_use: usize,
    /// The first node at or after the boundary that saves it.
    saved_at: Option<usize>,
}

/// A gradient that the whole-graph model shares with another (a sum hands its `dy` to all its
/// inputs as one buffer) but that a stage ending before the sum receives as a message of its
/// own: one more buffer of `bytes`, live in backward from the stage's end down to node `from`
/// (its value's producer).
#[derive(Clone, Copy, Debug)]
struct SplitGradient {
    bytes: u64,
    from: usize,
}

/// Range maxima in O(1) after O(n log n) preparation.
struct SparseMax(Vec<Vec<u64>>);

impl SparseMax {
    fn new(v: Vec<u64>) -> SparseMax {
        let mut levels = vec![v];
        let mut w = 1;
        while 2 * w <= levels[0].len() {
            let prev = levels.last().expect("one level");
            let next = (0..prev.len() - w)
                .map(|i| prev[i].max(prev[i + w]))
                .collect();
            levels.push(next);
            w *= 2;
        }
        SparseMax(levels)
    }

    /// The largest element of `r` (0 when empty).
    fn max(&self, r: Range<usize>) -> u64 {
        if r.is_empty() {
            return 0;
        }
        let k = (r.len()).ilog2() as usize;
        self.0[k][r.start].max(self.0[k][r.end - (1 << k)])
    }
}

/// The model of one graph at one micro-batch size and precision.
pub struct Footprint {
    /// Prefix sums over nodes: bytes of parameters with their gradients and one optimizer state
    /// tensor each, and of the trainable parameters alone.
    params: Vec<u64>,
    trainable: Vec<u64>,
    stats: Vec<u64>,
    /// Bytes of the tensors first saved before node i, and of the nodes' own saved tensors.
    saved: Vec<u64>,
    /// Per node: `saved[i]` + values live at its forward but not yet saved + the op's forward
    /// allocations.
    forward: SparseMax,
    /// Per node: `saved[i + 1]` + gradients live at its backward + the op's backward allocations.
    backward: SparseMax,
    /// Per boundary that a cut may use, the values it carries that were saved before it.
    carried: Vec<Option<Vec<Carried>>>,
    /// Per boundary that a cut may use, the gradients a stage ending there receives apart.
    split: Vec<Vec<SplitGradient>>,
}

impl Footprint {
    /// The same with `tensors` optimizer state tensors per trainable parameter (SGD keeps
    /// one, Adam two) instead of one.
    pub fn with_optimizer_state(mut self, tensors: usize) -> Footprint {
        for (p, t) in self.params.iter_mut().zip(&self.trainable) {
            *p = *p - t + tensors as u64 * t;
        }
        self
    }

    /// Scans `g` for micro-batches of `micro` samples with parameters in `dtype` and
    /// activations in `activations`, metering each op alone as the metered runs do (with
    /// `workspace`'s convolution workspace).
    pub fn new(
        g: &Graph,
        micro: usize,
        dtype: DType,
        activations: DType,
        workspace: ConvWorkspace,
    ) -> Result<Footprint> {
        let n = g.nodes.len();
        let dt = activations.size() as u64;
        let bytes = |v: usize| (g.values[v].shape.numel() * micro) as u64 * dt;
        // Savers of each value, in node order.
        let mut savers: Vec<Vec<usize>> = vec![Vec::new(); g.values.len()];
        let mut own = vec![0u64; n];
        let mut stats = vec![0u64; n];
        for (i, node) in g.nodes.iter().enumerate() {
            let ins: Vec<_> = node.inputs.iter().map(|&v| &g.values[v].shape).collect();
            let s = node.op.get().saves(&ins);
            if s.inputs {
                for &v in &node.inputs {
                    savers[v].push(i);
                }
            }
            if s.output {
                savers[node.output].push(i);
            }
            own[i] = (s.per_sample * micro) as u64 * dt
                + (s.stats_per_sample * micro * activations.compute().size()) as u64;
            stats[i] = (s.per_batch * activations.compute().size()) as u64;
        }
        // A loss output's gradient seed waits for backward like a saved tensor.
        for o in &g.outputs {
            if let Some(p) = g.values[o.value].producer {
                own[p] += bytes(o.value);
            }
        }
        for s in &mut savers {
            s.dedup();
        }
        let last_use = |v: usize| g.values[v].consumers.iter().copied().max();
        let requires_grad = requires_grad(g);

        let mut saved = vec![0u64; n + 1];
        for i in 0..n {
            saved[i + 1] += own[i];
        }
        for (v, s) in savers.iter().enumerate() {
            if let Some(&first) = s.first() {
                saved[first + 1] += bytes(v);
            }
        }
        // Live and not yet saved at node i's forward: produced before i, used at or after i,
        // saved by no node before i. Gradient live at node i's backward: from the value's last
        // consumer down to its producer (seeds are counted with the saved tensors).
        let ops = op_allocations(g, micro, (dtype, activations), &requires_grad, workspace)?;
        let mut unsaved = vec![0i64; n + 1];
        let mut grads = vec![0i64; n + 1];
        let is_output = |v: usize| g.outputs.iter().any(|o| o.value == v);
        // Gradients a node hands on as `dy` itself share one buffer, alive from the earliest
        // of their producers.
        let mut shared: Vec<Option<usize>> = vec![None; n];
        for v in 0..g.values.len() {
            let Some(last) = last_use(v) else { continue };
            let first = g.values[v].producer.map_or(0, |p| p + 1);
            let end = savers[v].first().map_or(last, |&s| s.min(last));
            if first <= end {
                unsaved[first] += bytes(v) as i64;
                unsaved[end + 1] -= bytes(v) as i64;
            }
            if let (Some(p), true, false) = (g.values[v].producer, requires_grad[v], is_output(v)) {
                if ops[last].passes_dy {
                    shared[last] = Some(shared[last].map_or(p, |q| q.min(p)));
                } else if p < last {
                    grads[p] += bytes(v) as i64;
                    grads[last] -= bytes(v) as i64;
                }
            }
        }
        for (i, from) in shared.iter().enumerate() {
            if let Some(p) = *from {
                let b = bytes(g.nodes[i].output) as i64;
                grads[p] += b;
                grads[i] -= b;
            }
        }
        for i in 0..n {
            saved[i + 1] += saved[i];
            unsaved[i + 1] += unsaved[i];
            grads[i + 1] += grads[i];
        }
        let forward = (0..n)
            .map(|i| saved[i] + unsaved[i] as u64 + ops[i].forward.saturating_sub(stats[i]))
            .collect();
        let backward = (0..n)
            .map(|i| saved[i + 1] + grads[i] as u64 + ops[i].backward)
            .collect();
        let prefix = |v: Vec<u64>| {
            let mut p = vec![0u64; n + 1];
            for i in 0..n {
                p[i + 1] = p[i] + v[i];
            }
            p
        };
        let param_bytes = |copies: fn(bool) -> usize| {
            let per_node = g.nodes.iter().map(|node| {
                node.params
                    .clone()
                    .map(|p| {
                        let spec = &g.params[p].spec;
                        (copies(spec.trainable) * spec.shape.numel() * dtype.size()) as u64
                    })
                    .sum()
            });
            prefix(per_node.collect())
        };
        let params = param_bytes(|trainable| if trainable { 3 } else { 1 });
        let trainable = param_bytes(|trainable| trainable as usize);
        let crossing = carried(g);
        // Of the values crossing a boundary whose gradients the model shares (the same last
        // consumer, one that hands on `dy`), all but the earliest produced arrive as buffers
        // of their own.
        let split = crossing
            .iter()
            .map(|values| {
                let mut shared: Vec<(usize, usize)> = values
                    .iter()
                    .flatten()
                    .filter_map(|&v| {
                        let (p, last) = (g.values[v].producer?, last_use(v)?);
                        let shares = requires_grad[v] && !is_output(v) && ops[last].passes_dy;
                        shares.then_some((last, p))
                    })
                    .collect();
                shared.sort_unstable();
                shared
                    .windows(2)
                    .filter(|w| w[0].0 == w[1].0)
                    .map(|w| SplitGradient {
                        bytes: bytes(g.nodes[w[1].1].output),
                        from: w[1].1,
                    })
                    .collect()
            })
            .collect();
        let carried = crossing
            .into_iter()
            .enumerate()
            .map(|(at, values)| {
                let carried = values?
                    .into_iter()
                    .filter(|&v| savers[v].first().is_some_and(|&s| s < at))
                    .map(|v| Carried {
                        bytes: bytes(v),
                        last_use: last_use(v).expect("a crossing value has a consumer"),
                        saved_at: savers[v].iter().copied().find(|&s| s >= at),
                    })
                    .collect();
                Some(carried)
            })
            .collect();
        Ok(Footprint {
            params,
            trainable,
            stats: prefix(stats),
            saved,
            forward: SparseMax::new(forward),
            backward: SparseMax::new(backward),
            carried,
            split,
        })
    }
}

/// What a stage over a node range holds: never less for a larger range.
pub trait StageMemory {
    /// What a stage made of `nodes` holds.
    fn stage(&self, nodes: Range<usize>) -> StageBytes;
}

impl StageMemory for Footprint {
    /// `r.start` must be 0 or a cut point.
    fn stage(&self, r: Range<usize>) -> StageBytes {
        let (a, b) = (r.start, r.end);
        let carried = self.carried[a]
            .as_deref()
            .expect("stages start at cut points");
        let split = self.split.get(b).map_or(&[][..], Vec::as_slice);
        let base = self.saved[a];
        let saved = self.saved[b] - base
            + carried
                .iter()
                .filter(|c| c.saved_at.is_some_and(|s| s < b))
                .map(|c| c.bytes)
                .sum::<u64>();
        // Where the carried values' and split gradients' contributions change, the ranges
        // between are maximized with the tables.
        let mut cuts = [b; 2 + 3 * MAX_CUT_VALUES];
        cuts[0] = a;
        let mut n = 2;
        for c in carried {
            cuts[n] = (c.last_use + 1).clamp(a, b);
            n += 1;
            if let Some(s) = c.saved_at {
                cuts[n] = s.clamp(a, b);
                n += 1;
            }
        }
        for s in split {
            cuts[n] = s.from.clamp(a, b);
            n += 1;
        }
        let cuts = &mut cuts[..n];
        cuts.sort_unstable();
        let (mut forward, mut backward) = (0, 0);
        for w in cuts.windows(2).filter(|w| w[0] < w[1]) {
            let i = w[0];
            let fwd: u64 = carried
                .iter()
                .filter(|c| i <= c.last_use || c.saved_at.is_some())
                .map(|c| c.bytes)
                .sum();
            let bwd: u64 = carried
                .iter()
                .filter(|c| c.saved_at.is_some_and(|s| s <= i))
                .map(|c| c.bytes)
                .sum::<u64>()
                + split
                    .iter()
                    .filter(|s| s.from <= i)
                    .map(|s| s.bytes)
                    .sum::<u64>();
            forward = forward.max(self.forward.max(w[0]..w[1]) + fwd);
            backward = backward.max(self.backward.max(w[0]..w[1]) + bwd);
        }
        StageBytes {
            params: self.params[b] - self.params[a],
            stats: self.stats[b] - self.stats[a],
            saved,
            forward: forward - base,
            backward: backward - base,
        }
    }
}

/// Which values get a gradient (those that depend on a trainable parameter), as autograd
/// decides it.
fn requires_grad(g: &Graph) -> Vec<bool> {
    let mut r = vec![false; g.values.len()];
    for n in &g.nodes {
        let trainable = n.params.clone().any(|p| g.params[p].spec.trainable);
        r[n.output] = trainable || n.inputs.iter().any(|&v| r[v]);
    }
    r
}

/// What a node's op allocates, metered alone.
#[derive(Clone, Copy, Default)]
struct OpBytes {
    /// The most its forward allocates (output, workspace, what it saves of its own).
    forward: u64,
    /// The most its backward allocates (input gradients, workspace).
    backward: u64,
    /// Its backward hands `dy` itself back as its inputs' gradients (a sum, a reshape).
    passes_dy: bool,
}

/// Each node's op metered alone, with parameters and activations of `(dtype, activations)`.
fn op_allocations(
    g: &Graph,
    micro: usize,
    (dtype, activations): (DType, DType),
    requires_grad: &[bool],
    workspace: ConvWorkspace,
) -> Result<Vec<OpBytes>> {
    let setup = Device::meter("setup", None, workspace);
    let mut out = Vec::with_capacity(g.nodes.len());
    for node in &g.nodes {
        let xs = node
            .inputs
            .iter()
            .map(|&v| {
                setup.zeros(
                    batched(micro, &g.values[v].shape),
                    activations,
                    Category::Activations,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let mut params = node
            .params
            .clone()
            .map(|p| setup.zeros(g.params[p].spec.shape.clone(), dtype, Category::Weights))
            .collect::<Result<Vec<_>>>()?;
        let mut grads = node
            .params
            .clone()
            .filter(|&p| g.params[p].spec.trainable)
            .map(|p| setup.zeros(g.params[p].spec.shape.clone(), dtype, Category::Gradients))
            .collect::<Result<Vec<_>>>()?;
        let op = node.op.get();
        let device = Device::meter("forward", None, workspace);
        let ctx = Ctx {
            device: &device,
            training: true,
            seed: 0,
            tiles: None,
        };
        let refs: Vec<_> = xs.iter().collect();
        let (y, saved) = op.forward(&ctx, &refs, &mut params)?;
        let mut bytes = OpBytes {
            forward: device.memory().peak,
            ..OpBytes::default()
        };
        let need: Vec<bool> = node.inputs.iter().map(|&v| requires_grad[v]).collect();
        if !grads.is_empty() || need.contains(&true) {
            let device = Device::meter("backward", None, workspace);
            let ctx = Ctx {
                device: &device,
                ..ctx
            };
            let shapes: Vec<_> = xs.iter().map(|x| x.shape().clone()).collect();
            let dy = setup.zeros(y.shape().clone(), activations, Category::Activations)?;
            let dx = op.backward(
                &ctx,
                Backward {
                    saved,
                    dy,
                    inputs: &shapes,
                    need: &need,
                    weights: true,
                },
                &params,
                &mut grads,
            )?;
            let memory = device.memory();
            bytes.backward = memory.peak;
            bytes.passes_dy = memory.live.total() == 0 && dx.iter().any(Option::is_some);
        }
        out.push(bytes);
    }
    Ok(out)
}

/// For every rank, the moments of its task list that no other moment covers.
pub fn moments(schedule: &Timeline) -> Vec<Vec<Moment>> {
    schedule
        .ranks
        .iter()
        .map(|tasks| {
            let mut held = [0; 2];
            let mut forwarded = [0; 2];
            let mut all = Vec::new();
            for t in tasks.iter().filter(|t| t.task.pass.computes()) {
                let c = t.task.replica % 2;
                let backward = t.task.pass != Pass::Forward;
                if !backward {
                    held[c] += 1;
                    forwarded[c] += 1;
                }
                all.push(Moment {
                    held,
                    forwarded,
                    running: c,
                    backward,
                });
                // A B leaves what its W reads held (counted whole: an upper bound).
                if matches!(t.task.pass, Pass::Backward | Pass::Weight) {
                    held[c] -= 1;
                }
            }
            all.sort_unstable();
            all.dedup();
            all.iter()
                .filter(|m| !all.iter().any(|o| o != *m && o.covers(m)))
                .copied()
                .collect()
        })
        .collect()
}

/// Adds to `seen` (per rank) the moments of `new` that no moment of `seen` covers; whether
/// there were any.
pub fn merge(seen: &mut [Vec<Moment>], new: Vec<Vec<Moment>>) -> bool {
    let mut added = false;
    for (have, more) in seen.iter_mut().zip(new) {
        for m in more {
            if !have.iter().any(|h| h.covers(&m)) {
                have.push(m);
                added = true;
            }
        }
    }
    added
}

/// Each rank's predicted peak under `scheme` with stages `stages`, at the moments `moments`
/// of its task list.
pub fn rank_bytes(scheme: &Scheme, moments: &[Vec<Moment>], stages: &[StageBytes]) -> Vec<u64> {
    moments
        .iter()
        .enumerate()
        .map(|(rank, at)| held_bytes(&rank_copies(scheme, rank, stages), at))
        .collect()
}
