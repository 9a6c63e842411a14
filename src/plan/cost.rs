//! The analytical cost model: an op takes as long as the slower of its arithmetic and its
//! memory traffic on a device (Paleo's max), forward plus backward.

use std::ops::Range;

use super::fitted::FittedCosts;
use crate::graph::{runs_on_tiles, Graph, Node};
use crate::ops::tiles::Grid;
use crate::ops::Op;
use crate::schemes::schedule::StageCosts;
use crate::schemes::Scheme;
use crate::tensor::DType;

/// What a device can do per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceProfile {
    /// Arithmetic throughput, FLOP/s.
    pub flops_per_s: f64,
    /// Memory bandwidth, bytes/s.
    pub bytes_per_s: f64,
}

impl DeviceProfile {
    /// A few CPU cores with AVX-512: what this project's benchmarks measure, roughly.
    pub const CPU: DeviceProfile = DeviceProfile {
        flops_per_s: 80e9,
        bytes_per_s: 10e9,
    };
}

/// Predicted seconds of forward + backward of node `n` for a batch of `batch`.
pub fn node_seconds(g: &Graph, n: &Node, batch: usize, dtype: DType, p: &DeviceProfile) -> f64 {
    let flops = g.node_flops(n) as f64 * batch as f64;
    let bytes = g.node_bytes(n, dtype) as f64 * batch as f64;
    // Backward does twice the arithmetic of forward and moves about twice the bytes.
    3.0 * (flops / p.flops_per_s).max(bytes / p.bytes_per_s)
}

/// Forward and backward seconds of every node: predicted, or measured by calibration.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeCosts {
    /// Forward seconds of each node for one micro-batch.
    pub forward: Vec<f64>,
    /// Backward seconds of each node for one micro-batch.
    pub backward: Vec<f64>,
    /// Seconds of each node's input-gradient pass (B) where backward is split: for an op that
    /// [splits its backward](crate::ops::Operator::splits_weights), its first call; for any
    /// other, its whole backward.
    pub input: Vec<f64>,
    /// Seconds of each node's weight pass (W) where backward is split: an op's second call (0
    /// for an op that does not split its backward).
    pub weight: Vec<f64>,
    /// Seconds stage 0 spends making a micro-batch's images (0 in the roofline model).
    pub data: f64,
}

impl NodeCosts {
    /// The roofline model of `p` (GPUs in the simulator): backward is two thirds of a node's
    /// forward + backward.
    pub fn analytic(g: &Graph, batch: usize, dtype: DType, p: &DeviceProfile) -> NodeCosts {
        let total = node_costs(g, batch, dtype, p);
        let backward: Vec<f64> = total.iter().map(|t| 2.0 * t / 3.0).collect();
        let (input, weight) = halves(g, &backward);
        NodeCosts {
            forward: total.iter().map(|t| t / 3.0).collect(),
            backward,
            input,
            weight,
            data: 0.0,
        }
    }

    /// The default CPU model: every node from `fit`, the committed fit of this project's
    /// kernels, its backward split into B and W as the fit's family splits it; a node of a
    /// family the fit has not seen (a custom op) from the roofline of `p`, split as
    /// [`NodeCosts::analytic`] splits it.
    pub fn fitted(
        g: &Graph,
        batch: usize,
        dtype: DType,
        fit: &FittedCosts,
        p: &DeviceProfile,
    ) -> NodeCosts {
        let mut c = NodeCosts {
            forward: vec![],
            backward: vec![],
            input: vec![],
            weight: vec![],
            data: fit.data(g, batch, dtype),
        };
        for n in &g.nodes {
            let (f, b) = fit.node(g, n, batch, dtype).unwrap_or_else(|| {
                let t = node_seconds(g, n, batch, dtype, p);
                (t / 3.0, 2.0 * t / 3.0)
            });
            let (i, w) = fit.split(g, n, b).unwrap_or_else(|| halve(n, b));
            c.forward.push(f);
            c.backward.push(b);
            c.input.push(i);
            c.weight.push(w);
        }
        let loss = g.outputs.iter().map(|o| fit.loss(g, o.value, batch, dtype));
        charge_losses(g, &mut c.forward, loss);
        c
    }

    /// Forward + backward seconds per node.
    pub fn total(&self) -> Vec<f64> {
        self.forward
            .iter()
            .zip(&self.backward)
            .map(|(f, b)| f + b)
            .collect()
    }

