//! A run's data: the source its flags name, split into training and held-out samples, and
//! the pipeline that turns a position of the epoch order into a prepared, labelled input.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::folder::{Folder, Pairs};
use super::order::Epochs;
use super::slide::{self, Slides, TileConfig};
use super::synthetic::{SceneStream, Scenes, Stream, Synthetic};
use super::transform::{Normalize, Transform};
use super::{Image, Mask, Source, Task, TilePlace, CHANNELS, UNLABELLED};
use crate::core::rng::{splitmix64, uniform};
use crate::{Error, Result};

/// Salts of the independent random streams drawn from the run's seed.
const HELD_OUT_STREAM: u64 = 0x4556_414c;
const SPLIT_STREAM: u64 = 0x5350_4c54;
const AUGMENT_STREAM: u64 = 0x4155_474d;

/// Loader threads a run may ask for: more would only cost memory and start-up time.
pub const MAX_WORKERS: usize = 1024;

/// Where the images come from (`--data`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum SourceSpec {
    /// Generated on the fly (see [`Synthetic`]).
    Synthetic,
    /// One sub-folder per class (see [`Folder`]), or to segment images and masks (see
    /// [`Pairs`]).
    Folder(PathBuf),
    /// Tiles of the slides in `dir`, labelled by the CSV file `labels` (see [`Slides`]).
    Slides {
        /// The folder of `.tif`/`.tiff` slides.
        dir: PathBuf,
        /// The labels CSV.
        labels: PathBuf,
        /// How slides are cut into tiles.
        tiles: TileConfig,
    },
}

impl std::fmt::Display for SourceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceSpec::Synthetic => write!(f, "synthetic data"),
            SourceSpec::Folder(dir) => write!(f, "{}", dir.display()),
            SourceSpec::Slides { dir, labels, .. } => {
                write!(f, "{} (labels {})", dir.display(), labels.display())
            }
        }
    }
}

/// How a run reads its data.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DataConfig {
    /// Where the images come from.
    pub source: SourceSpec,
    /// Random crops and flips while training.
    pub augment: bool,
    /// Fraction of the samples held out for validation (0: none).
    pub val: f64,
    /// Leave unreadable samples out with a warning instead of stopping.
    pub skip_bad: bool,
    /// Loader threads preparing batches ahead of training.
    pub workers: usize,
    /// Batches prepared ahead at most.
    pub prefetch: usize,
    /// A class per image or per pixel (configurations saved before segmentation classify).
    #[serde(default)]
    pub task: Task,
    /// How decoded images' channels are scaled (configurations saved before the choice
    /// normalized with ImageNet's statistics).
    #[serde(default)]
    pub normalize: Normalize,
    /// Images not of the model's side are resampled whole instead of cut to their centred
    /// square (configurations saved before the choice cut).
    #[serde(default)]
    pub resize: bool,
}

impl Default for DataConfig {
    /// Synthetic data, no augmentation, nothing held out, two workers four batches ahead,
    /// classifying.
    fn default() -> DataConfig {
        DataConfig {
            source: SourceSpec::Synthetic,
            augment: false,
            val: 0.0,
            skip_bad: false,
            workers: 2,
            prefetch: 4,
            task: Task::Classify,
            normalize: Normalize::ImageNet,
            resize: false,
        }
    }
}

impl DataConfig {
    /// How this data's samples become model inputs outside training (evaluation,
    /// prediction): as [`DataConfig::transform`] gives them, without augmentation.
    pub fn held_out_transform(&self) -> Transform {
        self.transform(false)
    }

    /// How this data's samples become model inputs (augmented while `training` if asked):
    /// decoded files normalized and fitted to the model's side as configured; synthetic
    /// images are generated centred and at the model's side, and stay as they are.
    pub fn transform(&self, training: bool) -> Transform {
        let synthetic = self.source == SourceSpec::Synthetic;
        Transform {
            augment: training && self.augment,
            normalize: match synthetic {
                true => Normalize::Unit,
                false => self.normalize,
            },
            resize: self.resize && !synthetic,
        }
    }
}

