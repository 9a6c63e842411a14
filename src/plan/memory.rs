//! What training holds in device memory. Exactly, per rank and category: the run itself on
//! metering devices (every allocation of the real task lists, no arithmetic). Roughly, from the
//! graph alone: parameters plus what forward saves per image.

use crate::graph::Graph;
use crate::memory::{human_bytes, MemoryStats};
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

/// Checks every rank's predicted peak against the capacity; the error names the rank that
/// exceeds it most, by how much, and the largest batch that would fit.
pub fn check_fits(c: &RunConfig) -> Result<()> {
    let Some(cap) = c.train.device_memory else {
        return Ok(());
    };
    let unlimited = |c: &RunConfig| RunConfig {
        train: crate::train::TrainConfig {
            device_memory: None,
            ..c.train.clone()
        },
        ..c.clone()
    };
    let peaks = per_rank(&unlimited(c))?;
    let Some((rank, worst)) = peaks
        .iter()
        .enumerate()
        .max_by_key(|(_, m)| m.peak)
        .filter(|(_, m)| m.peak > cap)
    else {
        return Ok(());
    };
    let fits = |b: usize| -> Result<bool> {
        let mut t = unlimited(c);
        t.train.batch_size = b * c.scheme.parts;
        Ok(per_rank(&t)?.iter().all(|m| m.peak <= cap))
    };
    // Largest multiple of m that fits: grow, then bisect.
    let (mut lo, mut hi) = (0, 1);
    while hi * c.scheme.parts < c.train.batch_size && fits(hi)? {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let what_fits = if lo == 0 {
        "no batch fits this split: try more stages (--split) or more memory".to_string()
    } else {
        format!("--batch-size {} fits", lo * c.scheme.parts)
    };
    Err(crate::Error::Config(format!(
        "the plan does not fit: rank {rank} needs {} ({}), {} over the capacity of {}; {what_fits}",
        human_bytes(worst.peak),
        worst.at_peak,
        human_bytes(worst.peak - cap),
        human_bytes(cap)
    )))
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
