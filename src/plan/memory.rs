//! What training holds in device memory, exactly, per rank and category: the run itself on
//! metering devices (every allocation of the real task lists, no arithmetic), and the choices
//! that follow from it (the largest batch, MAST's replicas).

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

/// `c` without a capacity, so that a metered run reports what it would need.
fn unlimited(c: &RunConfig) -> RunConfig {
    let mut u = c.clone();
    u.train.device_memory = None;
    u
}

/// Whether every rank of `c` stays within `cap` bytes.
pub fn fits(c: &RunConfig, cap: u64) -> Result<bool> {
    Ok(per_rank(&unlimited(c))?.iter().all(|m| m.peak <= cap))
}

/// The largest batch (a multiple of m, at most `limit`) with which `c` fits `cap`; 0 if none.
pub fn largest_batch(c: &RunConfig, cap: u64, limit: usize) -> Result<usize> {
    let m = c.scheme.parts;
    let with = |b: usize| {
        let mut t = c.clone();
        t.train.batch_size = b * m;
        fits(&t, cap)
    };
    // In micro-batch sizes: grow, then bisect.
    let (mut lo, mut hi) = (0, 1);
    while hi * m <= limit && with(hi)? {
        lo = hi;
        hi *= 2;
    }
    hi = hi.min(limit / m + 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if with(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo * m)
}

/// MAST's replicas by memory: the overlapped pair if it fits, else the pair holding one
/// replica's activations at a time, else one replica (MP-Basic).
pub fn choose_replicas(c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let mut pair = c.clone();
    pair.scheme.kind = crate::schemes::Kind::Mast;
    pair.scheme.replicas = 2;
    pair.max_in_flight = None;
    if fits(&pair, cap)? {
        return Ok(pair);
    }
    pair.max_in_flight = Some(c.scheme.parts);
    if fits(&pair, cap)? {
        return Ok(pair);
    }
    let mut one = c.clone();
    one.scheme.kind = crate::schemes::Kind::Mp;
    one.scheme.replicas = 1;
    Ok(one)
}

/// The fewest pipeline stages (balanced by cost) whose plan fits `cap`, the scheme becoming
/// MP-Basic where it was single; an error with the closest miss when even the most cut points
/// allow does not fit.
pub fn choose_split(c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let graph = crate::models::build(&c.train.model, c.train.image_size, c.train.classes)?;
    let most = crate::plan::partition::cut_points(&graph).len() + 1;
    let mut t = c.clone();
    t.balance = None;
    for p in 1..=most {
        t.scheme.stages = p;
        if p > 1 && t.scheme.kind == crate::schemes::Kind::Single {
            t.scheme.kind = crate::schemes::Kind::Mp;
        }
        if fits(&t, cap)? {
            return Ok(t);
        }
    }
    t.train.device_memory = Some(cap);
    check_fits(&t).map(|_| t)
}

/// Checks every rank's predicted peak against the capacity; the error names the rank that
/// exceeds it most, by how much, and the largest batch that would fit.
pub fn check_fits(c: &RunConfig) -> Result<()> {
    let Some(cap) = c.train.device_memory else {
        return Ok(());
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
    let what_fits = match largest_batch(c, cap, c.train.batch_size)? {
        0 => "no batch fits this split: try more stages (--split) or more memory".to_string(),
        b => format!("--batch-size {b} fits"),
    };
    Err(crate::Error::Config(format!(
        "the plan does not fit: rank {rank} needs {} ({}), {} over the capacity of {}; {what_fits}",
        human_bytes(worst.peak),
        worst.at_peak,
        human_bytes(worst.peak - cap),
        human_bytes(cap)
    )))
}

/// A metered single-device run of `model` with batch `batch` (for questions about one device).
pub fn single_device(
    model: &str,
    image_size: usize,
    classes: usize,
    dtype: DType,
    batch: usize,
) -> RunConfig {
    use crate::schemes::Scheme;
    let train = crate::train::TrainConfig {
        dtype,
        ..crate::train::TrainConfig::new(model, image_size, classes, batch, 1)
    };
    let mut c = RunConfig::new(train, Scheme::single(1));
    c.metered = true;
    c
}
