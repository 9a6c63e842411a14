//! The simulator: a scheme's real schedule replayed with predicted costs instead of tensors,
//! for any number of GPUs. A step is the pipeline schedule of one data-parallel group (stage
//! costs from the cost model on a device profile, boundary transfers on the link between the
//! two ranks) followed by the gradient all-reduce of each stage over the ranks holding a copy of
//! it (on the slowest link the group spans).

use std::fmt;
use std::str::FromStr;

use super::cost::{DeviceProfile, NodeCosts};
use crate::graph::Graph;
use crate::plan::{Layout, RunConfig};
use crate::schemes::schedule::{self, StageCosts};
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

    /// Seconds to move `bytes` between two ranks.
    fn send(&self, bytes: f64, same_node: bool) -> f64 {
        self.latency
            + bytes
                / if same_node {
                    self.intra_node
                } else {
                    self.inter_node
                }
    }

    /// Seconds of an all-reduce of `bytes` over `n` ranks: the bandwidth term of a ring
    /// (2(n-1)/n of the bytes cross each link) with the latency of a tree (2·⌈log₂ n⌉ hops), as
    /// NCCL's and MPI's large-scale algorithms achieve.
    fn all_reduce(&self, bytes: f64, n: usize, one_node: bool) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let bw = if one_node {
            self.intra_node
        } else {
            self.inter_node
        };
        let hops = 2.0 * (n as f64).log2().ceil();
        hops * self.latency + 2.0 * (n - 1) as f64 / n as f64 * bytes / bw
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
    /// Seconds: the pipeline of one group, then the slowest stage's all-reduce.
    pub pipeline: f64,
    /// Seconds of the slowest stage's gradient all-reduce.
    pub all_reduce: f64,
    /// Predicted training throughput.
    pub images_per_s: f64,
}

/// A step of `c` with `groups` data-parallel groups on `profile`.
pub fn step(c: &RunConfig, layout: &Layout, profile: &Profile, groups: usize) -> Result<Point> {
    let (g, s) = (&layout.graph, &c.scheme);
    let micro = c.train.batch_size / s.parts;
    let (dtype, activations) = (c.train.dtype, c.train.activations());
    let stages = &layout.partition.stages;
    let node_of = |rank: usize| rank / profile.gpus_per_node;
    let (forward, backward) =
        NodeCosts::analytic(g, micro, activations, &profile.device).stages(stages);
    let sc = StageCosts {
        forward,
        backward,
        transfer: (0..stages.len())
            .map(|st| {
                let bytes: usize = layout.outputs[st]
                    .iter()
                    .map(|&v| g.values[v].shape.numel())
                    .sum();
                let bytes = (bytes * micro * activations.size()) as f64;
                if bytes == 0.0 {
                    0.0
                } else {
                    profile.send(bytes, node_of(st) == node_of(st + 1))
                }
            })
            .collect(),
    };
    let schedule = schedule::build(s, &sc, c.max_in_flight)?;
    let holders = groups * if s.replicas >= 2 { 2 } else { 1 };
    let one_node = groups * s.stages <= profile.gpus_per_node;
    let all_reduce = stages
        .iter()
        .map(|r| {
            let params = g.trainable_in(r.clone());
            profile.all_reduce((params * dtype.size()) as f64, holders, one_node)
        })
        .fold(0.0, f64::max);
    let pipeline = schedule.makespan();
    let images = (s.replicas * c.train.batch_size * groups) as f64;
    Ok(Point {
        gpus: groups * s.stages,
        groups,
        pipeline,
        all_reduce,
        images_per_s: images / (pipeline + all_reduce),
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
    let mut groups = 1;
    while groups * c.scheme.stages <= max_gpus {
        points.push(step(c, &layout, profile, groups)?);
        groups *= 2;
    }
    Ok(points)
}
