//! Everything the ranks of a run agree on: the graph, its stages, the values crossing each
//! boundary, and the schedule. The same layout drives the real run, the metered run and the
//! simulator, so prediction and measurement are always comparable.

use std::sync::Arc;

use crate::backend::DeviceKind;
use crate::graph::{Graph, Output, ValueId};
use crate::plan::config::RunConfig;
use crate::plan::cost::{reduce_costs, DeviceProfile, Link, NodeCosts, TileCosts};
use crate::plan::cuts::crossing;
use crate::plan::memory;
use crate::plan::offload::HostLink;
use crate::plan::partition::{self, Partition};
use crate::schemes::admission::Admission;
use crate::schemes::schedule::{StageCosts, Timeline};
use crate::tensor::DType;
use crate::{Error, Result};

/// A graph split into stages and scheduled.
pub struct Layout {
    /// The model.
    pub graph: Arc<Graph>,
    /// Its stages.
    pub partition: Partition,
    /// Values entering each stage (the boundary before it), in a fixed order.
    pub inputs: Vec<Vec<ValueId>>,
    /// Values leaving each stage for the next.
    pub outputs: Vec<Vec<ValueId>>,
    /// Loss outputs each stage produces.
    pub losses: Vec<Vec<Output>>,
    /// What each node costs: measured (a calibration) or predicted (the fitted CPU model,
    /// [`crate::plan::fitted`]).
    pub costs: NodeCosts,
    /// What each node costs on a rank of a tile group, exchanges included (the analytical
    /// CPU model's link).
    pub tiles: TileCosts,
    /// Seconds of one optimizer step over the whole model.
    pub optimizer: f64,
    /// Each rank's tasks for one step, with their predicted times.
    pub schedule: Timeline,
    /// The same tasks timed for ranks that share this CPU's threads: the ranks computing at
    /// each moment split them (see [`Layout::predicted_step`]).
    pub shared: Timeline,
    /// What admitted its forwards (nothing where the caller wrote the tasks).
    pub admission: Admission,
    /// Where the first stage's tiles stop, under spatial parallelism.
    pub tiled: Option<TiledRegion>,
}

/// The default model's fit: this project's CPU kernels at the threads this process runs ops
/// on.
fn cpu_fit() -> &'static crate::plan::fitted::FittedCosts {
    crate::plan::fitted::cpu_for(rayon::current_num_threads())
}

/// How much of a spatial stage runs on tiles: the ops from its input on run on each rank's
/// tile until one needs its inputs whole (gathered onto every rank of the tile group, then
/// computed the same on each).
#[derive(Clone, Debug, PartialEq)]
pub struct TiledRegion {
    /// The grid of tiles.
    pub grid: crate::ops::tiles::Grid,
    /// Share of the stage's forward FLOPs computed on tiles.
    pub share: f64,
    /// The first node that gathers its inputs whole (none: tiled to its end).
    pub end: Option<RegionEnd>,
}

/// The node where a tiled region stops, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct RegionEnd {
    /// The node.
    pub node: usize,
    /// Its name, op and why it gathers its inputs.
    pub what: String,
    /// Whether because its output map has fewer rows or columns than the grid (else its op
    /// has no tile rule).
    pub map_smaller_than_grid: bool,
}

impl TiledRegion {
    /// Stage `stage` of `g` (nodes) split into `grid`'s tiles.
    pub fn of(g: &Graph, grid: crate::ops::tiles::Grid, stage: std::ops::Range<usize>) -> Self {
        let (mut tiled, mut all, mut end) = (0u64, 0u64, None);
        for id in stage {
            let n = &g.nodes[id];
            let flops = g.node_flops(n);
            all += flops;
            if crate::graph::runs_on_tiles(g, grid, id) {
                tiled += flops;
                continue;
            }
            let gathers = n.inputs.iter().any(|&v| grid.splits(&g.values[v].shape));
            if end.is_none() && gathers {
                let out = &g.values[n.output].shape;
                let no_rule = n.op.get().on_tiles() == crate::ops::tiles::TileRule::Whole;
                let why = match no_rule {
                    true => "an op with no tile rule: its inputs are gathered whole".to_string(),
                    false => {
                        format!("its output map ({out}) has fewer rows or columns than the grid")
                    }
                };
                end = Some(RegionEnd {
                    node: id,
                    what: format!("{} ({}): {why}", n.name, n.op.describe()),
                    map_smaller_than_grid: !no_rule,
                });
            }
        }
        TiledRegion {
            grid,
            share: if all == 0 {
                1.0
            } else {
                tiled as f64 / all as f64
            },
            end,
        }
    }

    /// Whether the region ends because the maps became smaller than the grid (the user's
    /// grid, not a missing tile rule) while most of the stage's work is still ahead: the tile
    /// ranks would mostly compute gathered copies.
    pub fn stops_paying(&self) -> bool {
        self.share < 0.5 && self.too_fine()
    }

