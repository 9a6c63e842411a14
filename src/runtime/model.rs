//! Inference: a trained model (graph, weights, and the preprocessing its training data had)
//! predicting on a caller's images or on a data set, under a memory cap, through the same
//! evaluation [`Session::predict`] runs.
//!
//! ```no_run
//! use gems::runtime::Model;
//! use gems::{Category, DType, Device, Shape};
//! # fn main() -> gems::Result<()> {
//! let mut model = Model::load("run/step-100.safetensors")?.configure(|c| {
//!     c.device_memory = Some(2 << 30);
//! });
//! // One RGB image, planes in [0, 1], of any size: cut and normalized as in training.
//! let host = Device::cpu("host", None);
//! let pixels = vec![0.5; 3 * 300 * 400];
//! let image = host.upload(Shape::new([3, 300, 400]), &pixels, DType::F32, Category::Activations)?;
//! let p = model.predict(&image)?;
//! println!("{} ({:.1}%)", model.classes()[p.class as usize], 100.0 * p.scores[p.class as usize]);
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::core::DType;
use crate::data::images::Images;
use crate::data::transform::Transform;
use crate::data::{Dataset, Image, Pipeline, Task, CHANNELS};
use crate::graph::Graph;
use crate::memory::MemoryStats;
use crate::models;
use crate::plan::{RunConfig, TrainConfig};
use crate::runtime::checkpoint::Checkpoint;
use crate::runtime::{Evaluation, SampleScore, Session};
use crate::schemes::Scheme;
use crate::tensor::{Shape, Tensor};
use crate::{Error, Result};

/// Where a model's weights come from.
enum Weights {
    /// A gems checkpoint ([`Session::restore`]) written in `dtype`.
    Checkpoint { path: PathBuf, dtype: DType },
    /// A plain state_dict ([`Session::load_weights`]).
    StateDict(PathBuf),
}

/// A trained model ready to predict: its graph, its weights, and how its training data
/// became inputs (the transform evaluation applies: the centred square, or the whole image
/// if training resized, resampled to the model's side, normalized as training normalized).
///
/// Predictions run in micro-batches of the configured batch size ([`Model::configure`]);
/// when a micro-batch does not fit the device's memory cap, the model halves it and tries
/// again, down to one image (an image that does not fit alone can be tiled over several
/// devices: [`Model::spread`]).
pub struct Model {
    graph: Graph,
    weights: Weights,
    config: TrainConfig,
    /// How it runs over devices: one by default.
    scheme: Scheme,
    transform: Transform,
    /// The class names its checkpoint records.
    names: Option<Vec<String>>,
    /// Optimizer steps its weights were trained for.
    steps: usize,
    /// Built on first use and after a micro-batch did not fit (a session stops at an error).
    session: Option<Session>,
}

/// What a model predicts for one image.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    /// The most probable class; segmenting, the class predicted at most pixels.
    pub class: u32,
    /// Per class: its softmax probability; segmenting, the fraction of pixels predicted as
    /// that class.
    pub scores: Vec<f32>,
    /// Segmenting: the class predicted at each pixel of the model's input (side × side,
    /// row-major); empty for a classifier.
    pub map: Vec<u32>,
}

impl From<SampleScore> for Prediction {
    fn from(s: SampleScore) -> Prediction {
        Prediction {
            class: s.predicted,
            scores: s.scores,
            map: s.map,
        }
    }
}