    /// Forward and backward seconds of each node range.
    pub fn stages(&self, stages: &[std::ops::Range<usize>]) -> (Vec<f64>, Vec<f64>) {
        (
            sum_over(&self.forward, stages),
            sum_over(&self.backward, stages),
        )
    }
}

/// Adds each of `g`'s outputs' `loss` seconds (in the order of [`Graph::outputs`]) to the
/// forward of the node computing it: the forward task that computes an output also scores it.
pub fn charge_losses(g: &Graph, forward: &mut [f64], loss: impl IntoIterator<Item = f64>) {
    for (o, t) in g.outputs.iter().zip(loss) {
        if let Some(n) = g.values[o.value].producer {
            forward[n] += t;
        }
    }
}

/// The sums of `v` over each range of `stages`.
fn sum_over(v: &[f64], stages: &[Range<usize>]) -> Vec<f64> {
    stages.iter().map(|r| v[r.clone()].iter().sum()).collect()
}

/// Each node's `backward` split into B and W with nothing measured: half each for an op that
/// splits its backward (a convolution's filter gradient costs about what its data gradient
/// does), all B for the others; B + W costs what the fused backward does.
pub fn halves(g: &Graph, backward: &[f64]) -> (Vec<f64>, Vec<f64>) {
    (g.nodes.iter().zip(backward))
        .map(|(n, &b)| halve(n, b))
        .unzip()
}

/// Node `n`'s backward of `b` seconds split as [`halves`] splits it.
fn halve(n: &Node, b: f64) -> (f64, f64) {
    match n.op.get().splits_weights() {
        true => (b / 2.0, b / 2.0),
        false => (b, 0.0),
    }
}

impl NodeCosts {
    /// What the schedule builder weighs the stages `stages` by, per micro-batch.
    pub fn stage_costs(&self, stages: &[Range<usize>]) -> StageCosts {
        let (mut forward, backward) = self.stages(stages);
        forward[0] += self.data;
        StageCosts {
            forward,
            backward,
            input: sum_over(&self.input, stages),
            weight: sum_over(&self.weight, stages),
            transfer: vec![0.0; stages.len()],
            reduce: vec![],
            step: vec![],
            offload: vec![],
            copies_overlap: false,
        }
    }
}

/// A link between two ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes/s.
    pub bytes_per_s: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Link {
    /// This project's CPU ranks: threads sharing memory.
    pub const CPU: Link = Link {
        bytes_per_s: 10e9,
        latency: 1e-6,
    };

    /// Seconds to move `bytes` in `messages` messages, one after another.
    pub fn send(&self, messages: usize, bytes: f64) -> f64 {
        messages as f64 * self.latency + bytes / self.bytes_per_s
    }

    /// Seconds of an all-reduce of `bytes` over `n` ranks: the bandwidth term of a ring
    /// (2(n-1)/n of the bytes cross each link) with the latency of a tree (2·⌈log₂ n⌉ hops), as
    /// NCCL's and MPI's large-scale algorithms achieve.
    pub fn all_reduce(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let hops = 2.0 * (n as f64).log2().ceil();
        hops * self.latency + 2.0 * (n - 1) as f64 / n as f64 * bytes / self.bytes_per_s
    }
}

/// Seconds of each of `stages`' REDUCE under `scheme` with `groups` data-parallel groups: its
/// parameters' gradients in `dtype` all-reduced over `link` among the ranks holding a copy
/// (the pipeline positions holding it, MAST's mirrored pair, each with its tiles, in every
/// group).
pub fn reduce_costs(
    g: &Graph,
    scheme: &Scheme,
    stages: &[Range<usize>],
    dtype: DType,
    groups: usize,
    link: &Link,
) -> Vec<f64> {
    (stages.iter().enumerate())
        .map(|(stage, nodes)| {
            let mut slots: Vec<usize> = (0..scheme.replicas.min(2))
                .map(|replica| scheme.place(replica, stage))
                .collect();
            slots.dedup();
            let holders = groups * slots.iter().map(|&s| scheme.width(s)).sum::<usize>();
            let bytes = g.trainable_in(nodes.clone()) * dtype.size();
            link.all_reduce(bytes as f64, holders)
        })
        .collect()
}

