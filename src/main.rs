//! The `gems` command line.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use gems::backend::cuda::{self, ConvImpl};
use gems::backend::{CopyMode, DeviceKind};
use gems::data::slide::TileConfig;
use gems::data::{DataConfig, SourceSpec};
use gems::graph::policy::{Keep, SavePolicy};
use gems::memory::{human_bytes, parse_bytes, Category};
use gems::plan::memory;
use gems::plan::offload::HostLink;
use gems::runtime::executor::{run_rank, Layout, RankReport, RunConfig};
use gems::optim::SgdConfig;
use gems::optim::schedule::{Decay, LrSchedule};
use gems::schemes::{Kind, Order, Scheme};
use gems::train::{Evaluation, StepReport, TrainConfig, Trainer};
use gems::{models, DType, Precision};

#[derive(Parser)]
#[command(
    name = "gems",
    version,
    about = "Memory-aware model-parallel training of deep CNNs on very large images"
)]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model on one device.
    Train(Box<TrainArgs>),
    /// List the models with parameters, FLOPs and activation memory, or show one model's graph.
    Models(ModelsArgs),
    /// Loss and accuracy of a checkpoint on held-out images (weights unchanged, BN in eval mode).
    Eval(EvalArgs),
    /// Show how a run would be split and scheduled and what each rank's memory holds (takes
    /// the flags of train).
    Plan(Box<TrainArgs>),
    /// Replay a run's schedule with predicted costs on up to --gpus GPUs of a profile: step
    /// time, images/s and weak-scaling efficiency (takes the flags of train).
    Simulate(Box<SimulateArgs>),
    /// Time every op of a model on this device at the run's micro-batch and write the profile
    /// that --calibration reads (takes the flags of train).
    Calibrate(Box<CalibrateArgs>),
    /// Make and inspect data: a synthetic whole-slide image, the tiles slides yield.
    #[command(subcommand)]
    Data(DataCommand),
    /// What this machine offers: the CUDA libraries found (and where), the GPUs, the kernel
    /// cache, and what --device auto picks.
    Info,
    /// Benchmarks on a device.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Every distinct convolution of a model, forward and both backwards, in TFLOP/s; ReLU and
    /// batch normalization in GB/s next to the device's copy bandwidth.
    Kernels(BenchKernelsArgs),
    /// GEMS's offload study: an epoch per model kept on the device, offloaded in each copy
    /// mode, and as --offload auto chooses under a cap 40% below the baseline's peak; and the
    /// host link's bandwidth.
    Offload(BenchOffloadArgs),
}

#[derive(Args)]
struct BenchOffloadArgs {
    /// Comma-separated models.
    #[arg(long, default_value = "vgg19,alexnet,resnet50,inception_v3_noaux")]
    models: String,
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    #[arg(long, default_value_t = 2)]
    classes: usize,
    /// Images per epoch (the study's data set, Hymenoptera, has 245).
    #[arg(long, default_value_t = 245)]
    images: usize,
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[command(flatten)]
    on: DeviceArgs,
    /// Write the measurements to this file as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// Where a command computes.
#[derive(Args)]
struct DeviceArgs {
    /// auto (a GPU when one is usable and the run is f32, else the CPU), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// fp32; tf32 (a GPU's convolutions and matrix products on the tensor cores); bf16 or
    /// fp16: mixed precision, activations in 16 bits, f32 master weights and arithmetic (fp16
    /// with a dynamic loss scale) [default: fp32; when resuming, the checkpoint's].
    #[arg(long)]
    precision: Option<Precision>,
}

impl DeviceArgs {
    /// The device for a run in `dtype`: `auto` is the CPU for f64 (GPUs compute in f32 here).
    fn kind(&self, dtype: DType) -> anyhow::Result<DeviceKind> {
        if self.device == "auto" && dtype == DType::F64 {
            return Ok(DeviceKind::Cpu);
        }
        Ok(DeviceKind::parse(&self.device)?)
    }

    /// What sets where a resumed checkpoint's run computes (its dtype says what `auto` means).
    fn for_checkpoint(&self) -> anyhow::Result<impl Fn(&mut TrainConfig)> {
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

    fn precision(&self) -> Precision {
        self.precision.unwrap_or_default()
    }
}

#[derive(Args)]
struct BenchKernelsArgs {
    #[arg(long, default_value = "resnet110v2")]
    model: String,
    #[arg(long, default_value_t = 1024)]
    image_size: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    #[command(flatten)]
    on: DeviceArgs,
    /// Convolutions on a GPU: native, cudnn, or both (side by side, with their ratio).
    #[arg(long, default_value = "native")]
    conv: BenchConv,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 10)]
    repeats: usize,
    /// Write the measurements to this file as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// `--conv` of `gems bench kernels`: one convolution path, or both side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BenchConv {
    One(ConvImpl),
    Both,
}

impl std::str::FromStr for BenchConv {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" => Ok(BenchConv::Both),
            _ => s
                .parse()
                .map(BenchConv::One)
                .map_err(|_| format!("unknown convolution path '{s}' (native, cudnn, both)")),
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
enum DataCommand {
    /// Write a synthetic pyramidal tiled TIFF slide with labelled tissue regions, and add its
    /// regions to a labels CSV file.
    MakeSlide(MakeSlideArgs),
    /// List the labelled tiles that slides:DIR yields (or export them as PNG).
    Tiles(TilesArgs),
}

#[derive(Args)]
struct MakeSlideArgs {
    /// The slide file to write (.tiff).
    #[arg(long)]
    out: PathBuf,
    /// Level-0 width in pixels.
    #[arg(long, default_value_t = 8192)]
    width: u32,
    /// Level-0 height [default: the width].
    #[arg(long)]
    height: Option<u32>,
    /// TIFF tile side (a multiple of 16).
    #[arg(long, default_value_t = 256)]
    tile: u32,
    /// Pyramid levels [default: halving until one tile holds the level].
    #[arg(long)]
    levels: Option<usize>,
    #[arg(long, default_value_t = 4)]
    classes: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Side of the grid cells holding one tissue region each, in level-0 pixels.
    #[arg(long, default_value_t = 1024)]
    region: u32,
    /// Per-pixel noise amplitude in [0, 1] (0 compresses best).
    #[arg(long, default_value_t = 0.06)]
    noise: f32,
    /// Write BigTIFF even when classic TIFF would do.
    #[arg(long)]
    bigtiff: bool,
    /// The labels CSV to add the slide's region rows to [default: labels.csv beside the slide].
    #[arg(long)]
    labels: Option<PathBuf>,
}

#[derive(Args)]
struct TilesArgs {
    /// slides:DIR
    #[arg(long)]
    data: DataSource,
    #[command(flatten)]
    slides: SlideArgs,
    /// The default tile side.
    #[arg(long, default_value_t = 256)]
    image_size: usize,
    /// Write every tile as DIR/<class>/<slide>_level<L>_<x>_<y>.png (a folder:DIR dataset).
    #[arg(long, value_name = "DIR")]
    export: Option<PathBuf>,
    /// List at most this many tiles (all are counted).
    #[arg(long, default_value_t = 20)]
    limit: usize,
}

#[derive(Args)]
struct EvalArgs {
    /// The checkpoint to evaluate.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Evaluate on every sample of this data (synthetic, folder:DIR or slides:DIR) instead
    /// of the checkpoint's held-out split.
    #[arg(long)]
    data: Option<DataSource>,
    #[command(flatten)]
    slides: SlideArgs,
    /// At most this many samples [default: all; 1000 of synthetic data].
    #[arg(long)]
    samples: Option<usize>,
    #[arg(long, default_value_t = 50)]
    batch_size: usize,
    /// Leave unreadable samples out with a warning instead of stopping.
    #[arg(long)]
    skip_bad: bool,
    #[command(flatten)]
    on: DeviceArgs,
    /// native or cudnn convolutions (GPU).
    #[arg(long, default_value = "native")]
    conv: ConvImpl,
}

/// `--offload`.
#[derive(Clone, Debug, PartialEq)]
enum Offload {
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
            file => Offload::File(file.into()),
        })
    }
}