/// The classes of a source that names its own for `task` (`None` for synthetic data, whose
/// count the run chooses), without listing its samples.
pub fn class_names(source: &SourceSpec, task: Task) -> Result<Option<Vec<String>>> {
    match (source, task) {
        (SourceSpec::Synthetic, _) => Ok(None),
        (SourceSpec::Folder(dir), Task::Classify) => Folder::class_names(dir).map(Some),
        (SourceSpec::Folder(dir), Task::Segment) => Pairs::class_names(dir).map(Some),
        (SourceSpec::Slides { labels, .. }, task) => slide::label_classes(labels, task).map(Some),
    }
}

/// What the training loop and evaluation draw from.
pub struct Dataset {
    /// The training samples, in shuffled epochs.
    pub train: Arc<Pipeline>,
    /// Held-out samples: the validation split, or for synthetic data another seed's stream.
    pub val: Option<Arc<Pipeline>>,
    /// The class names, in label order.
    pub classes: Vec<String>,
    /// Samples left out at opening (with `skip_bad`): where, and why.
    pub skipped: Vec<(String, String)>,
}

impl Dataset {
    /// Synthetic images of `classes` classes (see [`Synthetic`]): the training stream from
    /// `seed`, and another seed's stream held out.
    pub fn synthetic(image_size: usize, classes: usize, seed: u64) -> Dataset {
        Dataset::streams(Task::Classify, image_size, classes, seed, false)
    }

    /// Synthetic scenes of `classes` classes (the background included, at least 2; see
    /// [`Scenes`]) to segment: the training stream from `seed`, another seed's held out.
    pub fn scenes(image_size: usize, classes: usize, seed: u64) -> Result<Dataset> {
        Dataset::synthetic_with(Task::Segment, image_size, classes, seed, false)
    }

    /// Synthetic data for `task`, the training stream augmented with `augment`.
    fn synthetic_with(
        task: Task,
        image_size: usize,
        classes: usize,
        seed: u64,
        augment: bool,
    ) -> Result<Dataset> {
        if task == Task::Segment && classes < 2 {
            return Err(Error::Config(format!(
                "synthetic segmentation needs at least 2 classes (the background and a shape), \
                 not {classes}"
            )));
        }
        Ok(Dataset::streams(task, image_size, classes, seed, augment))
    }

    /// The synthetic stream of `task` from `seed` for training (augmented with `augment`),
    /// and another seed's held out.
    fn streams(task: Task, image_size: usize, classes: usize, seed: u64, augment: bool) -> Dataset {
        let stream = |seed| -> Arc<dyn Source> {
            match task {
                Task::Classify => Arc::new(Stream::new(Synthetic {
                    seed,
                    classes,
                    image_size,
                })),
                Task::Segment => Arc::new(SceneStream::new(Scenes {
                    seed,
                    classes,
                    image_size,
                })),
            }
        };
        let pipeline = |source: Arc<dyn Source>, training| {
            let transform = Transform {
                augment: augment && training,
                normalize: Normalize::Unit,
                resize: false,
            };
            Arc::new(Pipeline::new(
                source, image_size, transform, seed, false, training,
            ))
        };
        let train = stream(seed);
        Dataset {
            classes: train.classes().to_vec(),
            train: pipeline(train, true),
            val: Some(pipeline(stream(splitmix64(seed ^ HELD_OUT_STREAM)), false)),
            skipped: vec![],
        }
    }

    /// A caller's `source` as `image_size`² inputs prepared as [`Transform::default`] says
    /// (the centred square, ImageNet's normalization), the fraction `held_out` of its samples
    /// (chosen by a hash of `seed` and the index, as folders' are) held out for evaluation and
    /// the rest in shuffled epochs drawn from `seed`; with `held_out` 0, all of it for training
    /// (an unbounded source has no fraction to hold out).
    pub fn from_source(
        source: Arc<dyn Source>,
        image_size: usize,
        held_out: f64,
        seed: u64,
    ) -> Result<Dataset> {
        let split = Split {
            image_size,
            held_out,
            seed,
            skip_bad: false,
            transform: Transform::default(),
        };
        split.dataset(source, vec![])
    }
}

