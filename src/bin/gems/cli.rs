//! The command line's definitions: every command's flags, and how they read into the
//! library's types.

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use gems::backend::cuda::ConvImpl;
use gems::backend::{CopyMode, DeviceKind};
use gems::data::slide::{SlideReader, TileConfig};
use gems::data::transform::Normalize;
use gems::data::{DataConfig, SourceSpec, Task};
use gems::memory::parse_bytes;
use gems::optim::schedule::Decay;
use gems::schemes::schedule::Schedule;
use gems::schemes::{Kind, Order, Scheme};
use gems::{DType, Precision, TrainConfig};

#[derive(Parser)]
#[command(
    name = "gems",
    version,
    about = "Memory-aware model-parallel training of deep CNNs on very large images"
)]
pub struct Cli {
    /// Worker threads for the CPU backend, 1 to 1024 (default: all cores). Results do not
    /// depend on it.
    #[arg(long, global = true, value_parser = thread_count)]
    pub threads: Option<usize>,
    /// The default CPU cost model's fits: a file `gems fit-costs` wrote (this machine's
    /// refit, another machine's), instead of the ones built in (src/plan/cpu_costs.json).
    #[arg(long, global = true, value_name = "FILE")]
    pub cpu_costs: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Train a model on one device or spread over ranks by a scheme, with checkpoints.
    Train(Box<TrainArgs>),
    /// List the models with parameters, FLOPs and activation memory, or show one model's graph.
    Models(ModelsArgs),
    /// Loss and accuracy of a checkpoint on held-out images (weights unchanged, BN in eval mode).
    Eval(EvalArgs),
    /// A checkpoint's predictions for every sample of a data set: DIR/predictions.csv (each
    /// sample's class and per-class probabilities, or for segmentation the share of its
    /// pixels per class) and, segmenting, per-pixel class maps.
    Predict(PredictArgs),
    /// Write a model's weights as a plain safetensors state_dict that PyTorch loads: its
    /// initialization (--model, --image-size, --classes, --seed) or a checkpoint's.
    Export(ExportArgs),
    /// Show how a run would be split and scheduled and what each rank's memory holds (takes
    /// the flags of train).
    Plan(Box<TrainArgs>),
    /// Replay a run's schedule with predicted costs on up to --gpus GPUs of a profile: step
    /// time, images/s and weak-scaling efficiency (takes the flags of train).
    Simulate(Box<SimulateArgs>),
    /// Time every op of a model on this device at the run's micro-batch and write the profile
    /// that --calibration reads (takes the flags of train).
    Calibrate(Box<CalibrateArgs>),
    /// Fit the default CPU cost model (each op family's seconds per call, per image, per
    /// output plane, per FLOP and per byte) to calibrations of built-in models, one fit per
    /// thread count they were taken at, and write it as JSON (scripts/fit_cpu_costs.sh
    /// refreshes src/plan/cpu_costs.json).
    FitCosts(FitCostsArgs),
    /// Make and inspect data: a synthetic whole-slide image, the tiles slides yield.
    #[command(subcommand)]
    Data(DataCommand),
    /// What this machine offers: the CUDA libraries found (and where), the GPUs, the kernel
    /// cache, and what --device auto picks.
    Info,
    /// Benchmarks on a device.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Pipeline schedules as files.
    #[command(subcommand)]
    Schedule(ScheduleCommand),
}

#[derive(Subcommand)]
pub enum ScheduleCommand {
    /// Write the schedule a run would use (its order's, for its model and sizes) as JSON, one
    /// list of tasks per rank, which --schedule-file reads back (takes the flags of train).
    Export(Box<TrainArgs>),
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Every distinct convolution of a model, forward and both backwards, in TFLOP/s; ReLU and
    /// batch normalization in GB/s next to the device's copy bandwidth.
    Kernels(BenchKernelsArgs),
    /// GEMS's offload study: an epoch per model kept on the device, offloaded in each copy
    /// mode, and as --offload auto chooses under a cap 40% below the baseline's peak; and the
    /// host link's bandwidth.
    Offload(BenchOffloadArgs),
}

#[derive(Args)]
pub struct BenchOffloadArgs {
    /// Comma-separated models.
    #[arg(long, default_value = "vgg19,alexnet,resnet50,inception_v3_noaux")]
    pub models: String,
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    #[arg(long, default_value_t = 2)]
    pub classes: usize,
    /// Images per epoch (the study's data set, Hymenoptera, has 245).
    #[arg(long, default_value_t = 245)]
    pub images: usize,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[command(flatten)]
    pub on: DeviceArgs,
    /// Write the measurements to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Where a command computes.
#[derive(Args)]
pub struct DeviceArgs {
    /// auto (a GPU when one is usable and the run is f32, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// fp32; tf32 (a GPU's convolutions and matrix products on the tensor cores); bf16 or
    /// fp16: mixed precision, activations in 16 bits, f32 master weights and arithmetic (fp16
    /// with a dynamic loss scale) [default: fp32; when resuming, the checkpoint's].
    #[arg(long)]
    pub precision: Option<Precision>,
}

impl DeviceArgs {
    /// The device for a run in `dtype`: `auto` is the CPU for f64 (GPUs compute in f32 here).
    pub fn kind(&self, dtype: DType) -> anyhow::Result<DeviceKind> {
        if self.device == "auto" && dtype == DType::F64 {
            return Ok(DeviceKind::Cpu);
        }
        Ok(DeviceKind::parse(&self.device)?)
    }

