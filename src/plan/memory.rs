//! What training holds in device memory. Exactly, per rank and category: the run itself on
//! metering devices (every allocation of the real task lists, no arithmetic). Roughly, from the
//! graph alone: parameters plus what forward saves per image.

use crate::graph::Graph;
use crate::memory::MemoryStats;
use crate::runtime::executor::{run_local, RunConfig};
use crate::tensor::DType;
use crate::Result;

/// Each rank's memory over one step of `c` (peak and bytes by category at the peak), from a
/// metered run: the same schedule, ops and transfers as a real run, without computing.
pub fn per_rank(c: &RunConfig) -> Result<Vec<MemoryStats>> {
    let mut metered = c.clone();
    metered.metered = true;
    metered.return_params = false;
    metered.train.steps = 1;
    Ok(run_local(&metered)?.into_iter().map(|r| r.memory).collect())
}

/// Bytes that do not depend on the batch: parameter values and BN statistics, gradients and
/// momentum buffers of the trainable ones.
pub fn fixed_bytes(g: &Graph, dtype: DType) -> u64 {
    let all: usize = g.params.iter().map(|p| p.spec.shape.numel()).sum();
    ((all + 2 * g.parameter_count()) * dtype.size()) as u64
}

/// Bytes per image at the peak of a training step: what forward saves for backward, plus the
/// largest single output being produced on top of it.
pub fn per_image_bytes(g: &Graph, dtype: DType) -> u64 {
    let largest = g
        .nodes
        .iter()
        .map(|n| g.values[n.output].shape.numel())
        .max()
        .unwrap_or(0);
    g.saved_bytes_per_sample(dtype) + (largest * dtype.size()) as u64
}

/// Predicted peak bytes of one single-device training step with `batch` images.
pub fn single_device_peak(g: &Graph, batch: usize, dtype: DType) -> u64 {
    fixed_bytes(g, dtype) + batch as u64 * per_image_bytes(g, dtype)
}

/// The largest batch whose predicted peak fits `capacity`, if any does.
pub fn largest_batch(g: &Graph, dtype: DType, capacity: u64) -> Option<usize> {
    let free = capacity.checked_sub(fixed_bytes(g, dtype))?;
    let b = (free / per_image_bytes(g, dtype).max(1)) as usize;
    (b > 0).then_some(b)
}
