//! Planning on a user's graph: the run's configuration, where the graph is cut into stages,
//! what each op and each rank is expected to cost (time and bytes), and the simulator. Exact
//! answers that need a metered run come through `fit`, which sits above the runtime.

pub mod calibrate;
pub mod config;
pub mod cost;
pub mod cuts;
pub mod fitted;
pub mod footprint;
pub mod layout;
pub mod memory;
pub mod offload;
pub mod partition;
pub mod simulate;
pub mod timeline;

pub use config::{RunConfig, TrainConfig};
pub use layout::Layout;
