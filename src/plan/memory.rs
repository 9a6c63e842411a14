//! What training holds in device memory, exactly, per rank and category: the run itself on
//! metering devices (every allocation of the real task lists, no arithmetic), and the choices
//! that follow from it (the split, the largest batch, MAST's replicas).

use std::ops::Range;

use crate::backend::meter::ConvWorkspace;
use crate::graph::policy::Keep;
use crate::graph::Graph;
use crate::memory::{human_bytes, MemoryStats};
use crate::plan::cost::NodeCosts;
use crate::plan::footprint::{self, Footprint, StageMemory};
use crate::plan::partition::{self, Limit, Partition, Shortfall};
use crate::runtime::executor::{run_local, Layout, RunConfig};
use crate::schemes::schedule;
use crate::tensor::DType;
use crate::{Error, Result};

/// The split `c` runs with when it gives no balance: balanced by cost among the splits whose
/// ranks all fit `c.train.device_memory` by the analytic model ([`footprint`]); balanced by
/// cost alone without a capacity, when saved tensors leave the device (the model keeps them
/// there; the save policy is then what fits the capacity), or when no split fits (the checks
/// before a run report it, with [`shortfall`]).
///
/// What a mirrored rank holds at once depends on how its two copies' tasks interleave, which
/// depends on the stage costs: the search starts from the moments of the cost-balanced split's
/// schedule, and searches again with every moment seen so far until the split it returns has
/// none it did not account for.
pub fn split(c: &RunConfig, g: &Graph, costs: &NodeCosts) -> Result<Partition> {
    let p = c.scheme.stages;
    let total = costs.total();
    let fastest = partition::balanced(g, p, &total, None)?.expect("a split exists");
    let Some(model) = Model::of(c, g)? else {
        return Ok(fastest);
    };
    let moments_of = |part: &Partition| -> Result<_> {
        let s = schedule::build(&c.scheme, &costs.stage_costs(&part.stages), c.max_in_flight)?;
        Ok(footprint::moments(&s))
    };
    let mut seen = moments_of(&fastest)?;
    loop {
        let Some(part) = partition::balanced(g, p, &total, Some(&model.limit(c, &seen)))? else {
            return Ok(fastest);
        };
        if !footprint::merge(&mut seen, moments_of(&part)?) {
            return Ok(part);
        }
        // Still the fastest if it fits with the moments added too.
        let bytes: Vec<_> = part
            .stages
            .iter()
            .map(|r| model.fp.stage(r.clone()))
            .collect();
        let ranks = footprint::rank_bytes(&c.scheme, &seen, &bytes);
        if ranks.iter().all(|&b| b <= model.cap) {
            return Ok(part);
        }
    }
}

/// Where `c` runs the split balanced by cost although a capacity is set because no split fits
/// it: the split of its stages whose fullest rank needs least, by the analytic model.
pub fn shortfall(c: &RunConfig) -> Result<Option<Shortfall>> {
    if c.balance.is_some() {
        return Ok(None);
    }
    let layout = Layout::new(c)?;
    let Some(model) = Model::of(c, &layout.graph)? else {
        return Ok(None);
    };
    let moments = footprint::moments(&layout.schedule);
    let limit = model.limit(c, &moments);
    let total = layout.costs.total();
    let least = partition::least_memory(&layout.graph, c.scheme.stages, &total, &limit)?;
    Ok((least.need > model.cap).then_some(least))
}

/// The analytic model of a capped run whose saved tensors stay on the device.
struct Model {
    fp: Footprint,
    cap: u64,
}

impl Model {
    fn of(c: &RunConfig, g: &Graph) -> Result<Option<Model>> {
        let Some(cap) = c.train.device_memory else {
            return Ok(None);
        };
        if c.train.saves.nodes.iter().any(|&k| k != Keep::Device) {
            return Ok(None);
        }
        let fp = Footprint::new(
            g,
            c.train.batch_size / c.scheme.parts,
            c.train.dtype,
            c.train.activations(),
            ConvWorkspace::of(c.train.device),
        )?;
        Ok(Some(Model { fp, cap }))
    }

    fn limit<'a>(&'a self, c: &RunConfig, moments: &'a [Vec<footprint::Moment>]) -> Limit<'a> {
        Limit {
            cap: self.cap,
            stages: &self.fp,
            moments,
            mirrored: c.scheme.replicas >= 2,
        }
    }
}