    /// What sets where a resumed checkpoint's run computes (its dtype says what `auto` means).
    pub fn for_checkpoint(&self) -> anyhow::Result<impl Fn(&mut TrainConfig)> {
        let (f32_kind, f64_kind) = (self.kind(DType::F32)?, self.kind(DType::F64)?);
        let precision = self.precision;
        Ok(move |c: &mut TrainConfig| {
            c.device = match c.dtype {
                DType::F64 => f64_kind,
                _ => f32_kind,
            };
            if let Some(p) = precision {
                c.precision = p;
            }
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision.unwrap_or_default()
    }
}

#[derive(Args)]
pub struct BenchKernelsArgs {
    #[arg(long, default_value = "resnet110v2")]
    pub model: String,
    #[arg(long, default_value_t = 1024)]
    pub image_size: usize,
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[command(flatten)]
    pub on: DeviceArgs,
    /// Convolutions on a GPU: native, cudnn, cudnn-deterministic, or both (native and cudnn side
    /// by side, with their ratio).
    #[arg(long, default_value = "native")]
    pub conv: BenchConv,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 10)]
    pub repeats: usize,
    /// Write the measurements to this file as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// `--conv` of `gems bench kernels`: one convolution path, or both side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchConv {
    One(ConvImpl),
    Both,
}

impl std::str::FromStr for BenchConv {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(BenchConv::Both),
            _ => s.parse().map(BenchConv::One).map_err(|_| {
                format!("unknown convolution path '{s}' (native, cudnn, cudnn-deterministic, both)")
            }),
        }
    }
}

impl std::fmt::Display for BenchConv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchConv::One(c) => c.fmt(f),
            BenchConv::Both => f.write_str("both"),
        }
    }
}

#[derive(Subcommand)]
pub enum DataCommand {
    /// Write a synthetic pyramidal tiled TIFF slide with labelled tissue regions, and add its
    /// regions to a labels CSV file.
    MakeSlide(MakeSlideArgs),
    /// List the labelled tiles that slides:DIR yields (or export them as PNG).
    Tiles(TilesArgs),
}

#[derive(Args)]
pub struct MakeSlideArgs {
    /// The slide file to write (.tiff).
    #[arg(long)]
    pub out: PathBuf,
    /// Level-0 width in pixels.
    #[arg(long, default_value_t = 8192)]
    pub width: u32,
    /// Level-0 height [default: the width].
    #[arg(long)]
    pub height: Option<u32>,
    /// TIFF tile side (a multiple of 16).
    #[arg(long, default_value_t = 256)]
    pub tile: u32,
    /// Pyramid levels [default: halving until one tile holds the level].
    #[arg(long)]
    pub levels: Option<usize>,
    #[arg(long, default_value_t = 4)]
    pub classes: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Side of the grid cells holding one tissue region each, in level-0 pixels.
    #[arg(long, default_value_t = 1024)]
    pub region: u32,
    /// Per-pixel noise amplitude in [0, 1] (0 compresses best).
    #[arg(long, default_value_t = 0.06)]
    pub noise: f32,
    /// Write BigTIFF even when classic TIFF would do.
    #[arg(long)]
    pub bigtiff: bool,
    /// The labels CSV to add the slide's region rows to [default: labels.csv beside the slide].
    #[arg(long)]
    pub labels: Option<PathBuf>,
}

#[derive(Args)]
pub struct TilesArgs {
    /// slides:DIR
    #[arg(long)]
    pub data: DataSource,
    #[command(flatten)]
    pub slides: SlideArgs,
    /// The default tile side.
    #[arg(long, default_value_t = 256)]
    pub image_size: usize,
    /// Write every tile as DIR/<class>/<slide>_level<L>_<x>_<y>.png (a folder:DIR dataset).
    #[arg(long, value_name = "DIR")]
    pub export: Option<PathBuf>,
    /// List at most this many tiles (all are counted).
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
}

