//! The split a capacity allows, by the analytic memory model ([`footprint`]). The exact
//! per-rank answers (metered runs) and the choices made with them are in `fit`.

use crate::backend::meter::ConvWorkspace;
use crate::graph::policy::Keep;
use crate::graph::Graph;
use crate::plan::config::RunConfig;
use crate::plan::cost::{NodeCosts, TileCosts};
use crate::plan::footprint::{self, Footprint, StageBytes, StageMemory};
use crate::plan::partition::{self, Cost, Limit, Partition, Shortfall};
use crate::schemes::schedule::Timeline;
use crate::Result;

/// Splits tried one by one, each with its own schedule, when there are no more than this.
const EXHAUSTIVE: usize = 2048;

/// The split `c` runs with when it gives no balance: the fastest (by cost) among the splits
/// whose ranks all fit `c.train.device_memory` by the analytic model ([`footprint`]); balanced
/// by cost alone without a capacity, when saved tensors leave the device (the model keeps them
/// there; the save policy is then what fits the capacity), or when no split fits (the checks
/// before a run report it, with [`shortfall`]).
///
/// What a mirrored rank holds at once depends on how its two copies' tasks interleave, which
/// depends on the stage costs, that is on the split. Where the splits are few
/// (at most 2048), each is tried with its own schedule: exact. Otherwise the search starts
/// from the moments of the cost-balanced split's schedule, and searches again with every
/// moment seen so far until the split it returns has none it did not account for: it fits,
/// but a faster split that fits only its own schedule may be missed.
pub fn split(c: &RunConfig, g: &Graph, costs: &NodeCosts, tiles: &TileCosts) -> Result<Partition> {
    let p = c.scheme.model_stages();
    let cost = Cost::of(costs, tiles);
    let fastest = partition::balanced(g, p, &cost, None)?.expect("a split exists");
    let Some(model) = Model::of(c, g)? else {
        return Ok(fastest);
    };
    let bytes_of = |part: &Partition| -> Vec<StageBytes> {
        part.stages
            .iter()
            .map(|r| model.fp.stage(r.clone()))
            .collect()
    };
    // Each split with its own schedule, packed by its own bytes where the run packs by bytes.
    let moments_of = |part: &Partition| -> Result<_> {
        let stage_costs = tiles.stage_costs(costs, &part.stages);
        let s = c.timeline(&stage_costs, Some(&bytes_of(part)))?;
        Ok(footprint::moments(&s))
    };
    let fits = |part: &Partition, moments: &[Vec<footprint::Moment>]| {
        let ranks = footprint::rank_bytes(&c.scheme, moments, &bytes_of(part));
        ranks.iter().all(|&b| b <= model.cap)
    };
    if let Some(splits) = partition::every_split(g, p, EXHAUSTIVE) {
        // Few enough to try each with its own schedule: exact.
        let mut best: Option<Partition> = None;
        for part in splits {
            let faster = best
                .as_ref()
                .is_none_or(|b| cost.slowest(&part) < cost.slowest(b));
            if faster && fits(&part, &moments_of(&part)?) {
                best = Some(part);
            }
        }
        return Ok(best.unwrap_or(fastest));
    }
    let mut seen = moments_of(&fastest)?;
    loop {
        let Some(part) = partition::balanced(g, p, &cost, Some(&model.limit(c, &seen)))? else {
            return Ok(fastest);
        };
        // Still the fastest if it fits with the moments added too.
        if !footprint::merge(&mut seen, moments_of(&part)?) || fits(&part, &seen) {
            return Ok(part);
        }
    }
}

/// What each stage of `part` holds by the footprint model, where `c` packs its replicas by
/// bytes ([`RunConfig::packs_by_bytes`]) and the model applies; `None` otherwise.
pub fn stage_bytes(c: &RunConfig, g: &Graph, part: &Partition) -> Result<Option<Vec<StageBytes>>> {
    if !c.packs_by_bytes() || c.schedule.is_some() {
        return Ok(None);
    }
    Ok(Model::of(c, g)?.map(|model| {
        part.stages
            .iter()
            .map(|r| model.fp.stage(r.clone()))
            .collect()
    }))
}

/// Where `c` runs the split balanced by cost although a capacity is set because no split fits
/// it: the split of `g`'s stages whose fullest rank needs least, by the analytic model, given
/// the stages' `schedule` under the balanced split.
pub fn shortfall(
    c: &RunConfig,
    g: &Graph,
    schedule: &Timeline,
    costs: &NodeCosts,
    tiles: &TileCosts,
) -> Result<Option<Shortfall>> {
    let Some(model) = Model::of(c, g)? else {
        return Ok(None);
    };
    let moments = footprint::moments(schedule);
    let limit = model.limit(c, &moments);
    let cost = Cost::of(costs, tiles);
    let least = partition::least_memory(g, c.scheme.stages, &cost, &limit)?;
    Ok((least.need > model.cap).then_some(least))
}

/// The analytic model of a capped run whose saved tensors stay on the device.
struct Model {
    fp: Footprint,
    cap: u64,
}

impl Model {
    /// `None` where the model does not apply: no capacity, saved tensors off the device, or
    /// several model chunks per rank (the model counts one per orientation; the metered run
    /// still holds such a run to its capacity).
    fn of(c: &RunConfig, g: &Graph) -> Result<Option<Model>> {
        let Some(cap) = c.train.device_memory else {
            return Ok(None);
        };
        if c.scheme.chunks() > 1 {
            return Ok(None);
        }
        if c.train.saves.nodes.iter().any(|&k| k != Keep::Device) {
            return Ok(None);
        }
        let fp = Footprint::new(
            g,
            c.train.batch_size / c.scheme.parts,
            c.train.dtype,
            c.train.activations(),
            ConvWorkspace::of(c.train.device),
        )?
        .with_optimizer_state(c.train.optimizer.optimizer(c.train.sgd).state_names().len());
        Ok(Some(Model { fp, cap }))
    }

    fn limit<'a>(&'a self, c: &RunConfig, moments: &'a [Vec<footprint::Moment>]) -> Limit<'a> {
        Limit {
            cap: self.cap,
            stages: &self.fp,
            moments,
            mirrored: c.scheme.replicas >= 2,
            tiles: (0..c.scheme.stages).map(|s| c.scheme.width(s)).collect(),
        }
    }
}
