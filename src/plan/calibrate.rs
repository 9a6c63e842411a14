//! Calibration: each op of a model timed once on the actual device, at the micro-batch a run
//! will use, and kept in a profile file. Plans made with it predict step times from what this
//! machine does rather than from peak rates.

use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::RunConfig;
use super::cost::{charge_losses, halves, NodeCosts};
use crate::backend::DeviceKind;
use crate::graph::Graph;
use crate::memory::Category;
use crate::ops::{batched, loss, Backward, Ctx, Saved};
use crate::tensor::Device;
use crate::tensor::{DType, Shape, Tensor};
use crate::{Error, Result};

/// Measured forward and backward seconds of every node of one model configuration.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// The model measured.
    pub model: String,
    /// Its input side.
    pub image_size: usize,
    /// Its classes.
    pub classes: usize,
    /// Images per micro-batch the times are for.
    pub micro_batch: usize,
    /// The activations' dtype, which op times depend on.
    pub dtype: DType,
    /// The device measured (its report name).
    pub device: String,
    /// Each node's forward seconds, in node order.
    pub forward: Vec<f64>,
    /// Each node's backward seconds, in node order.
    pub backward: Vec<f64>,
    /// Each node's backward split as a zero-bubble order runs it, in node order: B, its input
    /// gradients alone, for an op that [splits its backward](crate::ops::Operator::splits_weights)
    /// (its whole backward, as `backward`, for any other op). Empty in a profile written
    /// before backwards were timed split.
    #[serde(default)]
    pub input: Vec<f64>,
    /// W, the parameter gradients alone, a second call after B (0 for an op that does not
    /// split its backward); empty where `input` is.
    #[serde(default)]
    pub weight: Vec<f64>,
    /// Seconds to make and upload one micro-batch of synthetic images.
    pub data: f64,
    /// Seconds of scoring one micro-batch at each of the model's outputs (in the order of
    /// [`Graph::outputs`]): the softmax cross-entropy, its gradient and the predictions
    /// counted, which the forward task computing an output runs after its ops. Empty in a
    /// profile written before losses were timed.
    #[serde(default)]
    pub loss: Vec<f64>,
    /// Seconds of one optimizer step over every parameter (SGD update and zeroing gradients).
    pub optimizer: f64,
}

impl Calibration {
    /// The measured times as the planner's node costs for `g` (the graph measured): a split
    /// backward's B and W as they were timed apart, or, in a profile without them, the fused
    /// backward in [`halves`].
    pub fn costs(&self, g: &Graph) -> NodeCosts {
        let n = self.backward.len();
        let (input, weight) = match (self.input.len(), self.weight.len()) == (n, n) {
            true => (self.input.clone(), self.weight.clone()),
            false => halves(g, &self.backward),
        };
        let mut forward = self.forward.clone();
        charge_losses(g, &mut forward, self.loss.iter().copied());
        NodeCosts {
            forward,
            backward: self.backward.clone(),
            input,
            weight,
            data: self.data,
        }
    }

    /// Seconds of every node's backward, fused and split (B + W), summed over the model.
    pub fn backward_sums(&self) -> (f64, f64) {
        let split = self.input.iter().chain(&self.weight).sum();
        (self.backward.iter().sum(), split)
    }

    /// Refuses a profile taken for another model, image, micro-batch or dtype than `g` at
    /// `micro_batch` in `dtype`, or for a graph of another node count.
    pub fn check(&self, g: &Graph, micro_batch: usize, dtype: DType) -> Result<()> {
        let nodes = g.nodes.len();
        if self.forward.len() != nodes || self.backward.len() != nodes {
            return Err(Error::Config(format!(
                "the calibration times {} nodes; {} has {nodes}",
                self.forward.len(),
                g.name
            )));
        }
        let want = (
            g.name.as_str(),
            g.image_size(),
            g.classes(),
            micro_batch,
            dtype,
        );
        let have = (
            self.model.as_str(),
            self.image_size,
            self.classes,
            self.micro_batch,
            self.dtype,
        );
        if want != have {
            return Err(Error::Config(format!(
                "the calibration is for {} at {}², {} classes, micro-batch {}, {}; this run is {} at {}², {} classes, micro-batch {}, {}",
                have.0, have.1, have.2, have.3, have.4.name(), want.0, want.1, want.2, want.3, want.4.name()
            )));
        }
        Ok(())
    }

