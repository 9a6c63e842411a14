//! Checkpoints in safetensors, independent of the scheme that wrote them. A checkpoint holds
//! the whole model's parameters and BN running statistics under their dotted
//! (torchvision-style) names, `<bn>.num_batches_tracked` (read from imported weights, one
//! more each step), the optimizer's state of each
//! trainable parameter under PyTorch's names (`optimizer.<name>.momentum_buffer` for SGD,
//! `optimizer.<name>.exp_avg` and `.exp_avg_sq` for Adam and AdamW, and the parameter's steps
//! as `optimizer.<name>.step`), and in its metadata the model (name, image side,
//! classes), the training configuration, the step, the data position (images consumed in the
//! data's epoch order) and fp16's loss scale. Data order and dropout masks are counter-based on
//! (seed, step, position), so those numbers are the whole random state: a run written as
//! `mast` over 2 ranks resumes as `single`, or as `mp` over 4, with the same state.
//!
//! Each checkpoint also names its run ([`Lineage`]): the run's identity, kept when it is
//! resumed, the checkpoint this stretch of it resumed from, a hash of the configuration, and the
//! class names its labels number, so evaluation can match classes by name.
//!
//! Files are written atomically (a temporary file in the same folder, synced, then renamed),
//! and a file that does not match the model — another model, image side or class count, a
//! tensor missing, reshaped, of another dtype, or cut short — is refused with a message that
//! names what differs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use crate::core::rng::splitmix64;
use crate::graph::Graph;
use crate::ops::loss::Reduction;
use crate::ops::Op;
use crate::optim::schedule::LrSchedule;
use crate::optim::{AdamConfig, LossScale, OptimizerKind, SgdConfig};
use crate::plan::TrainConfig;
use crate::tensor::{DType, Storage};
use crate::{Error, Result};

/// The whole model's training state on the host, indexed like the graph's parameters.
pub struct TrainingState {
    /// Every parameter and buffer, in the graph's order.
    pub values: Vec<Storage>,
    /// The optimizer's state of each trainable parameter.
    pub optimizer: Vec<Option<OptimizerState>>,
    /// Optimizer steps done.
    pub step: usize,
    /// Images consumed in the data's epoch order: where the next step's first image is.
    pub position: u64,
    /// fp16's dynamic loss scale (`None` for other precisions).
    pub loss_scale: Option<LossScale>,
    /// Each BN node's `num_batches_tracked` (PyTorch's count of its training forwards), in
    /// the graph's order of BN nodes: a step adds one, as one forward of the step's batch
    /// would in PyTorch.
    pub batches_tracked: Vec<u64>,
}

/// One parameter's optimizer state on the host.
pub struct OptimizerState {
    /// Steps the parameter has taken.
    pub steps: u64,
    /// Its state tensors by name, in the optimizer's order.
    pub tensors: Vec<(String, Storage)>,
}

impl OptimizerState {
    /// A copy (host storages are copied; device storages cannot be).
    pub fn try_clone(&self) -> Result<OptimizerState> {
        let tensors = self
            .tensors
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.try_clone()?)))
            .collect::<Result<_>>()?;
        Ok(OptimizerState {
            steps: self.steps,
            tensors,
        })
    }
}

const FORMAT: &str = "gems-checkpoint-1";

/// Which run a checkpoint belongs to, and what its labels mean.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lineage {
    /// The run's identity (16 hex digits): drawn when a run starts from scratch, kept when it
    /// is resumed, so the checkpoints of one run share it whichever stretch wrote them.
    pub run: String,
    /// Where this stretch of the run began: `<run>@<step>` of the checkpoint it resumed from.
    pub parent: Option<String>,
    /// The class names, in label order.
    pub classes: Vec<String>,
}

impl Lineage {
    /// A new run over data of these classes, its identity drawn from the clock and the process.
    pub fn fresh(classes: Vec<String>) -> Lineage {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let id = splitmix64(nanos ^ splitmix64(std::process::id() as u64));
        Lineage {
            run: format!("{id:016x}"),
            parent: None,
            classes,
        }
    }

