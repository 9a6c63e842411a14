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
//! use gems::{models, Dataset, RunConfig, Scheme, Session, TrainConfig};
//! # fn main() -> gems::Result<()> {
//! let graph = models::build("resnet20v2", 32, 4)?;
//! // MAST: two replicas over two pipeline stages, ranks as threads of this process.
//! let scheme = Scheme::mast().stages(2);
//! let config = RunConfig::new(TrainConfig::new(2, 10), scheme);
//! // Exactly what each rank will hold, from a metered run of the same tasks.
//! let peaks = gems::fit::per_rank(&graph, &config)?;
//! assert_eq!(peaks.len(), 2);
//! let mut session = Session::new(&graph, config, Dataset::synthetic(32, 4, 0))?;
//! let report = session.step()?;
//! assert_eq!(report.images, 4);
//! assert!(report.loss.is_finite());
//! # Ok(()) }
//! ```
//!
//! Layers, each importing only those below it (a test holds this): `core`-level types
//! ([`DType`], [`Shape`], [`Error`]), `memory`, `backend`, `tensor`, `comm` and `data`, `ops`,
//! `graph`, `models` and `optim`, `schemes`, `plan`, `runtime`, `fit`, and the binary.

#![warn(missing_docs)]

pub mod backend;
pub mod bench;
pub mod comm;
pub mod core;
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

pub use backend::DeviceKind;
pub use data::{Dataset, Source};
pub use graph::{Graph, GraphBuilder};
pub use memory::{Category, MemoryStats, OutOfMemory};
pub use plan::{RunConfig, TrainConfig};
pub use runtime::{Evaluation, Model, Prediction, Session, StepReport};
pub use schemes::{Kind, Order, Scheme};
pub use tensor::{DType, Device, Precision, Shape, Tensor};

pub use crate::core::{Error, Result, WhatFits};