    /// Writes the profile as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text =
            serde_json::to_string_pretty(self).map_err(|e| Error::Internal(e.to_string()))?;
        crate::core::files::write_atomically(path, text.as_bytes())
    }

    /// Reads a profile written by [`Calibration::save`].
    pub fn load(path: &Path) -> Result<Calibration> {
        let text = crate::core::files::read_text(path)?;
        serde_json::from_str(&text).map_err(|e| {
            Error::Config(format!(
                "{} is not a calibration profile: {e}",
                path.display()
            ))
        })
    }
}

/// The tensors ops are timed on: values from a pool of random numbers (in ±1, or in 0.5..1.5
/// for what must be positive). A large tensor ([`Samples::SHARED`] elements or more, 16 MiB in
/// f32, more than a CPU's cache holds for one core: cold in it either way) is made once per
/// shape and shared by every node that reads that shape: making one per node would take longer
/// than timing the ops on a GPU at large images. A smaller one is made afresh for each call,
/// warm in the cache as a tensor just written by the previous op is in training.
struct Samples<'a> {
    device: &'a Device,
    pool: Vec<f64>,
    made: std::collections::HashMap<(Shape, DType, bool), Tensor>,
}

impl<'a> Samples<'a> {
    fn new(device: &'a Device) -> Samples<'a> {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // A prime length, so that rows of power-of-two sides do not repeat one another.
        let pool = (0..65_521).map(|_| rng.random_range(-1.0..1.0)).collect();
        Samples {
            device,
            pool,
            made: Default::default(),
        }
    }

    const SHARED: usize = 4 << 20;

    /// An input of `shape` (shared by every reader when large).
    fn input(&mut self, shape: Shape, dtype: DType, positive: bool) -> Result<Tensor> {
        if shape.numel() < Self::SHARED {
            return self.own(shape, dtype, positive);
        }
        let key = (shape, dtype, positive);
        if let Some(t) = self.made.get(&key) {
            return Ok(t.clone());
        }
        let t = self.own(key.0.clone(), dtype, positive)?;
        self.made.insert(key, t.clone());
        Ok(t)
    }

    /// A tensor of `shape` of the caller's own (parameters too: forward updates some in place).
    fn own(&self, shape: Shape, dtype: DType, positive: bool) -> Result<Tensor> {
        let pool = &self.pool;
        let data: Vec<f64> = (0..shape.numel())
            .map(|i| pool[i % pool.len()])
            .map(|v| if positive { 1.0 + v / 2.0 } else { v })
            .collect();
        self.device
            .upload(shape, &data, dtype, Category::Activations)
    }
}

/// Times every node of `graph` (forward, then backward, and for an op that splits its
/// backward also its B and W calls apart) on `device` at `micro` images, with parameters in
/// `dtype` and activations in `activations`, the median of `repeats` runs after one warm-up,
/// and the loss at each output. Nodes are timed as a step runs them, in windows of
/// 64 MiB of outputs: every forward, then every backward in reverse, so that a
/// backward finds what its forward saved as far out of cache as in training (timed right
/// after its forward, unet_d3_w16's backward at micro-batch 1 measured 8–20% less).
pub fn calibrate(
    graph: &Graph,
    micro: usize,
    numerics: (DType, DType),
    device: &Device,
    repeats: usize,
) -> Result<Calibration> {
    // On the CPU each op is timed from a pool worker, where a training rank calls it.
    let on_cpu = crate::plan::fitted::cpu_threads(&device.backend().name()).is_some();
    match on_cpu {
        true => {
            crate::backend::cpu::on_worker(|| time_ops(graph, micro, numerics, device, repeats))
        }
        false => time_ops(graph, micro, numerics, device, repeats),
    }
}

fn time_ops(
    graph: &Graph,
    micro: usize,
    (dtype, activations): (DType, DType),
    device: &Device,
    repeats: usize,
) -> Result<Calibration> {
    let mut samples = Samples::new(device);
    let n = graph.nodes.len();
    let (mut forward, mut backward) = (vec![0.0; n], vec![0.0; n]);
    let (mut input, mut weight) = (vec![0.0; n], vec![0.0; n]);
    // The median of the runs after the first, which warms caches and the allocator.
    let median = |v: &[f64]| {
        let mut v = v[1..].to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // What training computes: no gradient for the model's input (the stem's backward-data).
    let mut requires_grad = vec![false; graph.values.len()];
    graph.mark_requires_grad(0..n, &mut requires_grad);
    let ctx = Ctx {
        device,
        training: true,
        seed: 1,
        tiles: None,
    };
    let mut first = 0;
    while first < n {
        let window = first..window_end(graph, first, micro, activations);
        first = window.end;
        let mut runs = (graph.nodes[window.clone()].iter())
            .map(|node| {
                let numerics = (dtype, activations);
                NodeRun::new(graph, node, micro, numerics, &requires_grad, &mut samples)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut times = vec![[(); 4].map(|_| Vec::new()); runs.len()];
        for _ in 0..=repeats {
            let swept = forward_sweep(&mut runs, &ctx, &mut samples)?;
            for (k, (f, saved)) in swept.into_iter().enumerate().rev() {
                times[k][0].push(f);
                let b = backward_call(&ctx, &mut samples, &mut runs[k], saved, true, true)?;
                times[k][1].push(b);
            }
            if runs.iter().any(|r| r.split) {
                // As a zero-bubble order runs them: every B (input gradients), then every W, a
                // second call on the same saved tensors with no input gradient asked for.
                let swept = forward_sweep(&mut runs, &ctx, &mut samples)?;
                let mut again = Vec::new();
                for (k, (_, saved)) in swept.into_iter().enumerate().rev() {
                    if runs[k].split {
                        again.push((k, Saved(saved.0.clone())));
                        let b =
                            backward_call(&ctx, &mut samples, &mut runs[k], saved, true, false)?;
                        times[k][2].push(b);
                    }
                }
                for (k, saved) in again {
                    let w = backward_call(&ctx, &mut samples, &mut runs[k], saved, false, true)?;
                    times[k][3].push(w);
                }
            }
        }
        for (i, [f, b, bi, bw]) in window.zip(times) {
            forward[i] = median(&f);
            backward[i] = median(&b);
            (input[i], weight[i]) = match bi.is_empty() {
                true => (backward[i], 0.0),
                false => (median(&bi), median(&bw)),
            };
        }
    }
    // Data and optimizer: what a step does besides its ops.
    let (image_size, classes) = (graph.image_size(), graph.classes());
    let synthetic = crate::data::synthetic::Synthetic {
        seed: 1,
        classes,
        image_size,
    };
    let mut data = Vec::new();
    for i in 0..=repeats {
        let (x, seconds) = timed(device, || {
            let (pixels, _) = synthetic.batch((i * micro) as u64, micro);
            let shape = batched(micro, graph.input_shape());
            device.upload(shape, &pixels, activations, Category::Activations)
        })?;
        data.push(seconds);
        drop(x);
    }
    let loss = (graph.outputs.iter())
        .enumerate()
        .map(|(i, o)| {
            let logits = samples.input(
                batched(micro, &graph.values[o.value].shape),
                activations,
                false,
            )?;
            let times = (0..=repeats)
                .map(|_| time_loss(device, &logits, i == 0, activations))
                .collect::<Result<Vec<_>>>()?;
            Ok(median(&times))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut params = crate::graph::Params::init(graph, device, dtype, 1)?;
    let sgd_config = crate::optim::SgdConfig {
        momentum: 0.9,
        weight_decay: 5e-4,
        nesterov: false,
    };
    let mut sgd = crate::optim::Sgd::new(&params, device, sgd_config)?;
    let mut optimizer = Vec::new();
    for _ in 0..=repeats {
        let ((), seconds) = timed(device, || {
            sgd.step(&mut params, device, 0.01, 1.0)?;
            params.zero_grads(device)
        })?;
        optimizer.push(seconds);
    }
    Ok(Calibration {
        data: median(&data),
        loss,
        optimizer: median(&optimizer),
        model: graph.name.clone(),
        image_size,
        classes,
        micro_batch: micro,
        dtype: activations,
        device: device.backend().name(),
        forward,
        backward,
        input,
        weight,
    })
}

/// Bytes of outputs a window of nodes is timed over: more than a CPU's cache holds, so that
/// what a node's forward saved has left the cache when its backward reads it, as in a step.
const WINDOW_BYTES: usize = 64 << 20;

/// The end of the window of nodes from `first`: the fewest whose outputs at `micro` images
/// in `dtype` reach [`WINDOW_BYTES`] (the rest of the model, where it is smaller).
fn window_end(graph: &Graph, first: usize, micro: usize, dtype: DType) -> usize {
    let mut bytes = 0;
    for (i, node) in graph.nodes.iter().enumerate().skip(first) {
        bytes += batched(micro, &graph.values[node.output].shape).numel() * dtype.size();
        if bytes >= WINDOW_BYTES {
            return i + 1;
        }
    }
    graph.nodes.len()
}

/// A node being timed: its op, parameters and gradients (its own, made once), the shapes it
/// reads and writes, and which inputs want a gradient.
struct NodeRun<'g> {
    node: &'g crate::graph::Node,
    op: &'g dyn crate::ops::Operator,
    shapes: Vec<Shape>,
    output: Shape,
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    need: Vec<bool>,
    split: bool,
    activations: DType,
}

impl<'g> NodeRun<'g> {
    fn new(
        graph: &'g Graph,
        node: &'g crate::graph::Node,
        micro: usize,
        (dtype, activations): (DType, DType),
        requires_grad: &[bool],
        samples: &mut Samples,
    ) -> Result<NodeRun<'g>> {
        let device = samples.device;
        let specs: Vec<_> = node.params.clone().map(|p| &graph.params[p].spec).collect();
        let params = (specs.iter())
            .map(|s| samples.own(s.shape.clone(), dtype, s.suffix == "running_var"))
            .collect::<Result<Vec<_>>>()?;
        let grads = (specs.iter().filter(|s| s.trainable))
            .map(|s| device.zeros(s.shape.clone(), dtype, Category::Gradients))
            .collect::<Result<Vec<_>>>()?;
        let op = node.op.get();
        Ok(NodeRun {
            node,
            op,
            shapes: (node.inputs.iter())
                .map(|&v| batched(micro, &graph.values[v].shape))
                .collect(),
            output: batched(micro, &graph.values[node.output].shape),
            params,
            grads,
            need: node.inputs.iter().map(|&v| requires_grad[v]).collect(),
            split: op.splits_weights(),
            activations,
        })
    }
}

/// Every forward of `runs` in order, each reading what an earlier one of them computed (warm
/// in cache, as in a step) or, for a value from outside them, a fresh sample: each one's
/// seconds and what it saved.
fn forward_sweep(
    runs: &mut [NodeRun],
    ctx: &Ctx,
    samples: &mut Samples,
) -> Result<Vec<(f64, Saved)>> {
    let device = samples.device;
    let mut values = std::collections::HashMap::new();
    let mut swept = Vec::new();
    for r in runs.iter_mut() {
        let xs = (r.node.inputs.iter().zip(&r.shapes))
            .map(|(v, s)| match values.get(v) {
                Some(t) => Ok(Tensor::clone(t)),
                None => samples.input(s.clone(), r.activations, false),
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = xs.iter().collect();
        let ((y, saved), seconds) = timed(device, || r.op.forward(ctx, &refs, &mut r.params))?;
        swept.push((seconds, saved));
        values.insert(r.node.output, y);
    }
    Ok(swept)
}

/// Seconds of one backward call of `r` on what its forward `saved`, with a fresh gradient of
/// its output (warm in cache, as one just computed is in a step): `inputs`, whether it
/// computes the input gradients training needs, and `weights`, whether it adds the parameter
/// gradients.
fn backward_call(
    ctx: &Ctx,
    samples: &mut Samples,
    r: &mut NodeRun,
    saved: Saved,
    inputs: bool,
    weights: bool,
) -> Result<f64> {
    let device = samples.device;
    let dy = samples.input(r.output.clone(), r.activations, false)?;
    let none = vec![false; r.need.len()];
    let b = Backward {
        saved,
        dy,
        inputs: &r.shapes,
        need: if inputs { &r.need } else { &none },
        weights,
    };
    let (dx, seconds) = timed(device, || r.op.backward(ctx, b, &r.params, &mut r.grads))?;
    drop(dx);
    Ok(seconds)
}

/// Seconds of what the trainer does with one micro-batch's `logits` at an output: the loss
/// against labels of every class in turn, the predictions where it is the `first` output
/// (whose accuracy a step reports), and the gradient in `dtype`.
fn time_loss(device: &Device, logits: &Tensor, first: bool, dtype: DType) -> Result<f64> {
    let dims = logits.shape().dims();
    let (classes, places) = (dims[1], logits.shape().numel() / dims[1]);
    let labels: Vec<u32> = (0..places).map(|q| (q % classes) as u32).collect();
    let (d, seconds) = timed(device, || {
        let ce = loss::softmax_cross_entropy(device, logits, &labels, None, loss::Norm::PerSample)?;
        if first {
            std::hint::black_box(loss::predictions(&ce.probs)?);
        }
        ce.backward(device, 1.0, dtype)
    })?;
    drop(d);
    Ok(seconds)
}

/// What `f` returns and its seconds on `device`, from an idle device to the end of the work
/// it queued (a GPU queues its work; the clock stops when it has finished).
fn timed<T>(device: &Device, f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    device.backend().synchronize()?;
    let start = Instant::now();
    let out = f()?;
    device.backend().synchronize()?;
    Ok((out, start.elapsed().as_secs_f64()))
}

/// Where [`on_first_use`] keeps its profiles for runs that name none: the `calibrations`
/// folder of the cache ([`cache_root`](crate::core::files::cache_root)).
pub fn cache_dir() -> Option<std::path::PathBuf> {
    Some(crate::core::files::cache_root()?.join("calibrations"))
}

/// What a run on a GPU can plan with when it names no calibration (`gems plan` and `gems
/// train` do; a [`Session`](crate::Session) plans with [`RunConfig::calibration`] as given):
/// every op of `graph` timed on the run's first GPU, at its micro-batch, the first time this
/// configuration runs there, then kept in `keep_in` ([`cache_dir`] for the command line) and
/// read back by later runs. The file's name holds a hash of the model, the GPU, its kernels'
/// sources, this file's (how it times them) and this version of gems: a change to any of them
/// measures afresh. `None` for a CPU run: the fitted CPU model prices it.
pub fn on_first_use(
    graph: &Graph,
    c: &RunConfig,
    keep_in: Option<&Path>,
) -> Result<Option<Calibration>> {
    let t = &c.train;
    if t.device == DeviceKind::Cpu {
        return Ok(None);
    }
    let device = Device::open(t.device, t.precision, t.conv, "calibration", 0, None)?;
    let micro = c.micro_batch();
    let key = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{:?}{:?}", graph.nodes, graph.values).hash(&mut h);
        device.backend().name().hash(&mut h);
        crate::backend::cuda::kernels::SOURCES.hash(&mut h);
        crate::backend::cuda::kernels::HEADER.hash(&mut h);
        include_str!("calibrate.rs").hash(&mut h);
        env!("CARGO_PKG_VERSION").hash(&mut h);
        format!(
            "{}-{}-{}-micro{micro}-{}-{:016x}.json",
            graph.name,
            graph.image_size(),
            graph.classes(),
            t.activations().name(),
            h.finish()
        )
    };
    let path = keep_in.map(|dir| dir.join(key));
    if let Some(cal) = path.as_deref().and_then(|p| Calibration::load(p).ok()) {
        if cal.check(graph, micro, t.activations()).is_ok() {
            return Ok(Some(cal));
        }
    }
    let cal = calibrate(graph, micro, (t.dtype, t.activations()), &device, 3)?;
    // A cache that cannot be written costs the next run another measurement, nothing more.
    if let Some(p) = &path {
        let _ = p.parent().map(std::fs::create_dir_all);
        let _ = cal.save(p);
    }
    Ok(Some(cal))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::cost::DeviceProfile;
    use crate::plan::Layout;
    use crate::schemes::{Kind, Order, Scheme};

    fn splits(g: &Graph) -> Vec<bool> {
        g.nodes
            .iter()
            .map(|n| n.op.get().splits_weights())
            .collect()
    }

    /// An op that splits its backward is timed as B and W apart, besides fused; any other op
    /// is all B. B alone is less than the fused backward, and W is measured.
    #[test]
    fn calibration_times_b_and_w_apart_where_backward_splits() {
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let device = Device::cpu("cpu", None);
        let cal = calibrate(&g, 2, (DType::F32, DType::F32), &device, 1).unwrap();
        let n = g.nodes.len();
        assert_eq!((cal.input.len(), cal.weight.len()), (n, n));
        let split = splits(&g);
        let sum = |v: &[f64], on: bool| -> f64 {
            (v.iter().zip(&split))
                .filter(|(_, &s)| s == on)
                .map(|(t, _)| t)
                .sum()
        };
        for i in (0..n).filter(|&i| !split[i]) {
            assert_eq!(
                (cal.input[i], cal.weight[i]),
                (cal.backward[i], 0.0),
                "node {i}"
            );
        }
        assert!(split.contains(&true));
        assert!(sum(&cal.weight, true) > 0.0);
        assert!(
            sum(&cal.input, true) < sum(&cal.backward, true),
            "B {} against the fused backward {}",
            sum(&cal.input, true),
            sum(&cal.backward, true)
        );
        let (fused, apart) = cal.backward_sums();
        assert!(fused > 0.0 && apart > 0.0);
    }

    /// The loss at each output is timed, and a plan charges it to the forward of the node
    /// computing that output, the task that scores it.
    #[test]
    fn the_loss_is_timed_and_charged_to_its_outputs_forward() {
        let g = crate::models::build("unet_d2_w4", 32, 3).unwrap();
        let device = Device::cpu("cpu", None);
        let cal = calibrate(&g, 2, (DType::F32, DType::F32), &device, 1).unwrap();
        assert_eq!(cal.loss.len(), g.outputs.len());
        assert!(cal.loss.iter().all(|&t| t > 0.0), "{:?}", cal.loss);
        let charged = Calibration {
            loss: vec![0.5],
            ..cal.clone()
        };
        let (before, after) = (cal.costs(&g).forward, charged.costs(&g).forward);
        let out = g.values[g.outputs[0].value].producer.unwrap();
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            let loss = if i == out { cal.loss[0] } else { 0.0 };
            assert!((b - cal.forward[i] - loss).abs() < 1e-12, "node {i}");
            let loss = if i == out { 0.5 } else { 0.0 };
            assert!((a - cal.forward[i] - loss).abs() < 1e-12, "node {i}");
        }
    }

    /// A profile written before B and W were timed still loads, and its plan splits each
    /// backward in halves costing what the fused one does.
    #[test]
    fn a_profile_without_split_times_loads_and_splits_in_halves() {
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let text = serde_json::json!({
            "model": g.name, "image_size": 32, "classes": 10, "micro_batch": 2,
            "dtype": DType::F32, "device": "cpu (2 threads)",
            "forward": vec![1.0; g.nodes.len()], "backward": vec![2.0; g.nodes.len()],
            "data": 0.0, "optimizer": 0.0,
        });
        let path =
            std::env::temp_dir().join(format!("gems-old-profile-{}.json", std::process::id()));
        std::fs::write(&path, text.to_string()).unwrap();
        let cal = Calibration::load(&path);
        std::fs::remove_file(&path).unwrap();
        let costs = cal.unwrap().costs(&g);
        for (i, s) in splits(&g).into_iter().enumerate() {
            let want = if s { (1.0, 1.0) } else { (2.0, 0.0) };
            assert_eq!((costs.input[i], costs.weight[i]), want, "node {i}");
        }
    }

    /// A calibrated plan prices a split backward's B and W as they were timed: where B + W
    /// took 30% more than the fused backward, the zero-bubble orders' predicted step grows
    /// (on a CPU the ranks share, by all that more) and the fused orders' does not move.
    #[test]
    fn a_calibrated_plan_prices_b_and_w_as_timed() {
        let g = crate::models::build("resnet20v2", 32, 10).unwrap();
        let costs = NodeCosts::analytic(&g, 2, DType::F32, &DeviceProfile::CPU);
        let halved = Calibration {
            model: g.name.clone(),
            image_size: g.image_size(),
            classes: g.classes(),
            micro_batch: 2,
            dtype: DType::F32,
            device: "test".into(),
            forward: costs.forward.clone(),
            backward: costs.backward.clone(),
            input: costs.input.clone(),
            weight: costs.weight.clone(),
            data: 0.0,
            loss: vec![],
            optimizer: 0.0,
        };
        let dearer = Calibration {
            input: (costs.input.iter().zip(splits(&g)))
                .map(|(t, s)| if s { 1.3 * t } else { *t })
                .collect(),
            weight: costs.weight.iter().map(|t| 1.3 * t).collect(),
            ..halved.clone()
        };
        let step = |cal: &Calibration, order: Order, shared: bool| {
            let s = Scheme::new(Kind::Mp, 2, 4, 1, 1, order);
            let mut c = RunConfig::new(crate::plan::TrainConfig::new(8, 1), s);
            c.calibration = Some(std::sync::Arc::new(cal.clone()));
            Layout::new(&g, &c).unwrap().predicted_step(shared)
        };
        for shared in [false, true] {
            for order in [Order::GPipe, Order::OneFOneB, Order::Interleaved] {
                let (a, b) = (step(&halved, order, shared), step(&dearer, order, shared));
                assert_eq!(a, b, "{order}");
            }
            for order in [Order::ZbH1, Order::ZbV] {
                let (a, b) = (step(&halved, order, shared), step(&dearer, order, shared));
                assert!(b > a, "{order}: {a} and, B and W 30% dearer, {b}");
                // Ranks sharing one CPU take the step's work: 4 micro-batches' more B and W.
                if shared {
                    let more = 4.0 * (dearer.backward_sums().1 - halved.backward_sums().1);
                    assert!(
                        ((b - a) / more - 1.0).abs() < 1e-9,
                        "{order}: {a} {b} {more}"
                    );
                }
            }
        }
    }
}
