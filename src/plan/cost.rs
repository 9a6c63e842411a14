//! The analytical cost model: an op takes as long as the slower of its arithmetic and its
//! memory traffic on a device (Paleo's max), forward plus backward.

use crate::graph::{Graph, Node};
use crate::schemes::schedule::StageCosts;
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

/// Bytes an op reads and writes per sample (inputs, output, parameters once).
fn bytes_moved(g: &Graph, n: &Node, dtype: DType) -> f64 {
    let ins: usize = n.inputs.iter().map(|&v| g.values[v].shape.numel()).sum();
    let out = g.values[n.output].shape.numel();
    ((ins + out) * dtype.size()) as f64
}

/// Predicted seconds of forward + backward of node `n` for a batch of `batch`.
pub fn node_seconds(g: &Graph, n: &Node, batch: usize, dtype: DType, p: &DeviceProfile) -> f64 {
    let flops = g.node_flops(n) as f64 * batch as f64;
    let bytes = bytes_moved(g, n, dtype) * batch as f64;
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
    /// Seconds stage 0 spends making a micro-batch's images (0 in the analytical model).
    pub data: f64,
}

impl NodeCosts {
    /// The analytical model: backward is two thirds of a node's forward + backward.
    pub fn analytic(g: &Graph, batch: usize, dtype: DType, p: &DeviceProfile) -> NodeCosts {
        let total = node_costs(g, batch, dtype, p);
        NodeCosts {
            forward: total.iter().map(|t| t / 3.0).collect(),
            backward: total.iter().map(|t| 2.0 * t / 3.0).collect(),
            data: 0.0,
        }
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
        let sum = |v: &[f64], r: &std::ops::Range<usize>| v[r.clone()].iter().sum::<f64>();
        (
            stages.iter().map(|r| sum(&self.forward, r)).collect(),
            stages.iter().map(|r| sum(&self.backward, r)).collect(),
        )
    }
}

impl NodeCosts {
    /// What the schedule builder weighs the stages `stages` by, per micro-batch.
    pub fn stage_costs(&self, stages: &[std::ops::Range<usize>]) -> StageCosts {
        let (mut forward, backward) = self.stages(stages);
        forward[0] += self.data;
        StageCosts {
            forward,
            backward,
            transfer: vec![0.0; stages.len()],
        }
    }
}

/// Predicted forward + backward seconds of every node.
pub fn node_costs(g: &Graph, batch: usize, dtype: DType, p: &DeviceProfile) -> Vec<f64> {
    g.nodes
        .iter()
        .map(|n| node_seconds(g, n, batch, dtype, p))
        .collect()
}
