//! The DAG IR: values with static per-sample shapes, nodes (one op each), parameters, and the
//! tree of blocks the model builder nested them in. Nodes are stored in a topological order
//! (the order they were built in), which forward follows and backward reverses.

mod autograd;
mod builder;
pub mod policy;

use std::fmt::Write;

pub use autograd::{
    backward, commit_running, forward, runs_on_tiles, weight_gradients, Params, RunningUpdate,
    Tape, WeightWork,
};
pub use builder::GraphBuilder;

use crate::ops::{Op, ParamSpec};
use crate::tensor::{DType, Shape};

/// Index of a value in [`Graph::values`].
pub type ValueId = usize;
/// Index of a node in [`Graph::nodes`].
pub type NodeId = usize;
/// Index of a block in [`Graph::blocks`].
pub type BlockId = usize;

#[derive(Clone, Debug)]
/// A tensor the graph computes: the input, or one node's output.
pub struct Value {
    /// Per sample (no batch dimension).
    pub shape: Shape,
    /// The node computing it (`None` for the graph's input).
    pub producer: Option<NodeId>,
    /// The nodes reading it.
    pub consumers: Vec<NodeId>,
}

#[derive(Clone, Debug)]
/// One op applied to values.
pub struct Node {
    /// Dotted name: the block path and the node's own name (`layer1.0.conv1`).
    pub name: String,
    /// The op and its settings.
    pub op: Op,
    /// The values it reads, in the op's order.
    pub inputs: Vec<ValueId>,
    /// The value it computes.
    pub output: ValueId,
    /// This node's parameters: trainable ones first, then buffers.
    pub params: std::ops::Range<usize>,
    /// The innermost block it was built in.
    pub block: BlockId,
}

#[derive(Clone, Debug)]
/// A parameter or buffer of a node.
pub struct Param {
    /// Dotted name (`layer1.0.bn1.running_mean`): the checkpoint key.
    pub name: String,
    /// Shape, initialization, and whether it is trained.
    pub spec: ParamSpec,
    /// The node that owns it.
    pub node: NodeId,
}

#[derive(Clone, Debug)]
/// A named group of nodes the builder nested (a residual block, a stage), for names and printing.
pub struct Block {
    /// Its name, the last part of its nodes' dotted names.
    pub name: String,
    /// What kind of block (`PreActBottleneck`, `Stage`), for printing.
    pub kind: String,
    /// The enclosing block (`None` for block 0, the model).
    pub parent: Option<BlockId>,
    /// Blocks nested in it.
    pub children: Vec<BlockId>,
    /// Nodes built directly in it.
    pub nodes: Vec<NodeId>,
}

/// A graph output the loss is applied to, with its weight in the total loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Output {
    /// The value the loss is applied to (logits).
    pub value: ValueId,
    /// Its weight in the total loss.
    pub weight: f64,
    /// Used only in training (an auxiliary classifier).
    pub training_only: bool,
}

impl Output {
    /// The model's output `value`, scored with weight 1 in training and evaluation.
    pub fn new(value: ValueId) -> Output {
        Output {
            value,
            weight: 1.0,
            training_only: false,
        }
    }
    /// An auxiliary classifier's `value`, scored with `weight` in training only.
    pub fn auxiliary(value: ValueId, weight: f64) -> Output {
        Output {
            value,
            weight,
            training_only: true,
        }
    }
}

#[derive(Clone, Debug)]
/// A model: a DAG of nodes over values, in topological order, with its parameters and blocks.
pub struct Graph {
    /// The model's name (`resnet110v2`).
    pub name: String,
    /// The input value (one image per sample).
    pub input: ValueId,
    /// Every value, indexed by [`ValueId`].
    pub values: Vec<Value>,
    /// Every node in topological order, indexed by [`NodeId`].
    pub nodes: Vec<Node>,
    /// Every parameter and buffer, in node order: the checkpoint's tensors.
    pub params: Vec<Param>,
    /// Block 0 is the model itself.
    pub blocks: Vec<Block>,
    /// The outputs scored by the loss, the evaluated one first.
    pub outputs: Vec<Output>,
}

impl Graph {
    /// Marks which outputs of `nodes` carry a gradient in training: a node's does when it has
    /// a trainable parameter or reads a value already marked (the caller marks what it feeds
    /// them; the model's input carries none).
    pub fn mark_requires_grad(&self, nodes: std::ops::Range<usize>, requires_grad: &mut [bool]) {
        for n in &self.nodes[nodes] {
            requires_grad[n.output] = n.params.clone().any(|p| self.params[p].spec.trainable)
                || n.inputs.iter().any(|&v| requires_grad[v]);
        }
    }

    /// The per-sample shape of the input (`[3, side, side]`).
    pub fn input_shape(&self) -> &Shape {
        &self.values[self.input].shape
    }

    /// The side of the square images the model takes (its input is `[C, side, side]`).
    pub fn image_size(&self) -> usize {
        self.input_shape().dims().last().copied().unwrap_or(0)
    }

    /// Classes the model scores: the channels of its first output (`[classes]` logits per
    /// sample, or `[classes, H, W]` for segmentation).
    pub fn classes(&self) -> usize {
        self.outputs
            .first()
            .and_then(|o| self.values[o.value].shape.dims().first().copied())
            .unwrap_or(0)
    }

    /// Places each sample is scored at: 1 for a classifier, H·W for per-pixel logits.
    pub fn positions(&self) -> usize {
        self.outputs.first().map_or(1, |o| {
            self.values[o.value].shape.dims().iter().skip(1).product()
        })
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

    /// Forward FLOPs of node `n` for one sample.
    pub fn node_flops(&self, n: &Node) -> u64 {
        let ins: Vec<&Shape> = n.inputs.iter().map(|&v| &self.values[v].shape).collect();
        n.op.get().flops(&ins, &self.values[n.output].shape)
    }

    /// Bytes node `n`'s forward reads and writes per sample in `dtype` (its inputs and its
    /// output).
    pub fn node_bytes(&self, n: &Node, dtype: DType) -> u64 {
        let ins: usize = n.inputs.iter().map(|&v| self.values[v].shape.numel()).sum();
        let out = self.values[n.output].shape.numel();
        ((ins + out) * dtype.size()) as u64
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
    let (mut own, mut stats) = (0, 0);
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
        stats += s.stats_per_sample;
    }
    let elems: usize = g
        .values
        .iter()
        .zip(&saved)
        .filter(|(_, &s)| s)
        .map(|(v, _)| v.shape.numel())
        .sum();
    ((elems + own) * dtype.size() + stats * dtype.compute().size()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::conv::Conv2d;

    #[test]
    fn gradients_start_at_the_first_trainable_parameter() {
        // input → relu → conv → relu: the first ReLU sees only the image.
        let (mut b, x) = GraphBuilder::new("tiny", "test", Shape::new([3, 8, 8]));
        let early = b.relu("early", x).unwrap();
        let conv = b.conv("conv", early, Conv2d::new(4, 3, 1, 1)).unwrap();
        let late = b.relu("late", conv).unwrap();
        let g = b.finish(vec![Output::new(late)]).unwrap();
        let mut wants = vec![false; g.values.len()];
        g.mark_requires_grad(0..g.nodes.len(), &mut wants);
        assert_eq!(
            [x, early, conv, late].map(|v| wants[v]),
            [false, false, true, true]
        );
        // A stage fed a value that carries a gradient passes it on without parameters.
        let mut fed = vec![false; g.values.len()];
        fed[x] = true;
        g.mark_requires_grad(0..1, &mut fed);
        assert!(fed[early]);
    }
}
