//! gems: memory-aware model-parallel training of deep CNNs on very large images.
//!
//! Data flows top to bottom: `models` build a `graph`; `runtime` executes it on a `backend`
//! `Device`, whose bytes are accounted by `memory`; `ops` hold each op's shapes, forward,
//! backward and costs.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod graph;
pub mod memory;
pub mod models;
pub mod ops;
pub mod plan;
pub mod runtime;
pub mod schemes;
pub mod tensor;
pub mod train;

pub use backend::Device;
pub use memory::{Category, OutOfMemory};
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
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
