//! The user's `auto` and `max` choices resolved against a capacity with exact answers: each
//! rank's memory comes from a metered run (the real task lists on devices that allocate and do
//! not compute), and the split, the largest batch, MAST's replicas and the offload policy are
//! searched with it. This layer sits above the runtime, which the planner below never imports.

pub mod study;

use std::ops::Range;

use crate::backend::cuda::ConvImpl;
use crate::backend::DeviceKind;
use crate::graph::policy::Keep;
use crate::graph::Graph;
use crate::memory::{ByCategory, Category, Held, MemoryStats};
use crate::ops::tiles::Grid;
use crate::plan::offload::{self, Chosen, HostLink};
use crate::plan::{Layout, RunConfig};
use crate::runtime::{meter, RankStep};
use crate::schemes::Kind;
use crate::tensor::Device;
use crate::tensor::Precision;
use crate::{Error, Result, WhatFits};

/// Each rank's memory over one step of `c` on `g` (peak and bytes by category at the peak),
/// from a metered run: the same split, schedule, ops and transfers as a real run, without
/// computing, and without the capacity, so that it reports what the run needs.
pub fn per_rank(g: &Graph, c: &RunConfig) -> Result<Vec<MemoryStats>> {
    Ok(metered_step(g, c)?.into_iter().map(|r| r.memory).collect())
}

/// The device's bytes during each task of each pipeline position (its first rank: tile 0 of
/// data-parallel group 0), from a metered run as [`per_rank`]'s: the most live at once and
/// what was live when the task ended, everything a rank holds counted (weights, optimizer
/// state, activations of its own tiles, what waits in the host tier left out).
pub fn per_task(g: &Graph, c: &RunConfig) -> Result<Vec<Vec<Held>>> {
    let mut ranks = metered_step(g, c)?;
    Ok((0..c.scheme.stages)
        .map(|p| std::mem::take(&mut ranks[c.scheme.first_rank(p)].held))
        .collect())
}

/// One metered step of `c` as [`per_rank`] describes it.
fn metered_step(g: &Graph, c: &RunConfig) -> Result<Vec<RankStep>> {
    let mut metered = c.clone();
    if c.train.device_memory.is_some() && (c.balance.is_none() || c.packs_by_bytes()) {
        // The split and the tasks the capacity chose, given explicitly.
        let layout = Layout::new(g, c)?;
        metered.balance = Some(layout.partition.balance(&layout.graph));
        if c.schedule.is_none() {
            metered.schedule = Some(std::sync::Arc::new(layout.schedule.schedule(&c.scheme)));
        }
    }
    metered.train.device_memory = None;
    meter(g, metered)
}

/// Whether `c` keeps every rank within `cap` with the split it would run with under that
/// capacity.
pub fn fits(g: &Graph, c: &RunConfig, cap: u64) -> Result<bool> {
    let mut t = c.clone();
    t.train.device_memory = Some(cap);
    Ok(per_rank(g, &t)?.iter().all(|m| m.peak <= cap))
}

