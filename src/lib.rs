//! gems: memory-aware model-parallel training of deep CNNs on very large images, on an engine
//! of its own (tensors, autograd, a CPU and a CUDA backend) whose allocator accounts for every
//! byte.
//!
//! The API is graph-first: build a [`Graph`] (with [`GraphBuilder`], or [`models::build`] for
//! the zoo), describe the run with a [`RunConfig`] (a [`TrainConfig`] and a [`Scheme`]), and
//! hold it open in a [`Session`], stepped by your own loop. The planner answers questions
//! about the same graph without training it ([`fit::per_rank`], [`fit::largest_batch`],
//! [`fit::choose_split`], [`plan::simulate`]).
//!
//! ```
//! use gems::{models, Dataset, Kind, Order, RunConfig, Scheme, Session, TrainConfig};
//! # fn main() -> gems::Result<()> {
//! let graph = models::build("resnet20v2", 16, 4)?;
//! // MAST: two replicas over two pipeline stages, ranks as threads of this process.
//! let scheme = Scheme::new(Kind::Mast, 2, 1, 2, 1, Order::GPipe);
//! let config = RunConfig::new(TrainConfig::new(2, 10), scheme);
//! // Exactly what each rank will hold, from a metered run of the same tasks.
//! let peaks = gems::fit::per_rank(&graph, &config)?;
//! assert_eq!(peaks.len(), 2);
//! let mut session = Session::new(&graph, config, Dataset::synthetic(16, 4, 0))?;
//! let report = session.step()?;
//! assert_eq!(report.images, 4);
//! assert!(report.loss.is_finite());
//! # Ok(()) }
//! ```
//!
//! Layers, each importing only those below it (a test holds this): `core`-level types
//! ([`DType`], [`Shape`], [`Error`]), `memory`, `backend`, `tensor`, `comm` and `data`, `ops`,
//! `graph`, `models` and `optim`, `schemes`, `plan`, `runtime`, `fit`, and the binary.

pub mod backend;
pub mod bench;
pub mod comm;
pub mod data;
pub mod fit;
pub mod graph;
pub mod memory;
pub mod models;
pub mod ops;
pub mod optim;
pub mod plan;
pub mod runtime;
pub mod schemes;
pub mod tensor;

pub use backend::{Device, DeviceKind};
pub use data::{Dataset, Source};
pub use graph::{Graph, GraphBuilder};
pub use memory::{Category, MemoryStats, OutOfMemory};
pub use plan::{RunConfig, TrainConfig};
pub use runtime::{Evaluation, Session, StepReport};
pub use schemes::{Kind, Order, Scheme};
pub use tensor::{DType, Precision, Shape, Tensor};

/// Everything that can go wrong on a user path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    #[error("shape error: {0}")]
    Shape(String),
    #[error("{0}")]
    Config(String),
    #[error("communication: {0}")]
    Comm(String),
    /// The accelerator or its libraries: missing, or failing.
    #[error("{0}")]
    Device(String),
    /// A sample that cannot be read; the message names the file (and tile).
    #[error("{0}")]
    Data(String),
    /// A plan whose fullest rank exceeds the device capacity: which rank, by how much, and
    /// what would fit instead.
    #[error("the plan does not fit: rank {rank} needs {} ({at_peak}), {} over the capacity of {}{}; {what_fits}",
        memory::human_bytes(*needed), memory::human_bytes(needed.saturating_sub(*capacity)),
        memory::human_bytes(*capacity), least.as_ref().map(|l| format!(" ({l})")).unwrap_or_default())]
    DoesNotFit {
        rank: usize,
        needed: u64,
        capacity: u64,
        /// The rank's bytes by category at its peak.
        at_peak: memory::ByCategory,
        /// The split that needs least when even that does not fit (analytic model).
        least: Option<plan::partition::Shortfall>,
        what_fits: WhatFits,
    },
    /// A file that cannot be used as asked (a checkpoint, a policy, a data set's file).
    #[error("{path}: {why}")]
    BadInput {
        path: std::path::PathBuf,
        why: String,
    },
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What would fit where a plan does not (see [`Error::DoesNotFit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhatFits {
    /// A batch of this many images per replica pass, with the same stages.
    Batch(usize),
    /// This many pipeline stages, with the same batch.
    Stages(usize),
    /// Nothing with this batch: more memory is needed.
    Nothing,
}

impl std::fmt::Display for WhatFits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WhatFits::Batch(b) => write!(f, "a batch of {b} fits"),
            WhatFits::Stages(p) => write!(f, "{p} stages fit"),
            WhatFits::Nothing => write!(f, "no split fits this batch: more memory is needed"),
        }
    }
}
