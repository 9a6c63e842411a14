//! Running training: a [`Session`] holds a model under a scheme on its ranks and runs it one
//! step at a time for the caller's loop; checkpoints any scheme can resume from; evaluation;
//! a trained [`Model`] predicting.

pub mod checkpoint;
pub mod evaluation;
pub mod folder;
mod model;
mod rank;
mod session;
pub mod whole_slide;

pub use checkpoint::{Checkpoint, Lineage, OptimizerState, TrainingState};
pub use evaluation::{Evaluation, SampleScore};
pub use folder::{CheckpointFolder, FolderRules};
pub use model::{Model, Prediction};
pub use rank::{CopyValues, RankStep};
pub use session::{meter, DeviceSummary, Session, StepHook, StepReport};

/// An f64 crossing ranks as its bits: JSON has no NaN or infinity, and an overflowing fp16
/// step's loss can be either.
pub(crate) mod f64_bits {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(v.to_bits())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        u64::deserialize(d).map(f64::from_bits)
    }
}