#[derive(Args)]
pub struct EvalArgs {
    /// The checkpoint to evaluate.
    #[arg(long, required_unless_present = "init", conflicts_with = "init")]
    pub checkpoint: Option<PathBuf>,
    /// Or the weights of a plain safetensors state_dict (torchvision's names, e.g. saved from
    /// PyTorch) for --model on --image-size inputs, scored on --data [default: synthetic].
    #[arg(long, value_name = "FILE")]
    pub init: Option<PathBuf>,
    /// The model of --init's weights.
    #[arg(long, requires = "init", default_value = "resnet20v2")]
    pub model: String,
    /// The input side --init's model runs at.
    #[arg(long, requires = "init", default_value_t = 32)]
    pub image_size: usize,
    /// Classes of --init's model when the data does not name them (synthetic data).
    #[arg(long, requires = "init")]
    pub classes: Option<usize>,
    /// How --init's weights expect images scaled: imagenet, unit, none or
    /// MEAN,MEAN,MEAN/STD,STD,STD, as `gems train --normalize` (a checkpoint records its own).
    #[arg(
        long,
        requires = "init",
        default_value = "imagenet",
        value_name = "HOW"
    )]
    pub normalize: Normalize,
    /// For --init's weights: resample whole images to --image-size instead of cutting their
    /// centred square, as `gems train --resize` (a checkpoint records its own).
    #[arg(long, requires = "init")]
    pub resize: bool,
    /// f32 or f64: the parameters' dtype to evaluate in, the weights converted (16-bit
    /// activations: --precision) [default: the checkpoint's; f32 for --init].
    #[arg(long, value_parser = parameter_dtype)]
    pub dtype: Option<DType>,
    /// Evaluate on every sample of this data (synthetic, folder:DIR or slides:DIR) instead
    /// of the checkpoint's held-out split.
    #[arg(long)]
    pub data: Option<DataSource>,
    #[command(flatten)]
    pub slides: SlideArgs,
    /// At most this many samples [default: all; 1000 of synthetic data].
    #[arg(long)]
    pub samples: Option<usize>,
    /// Write each sample's result to this CSV file: sample, true class, predicted class, loss.
    #[arg(long, value_name = "FILE.csv")]
    pub per_sample: Option<PathBuf>,
    /// For slides: write into this folder each slide's predictions stitched into a map (a
    /// PNG of the slide with the classes' colours over it, a tiled TIFF of the colours) and
    /// tiles.csv (each tile's place, classes, loss and per-class scores).
    #[arg(long, value_name = "DIR")]
    pub predictions: Option<PathBuf>,
    /// The slides' pyramid level the maps are drawn at [default: the finest whose longer side
    /// is at most 2048 pixels].
    #[arg(long, requires = "predictions")]
    pub map_level: Option<usize>,
    #[arg(long, default_value_t = 50)]
    pub batch_size: usize,
    /// Each class's weight in the reported loss, in class order [default: the checkpoint's;
    /// all 1 for --init].
    #[arg(long, value_delimiter = ',')]
    pub class_weights: Option<Vec<f64>>,
    /// Leave unreadable samples out with a warning instead of stopping.
    #[arg(long)]
    pub skip_bad: bool,
    #[command(flatten)]
    pub on: DeviceArgs,
    /// Each sample split into an RxC grid of tiles, one rank (a thread of this process) each:
    /// the same numbers as one device, each rank holding about 1/(R·C) of the activations
    /// (a U-Net is tiled from its input to its logits and scored on tiles).
    #[arg(long, default_value = "1x1", value_name = "RxC")]
    pub spatial: gems::ops::tiles::Grid,
    /// native, cudnn or cudnn-deterministic convolutions (GPU).
    #[arg(long, default_value = "native")]
    pub conv: ConvImpl,
}

#[derive(Args)]
pub struct PredictArgs {
    /// The checkpoint to predict with.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: PathBuf,
    /// The samples to predict (synthetic, folder:DIR or slides:DIR), in the data's order.
    #[arg(long)]
    pub data: DataSource,
    /// f32 or f64: the parameters' dtype to predict in, the weights converted (16-bit
    /// activations: --precision) [default: the checkpoint's].
    #[arg(long, value_parser = parameter_dtype)]
    pub dtype: Option<DType>,
    #[command(flatten)]
    pub slides: SlideArgs,
    /// The folder to write predictions.csv (and segmentation maps) into; made if missing.
    /// With slides:DIR and no --labels, a U-Net segments each whole slide at --level in
    /// windows --stride apart (default 512) with --margin of context, writing
    /// <slide>.classes.tiff (a pyramidal TIFF of class numbers, 255 for background; near-white
    /// window centres above --tissue, default 0.8, are background), <slide>.classes.png (an
    /// overview: the slide under the classes' colours) and classes.csv.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Whole slides: pixels of context around each window's kept centre, a multiple of
    /// 2^depth [default: the model's receptive radius rounded up to one].
    #[arg(long)]
    pub margin: Option<u32>,
    /// At most this many samples [default: all; 1000 of synthetic data].
    #[arg(long)]
    pub samples: Option<usize>,
    /// For slides: the pyramid level the maps are drawn at [default: the finest whose longer
    /// side is at most 2048 pixels].
    #[arg(long)]
    pub map_level: Option<usize>,
    /// Images per micro-batch, halved while one does not fit --device-memory [default: the
    /// checkpoint's batch size].
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Device capacity, e.g. 2GiB (emulated on the CPU; default unlimited / the free memory).
    #[arg(long, value_parser = parse_bytes)]
    pub device_memory: Option<u64>,
    /// Leave unreadable samples out with a warning instead of stopping.
    #[arg(long)]
    pub skip_bad: bool,
    #[command(flatten)]
    pub on: DeviceArgs,
    /// Each sample split into an RxC grid of tiles, one rank (a thread of this process) each:
    /// the same numbers as one device, each rank holding about 1/(R·C) of the activations
    /// (a U-Net is tiled from its input to its logits and scored on tiles).
    #[arg(long, default_value = "1x1", value_name = "RxC")]
    pub spatial: gems::ops::tiles::Grid,
    /// native, cudnn or cudnn-deterministic convolutions (GPU).
    #[arg(long, default_value = "native")]
    pub conv: ConvImpl,
}

