//! Calibration: each op of a model timed once on the actual device, at the micro-batch a run
//! will use, and kept in a profile file. Plans made with it predict step times from what this
//! machine does rather than from peak rates.

use std::path::Path;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::RunConfig;
use super::cost::{weight_share, NodeCosts};
use crate::backend::DeviceKind;
use crate::graph::Graph;
use crate::memory::Category;
use crate::ops::{batched, Backward, Ctx};
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
    /// Seconds to make and upload one micro-batch of synthetic images.
    pub data: f64,
    /// Seconds of one optimizer step over every parameter (SGD update and zeroing gradients).
    pub optimizer: f64,
}

impl Calibration {
    /// The measured times as the planner's node costs for `g` (the graph measured).
    pub fn costs(&self, g: &Graph) -> NodeCosts {
        NodeCosts {
            forward: self.forward.clone(),
            backward: self.backward.clone(),
            weight: weight_share(g, &self.backward),
            data: self.data,
        }
    }

    /// Refuses a profile taken for another model, image, micro-batch or dtype.
    pub fn check(
        &self,
        model: &str,
        image_size: usize,
        classes: usize,
        micro_batch: usize,
        dtype: DType,
    ) -> Result<()> {
        let want = (model, image_size, classes, micro_batch, dtype);
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
/// than timing the ops on a GPU at large images. A smaller one is made afresh for each node,
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

/// Times every node of `graph` (forward, then backward) on `device` at `micro` images, with
/// parameters in `dtype` and activations in `activations`, the median of `repeats` runs after
/// one warm-up.
#[allow(clippy::too_many_arguments)]
pub fn calibrate(
    graph: &Graph,
    micro: usize,
    (dtype, activations): (DType, DType),
    device: &Device,
    repeats: usize,
) -> Result<Calibration> {
    let mut samples = Samples::new(device);
    let (mut forward, mut backward) = (Vec::new(), Vec::new());
    // A GPU queues its work: each time ends when the device has finished it.
    let elapsed = |start: Instant| -> Result<f64> {
        device.backend().synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // What training computes: no gradient for the model's input (the stem's backward-data).
    let mut requires_grad = vec![false; graph.values.len()];
    graph.mark_requires_grad(0..graph.nodes.len(), &mut requires_grad);
    for node in &graph.nodes {
        let op = node.op.get();
        let shapes: Vec<Shape> = node
            .inputs
            .iter()
            .map(|&v| batched(micro, &graph.values[v].shape))
            .collect();
        let xs = shapes
            .iter()
            .map(|s| samples.input(s.clone(), activations, false))
            .collect::<Result<Vec<_>>>()?;
        let specs: Vec<_> = node.params.clone().map(|p| &graph.params[p].spec).collect();
        let mut params = specs
            .iter()
            .map(|s| samples.own(s.shape.clone(), dtype, s.suffix == "running_var"))
            .collect::<Result<Vec<_>>>()?;
        let mut grads = specs
            .iter()
            .filter(|s| s.trainable)
            .map(|s| device.zeros(s.shape.clone(), dtype, Category::Gradients))
            .collect::<Result<Vec<_>>>()?;
        let dy = samples.input(
            batched(micro, &graph.values[node.output].shape),
            activations,
            false,
        )?;
        let need: Vec<bool> = node.inputs.iter().map(|&v| requires_grad[v]).collect();
        let ctx = Ctx {
            device,
            training: true,
            seed: 1,
            tiles: None,
        };
        let refs: Vec<&Tensor> = xs.iter().collect();
        let (mut f, mut b) = (Vec::new(), Vec::new());
        for _ in 0..=repeats {
            device.backend().synchronize()?;
            let start = Instant::now();
            let (y, saved) = op.forward(&ctx, &refs, &mut params)?;
            f.push(elapsed(start)?);
            drop(y);
            let start = Instant::now();
            op.backward(
                &ctx,
                Backward {
                    saved,
                    dy: dy.clone(),
                    inputs: &shapes,
                    need: &need,
                    weights: true,
                },
                &params,
                &mut grads,
            )?;
            b.push(elapsed(start)?);
        }
        // The first run warms caches and the allocator.
        forward.push(median(f[1..].to_vec()));
        backward.push(median(b[1..].to_vec()));
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
        let start = Instant::now();
        let (pixels, _) = synthetic.batch((i * micro) as u64, micro);
        let x = device.upload(
            batched(micro, graph.input_shape()),
            &pixels,
            activations,
            Category::Activations,
        )?;
        data.push(elapsed(start)?);
        drop(x);
    }
    let mut params = crate::graph::Params::init(graph, device, dtype, 1)?;
    let sgd_config = crate::optim::SgdConfig {
        momentum: 0.9,
        weight_decay: 5e-4,
        nesterov: false,
    };
    let mut sgd = crate::optim::Sgd::new(&params, device, sgd_config)?;
    let mut optimizer = Vec::new();
    for _ in 0..=repeats {
        let start = Instant::now();
        sgd.step(&mut params, device, 0.01, 1.0)?;
        params.zero_grads(device)?;
        optimizer.push(elapsed(start)?);
    }
    Ok(Calibration {
        data: median(data[1..].to_vec()),
        optimizer: median(optimizer[1..].to_vec()),
        model: graph.name.clone(),
        image_size,
        classes,
        micro_batch: micro,
        dtype: activations,
        device: device.backend().name(),
        forward,
        backward,
    })
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
/// sources and this version of gems: a change to any of them measures afresh. `None` for a
/// CPU run: the fitted CPU model prices it.
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
    let usable = |cal: &Calibration| {
        cal.check(
            &graph.name,
            graph.image_size(),
            graph.classes(),
            micro,
            t.activations(),
        )
        .is_ok()
            && cal.forward.len() == graph.nodes.len()
            && cal.backward.len() == graph.nodes.len()
    };
    if let Some(cal) = path.as_deref().and_then(|p| Calibration::load(p).ok()) {
        if usable(&cal) {
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
