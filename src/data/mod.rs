//! Training data. Synthetic for now: deterministic images generated on the fly.

pub mod synthetic;