/// The largest batch (a multiple of m, at most `limit`) with which `c` fits `cap`; 0 if none.
pub fn largest_batch(g: &Graph, c: &RunConfig, cap: u64, limit: usize) -> Result<usize> {
    let m = c.scheme.parts;
    let with = |b: usize| {
        let mut t = c.clone();
        t.train.batch_size = b * m;
        fits(g, &t, cap)
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

/// MAST's replicas by memory: the pair, the second replica's forwards admitted by bytes (as
/// many as the memory the first leaves free holds: all at once where it holds both), if it
/// fits, else the pair holding one replica's activations at a time, else one replica
/// (MP-Basic).
pub fn choose_replicas(g: &Graph, c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let mut pair = c.clone();
    pair.scheme.kind = Kind::Mast;
    pair.scheme.replicas = 2;
    pair.max_in_flight = None;
    if fits(g, &pair, cap)? {
        return Ok(pair);
    }
    pair.max_in_flight = Some(c.scheme.parts);
    if fits(g, &pair, cap)? {
        return Ok(pair);
    }
    let mut one = c.clone();
    one.scheme.kind = Kind::Mp;
    one.scheme.replicas = 1;
    Ok(one)
}

/// The fewest pipeline stages whose plan fits `cap`, the scheme becoming MP-Basic where it was
/// single, with the split the capacity chose given as its balance; an error naming the closest
/// miss when even the most cut points allow do not fit.
pub fn choose_split(g: &Graph, c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let most = most_stages(g);
    let mut t = match fewest_stages(g, c, cap, 1..most + 1)? {
        Some(t) => t,
        None => {
            let mut t = with_stages(c, most);
            t.train.device_memory = Some(cap);
            check_fits(g, &t)?;
            t
        }
    };
    let mut capped = t.clone();
    capped.train.device_memory = Some(cap);
    let layout = Layout::new(g, &capped)?;
    t.balance = Some(layout.partition.balance(&layout.graph));
    Ok(t)
}

/// Grids tried by [`choose_spatial`], fewest tiles first: for each tile count the squarest grid
/// (the least halo per tile), up to 8x8.
fn grids() -> Vec<Grid> {
    let mut out = Vec::new();
    for n in 1..=64usize {
        let rows = (1..=n)
            .filter(|r| n.is_multiple_of(*r) && r * r <= n)
            .max()
            .unwrap_or(1);
        let (rows, cols) = (rows, n / rows);
        // Only grids as square as a tile count allows (no 1x7): at most twice as wide as tall.
        if cols <= 2 * rows || n <= 2 {
            out.push(Grid { rows, cols });
        }
    }
    out
}

/// Of the grids of tiles (the squarest of each tile count, up to 8x8) whose plan fits `cap`,
/// the one with the least predicted step, the first stage of `c` split into it (ties: fewer
/// tiles); an error naming the closest miss when even 8x8 tiles do not fit. More tiles shrink
/// each tile rank's share of the compute but add halo exchanges and statistics' sums, and where
/// the ranks share one device (local CPU ranks) they only add.
pub fn choose_spatial(g: &Graph, c: &RunConfig, cap: u64) -> Result<RunConfig> {
    let side = g.image_size();
    let mut candidates: Vec<RunConfig> = Vec::new();
    let graph = std::sync::Arc::new(g.clone());
    for grid in grids()
        .into_iter()
        .filter(|t| t.rows <= side && t.cols <= side)
    {
        let mut t = c.clone();
        t.scheme.spatial = grid;
        // Grids whose tiles would mostly compute gathered copies are not tried.
        let layout = Layout::weighed(graph.clone(), &t)?;
        if !layout.tiled.is_some_and(|r| r.stops_paying()) {
            candidates.push(t);
        }
    }
    // More tiles never hold more per rank: grids with fewer than the first that fits do not.
    let mut first = None;
    for (i, t) in candidates.iter().enumerate() {
        if fits(g, t, cap)? {
            first = Some(i);
            break;
        }
    }
    let Some(first) = first else {
        let mut last = candidates.last().expect("1x1 is a grid").clone();
        last.train.device_memory = Some(cap);
        return check_fits(g, &last).map(|_| last);
    };
    // Timed with the split the capacity chooses.
    let shared = c.train.device == DeviceKind::Cpu;
    let step = |t: &RunConfig| -> Result<f64> {
        let mut capped = t.clone();
        capped.train.device_memory = Some(cap);
        Ok(Layout::new(g, &capped)?.predicted_step(shared))
    };
    candidates.drain(..first);
    let fewest = step(&candidates[0])?;
    let mut faster = Vec::new();
    for t in candidates.drain(1..) {
        let time = step(&t)?;
        if time < fewest {
            faster.push((time, t));
        }
    }
    // Stable: of equal times, fewer tiles first.
    faster.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (_, t) in faster {
        if fits(g, &t, cap)? {
            return Ok(t);
        }
    }
    Ok(candidates.swap_remove(0))
}

/// The most stages `g` can be cut into.
fn most_stages(g: &Graph) -> usize {
    crate::plan::cuts::cut_points(g).len() + 1
}

/// `c` with `p` stages (MP-Basic where it was single) and splits balanced by cost.
fn with_stages(c: &RunConfig, p: usize) -> RunConfig {
    let mut t = c.clone();
    t.balance = None;
    t.scheme.stages = p;
    if p > 1 && t.scheme.kind == Kind::Single {
        t.scheme.kind = Kind::Mp;
    }
    t
}

/// The fewest stages among `range` with which `c` fits `cap` (if any), found by doubling then
/// bisecting: more stages never hold more per rank.
fn fewest_stages(
    g: &Graph,
    c: &RunConfig,
    cap: u64,
    range: Range<usize>,
) -> Result<Option<RunConfig>> {
    if range.is_empty() {
        return Ok(None);
    }
    let (mut lo, mut step) = (range.start, 1);
    let (mut hi, mut found) = loop {
        let p = (lo + step - 1).min(range.end - 1);
        let t = with_stages(c, p);
        if fits(g, &t, cap)? {
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
        if fits(g, &t, cap)? {
            (hi, found) = (mid, t);
        } else {
            lo = mid + 1;
        }
    }
    Ok(Some(found))
}

/// Checks every rank's metered peak against the capacity (the device memory given, else on
/// the CPU the machine's memory), then that the data loader's prefetched batches fit the
/// machine's memory beside it; [`Error::DoesNotFit`] names the rank that exceeds it most,
/// by how much, and what would fit: the largest batch with these stages, else the fewest
/// stages with this batch.
pub fn check_fits(g: &Graph, c: &RunConfig) -> Result<()> {
    c.check()?;
    let host = crate::memory::physical_memory();
    let cap = match (c.train.device_memory, c.train.device) {
        (Some(cap), _) => Some(cap),
        // Uncapped, a CPU rank still cannot hold more than the machine's memory: sizes no run
        // can hold are refused here, not by an allocation that aborts the process.
        (None, DeviceKind::Cpu) => host,
        (None, _) => None,
    };
    let mut device_peak = 0;
    if let Some(cap) = cap {
        device_peak = check_device(g, c, cap)?;
    }
    // The loader's batches live in host memory, beside a CPU rank's own.
    let on_host = match c.train.device {
        DeviceKind::Cpu => device_peak,
        _ => 0,
    };
    let loader = c.loader_bytes(g.image_size());
    match host {
        Some(host) if loader.saturating_add(on_host) > host => Err(Error::Config(format!(
            "prefetching {} micro-batches of {} images ahead holds up to {} of host memory, \
             more than this machine's {} leaves{}",
            c.train.data.prefetch,
            c.micro_batch(),
            crate::memory::human_bytes(loader),
            crate::memory::human_bytes(host),
            match on_host {
                0 => String::new(),
                b => format!(" beside the rank's {}", crate::memory::human_bytes(b)),
            }
        ))),
        _ => Ok(()),
    }
}

/// The largest rank's metered peak if every rank fits `cap`, else [`Error::DoesNotFit`].
fn check_device(g: &Graph, c: &RunConfig, cap: u64) -> Result<u64> {
    let (input, weights) = (input_bytes(g, c), weight_bytes(g, c));
    if input.saturating_add(weights) > cap {
        // One micro-batch's input and the model's weights alone exceed the capacity: refused
        // without metering (a metered run would make them on the host); `needed` is then
        // those two, a lower bound.
        let mut at_peak = ByCategory::only(Category::Activations, input);
        at_peak.0[Category::Weights.index()] = weights;
        return Err(Error::DoesNotFit {
            rank: 0,
            needed: input.saturating_add(weights),
            capacity: cap,
            at_peak,
            least: None,
            what_fits: what_fits(g, c, cap)?,
        });
    }
    let peaks = per_rank(g, c)?;
    let Some((rank, worst)) = peaks.iter().enumerate().max_by_key(|(_, m)| m.peak) else {
        return Ok(0);
    };
    if worst.peak <= cap {
        return Ok(worst.peak);
    }
    Err(Error::DoesNotFit {
        rank,
        needed: worst.peak,
        capacity: cap,
        at_peak: worst.at_peak,
        least: crate::plan::layout::shortfall(g, c)?.map(Box::new),
        what_fits: what_fits(g, c, cap)?,
    })
}

/// What fits `cap` where `c` does not: the largest batch with these stages, else the fewest
/// stages with this batch.
fn what_fits(g: &Graph, c: &RunConfig, cap: u64) -> Result<WhatFits> {
    // More stages take other tasks: their order's, not a schedule written for these.
    let own_order = RunConfig {
        schedule: None,
        ..c.clone()
    };
    Ok(match largest_batch(g, c, cap, c.train.batch_size)? {
        0 => match fewest_stages(g, &own_order, cap, c.scheme.stages + 1..most_stages(g) + 1)? {
            Some(t) => WhatFits::Stages(t.scheme.stages),
            None => WhatFits::Nothing,
        },
        b => WhatFits::Batch(b),
    })
}

/// Bytes of the parameters every rank holds whole (saturating): the model's with one stage,
/// else none counted here.
fn weight_bytes(g: &Graph, c: &RunConfig) -> u64 {
    match c.scheme.stages {
        1 => (g.parameter_count() as u64).saturating_mul(c.train.dtype.size() as u64),
        _ => 0,
    }
}

/// Bytes of one micro-batch's input images, saturating (sizes from a command line can be
/// anything).
fn input_bytes(g: &Graph, c: &RunConfig) -> u64 {
    let side = g.image_size() as u64;
    [
        c.micro_batch() as u64,
        3,
        side,
        side,
        c.train.activations().size() as u64,
    ]
    .into_iter()
    .fold(1u64, u64::saturating_mul)
}

/// The offload policy with the least predicted exposed time under which every rank of `c`
/// fits `cap` (`--offload auto`): nothing moves if the run fits as it is; an error if even
/// moving every node does not fit. The candidates come from the planner's cost model; the
/// shortest prefix of them that fits is found by bisection on metered runs.
pub fn choose_offload(
    g: &Graph,
    c: &RunConfig,
    cap: u64,
    link: &HostLink,
    prefetch: usize,
) -> Result<Chosen> {
    let layout = Layout::new(g, c)?;
    let candidates = |keeps: &[Keep]| {
        offload::candidates(
            g,
            &layout.costs,
            (c.micro_batch(), c.train.activations()),
            link,
            prefetch,
            keeps,
        )
    };
    let policy =
        |choices: &[offload::Choice], k: usize| offload::take(g.nodes.len(), choices, k, prefetch);
    let fits_with = |choices: &[offload::Choice], k: usize| {
        let mut t = c.clone();
        t.train.saves = policy(choices, k);
        fits(g, &t, cap)
    };
    // Each node's cheaper of offload and recompute; where even all of them cannot hold the
    // cap, every node offloaded (recomputing keeps a node's input on the device).
    let mut choices = candidates(&[Keep::Host, Keep::Recompute]);
    if !fits_with(&choices, choices.len())? {
        choices = candidates(&[Keep::Host]);
    }
    let policy = |k: usize| policy(&choices, k);
    let with = |k: usize| fits_with(&choices, k);
    if !with(choices.len())? {
        let mut t = c.clone();
        t.train.saves = policy(choices.len());
        let peak = per_rank(g, &t)?.iter().map(|m| m.peak).max().unwrap_or(0);
        return Err(Error::Config(format!(
            "even with every saved tensor offloaded a rank needs {}, over the {} cap: use more stages or a smaller batch",
            crate::memory::human_bytes(peak),
            crate::memory::human_bytes(cap)
        )));
    }
    // The least k that fits.
    let (mut lo, mut hi) = (0, choices.len());
    if with(0)? {
        hi = 0;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if with(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let steps_micro = c.scheme.micro_batches_per_step() as f64;
    Ok(Chosen {
        policy: policy(hi),
        exposed: choices[..hi].iter().map(|c| c.exposed).sum::<f64>() * steps_micro,
        bytes: choices[..hi].iter().map(|c| c.bytes).sum(),
    })
}

/// The host link of a device as measured copies show it: on a GPU the slowest pinned copy
/// direction (copies overlap compute), on the CPU the model's memory copies.
pub fn link_model(kind: DeviceKind, measured: &[crate::bench::Bandwidth]) -> HostLink {
    match kind {
        DeviceKind::Cpu => HostLink::CPU,
        DeviceKind::Cuda { .. } => HostLink {
            bytes_per_s: measured
                .iter()
                .filter(|b| b.kernel.ends_with("pinned"))
                .map(|b| b.gb_per_s() * 1e9)
                .fold(f64::INFINITY, f64::min),
            overlaps: true,
        },
    }
}

/// The host link offload is planned with: measured on a GPU (64 MiB copies), the CPU's model
/// otherwise.
pub fn host_link(kind: DeviceKind, precision: Precision) -> Result<HostLink> {
    if kind == DeviceKind::Cpu {
        return Ok(HostLink::CPU);
    }
    // Copies only: the convolution path does not matter.
    let device = Device::open(
        kind,
        precision,
        ConvImpl::Native,
        &kind.to_string(),
        0,
        None,
    )?;
    Ok(link_model(
        kind,
        &crate::bench::host_link(&device, 64 << 20, 3)?,
    ))
}

/// The capacity a run's choices are made against: the configured device memory, or on a GPU
/// what the device would offer; `None` on the CPU without a cap.
pub fn capacity(c: &RunConfig) -> Option<u64> {
    match (c.train.device_memory, c.train.device) {
        (Some(cap), _) => Some(cap),
        (None, DeviceKind::Cuda { ordinal }) => crate::backend::cuda::devices()
            .ok()
            .and_then(|g| g.into_iter().find(|g| g.ordinal == ordinal))
            .map(|g| crate::backend::cuda::capacity(g.free_memory, None)),
        (None, DeviceKind::Cpu) => None,
    }
}

/// Which of a run's sizes the planner chooses against the capacity (the rest are as given).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Auto {
    /// The fewest pipeline stages that fit.
    pub split: bool,
    /// MAST's pair where memory holds it (packed by bytes), else one replica.
    pub replicas: bool,
    /// The largest batch that fits.
    pub batch: bool,
    /// Where saved tensors wait, with offloaded ones fetched this many nodes ahead.
    pub offload: Option<usize>,
    /// The grid of tiles of the first stage's samples with the least predicted step that fits.
    pub spatial: bool,
}

/// A run with its `auto` sizes chosen, and the offload policy's predicted cost if chosen.
pub struct Resolved {
    /// The run with its sizes chosen.
    pub config: RunConfig,
    /// The offload policy chosen and its predicted cost, when it was left to the planner.
    pub offload: Option<Chosen>,
}

/// Chooses the sizes `auto` leaves open for `c` on `g`, in order: the split, MAST's replicas,
/// the batch, then the offload policy, each against [`capacity`] with metered runs.
pub fn resolve(g: &Graph, mut c: RunConfig, auto: Auto) -> Result<Resolved> {
    c.check()?;
    let capacity = capacity(&c);
    let cap = |what: &str| {
        capacity.ok_or_else(|| {
            Error::Config(format!(
                "choosing {what} needs a device capacity (or a GPU) to choose against"
            ))
        })
    };
    if auto.spatial {
        c = choose_spatial(g, &c, cap("the grid of tiles")?)?;
    }
    if auto.split {
        c = choose_split(g, &c, cap("the split")?)?;
    }
    if auto.replicas {
        if c.scheme.kind != Kind::Mast {
            return Err(Error::Config(
                "choosing replicas chooses between MAST's pair and one replica: use it with mast"
                    .into(),
            ));
        }
        c = choose_replicas(g, &c, cap("the replicas")?)?;
    }
    if auto.batch {
        let cap = cap("the batch size")?;
        c.train.batch_size = match largest_batch(g, &c, cap, 1 << 20)? {
            0 => {
                return Err(Error::Config(format!(
                    "no batch fits {} with this split",
                    crate::memory::human_bytes(cap)
                )))
            }
            b => b,
        };
    }
    let offload = match auto.offload {
        Some(prefetch) => {
            let cap = cap("where saved tensors wait")?;
            let link = host_link(c.train.device, c.train.precision)?;
            let chosen = choose_offload(g, &c, cap, &link, prefetch)?;
            c.train.saves = chosen.policy.clone();
            Some(chosen)
        }
        None => None,
    };
    Ok(Resolved { config: c, offload })
}
