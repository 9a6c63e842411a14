//! What training holds in device memory, predicted from the graph.

use crate::graph::Graph;
use crate::tensor::DType;

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
