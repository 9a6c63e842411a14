//! The simulator: a scheme's real schedule replayed with predicted costs instead of tensors,
//! for any number of GPUs. A step is the schedule of one data-parallel group (stage costs from
//! the cost model on a device profile, boundary transfers on the link between the two ranks, a
//! tiled stage's halo exchanges and statistics' sums on the link between its tile ranks), its
//! REDUCEs where it places them: each stage's gradient all-reduce over the ranks holding a copy
//! of it (on the slowest link the groups span), and each rank's STEP: the optimizer's memory
//! traffic over its copies' parameters at the device's bandwidth. A schedule's OFFLOADs and
//! PREFETCHes copy over PCIe 4.0 beside compute.

use std::fmt;
use std::str::FromStr;

use super::cost::{reduce_costs, step_costs, DeviceProfile, Link, NodeCosts, TileCosts};
use crate::graph::Graph;
use crate::plan::{Layout, RunConfig};
use crate::{Error, Result};

/// A machine to simulate: its GPUs and how they are connected.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Profile {
    /// Its name on the command line (`v100-ib`).
    pub name: &'static str,
    /// One GPU's speeds.
    pub device: DeviceProfile,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Bytes/s between two GPUs of a node, and between nodes (per GPU).
    pub intra_node: f64,
    /// Bytes/s between nodes, per GPU.
    pub inter_node: f64,
    /// Seconds per message.
    pub latency: f64,
}

impl Profile {
    /// LLNL Lassen as GEMS used it: 4 V100 per node (15.7 TFLOP/s fp32, 900 GB/s), NVLink 2
    /// (75 GB/s between a pair), dual-rail EDR InfiniBand (25 GB/s per node, 6.25 per GPU).
    pub const V100_IB: Profile = Profile {
        name: "v100-ib",
        device: DeviceProfile {
            flops_per_s: 15.7e12,
            bytes_per_s: 900e9,
        },
        gpus_per_node: 4,
        intra_node: 75e9,
        inter_node: 6.25e9,
        latency: 5e-6,
    };
    /// 8 H100 SXM per node (67 TFLOP/s fp32, 3.35 TB/s), NVLink 4 (450 GB/s), one 400 Gb/s
    /// NDR InfiniBand port per GPU (50 GB/s).
    pub const H100_NVLINK_IB: Profile = Profile {
        name: "h100-nvlink-ib",
        device: DeviceProfile {
            flops_per_s: 67e12,
            bytes_per_s: 3.35e12,
        },
        gpus_per_node: 8,
        intra_node: 450e9,
        inter_node: 50e9,
        latency: 3e-6,
    };
    /// This project's CPU ranks: threads sharing memory.
    pub const CPU: Profile = Profile {
        name: "cpu",
        device: DeviceProfile::CPU,
        gpus_per_node: 1 << 20,
        intra_node: 10e9,
        inter_node: 10e9,
        latency: 1e-6,
    };
    /// Every profile.
    pub const ALL: [Profile; 3] = [Profile::V100_IB, Profile::H100_NVLINK_IB, Profile::CPU];

    /// The link between two GPUs of one node, or of two nodes.
    pub fn link(&self, same_node: bool) -> Link {
        Link {
            bytes_per_s: if same_node {
                self.intra_node
            } else {
                self.inter_node
            },
            latency: self.latency,
        }
    }
}

impl FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Profile::ALL.iter().map(|p| p.name).collect();
                format!("unknown profile '{s}' ({})", names.join(", "))
            })
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// One simulated configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// GPUs in use.
    pub gpus: usize,
    /// D: data-parallel groups.
    pub groups: usize,
    /// Seconds of a step: the schedule of one group, its REDUCEs included.
    pub pipeline: f64,
    /// The share of the group's ranks' pipeline time spent idle (the schedule's bubble).
    pub bubble: f64,
    /// Seconds of the slowest stage's gradient all-reduce (its REDUCE).
    pub all_reduce: f64,
    /// Seconds of the slowest rank's STEP: the optimizer over its copies' parameters.
    pub optimizer: f64,
    /// Seconds per micro-batch a rank of a tile group spends in halo exchanges, forward and
    /// backward, over its stages on tiles (0 without tiles).
    pub halo: f64,
    /// Seconds per micro-batch a rank of a tile group spends summing statistics over it.
    pub sums: f64,
    /// Predicted training throughput.
    pub images_per_s: f64,
}