/// How [`open`] and [`Dataset::from_source`] divide a finite source.
struct Split {
    image_size: usize,
    held_out: f64,
    seed: u64,
    skip_bad: bool,
    /// How training samples become inputs (held-out ones are not augmented).
    transform: Transform,
}

impl Split {
    /// `source` divided into training and held-out samples; `skipped` is what opening it
    /// left out.
    fn dataset(&self, source: Arc<dyn Source>, skipped: Vec<(String, String)>) -> Result<Dataset> {
        let val = self.held_out;
        check_held_out(val)?;
        // Training shuffles each epoch and may augment; held-out samples go in order, as they
        // are.
        let pipeline = |source: Arc<dyn Source>, subset, training: bool| {
            let transform = Transform {
                augment: training && self.transform.augment,
                ..self.transform
            };
            let p = Pipeline::new(
                source,
                self.image_size,
                transform,
                self.seed,
                self.skip_bad,
                training,
            );
            Ok::<_, Error>(Arc::new(match subset {
                Some(s) => p.subset(s)?,
                None => p,
            }))
        };
        let classes = source.classes().to_vec();
        let Some(n) = source.samples() else {
            if val > 0.0 {
                return Err(Error::Config(
                    "an unbounded source has no fraction to hold out".into(),
                ));
            }
            return Ok(Dataset {
                classes,
                train: pipeline(source, None, true)?,
                val: None,
                skipped,
            });
        };
        let (train, held) = split(n, val, self.seed);
        if train.is_empty() || (val > 0.0 && held.is_empty()) {
            return Err(Error::Config(format!(
                "holding out {val} of {n} samples leaves {} for training and {} held out: both need some",
                train.len(),
                held.len()
            )));
        }
        Ok(Dataset {
            classes,
            train: pipeline(source.clone(), Some(train), true)?,
            val: match val > 0.0 {
                true => Some(pipeline(source, Some(held), false)?),
                false => None,
            },
            skipped,
        })
    }
}

/// Opens `c`'s source for a model of `image_size`² inputs. Synthetic data has `classes`
/// classes; other sources name theirs.
pub fn open(c: &DataConfig, image_size: usize, classes: usize, seed: u64) -> Result<Dataset> {
    check_held_out(c.val)?;
    if c.val > 0.0 && c.source == SourceSpec::Synthetic {
        return Err(Error::Config(
            "only a finite data set (a folder or slides) has a fraction to hold out; \
             synthetic images are an endless stream, each one new, with a held-out stream \
             of its own"
                .into(),
        ));
    }
    if c.workers == 0 || c.prefetch == 0 {
        return Err(Error::Config(
            "the loader needs at least one worker and one batch of prefetch".into(),
        ));
    }
    if c.workers > MAX_WORKERS {
        return Err(Error::Config(format!(
            "the loader runs at most {MAX_WORKERS} worker threads, not {}",
            c.workers
        )));
    }
    let (source, skipped): (Arc<dyn Source>, Vec<(String, String)>) = match &c.source {
        SourceSpec::Synthetic => {
            return Dataset::synthetic_with(c.task, image_size, classes, seed, c.augment)
        }
        SourceSpec::Folder(dir) if c.task == Task::Segment => {
            let f = Pairs::open(dir, c.skip_bad)?;
            let skipped = named(&f.skipped);
            (Arc::new(f), skipped)
        }
        SourceSpec::Folder(dir) => {
            let f = Folder::open(dir, c.skip_bad)?;
            let skipped = named(&f.skipped);
            (Arc::new(f), skipped)
        }
        SourceSpec::Slides { dir, labels, tiles } => {
            let s = Slides::open_for(c.task, dir, labels, tiles, c.skip_bad)?;
            let skipped = named(&s.skipped);
            (Arc::new(s), skipped)
        }
    };
    let split = Split {
        image_size,
        held_out: c.val,
        seed,
        skip_bad: c.skip_bad,
        transform: c.transform(true),
    };
    split.dataset(source, skipped)
}

/// Refuses a fraction to hold out outside [0, 1).
fn check_held_out(val: f64) -> Result<()> {
    if (0.0..1.0).contains(&val) {
        return Ok(());
    }
    Err(Error::Config(format!(
        "the fraction held out is in [0, 1), not {val}"
    )))
}