#[derive(Args)]
pub struct ExportArgs {
    /// The file to write (safetensors).
    #[arg(long, value_name = "FILE.safetensors")]
    pub out: PathBuf,
    /// The checkpoint whose weights to write [default: the model's initialization].
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    #[arg(long, default_value = "resnet20v2", conflicts_with = "checkpoint")]
    pub model: String,
    #[arg(long, default_value_t = 32, conflicts_with = "checkpoint")]
    pub image_size: usize,
    #[arg(long, default_value_t = 10, conflicts_with = "checkpoint")]
    pub classes: usize,
    /// The initialization's seed (as `gems train --seed`).
    #[arg(long, default_value_t = 0, conflicts_with = "checkpoint")]
    pub seed: u64,
}

/// `--offload`.
#[derive(Clone, Debug, PartialEq)]
pub enum Offload {
    None,
    All,
    Recompute,
    Auto,
    File(PathBuf),
}

impl std::str::FromStr for Offload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "none" => Offload::None,
            "all" => Offload::All,
            "recompute" => Offload::Recompute,
            "auto" => Offload::Auto,
            // A word that names no file is a mistyped policy, not a missing file.
            file if Path::new(file).exists() || file.ends_with(".json") => {
                Offload::File(file.into())
            }
            other => {
                return Err(format!(
                    "'{other}' is not none, all, recompute, auto, or an existing policy file"
                ))
            }
        })
    }
}

/// `--data`: synthetic, folder:DIR or slides:DIR.
#[derive(Clone, Debug)]
pub enum DataSource {
    Synthetic,
    Folder(PathBuf),
    Slides(PathBuf),
}

impl DataSource {
    /// The `--data` value that names `spec`.
    pub fn of(spec: &SourceSpec) -> DataSource {
        match spec {
            SourceSpec::Synthetic => DataSource::Synthetic,
            SourceSpec::Folder(dir) => DataSource::Folder(dir.clone()),
            SourceSpec::Slides { dir, .. } => DataSource::Slides(dir.clone()),
        }
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataSource::Synthetic => write!(f, "synthetic"),
            DataSource::Folder(dir) => write!(f, "folder:{}", dir.display()),
            DataSource::Slides(dir) => write!(f, "slides:{}", dir.display()),
        }
    }
}

impl std::str::FromStr for DataSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            _ if s == "synthetic" => Ok(DataSource::Synthetic),
            Some(("folder", dir)) if !dir.is_empty() => Ok(DataSource::Folder(dir.into())),
            Some(("slides", dir)) if !dir.is_empty() => Ok(DataSource::Slides(dir.into())),
            _ => Err(format!(
                "unknown data source {s:?}: use synthetic, folder:DIR or slides:DIR"
            )),
        }
    }
}

/// How slides:DIR is cut into labelled tiles.
#[derive(Args)]
pub struct SlideArgs {
    /// Labels for slides:DIR: rows `slide,label` (whole slides) or `slide,x,y,w,h,label`
    /// (regions in level-0 pixels; a tile takes the region holding its centre).
    #[arg(long, value_name = "FILE.csv")]
    pub labels: Option<PathBuf>,
    /// Pyramid level to cut tiles from (0: full resolution).
    #[arg(long, default_value_t = 0)]
    pub level: usize,
    /// Tile side in pixels of that level [default: --image-size].
    #[arg(long)]
    pub tile_size: Option<u32>,
    /// Distance between neighbouring tiles [default: the tile side].
    #[arg(long)]
    pub stride: Option<u32>,
    /// Leave out near-white tiles whose mean brightness (0 to 1) is above this; 0.8 suits
    /// bright-field slides.
    #[arg(long, value_name = "BRIGHTNESS", value_parser = brightness)]
    pub tissue: Option<f32>,
    /// What reads slides: auto (gems' own reader for .tif/.tiff/.svs, OpenSlide for the other
    /// formats when libopenslide loads), openslide (libopenslide for all), or gems.
    #[arg(long, value_name = "READER", default_value = "auto")]
    pub slide_reader: SlideReader,
}

/// A number of threads: 1 to 1024 (more would only cost memory and start-up time).
fn thread_count(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(format!("a thread count is 1 to 1024, not {s}")),
    }
}

/// A mean brightness: a number from 0 (black) to 1 (white).
fn brightness(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(b) if (0.0..=1.0).contains(&b) => Ok(b),
        _ => Err(format!("a brightness is a number from 0 to 1, not {s}")),
    }
}

