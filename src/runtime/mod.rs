//! Running training: a [`Session`] holds a model under a scheme on its ranks and runs it one
//! step at a time for the caller's loop; checkpoints any scheme can resume from; evaluation.

pub mod checkpoint;
pub mod evaluation;
pub mod folder;
mod rank;
mod session;

pub use checkpoint::{Checkpoint, Lineage, TrainingState};
pub use evaluation::Evaluation;
pub use folder::{CheckpointFolder, FolderRules};
pub use rank::{CopyValues, RankStep};
pub use session::{meter, DeviceSummary, Session, StepReport};
