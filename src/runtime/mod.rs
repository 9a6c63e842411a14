//! Running training: the optimizer and learning-rate schedules.

pub mod executor;
pub mod optim;
pub mod schedule;