/// A step of `c` with `groups` data-parallel groups on `profile`.
pub fn step(c: &RunConfig, layout: &Layout, profile: &Profile, groups: usize) -> Result<Point> {
    let (g, s) = (&layout.graph, &c.scheme);
    let micro = c.train.batch_size / s.parts;
    let (dtype, activations) = (c.train.dtype, c.train.activations());
    let stages = &layout.partition.stages;
    // A stage's first rank: tile groups fill nodes like any other ranks.
    let node_of = |slot: usize| s.first_rank(slot) / profile.gpus_per_node;
    let whole = NodeCosts::analytic(g, micro, activations, &profile.device);
    let tile_link = profile.link(s.spatial.tiles() <= profile.gpus_per_node);
    let tiles = TileCosts::new(g, s, &whole, micro, activations, &tile_link);
    let mut sc = tiles.stage_costs(&whole, stages);
    for (st, t) in sc.transfer.iter_mut().enumerate() {
        let bytes: usize = layout.outputs[st]
            .iter()
            .map(|&v| g.values[v].shape.numel())
            .sum();
        let bytes = (bytes * micro * activations.size()) as f64;
        if bytes > 0.0 {
            *t = profile.link(node_of(st) == node_of(st + 1)).send(1, bytes);
        }
    }
    let gpus = groups * s.group_size();
    let link = profile.link(gpus <= profile.gpus_per_node);
    sc.reduce = reduce_costs(g, s, stages, dtype, groups, &link);
    let states = c.train.optimizer.optimizer(c.train.sgd).state_names().len();
    sc.step = step_costs(g, s, stages, dtype, states, &profile.device);
    // A schedule's OFFLOADs and PREFETCHes copy over PCIe beside compute.
    let host = crate::plan::offload::HostLink::PCIE4;
    sc.offload = host.stage_copies(g, stages, micro, activations);
    sc.copies_overlap = host.overlaps;
    let bytes = crate::plan::memory::stage_bytes(c, g, &layout.partition)?;
    let schedule = c.timeline(&sc, bytes.as_deref())?;
    let pipeline = schedule.makespan();
    let images = (s.replicas * c.train.batch_size * groups) as f64;
    let (halo, sums) = tiles.exchanges(stages);
    Ok(Point {
        gpus,
        groups,
        pipeline,
        bubble: schedule.bubble(),
        all_reduce: sc.reduce.iter().copied().fold(0.0, f64::max),
        optimizer: sc.step.iter().copied().fold(0.0, f64::max),
        halo,
        sums,
        images_per_s: images / pipeline,
    })
}

/// Weak scaling of `c` on `g`: the same per-group work on P, 2P, 4P, … up to `max_gpus` GPUs.
pub fn weak_scaling(
    g: &Graph,
    c: &RunConfig,
    profile: &Profile,
    max_gpus: usize,
) -> Result<Vec<Point>> {
    if c.scheme.dp != 1 {
        return Err(Error::Config(
            "weak scaling varies the data-parallel groups itself: give one group".into(),
        ));
    }
    let layout = Layout::new(g, c)?;
    let mut points = Vec::new();
    // Checked: doubling towards a `max_gpus` near usize::MAX would wrap and never end.
    let mut groups = Some(1usize);
    while let Some(g) = groups.filter(|g| {
        g.checked_mul(c.scheme.group_size())
            .is_some_and(|gpus| gpus <= max_gpus)
    }) {
        points.push(step(c, &layout, profile, g)?);
        groups = g.checked_mul(2);
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{AdamConfig, OptimizerKind};
    use crate::plan::TrainConfig;
    use crate::schemes::{Kind, Order, Scheme};
    use crate::tensor::DType;

    /// A simulated step pays for the optimizer: one device's is its forward, its backward and
    /// its STEP, the optimizer's memory traffic over every parameter (f32 SGD with momentum:
    /// 6 × 4 bytes each; Adam: 8 × 4) at the profile's bandwidth.
    #[test]
    fn a_simulated_step_pays_for_the_optimizer() {
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let params = g.trainable_in(0..g.nodes.len()) as f64;
        let single = Scheme::new(Kind::Single, 1, 1, 1, 1, Order::GPipe);
        for (optimizer, bytes) in [
            (OptimizerKind::Sgd, 24.0),
            (OptimizerKind::Adam(AdamConfig::new(false)), 32.0),
        ] {
            let mut train = TrainConfig::new(2, 1);
            train.optimizer = optimizer;
            let c = RunConfig::new(train, single);
            let layout = Layout::new(&g, &c).unwrap();
            for profile in Profile::ALL {
                let point = step(&c, &layout, &profile, 1).unwrap();
                let costs = NodeCosts::analytic(&g, 2, DType::F32, &profile.device);
                let compute: f64 = costs.total().iter().sum();
                let want = bytes * params / profile.device.bytes_per_s;
                assert!(
                    ((point.pipeline - compute) / want - 1.0).abs() < 1e-6,
                    "{profile}: step {} s, forward and backward {compute} s, optimizer {want} s",
                    point.pipeline
                );
                assert!((point.optimizer / want - 1.0).abs() < 1e-12, "{profile}");
            }
        }
    }
}