/// Files left out at opening, as (where, why) for messages.
fn named(skipped: &[(PathBuf, String)]) -> Vec<(String, String)> {
    skipped
        .iter()
        .map(|(p, why)| (p.display().to_string(), why.clone()))
        .collect()
}

/// Samples 0..n divided into (training, held out): each held out with probability `val`, by
/// a hash of (seed, index), so the split is the same on every rank and in every run.
fn split(n: usize, val: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    (0..n).partition(|&i| uniform(seed ^ SPLIT_STREAM, i as u64) >= val)
}

/// Positions of the epoch order to prepared, labelled inputs, for one split of a source.
pub struct Pipeline {
    source: Arc<dyn Source>,
    /// The split's samples (all the source's when `None`).
    subset: Option<Vec<usize>>,
    /// Shuffled epochs over the split (training) or its samples in order; `None` for an
    /// unbounded source, whose positions are its indices.
    order: Option<Epochs>,
    image_size: usize,
    transform: Transform,
    seed: u64,
    skip_bad: bool,
    bad: AtomicUsize,
    /// Where the last unreadable sample was, for the summary.
    last_bad: Mutex<Option<String>>,
}

impl Pipeline {
    /// All of `source` as `image_size`² inputs, in shuffled epochs (`shuffle`) or in order.
    pub fn new(
        source: Arc<dyn Source>,
        image_size: usize,
        transform: Transform,
        seed: u64,
        skip_bad: bool,
        shuffle: bool,
    ) -> Pipeline {
        let order = source.samples().map(|len| Epochs {
            len,
            seed,
            sequential: !shuffle,
        });
        Pipeline {
            source,
            subset: None,
            order,
            image_size,
            transform,
            seed,
            skip_bad,
            bad: AtomicUsize::new(0),
            last_bad: Mutex::new(None),
        }
    }

    /// The same over the source's samples `indices` only (at least one).
    pub fn subset(mut self, indices: Vec<usize>) -> Result<Pipeline> {
        if indices.is_empty() {
            return Err(Error::Config("a split needs at least one sample".into()));
        }
        if let Some(o) = &mut self.order {
            o.len = indices.len();
        }
        self.subset = Some(indices);
        Ok(self)
    }