impl SlideArgs {
    /// The source `data` names, cut into tiles of `image_size` unless told otherwise.
    /// Opens slides with --slide-reader from now on.
    pub fn spec(&self, data: &DataSource, image_size: usize) -> anyhow::Result<SourceSpec> {
        gems::data::slide::use_reader(self.slide_reader);
        let tiling = [
            ("--labels", self.labels.is_some()),
            ("--level", self.level != 0),
            ("--tile-size", self.tile_size.is_some()),
            ("--stride", self.stride.is_some()),
            ("--tissue", self.tissue.is_some()),
        ];
        if let Some((flag, _)) = tiling.iter().find(|(_, given)| *given) {
            if !matches!(data, DataSource::Slides(_)) {
                anyhow::bail!("{flag} cuts slides into tiles: it needs --data slides:DIR");
            }
        }
        Ok(match data {
            DataSource::Synthetic => SourceSpec::Synthetic,
            DataSource::Folder(dir) => SourceSpec::Folder(dir.clone()),
            DataSource::Slides(dir) => {
                let labels = self
                    .labels
                    .clone()
                    .ok_or_else(|| anyhow::anyhow!("slides:DIR needs --labels FILE.csv"))?;
                let tile = self.tile_size.unwrap_or(image_size as u32);
                SourceSpec::Slides {
                    dir: dir.clone(),
                    labels,
                    tiles: TileConfig {
                        level: self.level,
                        tile,
                        stride: self.stride.unwrap_or(tile),
                        tissue_threshold: self.tissue,
                    },
                }
            }
        })
    }
}

/// Where training images come from and how they are read.
#[derive(Args)]
pub struct DataArgs {
    /// synthetic, folder:DIR (one sub-folder of PNG/JPEG/TIFF images per class), or
    /// slides:DIR (tiled TIFF slides, with --labels).
    #[arg(long, default_value = "synthetic")]
    pub data: DataSource,
    #[command(flatten)]
    pub slides: SlideArgs,
    /// Random crops and horizontal/vertical flips of training images.
    #[arg(long)]
    pub augment: bool,
    /// How decoded images' 0–255 values are scaled for the model: imagenet (divided by 255,
    /// then ImageNet's mean 0.485,0.456,0.406 subtracted and its standard deviation
    /// 0.229,0.224,0.225 divided by, as torchvision's pretrained models expect), unit (divided
    /// by 255 only: planes in [0, 1], as milesial's U-Net), none (the 0–255 values as they
    /// are), or MEAN,MEAN,MEAN/STD,STD,STD per channel (R, G, B) on the [0, 1] scale.
    /// Recorded in checkpoints; eval and predict use it. Synthetic data is generated
    /// centred and ignores it.
    #[arg(long, default_value = "imagenet", value_name = "HOW")]
    pub normalize: Normalize,
    /// Resample a whole image that is not of --image-size to it (both sides, so a non-square
    /// image is stretched; masks by nearest pixel) instead of cutting its centred largest
    /// square. Recorded in checkpoints; eval and predict use it.
    #[arg(long)]
    pub resize: bool,
    /// Hold out this fraction of the samples and report loss and accuracy on them at the end
    /// (and every --val-every steps).
    #[arg(long, default_value_t = 0.0)]
    pub val: f64,
    #[arg(long, value_name = "N")]
    pub val_every: Option<usize>,
    /// Leave unreadable samples out with a warning (counted in the summary) instead of stopping.
    #[arg(long)]
    pub skip_bad: bool,
    /// Loader threads preparing batches ahead of training (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = thread_count)]
    pub workers: usize,
    /// Batches prepared ahead at most.
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,
    /// Segmenting: train even when a class has no labelled pixel in the training masks (a
    /// warning names it) instead of refusing.
    #[arg(long)]
    pub allow_empty_class: bool,
}

impl DataArgs {
    /// The data for a model of `image_size`² inputs that serves `task`.
    pub fn config(&self, image_size: usize, task: Task) -> anyhow::Result<DataConfig> {
        Ok(DataConfig {
            source: self.slides.spec(&self.data, image_size)?,
            augment: self.augment,
            val: self.val,
            skip_bad: self.skip_bad,
            workers: self.workers,
            prefetch: self.prefetch,
            task,
            normalize: self.normalize,
            resize: self.resize,
        })
    }
}