    /// The same run continued from `ckpt` (a checkpoint without an identity, from before
    /// identities were recorded, starts a new one).
    pub fn resumed(ckpt: &Checkpoint, classes: Vec<String>) -> Result<Lineage> {
        let run = match ckpt.meta.get("run") {
            Some(run) => run.clone(),
            None => Lineage::fresh(vec![]).run,
        };
        Ok(Lineage {
            parent: Some(format!("{run}@{}", ckpt.step()?)),
            run,
            classes,
        })
    }
}

/// Metadata keys that define a run's computation (hashed into `config_hash`); the others
/// record progress or identity.
const CONFIG_KEYS: [&str; 23] = [
    "model",
    "image_size",
    "classes",
    "batch_size",
    "dtype",
    "precision",
    "seed",
    "lr",
    "schedule",
    "warmup",
    "total_steps",
    "momentum",
    "weight_decay",
    "nesterov",
    "data",
    "class_weights",
    "optimizer",
    "beta1",
    "beta2",
    "eps",
    "clip_grad_norm",
    "no_decay_norm_bias",
    "loss_reduction",
];

/// FNV-1a over the configuration's keys and values, in a fixed order: equal for two runs
/// configured alike, on any machine.
fn config_hash(meta: &HashMap<String, String>) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for key in CONFIG_KEYS {
        let value = meta.get(key).map_or("", String::as_str);
        for b in key.bytes().chain([0]).chain(value.bytes()).chain([0]) {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn safetensors_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// The state names a caller's own optimizer wrote: those of the first trainable parameter's
/// `optimizer.<name>.<state>` tensors (its step count aside), in the file's order.
fn custom_state_names(st: &SafeTensors, g: &Graph) -> Vec<String> {
    let Some(p) = g.params.iter().find(|p| p.spec.trainable) else {
        return Vec::new();
    };
    let prefix = format!("optimizer.{}.", p.name);
    let mut names: Vec<String> = (st.names().into_iter())
        .filter_map(|n| n.strip_prefix(&prefix))
        .filter(|n| *n != "step")
        .map(String::from)
        .collect();
    names.sort();
    names
}

/// Names of the BN nodes, whose `num_batches_tracked` the checkpoint carries.
pub fn batchnorm_nodes(g: &Graph) -> impl Iterator<Item = &str> {
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::BatchNorm(_)))
        .map(|n| n.name.as_str())
}

