//! Everything that can go wrong on a user path, as types a caller can match.

use super::bytes::{human_bytes, ByCategory, OutOfMemory, Shortfall};

/// Everything that can go wrong on a user path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A device allocation over its capacity.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// Tensors or a model whose shapes do not fit together.
    #[error("shape error: {0}")]
    Shape(String),
    /// A run configured in a way it cannot run (the message says what is allowed).
    #[error("{0}")]
    Config(String),
    /// Ranks that could not exchange data (a peer failed or left).
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
        human_bytes(*needed), human_bytes(needed.saturating_sub(*capacity)),
        human_bytes(*capacity), least.as_ref().map(|l| format!(" ({l})")).unwrap_or_default())]
    DoesNotFit {
        /// The rank that exceeds the capacity most.
        rank: usize,
        /// Its peak in bytes.
        needed: u64,
        /// The capacity in bytes.
        capacity: u64,
        /// The rank's bytes by category at its peak.
        at_peak: ByCategory,
        /// The split that needs least when even that does not fit (analytic model).
        least: Option<Box<Shortfall>>,
        /// What would fit instead.
        what_fits: WhatFits,
    },
    /// Training produced a non-finite loss or gradient at `step` (1-based); nothing of that
    /// step was applied, so the weights are those after the step before.
    #[error("training diverged at step {step}: {what}; the weights are those of step {}, unchanged", step - 1)]
    Diverged {
        /// The step that went wrong (1-based).
        step: usize,
        /// What was not finite.
        what: String,
    },
    /// A file that cannot be used as asked (a checkpoint, a policy, a data set's file).
    #[error("{path}: {why}")]
    BadInput {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A checkpoint folder holding `checkpoints` checkpoints (`first` … `last`) of another run,
    /// which a run may not write into unless it resumes from one of them or may overwrite them.
    #[error("{} holds {checkpoints} checkpoint(s) of another run ({first} … {last}): resume from one of them, choose another folder, or allow overwriting them", dir.display())]
    FolderInUse {
        /// The folder.
        dir: std::path::PathBuf,
        /// How many checkpoints of the other run it holds.
        checkpoints: usize,
        /// The first of them by name.
        first: String,
        /// The last of them by name.
        last: String,
    },
    /// A checkpoint folder another live run is writing into.
    #[error("{} is in use by another run ({holder}): wait for it to end, or choose another folder", dir.display())]
    FolderLocked {
        /// The folder.
        dir: std::path::PathBuf,
        /// Who holds it, as its lock file says: pid, host and start time.
        holder: String,
    },
    /// A broken invariant of gems itself: a bug to report.
    #[error("internal error: {0}")]
    Internal(String),
    /// A file system error.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// gems's result type: [`Error`] unless said otherwise.
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
