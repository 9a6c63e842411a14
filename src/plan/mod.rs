//! Planning: where the graph is cut into stages, and what each op is expected to cost.

pub mod calibrate;
pub mod cost;
pub mod footprint;
pub mod memory;
pub mod offload;
pub mod partition;
pub mod simulate;
pub mod timeline;