/// The model, configuration, progress and lineage as text, with fp16's loss scale as it stands.
fn metadata(
    g: &Graph,
    c: &TrainConfig,
    state: &TrainingState,
    lineage: &Lineage,
) -> HashMap<String, String> {
    let s = &c.schedule;
    let loss_scale = state
        .loss_scale
        .as_ref()
        .map_or(c.loss_scale, LossScale::factor);
    let mut meta: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("model", g.name.clone()),
        ("image_size", g.image_size().to_string()),
        ("classes", g.classes().to_string()),
        ("batch_size", c.batch_size.to_string()),
        ("dtype", c.dtype.name().to_string()),
        ("precision", c.precision.to_string()),
        ("loss_scale", loss_scale.to_string()),
        ("seed", c.seed.to_string()),
        ("step", state.step.to_string()),
        ("position", state.position.to_string()),
        ("lr", s.base.to_string()),
        ("schedule", s.decay.to_string()),
        ("warmup", s.warmup.to_string()),
        ("total_steps", s.total.to_string()),
        ("momentum", c.sgd.momentum.to_string()),
        ("weight_decay", c.sgd.weight_decay.to_string()),
        ("nesterov", c.sgd.nesterov.to_string()),
        (
            "data",
            serde_json::to_string(&c.data).expect("a data configuration serializes"),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(w) = &c.class_weights {
        let w = serde_json::to_string(w).expect("weights serialize");
        meta.insert("class_weights".into(), w);
    }
    meta.insert("optimizer".into(), c.optimizer.name().into());
    if let OptimizerKind::Adam(a) = c.optimizer {
        // Adam's weight decay is the one `weight_decay` records.
        meta.insert("weight_decay".into(), a.weight_decay.to_string());
        meta.insert("beta1".into(), a.betas.0.to_string());
        meta.insert("beta2".into(), a.betas.1.to_string());
        meta.insert("eps".into(), a.eps.to_string());
    }
    if let Some(n) = c.clip_grad_norm {
        meta.insert("clip_grad_norm".into(), n.to_string());
    }
    if c.no_decay_norm_bias {
        meta.insert("no_decay_norm_bias".into(), "true".into());
    }
    meta.insert("loss_reduction".into(), c.loss_reduction.to_string());
    if let Some(l) = &state.loss_scale {
        // The whole state, so a resumed run grows and skips as the uninterrupted one would.
        let state = serde_json::to_string(l).expect("a loss scale serializes");
        meta.insert("loss_scale_state".into(), state);
    }
    let hash = config_hash(&meta);
    meta.insert("config_hash".into(), hash);
    meta.insert("run".into(), lineage.run.clone());
    if let Some(parent) = &lineage.parent {
        meta.insert("parent".into(), parent.clone());
    }
    let classes = serde_json::to_string(&lineage.classes).expect("names serialize");
    meta.insert("class_names".into(), classes);
    meta
}

/// Writes `state` of a run of `c` on `g` (from `lineage`) to `path` atomically.
pub fn save(
    g: &Graph,
    c: &TrainConfig,
    state: &TrainingState,
    lineage: &Lineage,
    path: &Path,
) -> Result<()> {
    let meta = metadata(g, c, state, lineage);
    crate::core::files::write_atomically(path, &serialize(g, c.dtype, state, true, meta)?)
}

/// Writes the weights and BN statistics of `state` as a plain state_dict at `path` (what
/// PyTorch's `load_state_dict(strict=True)` takes after `safetensors.torch.load_file`): no
/// optimizer state, and metadata saying only that it is PyTorch's layout.
pub fn save_weights(g: &Graph, dtype: DType, state: &TrainingState, path: &Path) -> Result<()> {
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    crate::core::files::write_atomically(path, &serialize(g, dtype, state, false, meta)?)
}

/// The safetensors bytes of `state` under torchvision's names, with the optimizer's state if
/// `optimizer`; refuses a state holding a non-finite value.
fn serialize(
    g: &Graph,
    dtype: DType,
    state: &TrainingState,
    optimizer: bool,
    meta: HashMap<String, String>,
) -> Result<Vec<u8>> {
    // A checkpoint is what a run falls back to: never one that cannot train.
    let tensors = state.values.iter().zip(&g.params).chain(
        state
            .optimizer
            .iter()
            .zip(&g.params)
            .filter_map(|(o, p)| o.as_ref().map(|o| (o, p)))
            .flat_map(|(o, p)| o.tensors.iter().map(move |(_, t)| (t, p))),
    );
    for (v, p) in tensors {
        if v.to_f64_vec()?.iter().any(|x| !x.is_finite()) {
            return Err(Error::Diverged {
                step: state.step,
                what: format!(
                    "'{}' holds an infinite or NaN value, so no checkpoint is written",
                    p.name
                ),
            });
        }
    }
    let dtype = safetensors_dtype(dtype);
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>, Dtype)> = Vec::new();
    for (p, v) in g.params.iter().zip(&state.values) {
        owned.push((
            p.name.clone(),
            p.spec.shape.dims().to_vec(),
            v.to_le_bytes()?,
            dtype,
        ));
    }
    for (bn, &n) in batchnorm_nodes(g).zip(&state.batches_tracked) {
        owned.push((
            format!("{bn}.num_batches_tracked"),
            vec![],
            (n as i64).to_le_bytes().to_vec(),
            Dtype::I64,
        ));
    }
    for (p, o) in g.params.iter().zip(&state.optimizer) {
        let Some(o) = o.as_ref().filter(|_| optimizer) else {
            continue;
        };
        for (name, t) in &o.tensors {
            owned.push((
                format!("optimizer.{}.{name}", p.name),
                p.spec.shape.dims().to_vec(),
                t.to_le_bytes()?,
                dtype,
            ));
        }
        owned.push((
            format!("optimizer.{}.step", p.name),
            vec![],
            (o.steps as i64).to_le_bytes().to_vec(),
            Dtype::I64,
        ));
    }
    // A checksum per tensor, checked on every load: a bit flipped on disk names its tensor.
    let mut meta = meta;
    let sums: std::collections::BTreeMap<&str, String> = owned
        .iter()
        .map(|(n, _, data, _)| (n.as_str(), format!("{:08x}", crc32fast::hash(data))))
        .collect();
    meta.insert(
        CHECKSUMS.into(),
        serde_json::to_string(&sums).map_err(|e| Error::Internal(e.to_string()))?,
    );
    let views = owned
        .iter()
        .map(|(n, shape, data, dt)| {
            Ok((
                n.as_str(),
                TensorView::new(*dt, shape.clone(), data)
                    .map_err(|e| Error::Internal(format!("{n}: {e}")))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::Internal(format!("serializing a checkpoint: {e}")))
}

/// A checkpoint read into memory: its metadata and raw bytes.
pub struct Checkpoint {
    path: PathBuf,
    bytes: Vec<u8>,
    meta: HashMap<String, String>,
}

impl Checkpoint {
    /// Reads and checks the container; names the first tensor a truncated file cuts short.
    /// A file that is not a gems checkpoint is refused from its header, before the rest is
    /// read.
    pub fn read(path: &Path) -> Result<Checkpoint> {
        let bytes = read_checkpoint_file(path)?;
        let meta = match SafeTensors::read_metadata(&bytes) {
            Ok((_, m)) => m.metadata().clone().unwrap_or_default(),
            Err(e) => {
                let why = truncated_tensor(&bytes)
                    .map(|t| format!("tensor '{t}' is cut short"))
                    .unwrap_or_else(|| e.to_string());
                return Err(Error::Config(format!(
                    "{} is not a readable checkpoint: {why}",
                    path.display()
                )));
            }
        };
        if meta.get("format").map(String::as_str) != Some(FORMAT) {
            return Err(Error::Config(format!(
                "{} is not a gems checkpoint (no '{FORMAT}' format tag)",
                path.display()
            )));
        }
        verify_checksums(path, &bytes, &meta)?;
        Ok(Checkpoint {
            path: path.to_path_buf(),
            bytes,
            meta,
        })
    }

    fn get<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        self.meta
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                Error::Config(format!(
                    "{}: metadata '{key}' is missing or malformed",
                    self.path.display()
                ))
            })
    }

    /// Like [`Checkpoint::get`], with `default` where the key is absent.
    fn get_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T> {
        match self.meta.contains_key(key) {
            true => self.get(key),
            false => Ok(default),
        }
    }

    /// Optimizer steps done when it was written.
    pub fn step(&self) -> Result<usize> {
        self.get("step")
    }

    /// The run that wrote it (`None` for checkpoints from before runs had identities).
    pub fn run(&self) -> Option<&str> {
        self.meta.get("run").map(String::as_str)
    }

    /// The class names its labels number (`None` for checkpoints from before they were
    /// recorded).
    pub fn class_names(&self) -> Result<Option<Vec<String>>> {
        match self.meta.get("class_names") {
            Some(json) => serde_json::from_str(json)
                .map(Some)
                .map_err(|e| Error::Config(format!("{}: class names: {e}", self.path.display()))),
            None => Ok(None),
        }
    }

    /// The model the checkpoint was written for: its name, image side and classes.
    pub fn model(&self) -> Result<(String, usize, usize)> {
        Ok((
            self.get("model")?,
            self.get("image_size")?,
            self.get("classes")?,
        ))
    }

    /// The training configuration the checkpoint was written with (capacities, the device and
    /// the saved-tensor policy, which a resumed run chooses afresh, not included).
    pub fn config(&self) -> Result<TrainConfig> {
        let decay: String = self.get("schedule")?;
        Ok(TrainConfig {
            batch_size: self.get("batch_size")?,
            steps: self.get("total_steps")?,
            schedule: LrSchedule {
                base: self.get("lr")?,
                decay: decay.parse().map_err(Error::Config)?,
                warmup: self.get("warmup")?,
                total: self.get("total_steps")?,
            },
            sgd: SgdConfig {
                momentum: self.get("momentum")?,
                weight_decay: self.get("weight_decay")?,
                nesterov: self.get("nesterov")?,
            },
            optimizer: self.optimizer()?,
            clip_grad_norm: match self.meta.contains_key("clip_grad_norm") {
                true => Some(self.get("clip_grad_norm")?),
                false => None,
            },
            no_decay_norm_bias: self.get_or("no_decay_norm_bias", false)?,
            // Checkpoints from before the choice reduced per sample.
            loss_reduction: self.get_or("loss_reduction", Reduction::SampleMean)?,
            seed: self.get("seed")?,
            dtype: self
                .get::<String>("dtype")?
                .parse()
                .map_err(Error::Config)?,
            device_memory: None,
            host_memory: None,
            offload_copy: crate::backend::CopyMode::default(),
            saves: crate::graph::policy::SavePolicy::keep_all(),
            device: crate::backend::DeviceKind::Cpu,
            // Checkpoints from before mixed precision hold neither.
            precision: self.get_or("precision", crate::tensor::Precision::Fp32)?,
            loss_scale: self.get_or("loss_scale", LossScale::INITIAL)?,
            conv: crate::backend::cuda::ConvImpl::Native,
            data: match self.meta.get("data") {
                Some(json) => serde_json::from_str(json).map_err(|e| {
                    Error::Config(format!("the checkpoint's data configuration: {e}"))
                })?,
                None => crate::data::DataConfig::default(),
            },
            class_weights: match self.meta.get("class_weights") {
                Some(json) => {
                    Some(serde_json::from_str(json).map_err(|e| {
                        Error::Config(format!("the checkpoint's class weights: {e}"))
                    })?)
                }
                None => None,
            },
        })
    }

    /// The optimizer the checkpoint was written with (SGD for checkpoints from before others).
    fn optimizer(&self) -> Result<OptimizerKind> {
        Ok(
            match self.get_or("optimizer", "sgd".to_string())?.as_str() {
                "sgd" => OptimizerKind::Sgd,
                name @ ("adam" | "adamw") => OptimizerKind::Adam(AdamConfig {
                    betas: (self.get("beta1")?, self.get("beta2")?),
                    eps: self.get("eps")?,
                    weight_decay: self.get("weight_decay")?,
                    decoupled: name == "adamw",
                }),
                other => {
                    return Err(Error::Config(format!(
                        "{}: unknown optimizer '{other}'",
                        self.path.display()
                    )))
                }
            },
        )
    }

    /// The state for a run of `g` with `dtype` parameters; refuses, by name, a checkpoint of
    /// another model, image side or class count, and any tensor that does not match.
    pub fn state(&self, g: &Graph, dtype: DType) -> Result<TrainingState> {
        let file = self.path.display();
        let bad = |why: String| Error::BadInput {
            path: self.path.clone(),
            why,
        };
        let (model, side, classes) = self.model()?;
        if (model.as_str(), side, classes) != (g.name.as_str(), g.image_size(), g.classes()) {
            return Err(bad(format!(
                "written for {model} on {side}² images with {classes} classes, not {} on {}² with {}",
                g.name,
                g.image_size(),
                g.classes()
            )));
        }
        let st = SafeTensors::deserialize(&self.bytes).map_err(|e| bad(e.to_string()))?;
        let want = safetensors_dtype(dtype);
        let read = |name: &str, shape: &[usize], dt: Dtype| -> Result<TensorView<'_>> {
            let v = st
                .tensor(name)
                .map_err(|_| Error::Config(format!("checkpoint {file} lacks tensor '{name}'")))?;
            if v.dtype() != dt {
                return Err(Error::Config(format!(
                    "checkpoint {file}: tensor '{name}' is {:?}, expected {dt:?}",
                    v.dtype()
                )));
            }
            if v.shape() != shape {
                return Err(Error::Config(format!(
                    "checkpoint {file}: tensor '{name}' has shape {:?}, expected {shape:?}",
                    v.shape()
                )));
            }
            Ok(v)
        };
        let mut expected = std::collections::HashSet::new();
        let mut values = Vec::with_capacity(g.params.len());
        let step = self.step()?;
        // The names of its state: SGD's do not depend on its hyper-parameters.
        let sgd = SgdConfig {
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        };
        let names: Vec<String> = match self.optimizer() {
            Ok(kind) => (kind.optimizer(sgd).state_names().iter())
                .map(|n| n.to_string())
                .collect(),
            // A caller's own optimizer: the names its state was written under.
            Err(_) => custom_state_names(&st, g),
        };
        let mut optimizer = Vec::with_capacity(g.params.len());
        for p in &g.params {
            let shape = p.spec.shape.dims();
            let v = Storage::from_le_bytes(read(&p.name, shape, want)?.data(), dtype);
            check_values(&self.path, &p.name, &v)?;
            values.push(v);
            expected.insert(p.name.clone());
            if !p.spec.trainable {
                optimizer.push(None);
                continue;
            }
            let mut tensors = Vec::new();
            for name in &names {
                let key = format!("optimizer.{}.{name}", p.name);
                let data = read(&key, shape, want)?.data();
                expected.insert(key);
                tensors.push((name.clone(), Storage::from_le_bytes(data, dtype)));
            }
            // Checkpoints from before per-parameter steps stepped every parameter every step.
            let key = format!("optimizer.{}.step", p.name);
            let steps = match st.tensor(&key) {
                Ok(_) => {
                    let bytes = read(&key, &[], Dtype::I64)?.data();
                    let steps = i64::from_le_bytes(
                        bytes
                            .try_into()
                            .map_err(|_| bad(format!("tensor '{key}' is not one i64")))?,
                    );
                    expected.insert(key);
                    steps as u64
                }
                Err(_) => step as u64,
            };
            optimizer.push(Some(OptimizerState { steps, tensors }));
        }
        let mut batches_tracked = Vec::new();
        for bn in batchnorm_nodes(g) {
            let name = format!("{bn}.num_batches_tracked");
            batches_tracked.push(batch_count(&name, read(&name, &[], Dtype::I64)?).map_err(bad)?);
            expected.insert(name);
        }
        if let Some(extra) = st.names().into_iter().find(|n| !expected.contains(*n)) {
            return Err(Error::Config(format!(
                "checkpoint {file} has tensor '{extra}', which {} does not have",
                g.name
            )));
        }
        let loss_scale = match self.meta.get("loss_scale_state") {
            Some(json) => Some(
                serde_json::from_str(json)
                    .map_err(|e| bad(format!("the loss scale's state: {e}")))?,
            ),
            None => None,
        };
        Ok(TrainingState {
            values,
            optimizer,
            step,
            // Checkpoints from before data positions were recorded trained one batch a step.
            position: self.get_or("position", (step * self.get::<usize>("batch_size")?) as u64)?,
            loss_scale,
            batches_tracked,
        })
    }
}

