//! Choosing where saved tensors wait (`--offload auto`): per node keep, offload or recompute,
//! so that every rank fits a device-memory cap with the least predicted exposed time.
//!
//! Exposed time is what a choice adds to the step: for an offloaded bundle, the copy out and
//! the copy back, less the compute they overlap with (the next `prefetch` nodes' forward, the
//! coming nodes' backward) when the link copies asynchronously; for a recomputed node, its
//! forward. Nodes are taken cheapest exposed time per byte first, each with its cheaper
//! choice, and the shortest such prefix that fits is found by bisection on metered runs, so
//! what is chosen is checked against the exact memory model, not an estimate.

use crate::graph::policy::{Keep, SavePolicy};
use crate::graph::{saved_bytes, Graph};
use crate::plan::cost::NodeCosts;

/// The link between a device and its host tier.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLink {
    /// Copy bandwidth, bytes/s each way.
    pub bytes_per_s: f64,
    /// Copies run beside compute (a GPU's copy engines); on the CPU they are compute.
    pub overlaps: bool,
}

impl HostLink {
    /// Memory copies on this machine's cores.
    pub const CPU: HostLink = HostLink {
        bytes_per_s: 10e9,
        overlaps: false,
    };
    /// PCIe 4.0 x16 with pinned memory (about 25 GB/s each way).
    pub const PCIE4: HostLink = HostLink {
        bytes_per_s: 25e9,
        overlaps: true,
    };

    /// Seconds an OFFLOAD (or a PREFETCH) of each of `stages` copies over this link: what a
    /// micro-batch of `micro` samples saves there in its forward.
    pub fn stage_copies(
        &self,
        g: &Graph,
        stages: &[std::ops::Range<usize>],
        micro: usize,
        dtype: crate::tensor::DType,
    ) -> Vec<f64> {
        (stages.iter())
            .map(|r| (saved_bytes(g, r.clone(), dtype) * micro as u64) as f64 / self.bytes_per_s)
            .collect()
    }
}

/// One node's cheapest way to leave the device, and what it costs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The node.
    pub node: usize,
    /// Host or recompute.
    pub keep: Keep,
    /// Bytes per micro-batch the node saves.
    pub bytes: u64,
    /// Predicted seconds it adds per micro-batch.
    pub exposed: f64,
}

/// Predicted seconds per micro-batch that offloading (`Keep::Host`) or recomputing node `i`
/// adds, for the `bytes` it saves.
fn node_exposed(
    costs: &NodeCosts,
    i: usize,
    bytes: u64,
    keep: Keep,
    link: &HostLink,
    prefetch: usize,
) -> f64 {
    let n = costs.forward.len();
    let window = |times: &[f64]| -> f64 {
        times[(i + 1).min(n)..(i + 1 + prefetch.max(1)).min(n)]
            .iter()
            .sum()
    };
    let copy = bytes as f64 / link.bytes_per_s;
    match keep {
        Keep::Device => 0.0,
        Keep::Recompute => costs.forward[i],
        // Out behind the next nodes' forward, back behind the later nodes' backward.
        Keep::Host if link.overlaps => {
            (copy - window(&costs.forward)).max(0.0) + (copy - window(&costs.backward)).max(0.0)
        }
        Keep::Host => 2.0 * copy,
    }
}

/// Every node that saves something, with the cheapest of `keeps` for it (offload,
/// recompute), cheapest exposed time per byte first.
pub fn candidates(
    g: &Graph,
    costs: &NodeCosts,
    (micro, dtype): (usize, crate::tensor::DType),
    link: &HostLink,
    prefetch: usize,
    keeps: &[Keep],
) -> Vec<Choice> {
    let mut out: Vec<Choice> = (0..g.nodes.len())
        .filter_map(|i| {
            let bytes = saved_bytes(g, i..i + 1, dtype) * micro as u64;
            if bytes == 0 {
                return None;
            }
            let cost = |k| node_exposed(costs, i, bytes, k, link, prefetch);
            let (keep, exposed) = keeps
                .iter()
                .map(|&k| (k, cost(k)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .expect("a choice");
            Some(Choice {
                node: i,
                keep,
                bytes,
                exposed,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        let per_byte = |c: &Choice| c.exposed / c.bytes as f64;
        per_byte(a).total_cmp(&per_byte(b))
    });
    out
}

/// What `policy` moves off the device per micro-batch (bytes), and the seconds it adds per
/// micro-batch (predicted).
pub fn cost_of(
    g: &Graph,
    costs: &NodeCosts,
    micro: usize,
    dtype: crate::tensor::DType,
    link: &HostLink,
    policy: &SavePolicy,
) -> (u64, f64) {
    (0..g.nodes.len())
        .filter(|&i| policy.of(i) != Keep::Device)
        .map(|i| {
            let bytes = saved_bytes(g, i..i + 1, dtype) * micro as u64;
            (
                bytes,
                node_exposed(costs, i, bytes, policy.of(i), link, policy.prefetch),
            )
        })
        .fold((0, 0.0), |(b, t), (nb, nt)| (b + nb, t + nt))
}

/// The policy of the first `k` choices.
pub fn take(nodes: usize, choices: &[Choice], k: usize, prefetch: usize) -> SavePolicy {
    let mut p = SavePolicy::all(nodes, Keep::Device, prefetch);
    for c in &choices[..k] {
        p.nodes[c.node] = c.keep;
    }
    p
}

/// What `--offload auto` chose, and its predicted cost.
pub struct Chosen {
    /// Where each node's saved tensors wait.
    pub policy: SavePolicy,
    /// Predicted seconds added per step.
    pub exposed: f64,
    /// Bytes per micro-batch moved off the device.
    pub bytes: u64,
}