    /// The same samples with their labels numbered as in `names`, matched by class name (a
    /// model trained on `names` scoring data whose folders list its classes in another order,
    /// or only some of them). Refuses data with a class `names` lacks.
    pub fn by_class_names(&self, names: &[String]) -> Result<Pipeline> {
        let ours = self.classes();
        let map = ours
            .iter()
            .map(|c| names.iter().position(|n| n == c).map(|i| i as u32))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| {
                let missing: Vec<&str> = ours
                    .iter()
                    .filter(|c| !names.contains(c))
                    .map(String::as_str)
                    .collect();
                Error::Config(format!(
                    "the data has classes the model was not trained on ({}); its classes are {}",
                    missing.join(", "),
                    names.join(", ")
                ))
            })?;
        let renamed = Renamed {
            inner: self.source.clone(),
            classes: names.to_vec(),
            map,
        };
        Ok(Pipeline {
            source: Arc::new(renamed),
            subset: self.subset.clone(),
            order: self.order,
            image_size: self.image_size,
            transform: self.transform,
            seed: self.seed,
            skip_bad: self.skip_bad,
            bad: AtomicUsize::new(0),
            last_bad: Mutex::new(None),
        })
    }

    /// Samples of each class in one epoch, in label order, or when segmenting labelled pixels
    /// of each class (at the source's resolution, not augmented); `None` for an unbounded
    /// stream.
    pub fn class_counts(&self) -> Result<Option<Vec<usize>>> {
        let Some(n) = self.samples() else {
            return Ok(None);
        };
        let classes = self.classes().len();
        let mut counts = vec![0; classes];
        let mut count = |label: u32| {
            let slot = counts
                .get_mut(label as usize)
                .ok_or_else(|| Error::Internal(format!("label {label} of {classes} classes")))?;
            *slot += 1;
            Ok::<_, Error>(())
        };
        for pos in 0..n as u64 {
            match self.task() {
                Task::Classify => count(self.label(pos)?)?,
                Task::Segment => {
                    if let Some(mask) = self.mask(pos)? {
                        for &label in mask.labels.iter().filter(|&&l| l != UNLABELLED) {
                            count(label)?;
                        }
                    }
                }
            }
        }
        Ok(Some(counts))
    }

    /// The classes no labelled pixel of `counts` ([`Pipeline::class_counts`] when segmenting)
    /// belongs to; refuses masks without any labelled pixel: there would be nothing to learn.
    pub fn classes_without_pixels(&self, counts: &[usize]) -> Result<Vec<String>> {
        if counts.iter().all(|&n| n == 0) {
            return Err(Error::Config(format!(
                "no pixel of the masks of the {} samples is labelled (every value is 255): \
                 there is nothing to learn",
                self.samples().unwrap_or(0)
            )));
        }
        Ok(self
            .classes()
            .iter()
            .zip(counts)
            .filter(|(_, &n)| n == 0)
            .map(|(c, _)| c.clone())
            .collect())
    }

    /// Samples in one epoch; `None` for an unbounded stream.
    pub fn samples(&self) -> Option<usize> {
        self.order.map(|o| o.len)
    }

    /// The side of the square inputs it prepares.
    pub fn image_size(&self) -> usize {
        self.image_size
    }

    /// The class names, in label order.
    pub fn classes(&self) -> &[String] {
        self.source.classes()
    }

    /// Values of one prepared input.
    pub fn sample_len(&self) -> usize {
        CHANNELS * self.image_size * self.image_size
    }

    /// The source index at position `pos`.
    pub fn index(&self, pos: u64) -> usize {
        let i = self.order.map_or(pos as usize, |o| o.sample(pos));
        self.subset.as_ref().map_or(i, |s| s[i])
    }

    /// Where the sample at position `pos` comes from (a file, a slide's tile), for reports.
    pub fn describe(&self, pos: u64) -> String {
        self.source.describe(self.index(pos))
    }

    /// Where on a slide the sample at position `pos` was cut, if it is a slide's tile.
    pub fn place(&self, pos: u64) -> Option<TilePlace<'_>> {
        self.source.place(self.index(pos))
    }

    /// The label of the sample at position `pos` of the order.
    pub fn label(&self, pos: u64) -> Result<u32> {
        self.source.label(self.index(pos))
    }

    /// Labels of positions first..first+n.
    pub fn labels(&self, first: u64, n: usize) -> Result<Vec<u32>> {
        (first..first + n as u64).map(|p| self.label(p)).collect()
    }

    /// The task its source serves.
    pub fn task(&self) -> Task {
        self.source.task()
    }

    /// Target values per sample: 1 (a class) when classifying, image_size² (a class per
    /// pixel, row-major) when segmenting.
    pub fn positions(&self) -> usize {
        match self.task() {
            Task::Classify => 1,
            Task::Segment => self.image_size * self.image_size,
        }
    }

    /// Targets of positions first..first+n: n·positions() values, UNLABELLED where a pixel
    /// has no label. A pixel's target went through exactly the window, resampling (nearest)
    /// and flips its image went through, so targets and inputs line up pixel for pixel.
    /// Reads masks only, never images; an unreadable mask with `skip_bad` is all UNLABELLED.
    pub fn targets(&self, first: u64, n: usize) -> Result<Vec<u32>> {
        if self.task() == Task::Classify {
            return self.labels(first, n);
        }
        let mut out = Vec::with_capacity(n * self.positions());
        for pos in first..first + n as u64 {
            match self.mask(pos)? {
                Some(mask) => {
                    self.transform
                        .append_mask(&mask, self.image_size, &mut self.rng(pos), &mut out)
                }
                None => out.resize(out.len() + self.positions(), UNLABELLED),
            }
        }
        Ok(out)
    }

    /// The mask of position `pos`; none when it is unreadable and `skip_bad` (warned and
    /// counted).
    fn mask(&self, pos: u64) -> Result<Option<Mask>> {
        let index = self.index(pos);
        match self.source.mask(index) {
            Ok(mask) => Ok(Some(mask)),
            Err(e) if self.skip_bad => {
                self.skipping(index, &e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Prepares the input at position `pos` into `out` and returns its label. An unreadable
    /// sample is an error, or with `skip_bad` a warning, a count, and a blank (mean) input.
    pub fn sample(&self, pos: u64, out: &mut [f32]) -> Result<u32> {
        let label = self.label(pos)?;
        match self.read(pos)? {
            Some(img) => self
                .transform
                .apply(&img, self.image_size, &mut self.rng(pos), out),
            None => out.fill(0.0),
        }
        Ok(label)
    }

    /// Positions first..first+n as one NCHW batch and its targets ([`Pipeline::targets`]).
    pub fn batch(&self, first: u64, n: usize) -> Result<(Vec<f32>, Vec<u32>)> {
        let len = self.sample_len();
        let mut pixels = Vec::new();
        let values = n.checked_mul(len);
        values
            .and_then(|v| pixels.try_reserve_exact(v).ok())
            .ok_or_else(|| {
                Error::Config(format!(
                    "a batch of {n} images of {}² is more than this machine can hold",
                    self.image_size
                ))
            })?;
        let targets = self.targets(first, n)?;
        for pos in first..first + n as u64 {
            match self.read(pos)? {
                Some(img) => {
                    self.transform
                        .append(&img, self.image_size, &mut self.rng(pos), &mut pixels)
                }
                None => pixels.resize(pixels.len() + len, 0.0),
            }
        }
        Ok((pixels, targets))
    }

    /// The decoded image at position `pos`; none when it is unreadable and `skip_bad` (warned
    /// and counted).
    fn read(&self, pos: u64) -> Result<Option<Image>> {
        let index = self.index(pos);
        match self.source.read(index) {
            Ok(img) => Ok(Some(img)),
            Err(e) if self.skip_bad => {
                self.skipping(index, &e);
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Warns of and counts unreadable sample `index`.
    fn skipping(&self, index: usize, e: &Error) {
        self.bad.fetch_add(1, Ordering::Relaxed);
        eprintln!("warning: skipping a bad sample: {e}");
        *self.last_bad.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(self.source.describe(index));
    }

    /// The random stream that augments position `pos`: it differs per position, so per epoch
    /// too.
    fn rng(&self, pos: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(splitmix64(self.seed ^ AUGMENT_STREAM ^ splitmix64(pos)))
    }

    /// Unreadable samples met so far (with `skip_bad`), and the last of them.
    pub fn bad(&self) -> (usize, Option<String>) {
        (
            self.bad.load(Ordering::Relaxed),
            self.last_bad
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// A source whose labels are renumbered to another list of class names.
struct Renamed {
    inner: Arc<dyn Source>,
    classes: Vec<String>,
    /// The new label of each of the inner source's labels.
    map: Vec<u32>,
}

impl Source for Renamed {
    fn samples(&self) -> Option<usize> {
        self.inner.samples()
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn label(&self, index: usize) -> Result<u32> {
        self.renamed(self.inner.label(index)?)
    }

    fn read(&self, index: usize) -> Result<Image> {
        self.inner.read(index)
    }

    fn describe(&self, index: usize) -> String {
        self.inner.describe(index)
    }

    fn place(&self, index: usize) -> Option<TilePlace<'_>> {
        self.inner.place(index)
    }

    fn task(&self) -> Task {
        self.inner.task()
    }

    fn mask(&self, index: usize) -> Result<Mask> {
        let mut mask = self.inner.mask(index)?;
        for label in &mut mask.labels {
            *label = self.renamed(*label)?;
        }
        Ok(mask)
    }
}

impl Renamed {
    /// `label` numbered as in the new class names; UNLABELLED stays.
    fn renamed(&self, label: u32) -> Result<u32> {
        if label == UNLABELLED {
            return Ok(label);
        }
        self.map
            .get(label as usize)
            .copied()
            .ok_or_else(|| Error::Internal(format!("label {label} of {} classes", self.map.len())))
    }
}