/// The count a `num_batches_tracked` tensor `name` holds: one i64, not negative.
fn batch_count(name: &str, t: TensorView<'_>) -> std::result::Result<u64, String> {
    let one: Option<[u8; 8]> = match (t.dtype(), t.shape()) {
        (Dtype::I64, [] | [1]) => t.data().try_into().ok(),
        _ => None,
    };
    let n = one
        .map(i64::from_le_bytes)
        .ok_or_else(|| format!("tensor '{name}' is not one i64"))?;
    u64::try_from(n).map_err(|_| format!("tensor '{name}' counts {n} batches"))
}

/// The weights in a plain safetensors state_dict at `path` (torchvision's names, as PyTorch's
/// `save_file(model.state_dict())` writes them; a gems checkpoint also reads), indexed like
/// `g`'s parameters and converted to `dtype` from any float type, and each BN node's
/// `num_batches_tracked` (0 where the file has none). Optimizer entries are ignored; a
/// parameter missing, of another shape, or a tensor `g` does not have is refused by name.
pub fn read_weights(path: &Path, g: &Graph, dtype: DType) -> Result<(Vec<Storage>, Vec<u64>)> {
    let bad = |why: String| Error::BadInput {
        path: path.to_path_buf(),
        why,
    };
    let bytes = {
        use std::io::Read;
        let mut b = Vec::new();
        crate::core::files::open_regular(path)?
            .read_to_end(&mut b)
            .map_err(|e| bad(format!("cannot read it: {e}")))?;
        b
    };
    if let Some(why) = pytorch_file(&bytes) {
        return Err(bad(why));
    }
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("is not a safetensors file: {e}")))?;
    if let Ok((_, m)) = SafeTensors::read_metadata(&bytes) {
        verify_checksums(path, &bytes, &m.metadata().clone().unwrap_or_default())?;
    }
    let mut values = Vec::with_capacity(g.params.len());
    for p in &g.params {
        let t = st.tensor(&p.name).map_err(|_| {
            let wrapped = format!("module.{}", p.name);
            bad(match st.tensor(&wrapped) {
                Ok(_) => format!(
                    "has no tensor '{}' but has '{wrapped}': a state_dict saved from a wrapped \
                     model (DataParallel); save `model.module.state_dict()`, or strip the \
                     'module.' prefix from its names",
                    p.name
                ),
                Err(_) => format!("has no tensor '{}'", p.name),
            })
        })?;
        if t.shape() != p.spec.shape.dims() {
            return Err(bad(format!(
                "tensor '{}' has shape {:?}, the model's {:?}",
                p.name,
                t.shape(),
                p.spec.shape.dims()
            )));
        }
        let theirs = match t.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(bad(format!(
                    "tensor '{}' is {other:?}, not a float",
                    p.name
                )))
            }
        };
        let theirs = Storage::from_le_bytes(t.data(), theirs);
        check_values(path, &p.name, &theirs)?;
        let read = theirs.to_f64_vec()?;
        values.push(crate::backend::Backend::upload(
            &crate::backend::cpu::Cpu,
            &read,
            dtype,
        )?);
    }
    let known: std::collections::HashSet<&str> = g.params.iter().map(|p| p.name.as_str()).collect();
    let extra = st.names().into_iter().find(|n| {
        !known.contains(*n) && !n.ends_with(".num_batches_tracked") && !n.starts_with("optimizer.")
    });
    if let Some(extra) = extra {
        return Err(bad(format!(
            "has tensor '{extra}', which {} does not have",
            g.name
        )));
    }
    let batches_tracked = batchnorm_nodes(g)
        .map(|bn| {
            let name = format!("{bn}.num_batches_tracked");
            match st.tensor(&name) {
                Ok(t) => batch_count(&name, t).map_err(bad),
                Err(_) => Ok(0),
            }
        })
        .collect::<Result<_>>()?;
    Ok((values, batches_tracked))
}