    /// Whether tiles stop because a map became smaller than the grid: a coarser grid would
    /// keep more of the stage on tiles.
    pub fn too_fine(&self) -> bool {
        (self.end.as_ref()).is_some_and(|e| e.map_smaller_than_grid)
    }
}

impl std::fmt::Display for TiledRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.end {
            None => write!(f, "{} tiles to the end of the first stage", self.grid),
            Some(e) => write!(
                f,
                "{} tiles, first gathered whole at node {}, {}; {:.0}% of the first stage's \
                 FLOPs run on tiles",
                self.grid,
                e.node,
                e.what,
                100.0 * self.share
            ),
        }
    }
}

impl Layout {
    /// `c` on `graph`: checks the configuration, splits the graph (as `c.balance` says, else
    /// balanced by cost among the splits that fit the capacity) and builds the schedule.
    pub fn new(graph: &Graph, c: &RunConfig) -> Result<Layout> {
        Layout::on(Arc::new(graph.clone()), c)
    }

    /// [`Layout::new`] on a graph already shared.
    pub fn on(graph: Arc<Graph>, c: &RunConfig) -> Result<Layout> {
        let layout = Layout::weighed(graph, c)?;
        if let Some(region) = layout.tiled.as_ref().filter(|r| r.stops_paying()) {
            return Err(Error::Config(format!(
                "--spatial {} stops paying on {} at {}px: {region}; the tile ranks would \
                 mostly compute gathered copies (choose a coarser grid, or --spatial auto)",
                region.grid,
                layout.graph.name,
                layout.graph.image_size()
            )));
        }
        Ok(layout)
    }

    /// [`Layout::on`] without refusing a grid of tiles that stops paying
    /// ([`TiledRegion::stops_paying`]): for searches that weigh grids.
    pub fn weighed(graph: Arc<Graph>, c: &RunConfig) -> Result<Layout> {
        let t = &c.train;
        c.check()?;
        if let Some(w) = t
            .class_weights
            .as_ref()
            .filter(|w| w.len() != graph.classes())
        {
            return Err(Error::Config(format!(
                "{} class weights for {}'s {} classes",
                w.len(),
                graph.name,
                graph.classes()
            )));
        }
        let grid = c.scheme.spatial;
        if grid.is_split() && !grid.splits(graph.input_shape()) {
            return Err(Error::Config(format!(
                "a {grid} grid of tiles is finer than {}'s {} input: a tile needs a row and a \
                 column at least",
                graph.name,
                graph.input_shape()
            )));
        }
        t.precision.check(t.dtype).map_err(Error::Config)?;
        let micro = c.micro_batch();
        let costs = match &c.calibration {
            Some(cal) => {
                cal.check(&graph, micro, t.activations())?;
                cal.costs(&graph)
            }
            None => NodeCosts::fitted(
                &graph,
                micro,
                t.activations(),
                cpu_fit(),
                &DeviceProfile::CPU,
            ),
        };
        let tiles_of = |costs: &NodeCosts| {
            TileCosts::new(&graph, &c.scheme, costs, micro, t.activations(), &Link::CPU)
        };
        let tiles = tiles_of(&costs);
        let partition = match &c.balance {
            Some(b) if b.len() != c.scheme.model_stages() => {
                return Err(Error::Config(format!(
                    "the balance lists {} stages but the scheme has {}",
                    b.len(),
                    c.scheme.model_stages()
                )))
            }
            Some(b) => partition::from_balance(&graph, b)?,
            None => memory::split(c, &graph, &costs, &tiles)?,
        };
        let stages = &partition.stages;
        let inputs = stages.iter().map(|r| crossing(&graph, r.start)).collect();
        let outputs = stages
            .iter()
            .enumerate()
            .map(|(s, r)| {
                if s + 1 < stages.len() {
                    crossing(&graph, r.end)
                } else {
                    vec![]
                }
            })
            .collect();
        let losses = stages
            .iter()
            .map(|r| {
                graph
                    .outputs
                    .iter()
                    .filter(|o| {
                        graph.values[o.value]
                            .producer
                            .is_some_and(|p| r.contains(&p))
                    })
                    .copied()
                    .collect()
            })
            .collect();
        let bytes = crate::plan::memory::stage_bytes(c, &graph, &partition)?;
        let admission = match c.schedule {
            Some(_) => Admission::Free,
            None => c.admission(bytes.as_deref()),
        };
        let optimizer = match &c.calibration {
            Some(cal) => cal.optimizer,
            None => cpu_fit().optimizer(&graph, t.dtype),
        };
        let reduce = reduce_costs(&graph, &c.scheme, stages, t.dtype, c.scheme.dp, &Link::CPU);
        // Each rank steps the optimizer over its copies' share of the parameters (by tensor).
        let total = graph.params.len().max(1) as f64;
        let steps = |optimizer: f64| -> Vec<f64> {
            (0..c.scheme.stages)
                .map(|slot| {
                    let held: usize = (0..c.scheme.replicas.min(2))
                        .flat_map(|replica| c.scheme.stages_at(replica, slot))
                        .flat_map(|s| &graph.nodes[stages[s].clone()])
                        .map(|n| n.params.len())
                        .sum();
                    optimizer * held as f64 / total
                })
                .collect()
        };
        // An OFFLOAD or PREFETCH copies what a micro-batch's F saved of its stage.
        let link = match c.train.device {
            DeviceKind::Cpu => HostLink::CPU,
            DeviceKind::Cuda { .. } => HostLink::PCIE4,
        };
        let alone = StageCosts {
            reduce,
            step: steps(optimizer),
            offload: link.stage_copies(&graph, stages, micro, t.activations()),
            copies_overlap: link.overlaps && c.train.offload_copy.on_copy_stream(),
            ..tiles.stage_costs(&costs, stages)
        };
        let schedule = c.timeline(&alone, bytes.as_deref())?;
        // Ranks on one CPU share its pool of threads: while k of a pipeline's P ranks run
        // tasks, so do k of every data-parallel group's and every tile's, k·world/P in all.
        // Each runs at the default model's fit at its share of the threads where one was
        // measured, else at that share of the speed of all of them.
        let shared = {
            let (world, positions) = (c.scheme.world(), c.scheme.stages);
            let threads = rayon::current_num_threads();
            let fitted = c.calibration.is_none() && c.train.device == DeviceKind::Cpu;
            let at_share = |ranks: usize| {
                let (fit, by) = crate::plan::fitted::cpu_shared(threads, ranks)?;
                let costs =
                    NodeCosts::fitted(&graph, micro, t.activations(), fit, &DeviceProfile::CPU);
                let ops = tiles_of(&costs).stage_costs(&costs, stages);
                let shared = StageCosts {
                    forward: ops.forward,
                    backward: ops.backward,
                    input: ops.input,
                    weight: ops.weight,
                    step: steps(fit.optimizer(&graph, t.dtype)),
                    ..alone.clone()
                };
                Some(shared.slower(by))
            };
            let sharing: Vec<StageCosts> = (1..=positions)
                .map(|k| {
                    let whole = (k * world % positions == 0).then_some(k * world / positions);
                    match whole.filter(|&r| r > 1 && fitted).and_then(at_share) {
                        Some(shared) => shared,
                        None => alone.slower((k * world) as f64 / positions as f64),
                    }
                })
                .collect();
            crate::schemes::schedule::time_shared(
                &c.scheme,
                &sharing,
                &schedule.schedule(&c.scheme),
            )?
        };
        let tiled = (grid.is_split()).then(|| TiledRegion::of(&graph, grid, stages[0].clone()));
        Ok(Layout {
            graph,
            partition,
            inputs,
            outputs,
            losses,
            costs,
            tiles,
            optimizer,
            schedule,
            shared,
            admission,
            tiled,
        })
    }