/// Seconds of each pipeline position's STEP under `scheme` on a device of `p`: the optimizer
/// over the parameters of the copies it holds, bound by memory traffic. Per parameter in
/// `dtype` it reads the value, its gradient and its `states` state tensors (SGD with momentum
/// keeps one, Adam two), writes the value and the states back and zeroes the gradient: (4 +
/// 2·states) times the parameter's bytes, over the device's bandwidth.
pub fn step_costs(
    g: &Graph,
    scheme: &Scheme,
    stages: &[Range<usize>],
    dtype: DType,
    states: usize,
    p: &DeviceProfile,
) -> Vec<f64> {
    (0..scheme.stages)
        .map(|slot| {
            let params: usize = (0..scheme.replicas.min(2))
                .flat_map(|replica| scheme.stages_at(replica, slot))
                .map(|s| g.trainable_in(stages[s].clone()))
                .sum();
            ((4 + 2 * states) * params * dtype.size()) as f64 / p.bytes_per_s
        })
        .collect()
}

/// What a rank of a tile group exchanges with the others per micro-batch, node by node: the
/// halo rows and columns a window op reads from its neighbours (their gradients go back in
/// backward, the same bytes), and the sums of statistics over the group (batch norm's, forward
/// and backward; a global pool's mean, forward). The busiest tile's; all 0 without tiles.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exchange {
    /// Seconds of each node's halo exchange, forward and again backward.
    pub halo: Vec<f64>,
    /// Seconds of each node's statistics' sums in forward.
    pub forward_sums: Vec<f64>,
    /// Seconds of each node's statistics' sums in backward.
    pub backward_sums: Vec<f64>,
}

impl Exchange {
    /// The exchanges of the nodes of `g` that run on tiles of `grid`, for micro-batches of
    /// `micro` samples with activations of `dtype` over `link`.
    pub fn new(g: &Graph, grid: Grid, micro: usize, dtype: DType, link: &Link) -> Exchange {
        let n = g.nodes.len();
        let mut e = Exchange {
            halo: vec![0.0; n],
            forward_sums: vec![0.0; n],
            backward_sums: vec![0.0; n],
        };
        // Channels and (H, W) of a map; None for a vector (a global pool's output).
        let hw = |v: usize| match g.values[v].shape.dims() {
            [c, h, w] => Some((*c, (*h, *w))),
            _ => None,
        };
        for (i, node) in g.nodes.iter().enumerate() {
            if !grid.is_split() || !runs_on_tiles(g, grid, i) {
                continue;
            }
            let halo =
                hw(node.inputs[0])
                    .zip(hw(node.output))
                    .and_then(|((c, input), (_, output))| {
                        Some((c, input, node.op.tile_needs(grid, input, output)?))
                    });
            if let Some((c, input, needs)) = halo {
                // Each piece of a neighbour's tile inside a rank's rectangle is one message.
                e.halo[i] = (0..grid.tiles())
                    .map(|t| {
                        let pieces: Vec<usize> = (0..grid.tiles())
                            .filter(|&q| q != t)
                            .map(|q| {
                                let (h, w) = grid.owned(q, input).meet(&needs[t]).size();
                                h * w
                            })
                            .filter(|&px| px > 0)
                            .collect();
                        let bytes = pieces.iter().sum::<usize>() * c * micro * dtype.size();
                        link.send(pieces.len(), bytes as f64)
                    })
                    .fold(0.0, f64::max);
            }
            // Per channel, every tile's (mean, variance) forward; two sums backward.
            let channels = g.values[node.inputs[0]].shape.dims()[0];
            let sum = |values: usize| link.all_reduce((values * 8) as f64, grid.tiles());
            match &node.op {
                Op::BatchNorm(_) => {
                    e.forward_sums[i] = sum(2 * channels * grid.tiles());
                    e.backward_sums[i] = sum(2 * channels);
                }
                Op::GlobalAvgPool(_) => e.forward_sums[i] = sum(channels * micro),
                _ => {}
            }
        }
        e
    }

    /// Seconds of the halo exchanges of `nodes`, forward and backward.
    pub fn halo_in(&self, nodes: Range<usize>) -> f64 {
        2.0 * self.halo.get(nodes).map_or(0.0, |h| h.iter().sum())
    }

    /// Seconds of the statistics' sums of `nodes`, forward and backward.
    pub fn sums_in(&self, nodes: Range<usize>) -> f64 {
        let sum = |v: &[f64]| v.get(nodes.clone()).map_or(0.0, |s| s.iter().sum::<f64>());
        sum(&self.forward_sums) + sum(&self.backward_sums)
    }
}

