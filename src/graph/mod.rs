//! The DAG IR: values with static per-sample shapes, nodes (one op each), parameters, and the
//! tree of blocks the model builder nested them in. Nodes are stored in a topological order
//! (the order they were built in), which forward follows and backward reverses.

mod autograd;
mod builder;
pub mod policy;

use std::fmt::Write;

pub use autograd::{backward, commit_running, forward, Params, RunningUpdate, Tape};
pub use builder::GraphBuilder;

use crate::ops::{Op, ParamSpec};
use crate::tensor::{DType, Shape};

pub type ValueId = usize;
pub type NodeId = usize;
pub type BlockId = usize;

#[derive(Clone, Debug)]
pub struct Value {
    /// Per sample (no batch dimension).
    pub shape: Shape,
    pub producer: Option<NodeId>,
    pub consumers: Vec<NodeId>,
}

#[derive(Clone, Debug)]
pub struct Node {
    /// Dotted name: the block path and the node's own name (`layer1.0.conv1`).
    pub name: String,
    pub op: Op,
    pub inputs: Vec<ValueId>,
    pub output: ValueId,
    /// This node's parameters: trainable ones first, then buffers.
    pub params: std::ops::Range<usize>,
    pub block: BlockId,
}

#[derive(Clone, Debug)]
pub struct Param {
    /// Dotted name (`layer1.0.bn1.running_mean`): the checkpoint key.
    pub name: String,
    pub spec: ParamSpec,
    pub node: NodeId,
}

#[derive(Clone, Debug)]
pub struct Block {
    pub name: String,
    /// What kind of block (`PreActBottleneck`, `Stage`), for printing.
    pub kind: String,
    pub parent: Option<BlockId>,
    pub children: Vec<BlockId>,
    pub nodes: Vec<NodeId>,
}

/// A graph output the loss is applied to, with its weight in the total loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Output {
    pub value: ValueId,
    pub weight: f64,
    /// Used only in training (an auxiliary classifier).
    pub training_only: bool,
}

#[derive(Clone, Debug)]
pub struct Graph {
    pub name: String,
    pub input: ValueId,
    pub values: Vec<Value>,
    pub nodes: Vec<Node>,
    pub params: Vec<Param>,
    /// Block 0 is the model itself.
    pub blocks: Vec<Block>,
    pub outputs: Vec<Output>,
}

impl Graph {
    pub fn input_shape(&self) -> &Shape {
        &self.values[self.input].shape
    }

    /// The side of the square images the model takes (its input is `[C, side, side]`).
    pub fn image_size(&self) -> usize {
        self.input_shape().dims().last().copied().unwrap_or(0)
    }

    /// Classes the model scores: the width of its first output.
    pub fn classes(&self) -> usize {
        self.outputs
            .first()
            .and_then(|o| self.values[o.value].shape.dims().last().copied())
            .unwrap_or(0)
    }

    /// Trainable parameters of the nodes in `nodes`.
    pub fn trainable_in(&self, nodes: std::ops::Range<usize>) -> usize {
        self.nodes[nodes]
            .iter()
            .flat_map(|n| n.params.clone())
            .filter(|&p| self.params[p].spec.trainable)
            .map(|p| self.params[p].spec.shape.numel())
            .sum()
    }

    /// Trainable parameter count.
    pub fn parameter_count(&self) -> usize {
        self.params
            .iter()
            .filter(|p| p.spec.trainable)
            .map(|p| p.spec.shape.numel())
            .sum()
    }

    /// Forward FLOPs for one sample.
    pub fn flops_per_sample(&self) -> u64 {
        self.nodes.iter().map(|n| self.node_flops(n)).sum()
    }

    pub fn node_flops(&self, n: &Node) -> u64 {
        let ins: Vec<&Shape> = n.inputs.iter().map(|&v| &self.values[v].shape).collect();
        n.op.get().flops(&ins, &self.values[n.output].shape)
    }

    /// Bytes a training forward pass keeps for backward per sample (each saved tensor once),
    /// not counting per-batch statistics.
    pub fn saved_bytes_per_sample(&self, dtype: DType) -> u64 {
        saved_bytes(self, 0..self.nodes.len(), dtype)
    }

    /// `layer1.0`: the dotted path of a block (empty for the model).
    pub fn block_path(&self, b: BlockId) -> String {
        let mut parts = Vec::new();
        let mut cur = Some(b);
        while let Some(id) = cur {
            if self.blocks[id].parent.is_some() {
                parts.push(self.blocks[id].name.as_str());
            }
            cur = self.blocks[id].parent;
        }
        parts.reverse();
        parts.join(".")
    }

    /// Trainable parameters under a block, its sub-blocks included.
    fn block_params(&self, b: BlockId) -> usize {
        let own: usize = self.blocks[b]
            .nodes
            .iter()
            .flat_map(|&n| self.nodes[n].params.clone())
            .filter(|&p| self.params[p].spec.trainable)
            .map(|p| self.params[p].spec.shape.numel())
            .sum();
        own + self.blocks[b]
            .children
            .iter()
            .map(|&c| self.block_params(c))
            .sum::<usize>()
    }

    /// The block tree, one line per block with its kind, parameters and output shape.
    pub fn block_tree(&self) -> String {
        let mut out = String::new();
        self.write_block(&mut out, 0, 0);
        out
    }

    fn write_block(&self, out: &mut String, b: BlockId, depth: usize) {
        let blk = &self.blocks[b];
        let name = if depth == 0 { &self.name } else { &blk.name };
        let _ = writeln!(
            out,
            "{:indent$}{name} ({}) params {}",
            "",
            blk.kind,
            self.block_params(b),
            indent = 2 * depth
        );
        for &c in &blk.children {
            self.write_block(out, c, depth + 1);
        }
    }

    /// One line per node: id, name, op, inputs, output shape, consumers.
    pub fn adjacency_list(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "%{} input {}", self.input, self.input_shape());
        for (i, n) in self.nodes.iter().enumerate() {
            let ins: Vec<String> = n.inputs.iter().map(|v| format!("%{v}")).collect();
            let outs: Vec<String> = self.values[n.output]
                .consumers
                .iter()
                .map(|c| format!("n{c}"))
                .collect();
            let _ = writeln!(
                out,
                "n{i} {} = {}({}) -> %{} {} -> [{}]",
                n.name,
                n.op.describe(),
                ins.join(", "),
                n.output,
                self.values[n.output].shape,
                outs.join(", ")
            );
        }
        out
    }
}

/// Bytes the training forward of `nodes` keeps for backward per sample (each saved tensor
/// once), not counting per-batch statistics.
pub fn saved_bytes(g: &Graph, nodes: std::ops::Range<usize>, dtype: DType) -> u64 {
    let mut saved = vec![false; g.values.len()];
    let mut own = 0;
    for n in &g.nodes[nodes] {
        let ins: Vec<&Shape> = n.inputs.iter().map(|&v| &g.values[v].shape).collect();
        let s = n.op.get().saves(&ins);
        if s.inputs {
            n.inputs.iter().for_each(|&v| saved[v] = true);
        }
        if s.output {
            saved[n.output] = true;
        }
        own += s.per_sample;
    }
    let elems: usize = g
        .values
        .iter()
        .zip(&saved)
        .filter(|(_, &s)| s)
        .map(|(v, _)| v.shape.numel())
        .sum();
    ((elems + own) * dtype.size()) as u64
}