#[derive(Args)]
pub struct TrainArgs {
    #[arg(long, default_value = "resnet20v2")]
    pub model: String,
    /// Image side in pixels (square RGB images).
    #[arg(long, default_value_t = 32)]
    pub image_size: usize,
    /// Classes [default: the data's; 10 for synthetic data].
    #[arg(long)]
    pub classes: Option<usize>,
    /// Images per replica pass, or `max`: the largest that fits --device-memory [default: 32;
    /// when resuming, the checkpoint's].
    #[arg(long)]
    pub batch_size: Option<Choice>,
    /// Total optimizer steps [default: 150; when resuming, the checkpoint's total].
    #[arg(long)]
    pub steps: Option<usize>,
    /// Base learning rate.
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    pub lr: f64,
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    pub momentum: f64,
    #[arg(long, default_value_t = 5e-4, allow_negative_numbers = true)]
    pub weight_decay: f64,
    #[arg(long)]
    pub nesterov: bool,
    /// sgd (with --momentum, --nesterov), adam, or adamw; all take --weight-decay (Adam's is
    /// an L2 term on the gradient, AdamW's shrinks the weights by 1 - lr·wd).
    #[arg(long, default_value = "sgd", value_parser = ["sgd", "adam", "adamw"])]
    pub optimizer: String,
    /// Adam's and AdamW's decay rates of the moment estimates, BETA1,BETA2.
    #[arg(
        long,
        default_value = "0.9,0.999",
        value_parser = betas,
        allow_hyphen_values = true
    )]
    pub betas: (f64, f64),
    /// Adam's and AdamW's epsilon, added to the square root of the second moment.
    #[arg(long, default_value_t = 1e-8, allow_negative_numbers = true)]
    pub eps: f64,
    /// Clips the gradients to this global L2 norm over the whole model
    /// (torch.nn.utils.clip_grad_norm_) before each step.
    #[arg(long, allow_negative_numbers = true)]
    pub clip_grad_norm: Option<f64>,
    /// No weight decay on norm layers' weights and biases, nor on any bias.
    #[arg(long)]
    pub no_decay_norm_bias: bool,
    /// constant, cosine, or step:EVERY:GAMMA.
    #[arg(long, default_value = "cosine")]
    pub schedule: Decay,
    /// Steps of linear learning-rate warm-up [default: 10, or the whole run if shorter].
    #[arg(long)]
    pub warmup: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// f32 or f64 (of the parameters; --precision sets the activations').
    #[arg(long, default_value = "f32", value_parser = parameter_dtype)]
    pub dtype: DType,
    /// With --precision fp16: the first loss scale (a power of two; halved when gradients
    /// overflow, the step skipped; doubled after 2000 clean steps).
    #[arg(long, default_value_t = 65536.0, allow_negative_numbers = true)]
    pub loss_scale: f64,
    /// Each class's weight in the loss, in class order, e.g. 0.2,1,1 (PyTorch's
    /// CrossEntropyLoss(weight=)) [default: all 1].
    #[arg(long, value_delimiter = ',')]
    pub class_weights: Option<Vec<f64>>,
    /// How per-pixel losses make a step's loss: sample-mean (the mean over the step's images
    /// of each image's weighted mean over its labelled pixels) or pytorch (the weighted sum
    /// over all the step's labelled pixels divided by their total weight, as
    /// CrossEntropyLoss(weight=, ignore_index=255)). A classifier's class weights count only
    /// under pytorch (sample-mean weighs each image's one label by itself).
    #[arg(long, default_value = "sample-mean")]
    pub loss_reduction: gems::ops::loss::Reduction,
    /// Device capacity, e.g. 2GiB (emulated on the CPU; on a GPU the smaller of this and its
    /// free memory; default unlimited / the free memory).
    #[arg(long, value_parser = parse_bytes)]
    pub device_memory: Option<u64>,
    #[command(flatten)]
    pub on: DeviceArgs,
    /// Convolutions on a GPU: native (the handwritten kernels), cudnn (cuDNN 9, each shape's
    /// algorithms timed once and reported at the end) or cudnn-deterministic (its
    /// deterministic algorithms only: bit-identical results run after run).
    #[arg(long, default_value = "native")]
    pub conv: ConvImpl,
    /// Write one JSON line per step to this file.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Folder to write checkpoints into (step-NNNNNN.safetensors and the run's manifest
    /// gems-run.json), every --checkpoint-every steps and at the end. A folder holding another
    /// run's checkpoints is refused unless --resume names one of them or --overwrite is given.
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    #[arg(long, value_name = "N", requires = "checkpoint")]
    pub checkpoint_every: Option<usize>,
    /// Keep only the newest N checkpoints of this run in the folder.
    #[arg(long, value_name = "N", requires = "checkpoint")]
    pub keep_last: Option<usize>,
    /// Remove another run's checkpoints from the --checkpoint folder instead of refusing it.
    #[arg(long, requires = "checkpoint")]
    pub overwrite: bool,
    /// Continue from a checkpoint: model, data, optimizer and schedule come from it (their
    /// flags may repeat the checkpoint's values, not change them).
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
    /// Start from the weights of a plain safetensors state_dict (torchvision's names, e.g.
    /// saved from PyTorch or by `gems export`) instead of the model's initialization.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Where saved activations wait for backward: none (on the device), all (in the host
    /// tier), recompute (checkpointing: runs of √nodes recomputed in backward), auto (the planner's choice to fit
    /// --device-memory with the least exposed time), or a policy file (JSON).
    #[arg(long, default_value = "none")]
    pub offload: Offload,
    /// Nodes ahead of backward that offloaded activations are brought back.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub offload_ahead: usize,
    /// Capacity of the host tier offloaded activations wait in, e.g. 64GiB (default unlimited).
    #[arg(long, value_parser = parse_bytes)]
    pub host_memory: Option<u64>,
    /// How offloaded activations travel: naive (pageable, blocking), pinned (pinned pool,
    /// blocking), async (pageable, copy stream) or pinned-async (pinned pool, copy stream,
    /// events). On the CPU every mode is a memory copy.
    #[arg(long, default_value = "pinned-async")]
    pub offload_copy: CopyMode,
    #[command(flatten)]
    pub input: DataArgs,
    #[command(flatten)]
    pub spread: SchemeArgs,
    /// Draw the schedule as SVG: predicted (plan) or the last step as measured (train, with
    /// a --scheme).
    #[arg(long, value_name = "FILE.svg")]
    pub timeline: Option<PathBuf>,
    /// A profile from `gems calibrate`: measured op times to split and schedule with.
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Plan: also train this many steps on local ranks (of each order, with --order all) and
    /// print the measured step (the median after the first).
    #[arg(long, value_name = "STEPS")]
    pub measure: Option<usize>,
    /// The flags given on the command line (clap's ids), to tell a value repeated from a
    /// checkpoint's apart from a default.
    #[arg(skip)]
    pub given: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    Local,
    Mpi,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Local => "threads",
            Transport::Mpi => "MPI processes",
        })
    }
}