/// The metadata key of the per-tensor checksums: a JSON object of name → CRC-32 (hex).
const CHECKSUMS: &str = "checksums";

/// Checks each tensor of the safetensors file `bytes` against the checksums its metadata
/// records (files without them, from before checksums, pass), naming the first that differs.
fn verify_checksums(path: &Path, bytes: &[u8], meta: &HashMap<String, String>) -> Result<()> {
    let Some(json) = meta.get(CHECKSUMS) else {
        return Ok(());
    };
    let bad = |why: String| Error::BadInput {
        path: path.to_path_buf(),
        why,
    };
    let sums: HashMap<String, String> = serde_json::from_str(json)
        .map_err(|e| bad(format!("its checksums are unreadable: {e}")))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
    let mut names: Vec<&String> = sums.keys().collect();
    names.sort();
    for name in names {
        // A tensor missing altogether is named by the reader that needs it.
        let Ok(t) = st.tensor(name) else {
            continue;
        };
        let got = format!("{:08x}", crc32fast::hash(t.data()));
        if got != sums[name] {
            return Err(bad(format!(
                "tensor '{name}' is damaged: its checksum is {got}, {} when written; the file \
                 changed on disk (restore it, or resume from an earlier checkpoint)",
                sums[name]
            )));
        }
    }
    Ok(())
}