/// `--data`: synthetic, folder:DIR or slides:DIR.
#[derive(Clone, Debug)]
enum DataSource {
    Synthetic,
    Folder(PathBuf),
    Slides(PathBuf),
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
struct SlideArgs {
    /// Labels for slides:DIR: rows `slide,label` (whole slides) or `slide,x,y,w,h,label`
    /// (regions in level-0 pixels; a tile takes the region holding its centre).
    #[arg(long, value_name = "FILE.csv")]
    labels: Option<PathBuf>,
    /// Pyramid level to cut tiles from (0: full resolution).
    #[arg(long, default_value_t = 0)]
    level: usize,
    /// Tile side in pixels of that level [default: --image-size].
    #[arg(long)]
    tile_size: Option<u32>,
    /// Distance between neighbouring tiles [default: the tile side].
    #[arg(long)]
    stride: Option<u32>,
    /// Leave out near-white tiles whose mean brightness (0 to 1) is above this; 0.8 suits
    /// bright-field slides.
    #[arg(long, value_name = "BRIGHTNESS")]
    tissue: Option<f32>,
}

impl SlideArgs {
    /// The source `data` names, cut into tiles of `image_size` unless told otherwise.
    fn spec(&self, data: &DataSource, image_size: usize) -> anyhow::Result<SourceSpec> {
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
struct DataArgs {
    /// synthetic, folder:DIR (one sub-folder of PNG/JPEG/TIFF images per class), or
    /// slides:DIR (tiled TIFF slides, with --labels).
    #[arg(long, default_value = "synthetic", conflicts_with = "resume")]
    data: DataSource,
    #[command(flatten)]
    slides: SlideArgs,
    /// Random crops and horizontal/vertical flips of training images.
    #[arg(long, conflicts_with = "resume")]
    augment: bool,
    /// Hold out this fraction of the samples and report loss and accuracy on them at the end
    /// (and every --val-every steps).
    #[arg(long, default_value_t = 0.0, conflicts_with = "resume")]
    val: f64,
    #[arg(long, value_name = "N")]
    val_every: Option<usize>,
    /// Leave unreadable samples out with a warning (counted in the summary) instead of stopping.
    #[arg(long)]
    skip_bad: bool,
    /// Loader threads preparing batches ahead of training.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Batches prepared ahead at most.
    #[arg(long, default_value_t = 4)]
    prefetch: usize,
}

impl DataArgs {
    fn config(&self, image_size: usize) -> anyhow::Result<DataConfig> {
        Ok(DataConfig {
            source: self.slides.spec(&self.data, image_size)?,
            augment: self.augment,
            val: self.val,
            skip_bad: self.skip_bad,
            workers: self.workers,
            prefetch: self.prefetch,
        })
    }
}

#[derive(Args)]
struct TrainArgs {
    #[arg(long, default_value = "resnet20v2", conflicts_with = "resume")]
    model: String,
    /// Image side in pixels (square RGB images).
    #[arg(long, default_value_t = 32, conflicts_with = "resume")]
    image_size: usize,
    /// Classes [default: the data's; 10 for synthetic data].
    #[arg(long, conflicts_with = "resume")]
    classes: Option<usize>,
    /// Images per replica pass, or `max`: the largest that fits --device-memory.
    #[arg(long, default_value = "32", conflicts_with = "resume")]
    batch_size: Choice,
    /// Total optimizer steps [default: 150; when resuming, the checkpoint's total].
    #[arg(long)]
    steps: Option<usize>,
    /// Base learning rate.
    #[arg(long, default_value_t = 0.1, conflicts_with = "resume")]
    lr: f64,
    #[arg(long, default_value_t = 0.9, conflicts_with = "resume")]
    momentum: f64,
    #[arg(long, default_value_t = 5e-4, conflicts_with = "resume")]
    weight_decay: f64,
    #[arg(long, conflicts_with = "resume")]
    nesterov: bool,
    /// constant, cosine, or step:EVERY:GAMMA.
    #[arg(long, default_value = "cosine", conflicts_with = "resume")]
    schedule: Decay,
    /// Steps of linear learning-rate warm-up.
    #[arg(long, default_value_t = 10, conflicts_with = "resume")]
    warmup: usize,
    #[arg(long, default_value_t = 0, conflicts_with = "resume")]
    seed: u64,
    /// f32 or f64 (of the parameters; --precision sets the activations').
    #[arg(long, default_value = "f32", conflicts_with = "resume", value_parser = parameter_dtype)]
    dtype: DType,
    /// With --precision fp16: the first loss scale (a power of two; halved when gradients
    /// overflow, the step skipped; doubled after 2000 clean steps).
    #[arg(long, default_value_t = 65536.0, conflicts_with = "resume")]
    loss_scale: f64,
    /// Device capacity, e.g. 2GiB (emulated on the CPU; on a GPU the smaller of this and its
    /// free memory; default unlimited / the free memory).
    #[arg(long, value_parser = parse_bytes)]
    device_memory: Option<u64>,
    #[command(flatten)]
    on: DeviceArgs,
    /// Convolutions on a GPU: native (the handwritten kernels) or cudnn (cuDNN 9, each
    /// shape's algorithms timed once and reported at the end).
    #[arg(long, default_value = "native")]
    conv: ConvImpl,
    /// Write one JSON line per step to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Folder to write checkpoints into (step-NNNNNN.safetensors), every --checkpoint-every
    /// steps and at the end.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    #[arg(long, value_name = "N", requires = "checkpoint")]
    checkpoint_every: Option<usize>,
    /// Continue from a checkpoint: model, data, optimizer and schedule come from it.
    #[arg(long, value_name = "FILE")]
    resume: Option<PathBuf>,
    /// Where saved activations wait for backward: none (on the device), all (in the host
    /// tier), recompute (checkpointing: runs of √nodes recomputed in backward), auto (the planner's choice to fit
    /// --device-memory with the least exposed time), or a policy file (JSON).
    #[arg(long, default_value = "none")]
    offload: Offload,
    /// Nodes ahead of backward that offloaded activations are brought back.
    #[arg(long, default_value_t = 2, value_name = "N")]
    offload_ahead: usize,
    /// Capacity of the host tier offloaded activations wait in, e.g. 64GiB (default unlimited).
    #[arg(long, value_parser = parse_bytes)]
    host_memory: Option<u64>,
    /// How offloaded activations travel: naive (pageable, blocking), pinned (pinned pool,
    /// blocking), async (pageable, copy stream) or pinned-async (pinned pool, copy stream,
    /// events). On the CPU every mode is a memory copy.
    #[arg(long, default_value = "pinned-async")]
    offload_copy: CopyMode,
    #[command(flatten)]
    input: DataArgs,
    #[command(flatten)]
    spread: SchemeArgs,
    /// Draw the schedule as SVG: predicted (plan) or the last step as measured (train, with
    /// a --scheme).
    #[arg(long, value_name = "FILE.svg")]
    timeline: Option<PathBuf>,
    /// A profile from `gems calibrate`: measured op times to split and schedule with.
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
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
struct CalibrateArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// Where to write the profile (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Timed runs per op (the median is kept).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

#[derive(Args)]
struct SimulateArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// Largest GPU count to simulate (P, 2P, 4P, … GPUs: D = 1, 2, 4, … groups).
    #[arg(long, default_value_t = 1024)]
    gpus: usize,
    /// Machine: v100-ib (LLNL Lassen), h100-nvlink-ib, or cpu.
    #[arg(long, default_value = "v100-ib")]
    profile: gems::plan::simulate::Profile,
}

/// A number, or a choice left to the planner (`auto`, or `max` for a batch size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Choice {
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

/// How a run is spread over ranks (see DESIGN.md for the schemes).
#[derive(Args)]
struct SchemeArgs {
    /// single, dp, mp, mast or master.
    #[arg(long, default_value = "single")]
    scheme: Kind,
    /// P: pipeline stages, or `auto`: the fewest whose plan fits --device-memory.
    #[arg(long, default_value = "1")]
    split: Choice,
    /// m: micro-batches per replica pass (--batch-size is split into these).
    #[arg(long, default_value_t = 1)]
    parts: usize,
    /// η: replicas per step [default: 2 for mast, 1 otherwise; master needs an even η > 2],
    /// or `auto`: MAST's pair where --device-memory holds it (overlapped, else one replica's
    /// activations at a time), else one replica.
    #[arg(long)]
    replicas: Option<Choice>,
    /// D: data-parallel groups.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// World size; must be P·D (checked; the default is P·D).
    #[arg(long)]
    ranks: Option<usize>,
    /// Pipeline order: gpipe or 1f1b.
    #[arg(long, default_value = "gpipe")]
    order: Order,
    /// Segments (pieces between cut points) per stage, e.g. 10,12; balanced by cost if absent.
    #[arg(long, value_delimiter = ',')]
    balance: Option<Vec<usize>>,
    /// How ranks talk: local (threads of this process) or mpi (one process per rank under mpirun).
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    transport: Transport,
    /// At most this many micro-batches' activations per rank at once (MAST's one-replica-at-a-time variant: m).
    #[arg(long)]
    max_in_flight: Option<usize>,
}

impl SchemeArgs {
    fn scheme(&self) -> anyhow::Result<Scheme> {
        let replicas = match self.replicas {
            Some(Choice::Fixed(n)) => n,
            _ if self.scheme == Kind::Mast => 2,
            _ => 1,
        };
        // `auto` is resolved against memory later, from one stage up.
        let stages = match self.split {
            Choice::Fixed(p) => p,
            Choice::Auto => 1,
        };
        let s = Scheme::new(
            self.scheme,
            stages,
            self.parts,
            replicas,
            self.dp,
            self.order,
        );
        if let Some(n) = self.ranks {
            if n != s.world() {
                anyhow::bail!(
                    "--ranks {n} is not P·D = {}·{} = {}",
                    s.stages,
                    s.dp,
                    s.world()
                );
            }
        }
        Ok(s)
    }

    /// Whether this is plain one-device training.
    fn is_single(&self) -> bool {
        self.scheme == Kind::Single && self.parts == 1 && self.split == Choice::Fixed(1)
    }
}

#[derive(Args)]
struct ModelsArgs {
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Bytes per element for activation sizes: f32, f64, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: DType,
    /// Print this model's block tree and adjacency list.
    #[arg(long, value_name = "NAME")]
    graph: Option<String>,
    /// Also show the largest training batch predicted to fit this much device memory.
    #[arg(long, value_parser = parse_bytes)]
    device_memory: Option<u64>,
}

fn main() -> ExitCode {
    // Like other command-line tools, end quietly when the reader of our output goes away
    // (`gems models | head`) instead of failing a print.
    // SAFETY: setting a signal's disposition to the default at startup, before any threads.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any thread exists, so that every thread's allocations share one heap.
    gems::backend::cpu::tune_host_allocator();
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
        {
            eprintln!("error: cannot start {t} threads: {e}");
            return ExitCode::FAILURE;
        }
    }
    let result = match cli.command {
        Command::Train(a) => train(*a),
        Command::Models(a) => list_models(a),
        Command::Eval(a) => eval(a),
        Command::Plan(a) => plan(*a),
        Command::Simulate(a) => simulate(*a),
        Command::Calibrate(a) => calibrate(*a),
        Command::Data(DataCommand::MakeSlide(a)) => make_slide(a),
        Command::Data(DataCommand::Tiles(a)) => tiles(a),
        Command::Info => info(),
        Command::Bench(BenchCommand::Kernels(a)) => bench_kernels(a),
        Command::Bench(BenchCommand::Offload(a)) => bench_offload(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train(a: TrainArgs) -> anyhow::Result<()> {
    if a.steps == Some(0) || a.checkpoint_every == Some(0) {
        anyhow::bail!("--steps and --checkpoint-every must be at least 1");
    }
    if a.input.val_every == Some(0) {
        anyhow::bail!("--val-every must be at least 1");
    }
    if !a.spread.is_single() {
        return train_spread(a);
    }
    if let Some(dir) = &a.checkpoint {
        std::fs::create_dir_all(dir).map_err(|e| {
            anyhow::anyhow!("cannot create checkpoint folder {}: {e}", dir.display())
        })?;
    }
    let mut trainer = match &a.resume {
        Some(file) => {
            let on = a.on.for_checkpoint()?;
            let t = Trainer::resume(file, |c| {
                on(c);
                c.offload_copy = a.offload_copy;
                c.device_memory = a.device_memory;
                c.conv = a.conv;
                c.data.skip_bad = a.input.skip_bad;
                c.data.workers = a.input.workers;
                c.data.prefetch = a.input.prefetch;
            })?;
            println!(
                "resuming from {} at step {}",
                file.display(),
                t.steps_done()
            );
            t
        }
        None => Trainer::new(run_config(&a)?.train)?,
    };
    let total = a.steps.unwrap_or(trainer.config.steps);
    let first = trainer.steps_done();
    if first >= total {
        anyhow::bail!("the checkpoint is at step {first}; ask for more --steps than that");
    }
    let config = trainer.config.clone();
    let mut metrics = match &a.metrics {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).map_err(
            |e| anyhow::anyhow!("cannot write metrics to {}: {e}", p.display()),
        )?)),
        None => None,
    };
    let g = &trainer.graph;
    println!(
        "training {} ({} parameters, {:.2} GFLOPs/image) on {}², {} classes, batch {}, {} steps, {} on {}",
        g.name,
        g.parameter_count(),
        g.flops_per_sample() as f64 / 1e9,
        config.image_size,
        config.classes,
        config.batch_size,
        total,
        config.numerics(),
        trainer.device.backend().name(),
    );
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new((total - first) as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("static template"),
        );
        Some(b)
    } else {
        None
    };
    report_skipped(&trainer.data.skipped);
    let started = Instant::now();
    let mut history: Vec<StepReport> = Vec::with_capacity(total - first);
    for _ in first..total {
        let r = trainer.step()?;
        let done = trainer.steps_done();
        if a.input.val > 0.0
            && a.input
                .val_every
                .is_some_and(|n| done % n == 0 && done < total)
        {
            let line = validation_line(done, total, &trainer.evaluate(None, config.batch_size)?);
            match &bar {
                Some(b) => b.println(line),
                None => println!("{line}"),
            }
        }
        if let Some(dir) = &a.checkpoint {
            let done = trainer.steps_done();
            if done == total || a.checkpoint_every.is_some_and(|n| done % n == 0) {
                gems::checkpoint::save(&trainer, &dir.join(format!("step-{done:06}.safetensors")))?;
            }
        }
        if let Some(m) = metrics.as_mut() {
            let mut line = serde_json::to_value(&r)?;
            line["images_per_s"] = (r.batch as f64 / r.seconds).into();
            writeln!(m, "{line}")?;
        }
        let recent = &history[history.len().saturating_sub(9)..];
        let (loss, acc) = window_stats(recent.iter().chain(std::iter::once(&r)));
        let ips = r.batch as f64 / r.seconds;
        let msg = format!(
            "loss {loss:.4}  acc {:.1}%  {ips:.1} img/s  lr {:.4}",
            100.0 * acc,
            r.lr
        );
        match &bar {
            Some(b) => {
                b.set_message(msg);
                b.inc(1);
            }
            None if (r.step + 1) % (total / 10).max(1) == 0 => {
                println!("step {:>5}/{total}  {msg}", r.step + 1)
            }
            None => {}
        }
        history.push(r);
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut m) = metrics {
        m.flush()?;
    }
    let secs = started.elapsed().as_secs_f64();
    let images: usize = history.iter().map(|r| r.batch).sum();
    let tail = &history[history.len().saturating_sub(10)..];
    let (loss, acc) = window_stats(tail.iter());
    let mem = trainer.memory();
    println!(
        "done: {} steps, {images} images in {secs:.1} s",
        history.len()
    );
    println!(
        "  loss {loss:.4}, accuracy {:.1}% (mean of the last {} steps; chance is {:.1}%)",
        100.0 * acc,
        tail.len(),
        100.0 / config.classes as f64
    );
    println!("  throughput {:.1} images/s", images as f64 / secs);
    if let Some(s) = &trainer.loss_scale {
        println!(
            "  loss scale {} ({} steps skipped: their gradients overflowed f16)",
            s.factor(),
            s.skipped()
        );
    }
    let waited: f64 = history.iter().map(|r| r.data_wait).sum();
    println!(
        "  waited for data {waited:.2} s ({:.1}% of the loop)",
        100.0 * waited / secs
    );
    let (bad, last) = trainer.data.train.bad();
    if bad > 0 {
        println!(
            "  {bad} unreadable samples skipped (blank inputs), the last {}",
            last.unwrap_or_default()
        );
    }
    if a.input.val > 0.0 || trainer.config.data.val > 0.0 {
        print_validation(&trainer.evaluate(None, config.batch_size)?);
    }
    println!("  peak memory {}: {}", human_bytes(mem.peak), mem.at_peak);
    if let Some(cap) = mem.capacity {
        println!(
            "  capacity {} ({:.0}% used at peak)",
            human_bytes(cap),
            100.0 * mem.peak as f64 / cap as f64
        );
    }
    let host = trainer.device.host_memory();
    if host.peak > 0 {
        let pool = trainer.device.host_pool();
        println!(
            "  host tier peak {}{} ({} copies; pinned pool: {} blocks allocated, {} reused, {})",
            human_bytes(host.peak),
            host.capacity
                .map(|c| format!(" of {}", human_bytes(c)))
                .unwrap_or_default(),
            trainer.config.offload_copy,
            pool.allocated,
            pool.reused,
            human_bytes(pool.bytes)
        );
    }
    print_conv_algorithms(&trainer.device);
    debug_assert_eq!(mem.live.get(Category::Activations), 0);
    Ok(())
}

/// The algorithms cuDNN chose per convolution shape (nothing for the native kernels).
fn print_conv_algorithms(device: &gems::Device) {
    let lines = device.backend().conv_algorithms();
    if !lines.is_empty() {
        println!("  cuDNN algorithms per convolution shape:");
        for l in lines {
            println!("    {l}");
        }
    }
}

/// The run the training flags describe, with `auto` and `max` resolved against
/// --device-memory by metered runs.
fn run_config(a: &TrainArgs) -> anyhow::Result<RunConfig> {
    let steps = a.steps.unwrap_or(150);
    let data = a.input.config(a.image_size)?;
    let classes = match (gems::data::pipeline::class_names(&data.source)?, a.classes) {
        (None, given) => given.unwrap_or(10),
        (Some(names), Some(given)) if given != names.len() => anyhow::bail!(
            "--classes {given}, but the data has {} classes ({})",
            names.len(),
            names.join(", ")
        ),
        (Some(names), _) => names.len(),
    };
    let train = TrainConfig {
        model: a.model.clone(),
        image_size: a.image_size,
        classes,
        batch_size: match a.batch_size {
            Choice::Fixed(b) => b,
            Choice::Auto => a.spread.parts,
        },
        steps,
        schedule: LrSchedule {
            base: a.lr,
            decay: a.schedule,
            warmup: a.warmup,
            total: steps,
        },
        sgd: SgdConfig {
            momentum: a.momentum,
            weight_decay: a.weight_decay,
            nesterov: a.nesterov,
        },
        seed: a.seed,
        dtype: a.dtype,
        device_memory: a.device_memory,
        host_memory: a.host_memory,
        offload_copy: a.offload_copy,
        saves: SavePolicy::keep_all(),
        data,
        device: a.on.kind(a.dtype)?,
        precision: a.on.precision(),
        conv: a.conv,
        loss_scale: a.loss_scale,
    };
    let mut c = RunConfig::new(train, a.spread.scheme()?);
    c.balance = a.spread.balance.clone();
    c.max_in_flight = a.spread.max_in_flight;
    if let Some(p) = &a.calibration {
        c.calibration = Some(std::sync::Arc::new(
            gems::plan::calibrate::Calibration::load(p)?,
        ));
    }
    // What the choices below fit: --device-memory, or on a GPU what the device would offer.
    let capacity = match (a.device_memory, c.train.device) {
        (Some(cap), _) => Some(cap),
        (None, DeviceKind::Cuda { ordinal }) => cuda::devices()
            .ok()
            .and_then(|g| g.into_iter().find(|g| g.ordinal == ordinal))
            .map(|g| cuda::capacity(g.free_memory, None)),
        (None, DeviceKind::Cpu) => None,
    };
    let needs =
        |what: &str| anyhow::anyhow!("{what} needs --device-memory (or a GPU) to choose against");
    if a.spread.split == Choice::Auto {
        let cap = capacity.ok_or_else(|| needs("--split auto"))?;
        c = gems::plan::memory::choose_split(&c, cap)?;
        println!("--split auto: {} stages", c.scheme.stages);
    }
    if a.spread.replicas == Some(Choice::Auto) {
        let cap = capacity.ok_or_else(|| needs("--replicas auto"))?;
        if a.spread.scheme != Kind::Mast {
            anyhow::bail!("--replicas auto chooses between MAST's pair and one replica: use it with --scheme mast");
        }
        c = gems::plan::memory::choose_replicas(&c, cap)?;
        let variant = match (c.scheme.replicas, c.max_in_flight) {
            (1, _) => "one replica (mp)",
            (_, None) => "the MAST pair, overlapped",
            _ => "the MAST pair, one replica's activations at a time",
        };
        println!("--replicas auto: {variant}");
    }
    if a.batch_size == Choice::Auto {
        let cap = capacity.ok_or_else(|| needs("--batch-size max"))?;
        c.train.batch_size = match gems::plan::memory::largest_batch(&c, cap, 1 << 20)? {
            0 => anyhow::bail!("no batch fits {} with this split", human_bytes(cap)),
            b => b,
        };
        println!("--batch-size max: {}", c.train.batch_size);
    }
    let nodes = || {
        models::build(&c.train.model, c.train.image_size, c.train.classes).map(|g| g.nodes.len())
    };
    c.train.saves = match &a.offload {
        Offload::None => SavePolicy::keep_all(),
        Offload::All => SavePolicy::all(nodes()?, Keep::Host, a.offload_ahead),
        Offload::Recompute => SavePolicy::checkpointed(nodes()?),
        Offload::File(path) => SavePolicy::load(path, nodes()?)?,
        Offload::Auto => {
            let cap = capacity.ok_or_else(|| needs("--offload auto"))?;
            let link = host_link(c.train.device, c.train.precision)?;
            let chosen = gems::plan::offload::choose(&c, cap, &link, a.offload_ahead)?;
            let (_, host, recompute) = chosen.policy.counts();
            println!(
                "--offload auto: {host} nodes offloaded, {recompute} recomputed ({} per micro-batch off the device, {:.3} s per step predicted exposed)",
                human_bytes(chosen.bytes),
                chosen.exposed
            );
            chosen.policy
        }
    };
    Ok(c)
}

/// The partition, the predicted schedule, and each rank's memory by category against capacity.
fn plan(a: TrainArgs) -> anyhow::Result<()> {
    let c = run_config(&a)?;
    let layout = Layout::new(&c)?;
    let (g, s) = (&layout.graph, &c.scheme);
    let micro = c.train.batch_size / s.parts;
    println!(
        "plan: {} at {}², {} with P={} m={} η={} D={}, B={} ({micro} per micro-batch), {}",
        g.name,
        c.train.image_size,
        s.kind,
        s.stages,
        s.parts,
        s.replicas,
        s.dp,
        c.train.batch_size,
        c.train.numerics()
    );
    let costs = layout.costs.total();
    println!(
        "{:<6} {:>12} {:>12} {:>20} {:>22}",
        "stage", "nodes", "parameters", "saved/micro-batch", "fwd+bwd/micro-batch"
    );
    let saved = layout.saved_per_micro_batch(c.train.activations(), micro);
    for (i, r) in layout.partition.stages.iter().enumerate() {
        let params = g.trainable_in(r.clone());
        let saved = saved[i];
        let secs: f64 = costs[r.clone()].iter().sum();
        println!(
            "{i:<6} {:>12} {params:>12} {:>20} {:>20.2} ms",
            format!("{}..{}", r.start, r.end),
            human_bytes(saved),
            1e3 * secs
        );
    }
    // Local ranks share this machine.
    let step = layout.predicted_step(true);
    let images = (s.replicas * c.train.batch_size * s.dp) as f64;
    println!(
        "predicted step {:.3} s, {:.1} images/s ({}; rank busy: {})",
        step,
        images / step,
        if c.calibration.is_some() {
            "calibrated"
        } else {
            "analytical CPU model"
        },
        layout
            .schedule
            .busy()
            .iter()
            .map(|b| format!("{:.0}%", 100.0 * b / step))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let saves = &c.train.saves;
    let (_, host, recompute) = saves.counts();
    if host + recompute > 0 {
        let link = host_link(c.train.device, c.train.precision)?;
        let (bytes, exposed) = gems::plan::offload::cost_of(
            g,
            &layout.costs,
            micro,
            c.train.activations(),
            &link,
            saves,
        );
        println!(
            "saved tensors: {host} nodes offloaded to the host tier (fetched {} nodes ahead), {recompute} recomputed; {} per micro-batch off the device, {:.3} s per micro-batch predicted exposed (host link {:.1} GB/s{})",
            saves.prefetch,
            human_bytes(bytes),
            exposed,
            link.bytes_per_s / 1e9,
            if link.overlaps { ", copies overlap compute" } else { ", copies are compute" }
        );
        for (i, r) in layout.partition.stages.iter().enumerate() {
            let count = |k| r.clone().filter(|&n| saves.of(n) == k).count();
            println!(
                "  stage {i}: {} on the device, {} offloaded, {} recomputed",
                count(Keep::Device),
                count(Keep::Host),
                count(Keep::Recompute)
            );
        }
    }
    if let Some(path) = &a.timeline {
        let bytes = layout.saved_per_micro_batch(c.train.activations(), micro);
        let title = format!(
            "{} {} P={} m={} η={}: predicted",
            g.name, s.kind, s.stages, s.parts, s.replicas
        );
        let svg = gems::plan::timeline::svg(
            &title,
            &layout.schedule.ranks,
            &gems::plan::timeline::held(&layout.schedule.ranks, &bytes),
        );
        std::fs::write(path, svg)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("timeline: {}", path.display());
    }
    let mem = gems::plan::memory::per_rank(&c)?;
    println!("memory per rank (a metered run of the same tasks):");
    for (r, m) in mem.iter().enumerate() {
        let verdict = match c.train.device_memory {
            Some(cap) if m.peak > cap => format!(
                "  exceeds {} by {}",
                human_bytes(cap),
                human_bytes(m.peak - cap)
            ),
            Some(cap) => format!(
                "  fits {} ({:.0}%)",
                human_bytes(cap),
                100.0 * m.peak as f64 / cap as f64
            ),
            None => String::new(),
        };
        println!(
            "  rank {r}: {}: {}{verdict}",
            human_bytes(m.peak),
            m.at_peak
        );
    }
    Ok(())
}

fn bench_kernels(a: BenchKernelsArgs) -> anyhow::Result<()> {
    use gems::bench;
    let kind = a.on.kind(DType::F32)?;
    let dtype = a.on.precision().activations(DType::F32);
    let convs = match a.conv {
        BenchConv::One(c) => vec![c],
        BenchConv::Both => vec![ConvImpl::Native, ConvImpl::Cudnn],
    };
    // One device per convolution path (on a GPU, both on the same one).
    let devices = convs
        .iter()
        .map(|&c| gems::Device::open(kind, a.on.precision(), c, &kind.to_string(), 0, None))
        .collect::<gems::Result<Vec<_>>>()?;
    let g = models::build(&a.model, a.image_size, 1000)?;
    let shapes = bench::conv_shapes(&g, a.batch)?;
    println!(
        "{} at {}², batch {}, {} activations: {} distinct convolutions on {}",
        a.model,
        a.image_size,
        a.batch,
        dtype.name(),
        shapes.len(),
        devices
            .iter()
            .map(|d| d.backend().name())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let both = devices.len() == 2;
    if both {
        println!(
            "{:<28} {:>5} {:>8}  {:^24}  {:^24}  {:^24}",
            "convolution (first node)",
            "count",
            "GFLOP",
            "forward ms",
            "backward-data ms",
            "backward-filter ms"
        );
        let sub = format!("{:>8} {:>8} {:>6}", "native", "cudnn", "ratio");
        println!(
            "{:<43}  {sub}  {sub}  {sub}",
            "(ratio: native time / cuDNN time)"
        );
    } else {
        println!(
            "{:<28} {:>5} {:>8}  {:>21}  {:>21}  {:>21}",
            "convolution (first node)",
            "count",
            "GFLOP",
            "forward ms TFLOP/s",
            "bwd-data ms TFLOP/s",
            "bwd-filter ms TFLOP/s"
        );
    }
    let mut rows = Vec::new();
    // Seconds of each pass over the whole model, per device.
    let mut total = vec![[0.0f64; 3]; devices.len()];
    let mut flops = 0.0;
    for s in &shapes {
        let t = devices
            .iter()
            .map(|d| bench::conv_passes(d, &s.geom, dtype, a.repeats))
            .collect::<gems::Result<Vec<_>>>()?;
        let f = s.flops();
        let cells: Vec<String> = (0..3)
            .map(|pass| match t.as_slice() {
                [one] => format!("{:>10.3} {:>10.2}", 1e3 * one[pass], f / one[pass] / 1e12),
                [native, cudnn] => format!(
                    "{:>8.3} {:>8.3} {:>5.2}x",
                    1e3 * native[pass],
                    1e3 * cudnn[pass],
                    native[pass] / cudnn[pass]
                ),
                _ => unreachable!("one or two convolution paths"),
            })
            .collect();
        println!(
            "{:<28} {:>5} {:>8.2}  {}  {}  {}",
            s.example,
            s.count,
            f / 1e9,
            cells[0],
            cells[1],
            cells[2]
        );
        for (acc, times) in total.iter_mut().zip(&t) {
            for (a, sec) in acc.iter_mut().zip(times) {
                *a += sec * s.count as f64;
            }
        }
        flops += f * s.count as f64;
        let mut row = serde_json::json!({
            "node": s.example, "count": s.count, "geom": format!("{:?}", s.geom),
            "gflop": f / 1e9, "seconds": t[0],
        });
        if both {
            row["cudnn_seconds"] = serde_json::json!(t[1]);
        }
        rows.push(row);
    }
    for (conv, total) in convs.iter().zip(&total) {
        println!(
            "all {} convolutions{}: forward {:.2}, backward-data {:.2}, backward-filter {:.2} TFLOP/s",
            shapes.iter().map(|s| s.count).sum::<usize>(),
            if both { format!(" ({conv})") } else { String::new() },
            flops / total[0] / 1e12,
            flops / total[1] / 1e12,
            flops / total[2] / 1e12
        );
    }
    let device = &devices[0];
    // The largest activation of the model at this batch, seen per channel.
    let widest = g
        .values
        .iter()
        .filter(|v| v.shape.rank() == 3)
        .max_by_key(|v| v.shape.numel())
        .map(|v| v.shape.clone())
        .ok_or_else(|| anyhow::anyhow!("{} has no image-shaped activation", a.model))?;
    let (c, h, w) = (widest.dim(0), widest.dim(1), widest.dim(2));
    let geom = gems::backend::ChannelGeom {
        n: a.batch,
        c,
        hw: h * w,
    };
    let bw = bench::memory_bound(device, &geom, dtype, a.repeats)?;
    let copy = bw[0].gb_per_s();
    println!(
        "memory-bound kernels over {}×{c}×{h}×{w} {}:",
        a.batch,
        dtype.name()
    );
    for b in &bw {
        println!(
            "  {:<24} {:>8.1} GB/s  {:>5.1}% of copy",
            b.kernel,
            b.gb_per_s(),
            100.0 * b.gb_per_s() / copy
        );
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({
            "model": a.model, "image_size": a.image_size, "batch": a.batch,
            "device": device.backend().name(), "repeats": a.repeats, "conv": a.conv.to_string(),
            "convolutions": rows, "memory_bound": bw,
            "cudnn_algorithms": devices.iter().flat_map(|d| d.backend().conv_algorithms()).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    for d in &devices {
        print_conv_algorithms(d);
    }
    Ok(())
}

/// The planner's model of a device's host link: on a GPU, the slower direction of pinned copies
/// as measured, overlapping compute (copy engines); on the CPU, memory copies that do not.
fn link_model(kind: DeviceKind, measured: &[gems::bench::Bandwidth]) -> HostLink {
    match kind {
        DeviceKind::Cpu => HostLink::CPU,
        DeviceKind::Cuda { .. } => HostLink {
            bytes_per_s: measured
                .iter()
                .filter(|b| b.kernel.ends_with("pinned"))
                .map(|b| b.gb_per_s() * 1e9)
                .fold(f64::INFINITY, f64::min),
            overlaps: true,
        },
    }
}

/// The host link `--offload auto` plans with: measured on a GPU (64 MiB copies), the CPU's
/// model otherwise.
fn host_link(kind: DeviceKind, precision: Precision) -> anyhow::Result<HostLink> {
    if kind == DeviceKind::Cpu {
        return Ok(HostLink::CPU);
    }
    // Copies only: the convolution path does not matter.
    let device = gems::Device::open(
        kind,
        precision,
        ConvImpl::Native,
        &kind.to_string(),
        0,
        None,
    )?;
    Ok(link_model(
        kind,
        &gems::bench::host_link(&device, 64 << 20, 3)?,
    ))
}

fn bench_offload(a: BenchOffloadArgs) -> anyhow::Result<()> {
    use gems::bench;
    let kind = a.on.kind(DType::F32)?;
    let device = gems::Device::open(
        kind,
        a.on.precision(),
        ConvImpl::Native,
        &kind.to_string(),
        0,
        None,
    )?;
    println!("host link of {}:", device.backend().name());
    let link = bench::host_link(&device, 256 << 20, 5)?;
    for b in &link {
        println!("  {:<20} {:>6.1} GB/s", b.kernel, b.gb_per_s());
    }
    let host_link = link_model(kind, &link);
    drop(device);
    let mut base = TrainConfig::new("", a.image_size, a.classes, a.batch, 1);
    base.device = kind;
    base.precision = a.on.precision();
    let models: Vec<String> = a.models.split(',').map(|m| m.trim().to_string()).collect();
    println!(
        "epoch of {} images at {}², batch {}, {} classes:",
        a.images, a.image_size, a.batch, a.classes
    );
    println!(
        "{:<20} {:<24} {:>10} {:>11} {:>12} {:>12}",
        "model", "saved activations", "s/epoch", "× baseline", "device peak", "host peak"
    );
    let runs = bench::offload_study(&base, &models, a.images, &host_link)?;
    let mut baseline = f64::NAN;
    for r in &runs {
        match &r.seconds {
            Ok(s) => {
                if r.variant == "baseline" {
                    baseline = *s;
                }
                println!(
                    "{:<20} {:<24} {:>10.2} {:>11.2} {:>12} {:>12}",
                    r.model,
                    r.variant,
                    s,
                    s / baseline,
                    human_bytes(r.device_peak),
                    human_bytes(r.host_peak)
                );
            }
            Err(e) => println!("{:<20} {:<24} failed: {e}", r.model, r.variant),
        }
    }
    if let Some(path) = &a.json {
        let doc = serde_json::json!({ "link": link, "runs": runs });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

fn info() -> anyhow::Result<()> {
    println!("gems {}", env!("CARGO_PKG_VERSION"));
    println!("CPU: {} threads", rayon::current_num_threads());
    println!("CUDA libraries (GEMS_CUDA_LIB_DIRS, the toolkit, Python's nvidia packages, the loader's path):");
    for lib in cuda::libs::load() {
        match (&lib.path, &lib.problem) {
            (Some(path), _) => println!("  {:<7} {}", lib.role, path.display()),
            (None, why) => println!(
                "  {:<7} not found: {}",
                lib.role,
                why.as_deref().unwrap_or("")
            ),
        }
    }
    match cuda::kernels::nvrtc_version() {
        Some((major, minor)) => {
            let archs = cuda::kernels::known_archs()
                .map(|a| {
                    a.iter()
                        .map(|a| format!("sm_{a}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|e| e.to_string());
            println!("  NVRTC {major}.{minor} compiles the kernels to machine code for {archs}")
        }
        None => println!(
            "  NVRTC cannot be used: cudarc opens it as libnvrtc.so or libnvrtc.so.<major>; \
             link the library found under one of those names in a folder on LD_LIBRARY_PATH"
        ),
    }
    match cuda::cudnn::load() {
        Ok(v) => println!(
            "  cuDNN {} runs --conv cudnn",
            cuda::cudnn::version_string(v)
        ),
        Err(e) => println!("  {e}"),
    }
    match cuda::kernels::cache_dir() {
        Some(dir) => println!("kernel cache: {}", dir.display()),
        None => println!("kernel cache: none (set GEMS_CACHE_DIR or HOME)"),
    }
    match cuda::devices() {
        Ok(gpus) if gpus.is_empty() => println!("GPUs: none"),
        Ok(gpus) => {
            for g in gpus {
                println!(
                    "cuda:{} {}: compute capability {}.{}, {} SMs, {} total, {} free",
                    g.ordinal,
                    g.name,
                    g.compute_capability.0,
                    g.compute_capability.1,
                    g.multiprocessors,
                    human_bytes(g.total_memory),
                    human_bytes(g.free_memory)
                );
            }
        }
        Err(e) => println!("GPUs: none usable ({e})"),
    }
    println!("--device auto picks: {}", DeviceKind::parse("auto")?);
    Ok(())
}

fn calibrate(a: CalibrateArgs) -> anyhow::Result<()> {
    let c = run_config(&a.train)?;
    let t = &c.train;
    let micro = t.batch_size / c.scheme.parts.max(1);
    let g = models::build(&t.model, t.image_size, t.classes)?;
    let device = gems::Device::cpu("cpu:0", None);
    let started = Instant::now();
    let cal = gems::plan::calibrate::calibrate(
        &g,
        &t.model,
        t.image_size,
        t.classes,
        micro,
        (t.dtype, t.activations()),
        &device,
        a.repeats.max(1),
    )?;
    cal.save(&a.out)?;
    let (f, b): (f64, f64) = (cal.forward.iter().sum(), cal.backward.iter().sum());
    println!(
        "calibrated {} ops of {} at {}², micro-batch {micro}, {} in {:.1} s: forward {:.2} ms, backward {:.2} ms per micro-batch; wrote {}",
        g.nodes.len(), t.model, t.image_size, t.numerics(), started.elapsed().as_secs_f64(), 1e3 * f, 1e3 * b, a.out.display()
    );
    Ok(())
}

fn simulate(a: SimulateArgs) -> anyhow::Result<()> {
    use gems::plan::simulate;
    let c = run_config(&a.train)?;
    let s = &c.scheme;
    println!(
        "simulate: {} at {}², {} with P={} m={} η={}, B={} per replica pass, {} on {}",
        c.train.model,
        c.train.image_size,
        s.kind,
        s.stages,
        s.parts,
        s.replicas,
        c.train.batch_size,
        c.train.numerics(),
        a.profile
    );
    let points = simulate::weak_scaling(&c, &a.profile, a.gpus)?;
    let base = points
        .first()
        .ok_or_else(|| anyhow::anyhow!("--gpus {} is fewer than P = {}", a.gpus, s.stages))?;
    println!(
        "{:>6} {:>7} {:>12} {:>13} {:>11} {:>11}",
        "gpus", "groups", "pipeline s", "all-reduce s", "images/s", "efficiency"
    );
    for p in &points {
        let eff = p.images_per_s / (base.images_per_s * p.groups as f64);
        println!(
            "{:>6} {:>7} {:>12.4} {:>13.4} {:>11.2} {:>10.2}%",
            p.gpus,
            p.groups,
            p.pipeline,
            p.all_reduce,
            p.images_per_s,
            100.0 * eff
        );
    }
    let peak = gems::plan::memory::per_rank(&c)?
        .iter()
        .map(|m| m.peak)
        .max()
        .unwrap_or(0);
    println!(
        "largest rank memory {} (metered, with the CPU backend's workspace)",
        human_bytes(peak)
    );
    if s.replicas >= 2 {
        let mut mp = c.clone();
        mp.scheme.kind = Kind::Mp;
        mp.scheme.replicas = 1;
        mp.max_in_flight = None;
        let layout = Layout::new(&mp)?;
        let one = simulate::step(&mp, &layout, &a.profile, 1)?;
        println!(
            "{} over MP-Basic on {} GPUs: {:.2}× images/s",
            s.kind,
            s.stages,
            base.images_per_s / one.images_per_s
        );
    }
    Ok(())
}

/// Training spread over ranks (threads of this process).
fn train_spread(a: TrainArgs) -> anyhow::Result<()> {
    if a.checkpoint.is_some() || a.resume.is_some() {
        anyhow::bail!("--checkpoint and --resume work with --scheme single for now");
    }
    let mut c = run_config(&a)?;
    c.val_every = a.input.val_every;
    let (scheme, steps) = (c.scheme, c.train.steps);
    gems::plan::memory::check_fits(&c)?;
    let layout = Layout::new(&c)?;
    let per_step = scheme.replicas * c.train.batch_size * scheme.dp;
    let header = || {
        let g = &layout.graph;
        println!(
            "training {} with {}: P={} stages, m={} micro-batches, η={} replicas, D={} groups on {} ranks ({}); {per_step} images per step, {}",
            g.name, scheme.kind, scheme.stages, scheme.parts, scheme.replicas, scheme.dp, scheme.world(), a.spread.transport, c.train.numerics()
        );
        for (s, r) in layout.partition.stages.iter().enumerate() {
            let (first, last) = (&g.nodes[r.start].name, &g.nodes[r.end - 1].name);
            println!(
                "  stage {s}: nodes {}..{} ({first} … {last})",
                r.start, r.end
            );
        }
    };
    let started = Instant::now();
    let reports = match a.spread.transport {
        Transport::Local => {
            header();
            gems::comm::local::run(scheme.world(), |comm| run_rank(&c, &layout, &*comm))?
        }
        Transport::Mpi => match run_mpi(&c, &layout, header)? {
            Some(reports) => reports,
            None => return Ok(()),
        },
    };
    let secs = started.elapsed().as_secs_f64();
    // The same on every rank that evaluates; rank 0's report is the one MPI's gather keeps whole.
    let validation = &reports[0].validation;
    for (done, e) in validation.iter().filter(|(done, _)| *done < steps) {
        println!("{}", validation_line(*done, steps, e));
    }
    let step_loss = |i: usize| reports.iter().map(|r| r.losses[i]).sum::<f64>();
    let tail = steps.saturating_sub(10)..steps;
    let loss = tail.clone().map(step_loss).sum::<f64>() / tail.len() as f64;
    let (correct, seen) = reports
        .iter()
        .flat_map(|r| &r.correct[tail.clone()])
        .fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
    println!(
        "done: {steps} steps, {} images in {secs:.1} s",
        steps * per_step
    );
    println!(
        "  loss {loss:.4}, accuracy {:.1}% (mean of the last {} steps)",
        100.0 * correct as f64 / seen.max(1) as f64,
        tail.len()
    );
    println!(
        "  throughput {:.1} images/s",
        (steps * per_step) as f64 / secs
    );
    if c.train.precision.scales_loss() {
        println!(
            "  {} steps skipped: their gradients overflowed f16's loss scale",
            reports[0].skipped_steps
        );
    }
    if let Some((_, e)) = validation.last() {
        print_validation(e);
    }
    if let Some(path) = &a.timeline {
        let g = &layout.graph;
        let micro = c.train.batch_size / scheme.parts;
        let bytes = layout.saved_per_micro_batch(c.train.activations(), micro);
        let mut tasks = vec![Vec::new(); scheme.stages];
        for r in reports.iter().filter(|r| r.rank < scheme.stages) {
            tasks[r.rank] = r.timeline.clone();
        }
        let title = format!(
            "{} {} P={} m={} η={}: measured, last step",
            g.name, scheme.kind, scheme.stages, scheme.parts, scheme.replicas
        );
        let svg =
            gems::plan::timeline::svg(&title, &tasks, &gems::plan::timeline::held(&tasks, &bytes));
        std::fs::write(path, svg)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
        println!("  timeline: {}", path.display());
    }
    if let Some(path) = &a.metrics {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path)
                .map_err(|e| anyhow::anyhow!("cannot write metrics to {}: {e}", path.display()))?,
        );
        for i in 0..steps {
            let (correct, scored) = reports
                .iter()
                .map(|r| r.correct[i])
                .fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
            writeln!(
                f,
                "{}",
                serde_json::json!({ "step": i, "loss": step_loss(i), "correct": correct, "batch": scored })
            )?;
        }
        f.flush()?;
    }
    println!("  rank   busy s   idle s   data wait s   peak memory");
    for r in &reports {
        println!(
            "  {:>4} {:>8.2} {:>8.2} {:>13.2}   {}: {}",
            r.rank,
            r.busy,
            (r.wall - r.busy).max(0.0),
            r.data_wait,
            human_bytes(r.memory.peak),
            r.memory.at_peak
        );
    }
    Ok(())
}

/// A parameter dtype: f32 or f64 (16-bit types hold activations, chosen by --precision).
fn parameter_dtype(s: &str) -> Result<DType, String> {
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

/// Runs this process's rank under mpirun; the reports of all ranks come back on rank 0.
#[cfg(feature = "mpi")]
fn run_mpi(
    c: &RunConfig,
    layout: &Layout,
    header: impl FnOnce(),
) -> anyhow::Result<Option<Vec<RankReport>>> {
    use gems::comm::Comm;
    use gems::runtime::executor::gather_reports;
    let universe = mpi::initialize().ok_or_else(|| anyhow::anyhow!("MPI was initialized twice"))?;
    let comm = gems::comm::mpi::MpiComm::world(&universe);
    if comm.rank() == 0 {
        header();
    }
    match run_rank(c, layout, &comm).and_then(|r| gather_reports(&comm, r)) {
        Ok(r) => Ok(r),
        Err(e) => {
            // One rank failing ends the job: the others would wait for it forever.
            eprintln!("error: rank {}: {e}", comm.rank());
            comm.abort(1)
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &RunConfig, _: &Layout, _: impl FnOnce()) -> anyhow::Result<Option<Vec<RankReport>>> {
    anyhow::bail!("this gems was built without MPI: build it with `cargo build --release --features mpi` and start it with mpirun")
}

/// A line of validation during training, after `done` of `total` steps.
fn validation_line(done: usize, total: usize, e: &Evaluation) -> String {
    format!(
        "step {done:>5}/{total}  validation loss {:.4}, accuracy {:.1}%",
        e.loss,
        100.0 * e.accuracy
    )
}

/// The summary's line of the evaluation after the last step.
fn print_validation(e: &Evaluation) {
    println!(
        "  validation: loss {:.4}, accuracy {:.1}% on {} held-out samples",
        e.loss,
        100.0 * e.accuracy,
        e.samples
    );
}

/// Mean loss and accuracy over reports.
fn window_stats<'a>(rs: impl Iterator<Item = &'a StepReport>) -> (f64, f64) {
    let (mut loss, mut correct, mut seen, mut n) = (0.0, 0, 0, 0);
    for r in rs {
        loss += r.loss;
        correct += r.correct;
        seen += r.batch;
        n += 1;
    }
    (loss / n.max(1) as f64, correct as f64 / seen.max(1) as f64)
}

fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let on = a.on.for_checkpoint()?;
    let mut t = Trainer::resume(&a.checkpoint, |c| {
        on(c);
        c.data.skip_bad = a.skip_bad;
        c.conv = a.conv;
    })?;
    let (e, what) = match &a.data {
        Some(source) => {
            let c = &t.config;
            let config = DataConfig {
                source: a.slides.spec(source, c.image_size)?,
                augment: false,
                val: 0.0,
                ..c.data.clone()
            };
            let data = gems::data::open(&config, c.image_size, c.classes, c.seed)?;
            report_skipped(&data.skipped);
            // The first epoch of the (shuffled) training order holds every sample once.
            let e = match data.train.samples() {
                Some(_) => t.evaluate_on(&data.train, a.samples, a.batch_size)?,
                None => t.evaluate(Some(a.samples.unwrap_or(1000)), a.batch_size)?,
            };
            (e, "samples")
        }
        None => {
            let samples = match t.config.data.source {
                SourceSpec::Synthetic => Some(a.samples.unwrap_or(1000)),
                _ => a.samples,
            };
            (t.evaluate(samples, a.batch_size)?, "held-out samples")
        }
    };
    println!(
        "{} at step {}: loss {:.4}, accuracy {:.1}% on {} {what}",
        t.config.model,
        t.steps_done(),
        e.loss,
        100.0 * e.accuracy,
        e.samples
    );
    let names: Vec<String> = e
        .classes
        .iter()
        .enumerate()
        .map(|(i, c)| format!("{i} {c}"))
        .collect();
    let width = names
        .iter()
        .map(|n| n.chars().count())
        .max()
        .unwrap_or(0)
        .max(5);
    println!("confusion matrix (rows: true class, columns: predicted):");
    print!("{:<width$} {:>8}", "class", "samples");
    for i in 0..names.len() {
        print!(" {i:>6}");
    }
    println!("  recall");
    for (i, ((name, row), n)) in names
        .iter()
        .zip(&e.confusion)
        .zip(e.per_class())
        .enumerate()
    {
        print!("{name:<width$} {n:>8}");
        for v in row {
            print!(" {v:>6}");
        }
        let recall = match n {
            0 => 0.0,
            n => 100.0 * row[i] as f64 / n as f64,
        };
        println!("  {recall:5.1}%");
    }
    Ok(())
}

fn make_slide(a: MakeSlideArgs) -> anyhow::Result<()> {
    use gems::data::slide::MakeSlide;
    let mut opts = MakeSlide::new(a.width, a.height.unwrap_or(a.width));
    opts.tile = a.tile;
    opts.levels = a.levels.unwrap_or(opts.levels);
    opts.classes = a.classes;
    opts.seed = a.seed;
    opts.region = a.region;
    opts.noise = a.noise;
    opts.bigtiff = a.bigtiff;
    let started = Instant::now();
    let made = gems::data::slide::make_slide(&a.out, &opts)?;
    let name = a
        .out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let labels = a
        .labels
        .unwrap_or_else(|| a.out.with_file_name("labels.csv"));
    // Rows of other slides stay; this slide's are replaced.
    let kept: String = match std::fs::read_to_string(&labels) {
        Ok(old) => old
            .lines()
            .filter(|l| l.split(',').next().map(str::trim) != Some(name.as_str()))
            .map(|l| format!("{l}\n"))
            .collect(),
        Err(_) => "slide,x,y,w,h,label\n".to_string(),
    };
    std::fs::write(&labels, kept + &made.label_rows(&name))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", labels.display()))?;
    println!(
        "wrote {} ({}, {}) in {:.1} s: {} levels ({}), {} tissue regions of {} classes; labels in {}",
        a.out.display(),
        if made.bigtiff { "BigTIFF" } else { "TIFF" },
        human_bytes(made.bytes),
        started.elapsed().as_secs_f64(),
        made.levels.len(),
        made.levels
            .iter()
            .map(|l| format!("{}×{}", l.width, l.height))
            .collect::<Vec<_>>()
            .join(", "),
        made.regions.len(),
        made.classes,
        labels.display()
    );
    Ok(())
}

fn tiles(a: TilesArgs) -> anyhow::Result<()> {
    let SourceSpec::Slides { dir, labels, tiles } = a.slides.spec(&a.data, a.image_size)? else {
        anyhow::bail!("gems data tiles lists the tiles of --data slides:DIR");
    };
    let slides = gems::data::slide::Slides::open(&dir, &labels, &tiles)?;
    let all = slides.tiles();
    let classes = gems::data::Source::classes(&slides);
    println!(
        "{} tiles of {}² at level {} (stride {}) from {} slides in {}",
        all.len(),
        tiles.tile,
        tiles.level,
        tiles.stride,
        slides.slides().len(),
        dir.display()
    );
    for (c, name) in classes.iter().enumerate() {
        let n = all.iter().filter(|t| t.label as usize == c).count();
        println!("  class {c} {name}: {n} tiles");
    }
    for (i, t) in all.iter().enumerate().take(a.limit) {
        let slide = slides.slides()[t.slide].path().display();
        println!(
            "  {i:>6}  {slide}  x {:>6}  y {:>6}  {}",
            t.x, t.y, classes[t.label as usize]
        );
    }
    if all.len() > a.limit {
        println!("  … {} more (--limit)", all.len() - a.limit);
    }
    if let Some(out) = &a.export {
        for i in 0..all.len() {
            slides.export_png(i, out)?;
        }
        let out = out.display();
        println!(
            "exported {} tiles to {out} (train on them with --data folder:{out})",
            all.len()
        );
    }
    Ok(())
}

/// Warns of samples left out when the data was opened.
fn report_skipped(skipped: &[(String, String)]) {
    for (what, why) in skipped {
        eprintln!("warning: skipping {what}: {why}");
    }
    if !skipped.is_empty() {
        println!("{} unreadable samples left out", skipped.len());
    }
}

fn list_models(a: ModelsArgs) -> anyhow::Result<()> {
    if let Some(name) = a.graph {
        let g = models::build(&name, a.image_size, a.classes)?;
        println!(
            "{} at {}², {} classes: {} parameters\n",
            g.name,
            a.image_size,
            a.classes,
            g.parameter_count()
        );
        println!("blocks:\n{}", g.block_tree());
        println!("adjacency list:\n{}", g.adjacency_list());
        return Ok(());
    }
    println!(
        "models at {}×{}, {} classes, {} activations:",
        a.image_size,
        a.image_size,
        a.classes,
        a.dtype.name()
    );
    let cap = a
        .device_memory
        .map(|c| format!("batch in {}", human_bytes(c)))
        .unwrap_or_default();
    println!(
        "{:<16} {:>12} {:>14} {:>18} {:>16}",
        "model", "parameters", "GFLOPs/image", "activations/image", cap
    );
    for name in models::LISTED {
        match models::build(name, a.image_size, a.classes) {
            Ok(g) => {
                let fits = match a.device_memory {
                    Some(cap) => {
                        let one = memory::single_device(name, a.image_size, a.classes, a.dtype, 1);
                        match memory::largest_batch(&one, cap, 1 << 20)? {
                            0 => "none".to_string(),
                            b => b.to_string(),
                        }
                    }
                    None => String::new(),
                };
                println!(
                    "{:<16} {:>12} {:>14.3} {:>18} {:>16}",
                    name,
                    g.parameter_count(),
                    g.flops_per_sample() as f64 / 1e9,
                    human_bytes(g.saved_bytes_per_sample(a.dtype)),
                    fits
                )
            }
            Err(e) => println!("{name:<16} {e}"),
        }
    }
    Ok(())
}