/// What each node costs per rank of a tile group where its stage runs on tiles: its share of
/// the compute where the node runs on tiles (all of it where it runs on whole inputs), plus
/// its exchanges. Stages not on tiles cost what they cost on one rank.
#[derive(Clone, Debug, PartialEq)]
pub struct TileCosts {
    /// Each node on a rank of a tile group.
    pub costs: NodeCosts,
    /// The exchanges counted in `costs`.
    pub exchange: Exchange,
    /// Which stages run on tiles (as many stages, as many pipeline positions: the stages on
    /// tiles are those placed at the positions on tiles).
    pub on_tiles: Vec<bool>,
    /// The tiles of a sample.
    pub grid: Grid,
}

impl TileCosts {
    /// `whole` (each node on one rank) spread over `scheme`'s tiles, exchanging over `link`,
    /// for micro-batches of `micro` samples with activations of `dtype`.
    pub fn new(
        g: &Graph,
        scheme: &Scheme,
        whole: &NodeCosts,
        micro: usize,
        dtype: DType,
        link: &Link,
    ) -> TileCosts {
        let grid = scheme.spatial;
        let exchange = Exchange::new(g, grid, micro, dtype, link);
        let share = |i: usize, t: f64| match grid.is_split() && runs_on_tiles(g, grid, i) {
            true => t / grid.tiles() as f64,
            false => t,
        };
        let costs = NodeCosts {
            forward: (whole.forward.iter().enumerate())
                .map(|(i, &t)| share(i, t) + exchange.halo[i] + exchange.forward_sums[i])
                .collect(),
            backward: (whole.backward.iter().enumerate())
                .map(|(i, &t)| share(i, t) + exchange.halo[i] + exchange.backward_sums[i])
                .collect(),
            input: (whole.input.iter().enumerate())
                .map(|(i, &t)| share(i, t) + exchange.halo[i] + exchange.backward_sums[i])
                .collect(),
            weight: (whole.weight.iter().enumerate())
                .map(|(i, &t)| share(i, t))
                .collect(),
            data: whole.data,
        };
        TileCosts {
            costs,
            exchange,
            on_tiles: (0..scheme.model_stages())
                .map(|s| scheme.tiled(s))
                .collect(),
            grid,
        }
    }

    /// Each node's costs on a rank of stage `s`, given `whole`, their costs on one rank.
    pub fn of_stage<'a>(&'a self, whole: &'a NodeCosts, s: usize) -> &'a NodeCosts {
        match self.on_tiles.get(s) {
            Some(true) => &self.costs,
            _ => whole,
        }
    }

    /// What the schedule builder weighs the stages `stages` by, per micro-batch, given
    /// `whole`, each node's costs on one rank.
    pub fn stage_costs(&self, whole: &NodeCosts, stages: &[Range<usize>]) -> StageCosts {
        let (one, tiled) = (whole.stage_costs(stages), self.costs.stage_costs(stages));
        let pick = |w: &[f64], t: &[f64]| -> Vec<f64> {
            (0..stages.len())
                .map(|s| if self.on_tiles[s] { t[s] } else { w[s] })
                .collect()
        };
        StageCosts {
            forward: pick(&one.forward, &tiled.forward),
            backward: pick(&one.backward, &tiled.backward),
            input: pick(&one.input, &tiled.input),
            weight: pick(&one.weight, &tiled.weight),
            ..one
        }
    }

    /// Seconds of the halo exchanges and of the statistics' sums of the stages on tiles, per
    /// micro-batch on each of their ranks.
    pub fn exchanges(&self, stages: &[Range<usize>]) -> (f64, f64) {
        let on = || (stages.iter().zip(&self.on_tiles)).filter(|(_, &t)| t);
        (
            on().map(|(r, _)| self.exchange.halo_in(r.clone())).sum(),
            on().map(|(r, _)| self.exchange.sums_in(r.clone())).sum(),
        )
    }
}

/// Predicted forward + backward seconds of every node.
pub fn node_costs(g: &Graph, batch: usize, dtype: DType, p: &DeviceProfile) -> Vec<f64> {
    g.nodes
        .iter()
        .map(|n| node_seconds(g, n, batch, dtype, p))
        .collect()
}