impl Model {
    /// The model of the gems checkpoint at `path` (its metadata names the model, its image
    /// side and classes, and the data it trained on, hence the normalization), with its
    /// weights and BN statistics, on the CPU, in micro-batches of its training batch size.
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let path = path.as_ref();
        let ckpt = Checkpoint::read(path)?;
        let (name, side, classes) = ckpt.model()?;
        let graph = models::build(&name, side, classes)?;
        let config = ckpt.config()?;
        let dtype = config.dtype;
        Ok(Model {
            transform: config.data.held_out_transform(),
            names: ckpt.class_names()?.filter(|n| n.len() == classes),
            steps: ckpt.step()?,
            config,
            scheme: Scheme::single(1),
            graph,
            weights: Weights::Checkpoint {
                path: path.to_path_buf(),
                dtype,
            },
            session: None,
        })
    }

    /// `graph` with the weights of the plain safetensors state_dict at `path` (torchvision's
    /// names), taking inputs normalized as torchvision's pretrained models do (ImageNet's
    /// mean and deviation; [`Model::prepare`] changes it), on the CPU, in micro-batches of 8.
    pub fn from_state_dict(path: impl AsRef<Path>, graph: Graph) -> Result<Model> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::BadInput {
                path: path.to_path_buf(),
                why: "no such file".into(),
            });
        }
        Ok(Model {
            transform: Transform::default(),
            names: None,
            steps: 0,
            config: TrainConfig::new(8, 1),
            scheme: Scheme::single(1),
            graph,
            weights: Weights::StateDict(path.to_path_buf()),
            session: None,
        })
    }

    /// The same with `f` applied to its run's configuration: the device and dtype, the
    /// memory cap (`device_memory`), the micro-batch (`batch_size`), convolutions.
    pub fn configure(mut self, f: impl FnOnce(&mut TrainConfig)) -> Model {
        f(&mut self.config);
        self.session = None;
        self
    }

    /// The same preparing images with `transform` (its normalization, and whether an image
    /// not of the model's side is resized or cut to its centred square) instead of what the
    /// weights were trained with; predictions never augment.
    pub fn prepare(mut self, transform: Transform) -> Model {
        self.transform = Transform {
            augment: false,
            ..transform
        };
        self
    }

    /// How images are prepared: the centred square (or the whole image resized), normalized.
    pub fn transform(&self) -> Transform {
        self.transform
    }

    /// The same running under `scheme` over ranks that are threads of this process: with
    /// spatial tiles ([`Scheme::with_spatial`]), an image too large for one device's memory
    /// predicts over several; a pipeline splits the model's layers.
    pub fn spread(mut self, scheme: Scheme) -> Model {
        self.scheme = scheme;
        self.session = None;
        self
    }

    /// The same model on `side`² inputs: a fully convolutional model (a U-Net) has the
    /// same weights at every side, so its checkpoint's weights load into the graph built at
    /// `side` (parameters and BN statistics). Refuses a side the model cannot take.
    pub fn at_side(self, side: usize) -> Result<Model> {
        let graph = crate::models::build(&self.graph.name, side, self.graph.classes())?;
        let path = match self.weights {
            Weights::Checkpoint { path, .. } | Weights::StateDict(path) => path,
        };
        Ok(Model {
            graph,
            weights: Weights::StateDict(path),
            session: None,
            ..self
        })
    }

    /// The class of every pixel of each image (each the model's side, in [0, 1] as
    /// [`Model::predict`] takes them), row-major, in order.
    pub fn segment(&mut self, images: Vec<Image>) -> Result<Vec<Vec<u32>>> {
        if self.task() != Task::Segment {
            return Err(Error::Config(format!(
                "{} classifies images; segmenting needs a segmentation model",
                self.graph.name
            )));
        }
        let n = images.len();
        let data = self.pipeline(images)?;
        let mut per_sample = self.evaluate(&data, None, 1)?.per_sample;
        per_sample.sort_by_key(|s| s.position);
        if per_sample.len() != n {
            return Err(Error::Internal(format!(
                "{} maps for {n} images",
                per_sample.len()
            )));
        }
        Ok(per_sample.into_iter().map(|s| s.map).collect())
    }

    /// The class names, in the order of [`Prediction::scores`]: as its checkpoint records
    /// them, else their numbers.
    pub fn classes(&self) -> Vec<String> {
        self.names
            .clone()
            .unwrap_or_else(|| (0..self.graph.classes()).map(|c| c.to_string()).collect())
    }

    /// The class names its checkpoint records (`None` for a plain state_dict, or a checkpoint
    /// from before names were recorded).
    pub fn class_names(&self) -> Option<&[String]> {
        self.names.as_deref()
    }

    /// Optimizer steps its weights were trained for (0 for a plain state_dict).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The model's graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// How it runs over ranks ([`Model::spread`]; one device unless spread).
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    /// The configuration predictions run with; `batch_size` is the micro-batch that fits.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The prediction for one image: C×H×W (or 1×C×H×W) on the host, planes in [0, 1] as
    /// decoded files have them, of any size (prepared as evaluation prepares an image).
    pub fn predict(&mut self, image: &Tensor) -> Result<Prediction> {
        let one = match *image.shape().dims() {
            [c, h, w] => image.reshape(Shape::new([1, c, h, w]))?,
            [1, _, _, _] => image.reshape(image.shape().clone())?,
            _ => {
                return Err(Error::Shape(format!(
                    "predict takes one image (C×H×W or 1×C×H×W), got {}",
                    image.shape()
                )))
            }
        };
        let mut all = self.predict_batch(&one)?;
        all.pop()
            .ok_or_else(|| Error::Internal("no prediction for an image".into()))
    }

    /// The predictions for a batch of images N×C×H×W, in order (see [`Model::predict`]).
    pub fn predict_batch(&mut self, images: &Tensor) -> Result<Vec<Prediction>> {
        let data = self.pipeline(self.images(images)?)?;
        let every = match self.task() {
            Task::Classify => 0,
            Task::Segment => 1,
        };
        let e = self.evaluate(&data, None, every)?;
        Ok(e.per_sample.into_iter().map(Prediction::from).collect())
    }

    /// [`Session::predict`] of `data` (the first `samples` of its order, default all; each
    /// segmented sample's classes kept at every `map_every`-th pixel) in micro-batches that
    /// fit: a micro-batch that does not is halved, down to one image per micro-batch of the
    /// scheme.
    pub fn evaluate(
        &mut self,
        data: &Arc<Pipeline>,
        samples: Option<usize>,
        map_every: usize,
    ) -> Result<Evaluation> {
        loop {
            match self.session()?.predict(data, samples, map_every) {
                Err(Error::OutOfMemory(_)) if self.config.batch_size / 2 >= self.scheme.parts => {
                    self.config.batch_size /= 2;
                    self.session = None;
                }
                result => return result,
            }
        }
    }

    /// Each rank's memory over the predictions since the session started (after a
    /// micro-batch did not fit: since the retry): peak, and bytes by category; empty before
    /// the first prediction.
    pub fn memory(&mut self) -> Result<Vec<MemoryStats>> {
        match &mut self.session {
            Some(s) => s.memory(),
            None => Ok(Vec::new()),
        }
    }

    /// Whether it classifies images or segments them.
    fn task(&self) -> Task {
        match self.graph.positions() {
            1 => Task::Classify,
            _ => Task::Segment,
        }
    }

    /// The session predictions run on, with the model's weights.
    fn session(&mut self) -> Result<&mut Session> {
        if self.config.batch_size == 0 {
            return Err(Error::Config(
                "prediction needs a batch of at least 1".into(),
            ));
        }
        let session = match self.session.take() {
            Some(s) => s,
            None => {
                let config = RunConfig::new(self.config.clone(), self.scheme);
                // A session reads its training data only when it steps, which predicting never
                // does: none, of the model's kind, and no class names to hold checkpoints to.
                let none = self.pipeline(Vec::new())?;
                let data = Dataset {
                    train: none,
                    val: None,
                    classes: Vec::new(),
                    skipped: Vec::new(),
                };
                let mut s = Session::new(&self.graph, config, data)?;
                match &self.weights {
                    Weights::Checkpoint { path, dtype } if *dtype == self.config.dtype => {
                        s.restore(path)?
                    }
                    // Configured for another dtype: its weights and BN statistics converted.
                    Weights::Checkpoint { path, .. } | Weights::StateDict(path) => {
                        s.load_weights(path)?
                    }
                }
                s
            }
        };
        Ok(self.session.insert(session))
    }

    /// `images` in order, prepared as the model's training data was outside training.
    fn pipeline(&self, images: Vec<Image>) -> Result<Arc<Pipeline>> {
        Ok(Arc::new(Pipeline::new(
            Arc::new(Images::new(images, self.classes(), self.task())?),
            self.graph.image_size(),
            self.transform,
            self.config.seed,
            false,
            false,
        )))
    }

    /// The images of a tensor N×C×H×W on the host.
    fn images(&self, t: &Tensor) -> Result<Vec<Image>> {
        let (n, h, w) = match t.shape().dims() {
            &[n, c, h, w] if c == CHANNELS && n > 0 && h > 0 && w > 0 => (n, h, w),
            _ => {
                return Err(Error::Shape(format!(
                    "images are N×{CHANNELS}×H×W with N, H, W at least 1, got {}",
                    t.shape()
                )))
            }
        };
        let values = t.to_f64_vec()?;
        Ok(values
            .chunks_exact(CHANNELS * h * w)
            .take(n)
            .map(|v| Image {
                height: h,
                width: w,
                pixels: v.iter().map(|&x| x as f32).collect(),
            })
            .collect())
    }
}
