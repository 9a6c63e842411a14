//! Where each node's saved tensors wait between forward and backward: on the device, in the
//! host tier (offloaded after the node's forward, brought back `prefetch` nodes ahead of its
//! backward), or nowhere (recomputed in backward from the inputs of its run of recomputed
//! nodes, which are kept: activation checkpointing). Gradients and weights come out the same to
//! the last bit whatever the policy: only where tensors live, and when, changes.

use std::path::Path;

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
/// Where a node's saved tensors wait for backward.
pub enum Keep {
    /// On the device.
    Device,
    /// In the host tier, brought back before backward needs them.
    Host,
    /// Dropped and recomputed from the last kept input before backward.
    Recompute,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
/// Where each node's saved tensors wait, and how far ahead offloaded ones come back.
pub struct SavePolicy {
    /// By node id; nodes past the end stay on the device.
    pub nodes: Vec<Keep>,
    /// How many nodes ahead of backward an offloaded bundle is brought back (0: just in time).
    pub prefetch: usize,
}

impl SavePolicy {
    /// Everything stays on the device.
    pub fn keep_all() -> SavePolicy {
        SavePolicy {
            nodes: vec![],
            prefetch: 0,
        }
    }

    /// Every one of `nodes` nodes as `keep`.
    pub fn all(nodes: usize, keep: Keep, prefetch: usize) -> SavePolicy {
        SavePolicy {
            nodes: vec![keep; nodes],
            prefetch,
        }
    }

    /// Activation checkpointing in runs of about √nodes recomputed nodes, each run's last node
    /// kept on the device: the runs' inputs plus one run's tensors at a time.
    pub fn checkpointed(nodes: usize) -> SavePolicy {
        let every = (nodes as f64).sqrt().ceil().max(1.0) as usize;
        SavePolicy {
            nodes: (0..nodes)
                .map(|i| match (i + 1) % every {
                    0 => Keep::Device,
                    _ => Keep::Recompute,
                })
                .collect(),
            prefetch: 0,
        }
    }

    /// Where node `node`'s saved tensors wait.
    pub fn of(&self, node: usize) -> Keep {
        self.nodes.get(node).copied().unwrap_or(Keep::Device)
    }

    /// Nodes per choice: (device, host, recompute).
    pub fn counts(&self) -> (usize, usize, usize) {
        let n = |k| self.nodes.iter().filter(|&&x| x == k).count();
        (n(Keep::Device), n(Keep::Host), n(Keep::Recompute))
    }

    /// A policy file: JSON `{"nodes": ["device", "host", "recompute", …], "prefetch": 2}`
    /// with one entry per node of the model.
    pub fn load(path: &Path, nodes: usize) -> Result<SavePolicy> {
        let text = crate::core::files::read_text(path)?;
        let p: SavePolicy = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{} is not a policy file: {e}", path.display())))?;
        if p.nodes.len() != nodes {
            return Err(Error::Config(format!(
                "{} lists {} nodes but the model has {nodes}",
                path.display(),
                p.nodes.len()
            )));
        }
        Ok(p)
    }
}