#[derive(Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Where to write the profile (JSON).
    #[arg(long)]
    pub out: PathBuf,
    /// Timed runs per op (the median is kept).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
}

#[derive(Args)]
pub struct FitCostsArgs {
    /// Calibration profiles (`gems calibrate --out`) of built-in models on CPU ranks.
    #[arg(required = true)]
    pub profiles: Vec<PathBuf>,
    /// Where to write the fits (JSON).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Largest GPU count to simulate (P, 2P, 4P, … GPUs: D = 1, 2, 4, … groups).
    #[arg(long, default_value_t = 1024)]
    pub gpus: usize,
    /// Machine: v100-ib (LLNL Lassen), h100-nvlink-ib, or cpu.
    #[arg(long, default_value = "v100-ib")]
    pub profile: gems::plan::simulate::Profile,
}

/// A number, or a choice left to the planner (`auto`, or `max` for a batch size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Fixed(usize),
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "max" => Ok(Choice::Auto),
            n => n
                .parse()
                .map(Choice::Fixed)
                .map_err(|_| format!("'{s}' is not a number, auto or max")),
        }
    }
}

/// A grid of tiles, or a choice left to the planner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiling {
    Auto,
    Grid(gems::ops::tiles::Grid),
}

impl std::str::FromStr for Tiling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Tiling::Auto),
            grid => grid.parse().map(Tiling::Grid),
        }
    }
}

/// How a run is spread over ranks (see DESIGN.md for the schemes).
#[derive(Args)]
pub struct SchemeArgs {
    /// single, dp, mp, mast or master.
    #[arg(long, default_value = "single")]
    pub scheme: Kind,
    /// P: pipeline stages, or `auto`: the fewest whose plan fits --device-memory.
    #[arg(long, default_value = "1")]
    pub split: Choice,
    /// m: micro-batches per replica pass (--batch-size is split into these).
    #[arg(long, default_value_t = 1)]
    pub parts: usize,
    /// η: replicas per step [default: 2 for mast, 4 for master (an even η > 2), 1 otherwise],
    /// or `auto`: MAST's pair where --device-memory holds it (overlapped, else one replica's
    /// activations at a time), else one replica.
    #[arg(long)]
    pub replicas: Option<Choice>,
    /// D: data-parallel groups.
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// Spatial parallelism: each sample of the first stage split into an RxC grid of tiles
    /// (e.g. 2x2), one rank each, exactly as one device computes it (halo exchange, batch norm
    /// over the whole map; a U-Net's decoder and per-pixel loss on tiles too); with mast or
    /// master the mirrored replica's first stage too. `auto`:
    /// of the grids (the squarest of each tile count) whose plan fits --device-memory, the one
    /// with the least predicted step (halo exchanges and statistics' sums counted).
    #[arg(long, default_value = "1x1", value_name = "RxC")]
    pub spatial: Tiling,
    /// World size; must be the scheme's (checked; the default is the scheme's: P·D ranks, with
    /// R·C for each stage position that runs on tiles).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Pipeline order: gpipe, 1f1b, interleaved (V model chunks per rank, Megatron's order),
    /// zbh1 (zero-bubble: backward split into B and W, 1F1B's memory) or zbv (zero-bubble, two
    /// chunks per rank in a V); `all` (plan only) compares every order that fits the scheme.
    #[arg(long, default_value = "gpipe")]
    pub order: OrderChoice,
    /// V: model chunks per rank under --order interleaved (the model is split into P·V stages).
    #[arg(long, default_value_t = 2, value_name = "V")]
    pub virtual_stages: usize,
    /// Run the tasks a schedule file lists (JSON, as `gems schedule export` writes it) instead
    /// of the order's; P, m and η come from the file unless given.
    #[arg(long, value_name = "FILE.json")]
    pub schedule_file: Option<PathBuf>,
    /// Segments (pieces between cut points) per stage, e.g. 10,12; balanced by cost if absent.
    #[arg(long, value_delimiter = ',')]
    pub balance: Option<Vec<usize>>,
    /// How ranks talk: local (threads of this process) or mpi (one process per rank under mpirun).
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub transport: Transport,
    /// Bound by count: at most this many micro-batches' activations per rank at once (m: MAST
    /// one replica's activations at a time). Without it, under --device-memory a replica's
    /// next forward starts when the rank's free bytes hold it.
    #[arg(long)]
    pub max_in_flight: Option<usize>,
}