/// Each rank's memory over one step of `c` (peak and bytes by category at the peak), from a
/// metered run: the same split, schedule, ops and transfers as a real run, without computing,
/// and without the capacity, so that it reports what the run needs.
pub fn per_rank(c: &RunConfig) -> Result<Vec<MemoryStats>> {
    let mut metered = c.clone();
    if c.balance.is_none() && c.train.device_memory.is_some() {
        // The split the capacity chose, given explicitly.
        let layout = Layout::new(c)?;
        metered.balance = Some(layout.partition.balance(&layout.graph));
    }
    metered.train.device_memory = None;
    metered.metered = true;
    metered.return_params = false;
    metered.train.steps = 1;
    Ok(run_local(&metered)?.into_iter().map(|r| r.memory).collect())
}

/// Whether `c` keeps every rank within `cap` with the split it would run with under that
/// capacity.
pub fn fits(c: &RunConfig, cap: u64) -> Result<bool> {
    let mut t = c.clone();
    t.train.device_memory = Some(cap);
    Ok(per_rank(&t)?.iter().all(|m| m.peak <= cap))
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

/// The fewest pipeline stages whose plan fits `cap`, the scheme becoming MP-Basic where it was
/// single; an error naming the closest miss when even the most cut points allow do not fit.
pub fn choose_split(c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let graph = crate::models::build(&c.train.model, c.train.image_size, c.train.classes)?;
    let most = crate::plan::partition::cut_points(&graph).len() + 1;
    if let Some(t) = fewest_stages(c, cap, 1..most + 1)? {
        return Ok(t);
    }
    let mut t = with_stages(c, most);
    t.train.device_memory = Some(cap);
    check_fits(&t).map(|_| t)
}

/// `c` with `p` stages (MP-Basic where it was single) and splits balanced by cost.
fn with_stages(c: &RunConfig, p: usize) -> RunConfig {
    let mut t = c.clone();
    t.balance = None;
    t.scheme.stages = p;
    if p > 1 && t.scheme.kind == crate::schemes::Kind::Single {
        t.scheme.kind = crate::schemes::Kind::Mp;
    }
    t
}

/// The fewest stages among `range` with which `c` fits `cap` (if any), found by doubling then
/// bisecting: more stages never hold more per rank.
fn fewest_stages(c: &RunConfig, cap: u64, range: Range<usize>) -> Result<Option<RunConfig>> {
    if range.is_empty() {
        return Ok(None);
    }
    let (mut lo, mut step) = (range.start, 1);
    let (mut hi, mut found) = loop {
        let p = (lo + step - 1).min(range.end - 1);
        let t = with_stages(c, p);
        if fits(&t, cap)? {
            break (p, t);
        }
        if p + 1 >= range.end {
            return Ok(None);
        }
        lo = p + 1;
        step *= 2;
    };
    while lo < hi {
        let mid = (lo + hi) / 2;
        let t = with_stages(c, mid);
        if fits(&t, cap)? {
            (hi, found) = (mid, t);
        } else {
            lo = mid + 1;
        }
    }
    Ok(Some(found))
}

/// Checks every rank's predicted peak against the capacity; the error names the rank that
/// exceeds it most, by how much, and what would fit: the largest batch with these stages, else
/// the fewest stages with this batch.
pub fn check_fits(c: &RunConfig) -> Result<()> {
    let Some(cap) = c.train.device_memory else {
        return Ok(());
    };
    let peaks = per_rank(c)?;
    let Some((rank, worst)) = peaks
        .iter()
        .enumerate()
        .max_by_key(|(_, m)| m.peak)
        .filter(|(_, m)| m.peak > cap)
    else {
        return Ok(());
    };
    let least = match shortfall(c)? {
        Some(s) => format!(" ({s})"),
        None => String::new(),
    };
    let graph = crate::models::build(&c.train.model, c.train.image_size, c.train.classes)?;
    let most = crate::plan::partition::cut_points(&graph).len() + 1;
    let what_fits = match largest_batch(c, cap, c.train.batch_size)? {
        0 => match fewest_stages(c, cap, c.scheme.stages + 1..most + 1)? {
            Some(t) => format!("--split {} fits", t.scheme.stages),
            None => "no split fits this batch: more memory is needed".to_string(),
        },
        b => format!("--batch-size {b} fits"),
    };
    Err(Error::Config(format!(
        "the plan does not fit: rank {rank} needs {} ({}), {} over the capacity of {}{least}; {what_fits}",
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