    /// Predicted seconds of a step: the schedule, its REDUCEs and STEPs (each rank's optimizer
    /// over its copies' share of the parameters) included. With `shared_device`, the ranks are
    /// threads of this process sharing its CPU (or processes sharing one machine): the ranks
    /// running tasks at each moment share its threads, each at the default model's fit at
    /// its share of them (see [`crate::plan::fitted::cpu_shared`]; under a calibration
    /// profile, its times as many times over as ranks run); otherwise each rank is a device of
    /// its own and the step ends with the slowest rank's STEP.
    pub fn predicted_step(&self, shared_device: bool) -> f64 {
        match shared_device {
            true => self.shared.makespan(),
            false => self.schedule.makespan(),
        }
    }

    /// Bytes each stage saves for backward per micro-batch of `micro` images.
    pub fn saved_per_micro_batch(&self, dtype: DType, micro: usize) -> Vec<u64> {
        self.partition
            .stages
            .iter()
            .map(|r| crate::graph::saved_bytes(&self.graph, r.clone(), dtype) * micro as u64)
            .collect()
    }

    /// The param ids of stage `s`'s nodes.
    pub fn param_ids(&self, s: usize) -> std::ops::Range<usize> {
        let r = &self.partition.stages[s];
        let nodes = &self.graph.nodes[r.clone()];
        let first = nodes.first().map_or(0, |n| n.params.start);
        let last = nodes.last().map_or(first, |n| n.params.end);
        first..last
    }
}

/// Where `c` runs the split balanced by cost although a capacity is set because no split fits
/// it: the split of its stages whose fullest rank needs least, by the analytic model.
pub fn shortfall(g: &Graph, c: &RunConfig) -> Result<Option<partition::Shortfall>> {
    if c.balance.is_some() {
        return Ok(None);
    }
    let l = Layout::new(g, c)?;
    memory::shortfall(c, &l.graph, &l.schedule, &l.costs, &l.tiles)
}