/// `--order`: one order, or every order (compared by `gems plan`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderChoice {
    One(Order),
    All,
}

impl std::str::FromStr for OrderChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(OrderChoice::All),
            _ => Ok(OrderChoice::One(s.parse()?)),
        }
    }
}

impl SchemeArgs {
    /// The schedule file's tasks, where one is given.
    pub fn schedule(&self) -> anyhow::Result<Option<Schedule>> {
        let Some(path) = &self.schedule_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        Schedule::from_json(&text)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
    }

    pub fn scheme(&self) -> anyhow::Result<Scheme> {
        let file = self.schedule()?;
        let replicas = match (self.replicas, &file) {
            (Some(Choice::Fixed(n)), _) => n,
            (_, Some(f)) => f.replicas,
            _ if self.scheme == Kind::Mast => 2,
            _ if self.scheme == Kind::Master => 4,
            _ => 1,
        };
        // `auto` is resolved against memory later, from one stage up; a schedule file gives
        // the sizes the flags leave at their defaults.
        let stages = match (self.split, &file) {
            (Choice::Fixed(1), Some(f)) => f.stages,
            (Choice::Fixed(p), _) => p,
            (Choice::Auto, _) => 1,
        };
        let parts = match &file {
            Some(f) if self.parts == 1 => f.micro_batches,
            _ => self.parts,
        };
        // A schedule file places its stages as its order does, unless --order says otherwise.
        let (order, virtual_stages) = match (self.order, &file) {
            (OrderChoice::One(Order::GPipe), Some(f)) => (f.placement, f.virtual_stages),
            (OrderChoice::One(o), _) => (o, self.virtual_stages),
            (OrderChoice::All, _) => (Order::GPipe, self.virtual_stages),
        };
        let s = Scheme::new(self.scheme, stages, parts, replicas, self.dp, order)
            .with_virtual_stages(virtual_stages)
            .with_spatial(match self.spatial {
                Tiling::Grid(grid) => grid,
                // Resolved against memory later, from no split up.
                Tiling::Auto => gems::ops::tiles::Grid::ONE,
            });
        if let Some(n) = self.ranks {
            if n != s.world() && !s.spatial.is_split() {
                anyhow::bail!(
                    "--ranks {n} is not P·D = {}·{} = {}",
                    s.stages,
                    s.dp,
                    s.world()
                );
            }
            if n != s.world() {
                anyhow::bail!(
                    "--ranks {n} is not the scheme's {}: {} per group (R·C = {} at each position \
                     that runs on tiles) × D = {}",
                    s.world(),
                    s.group_size(),
                    s.spatial.tiles(),
                    s.dp,
                );
            }
        }
        Ok(s)
    }
}

#[derive(Args)]
pub struct ModelsArgs {
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Bytes per element for activation sizes: f32, f64, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: DType,
    /// Print this model's block tree and adjacency list.
    #[arg(long, value_name = "NAME")]
    pub graph: Option<String>,
    /// Also show the largest training batch predicted to fit this much device memory.
    #[arg(long, value_parser = parse_bytes)]
    pub device_memory: Option<u64>,
}
/// Adam's betas: two numbers, `BETA1,BETA2` (their range is checked with the other
/// hyper-parameters).
pub fn betas(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("--betas takes two numbers BETA1,BETA2 such as 0.9,0.999, not '{s}'");
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    Ok((
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    ))
}

/// A parameter dtype: f32 or f64 (16-bit types hold activations, chosen by --precision).
pub fn parameter_dtype(s: &str) -> Result<DType, String> {
    match s.parse()? {
        d @ (DType::F32 | DType::F64) => Ok(d),
        d => Err(format!(
            "{} parameters are not supported: parameters are f32 or f64; for 16-bit \
             activations use --precision {}",
            d.name(),
            if d == DType::BF16 { "bf16" } else { "fp16" }
        )),
    }
}

/// An error in the command line's words: where a plan does not fit, what would fit is said as
/// the flag that asks for it.
pub fn explain(e: &anyhow::Error) -> String {
    let message = e.to_string();
    if let Some(gems::Error::FolderInUse {
        dir,
        checkpoints,
        first,
        last,
    }) = e.downcast_ref::<gems::Error>()
    {
        return format!(
            "{} holds {checkpoints} checkpoint(s) of another run ({first} … {last}): --resume one \
             of them, choose another --checkpoint folder, or pass --overwrite to remove them",
            dir.display()
        );
    }
    let Some(gems::Error::DoesNotFit { what_fits, .. }) = e.downcast_ref::<gems::Error>() else {
        return message;
    };
    let flag = match what_fits {
        gems::WhatFits::Batch(b) => format!("--batch-size {b} fits"),
        gems::WhatFits::Stages(p) => format!("--split {p} fits"),
        gems::WhatFits::Nothing => return message,
    };
    match message.strip_suffix(&what_fits.to_string()) {
        Some(head) => format!("{head}{flag}"),
        None => message,
    }
}