/// Refuses weights a run cannot start from: a non-finite value anywhere, a negative running
/// variance (batch norm would take its square root), each named with its tensor.
fn check_values(path: &Path, name: &str, v: &Storage) -> Result<()> {
    let values = v.to_f64_vec()?;
    let bad = |i: usize, what: &str| Error::BadInput {
        path: path.to_path_buf(),
        why: format!("tensor '{name}' holds {} at element {i}: {what}", values[i]),
    };
    if let Some(i) = values.iter().position(|x| !x.is_finite()) {
        return Err(bad(i, "weights must be finite"));
    }
    if name.ends_with("running_var") {
        if let Some(i) = values.iter().position(|&x| x < 0.0) {
            return Err(bad(i, "a running variance cannot be negative"));
        }
    }
    Ok(())
}

/// Why `bytes` are a PyTorch file rather than safetensors (`torch.save` writes a zip archive,
/// or a pickle in its older format), with how to convert it; `None` otherwise.
fn pytorch_file(bytes: &[u8]) -> Option<String> {
    let zip = bytes.starts_with(b"PK\x03\x04");
    let pickle = bytes.first() == Some(&0x80) && bytes.get(1).is_some_and(|p| (2..=5).contains(p));
    (zip || pickle).then(|| {
        "is a PyTorch file (torch.save's format), not safetensors: convert it with `python3 -c \
         \"import torch, safetensors.torch as s; s.save_file(torch.load('IN.pth', \
         map_location='cpu'), 'OUT.safetensors')\"` (a checkpoint dict: save its \
         'state_dict' or 'model' entry)"
            .to_string()
    })
}

/// Headers longer than this are not a checkpoint's (safetensors itself allows 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// The bytes of the checkpoint file at `path`, once its header shows it is a gems checkpoint.
fn read_checkpoint_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let bad = |why: String| Error::BadInput {
        path: path.to_path_buf(),
        why,
    };
    let not_ours = || {
        bad(format!(
            "is not a gems checkpoint (no '{FORMAT}' format tag)"
        ))
    };
    let mut file = crate::core::files::open_regular(path)?;
    let len = file
        .metadata()
        .map_err(|e| bad(format!("cannot read it: {e}")))?
        .len();
    let mut head = [0u8; 8];
    file.read_exact(&mut head).map_err(|_| not_ours())?;
    if let Some(why) = pytorch_file(&head) {
        return Err(bad(why));
    }
    let n = u64::from_le_bytes(head);
    if n > MAX_HEADER || 8 + n > len {
        return Err(not_ours());
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len as usize)
        .map_err(|_| bad(format!("{len} bytes do not fit in this machine's memory")))?;
    bytes.extend_from_slice(&head);
    (&mut file)
        .take(n)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..]).map_err(|_| not_ours())?;
    if header
        .pointer("/__metadata__/format")
        .and_then(|f| f.as_str())
        != Some(FORMAT)
    {
        return Err(not_ours());
    }
    file.read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot read it: {e}")))?;
    Ok(bytes)
}

/// The first tensor whose bytes lie beyond the end of a cut-short file, from its JSON header.
fn truncated_tensor(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: HashMap<String, serde_json::Value> =
        serde_json::from_slice(bytes.get(8..8 + n)?).ok()?;
    let available = bytes.len() - 8 - n;
    header
        .iter()
        .filter_map(|(name, info)| {
            Some((name, info.get("data_offsets")?.get(1)?.as_u64()? as usize))
        })
        .filter(|(_, end)| *end > available)
        .min_by_key(|(_, end)| *end)
        .map(|(name, _)| name.clone())
}
