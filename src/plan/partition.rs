//! Cutting a graph into pipeline stages: contiguous node ranges between cut points
//! ([`crate::plan::cuts`]), chosen to balance predicted cost among the splits whose ranks fit
//! a memory cap (by the analytic model of [`crate::plan::footprint`]), or given explicitly as a
//! balance list.

use std::ops::Range;

pub use crate::core::Shortfall;
use crate::graph::Graph;
use crate::plan::cost::{NodeCosts, TileCosts};
use crate::plan::cuts::{carried, cut_points};
use crate::plan::footprint::{held_bytes, Moment, StageBytes, StageMemory};
use crate::{Error, Result};

/// Contiguous node ranges, one per stage, covering the graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Each stage's node range, in order.
    pub stages: Vec<Range<usize>>,
}

impl Partition {
    /// The stages between consecutive `bounds` (node indices).
    fn from_bounds(bounds: &[usize]) -> Partition {
        Partition {
            stages: bounds.windows(2).map(|w| w[0]..w[1]).collect(),
        }
    }

    /// This split as a balance list: segments (pieces between cut points) per stage.
    pub fn balance(&self, g: &Graph) -> Vec<usize> {
        let cuts = cut_points(g);
        let before = |at: usize| cuts.partition_point(|&c| c < at);
        self.stages
            .iter()
            .map(|r| before(r.end) - before(r.start + 1) + 1)
            .collect()
    }
}

fn too_many(g: &Graph, p: usize, cuts: usize) -> Error {
    Error::Config(format!(
        "{} has {cuts} cut points, so it splits into at most {} stages, not {p}",
        g.name,
        cuts + 1
    ))
}

/// Past this many cut points, a mirrored search (whose work grows with the cube of the
/// positions it considers) cuts only where one value crosses: between blocks.
pub const MIRRORED_POSITIONS: usize = 400;

/// Each node's seconds per micro-batch on a rank of its stage: on one rank, or on each rank of
/// a tile group for the stages that run on tiles.
#[derive(Clone, Debug, PartialEq)]
pub struct Cost {
    /// On one rank.
    pub whole: Vec<f64>,
    /// On a rank of a tile group.
    pub tiled: Vec<f64>,
    /// Which stages run on tiles (none past its end).
    pub on_tiles: Vec<bool>,
}

impl Cost {
    /// Every stage on one rank.
    pub fn whole(cost: Vec<f64>) -> Cost {
        Cost {
            tiled: cost.clone(),
            whole: cost,
            on_tiles: Vec::new(),
        }
    }

    /// Forward plus backward of `whole`, on one rank, and of `tiles`, on tiles.
    pub fn of(whole: &NodeCosts, tiles: &TileCosts) -> Cost {
        Cost {
            whole: whole.total(),
            tiled: tiles.costs.total(),
            on_tiles: tiles.on_tiles.clone(),
        }
    }

    /// Each node's seconds on a rank of stage `s`.
    pub fn of_stage(&self, s: usize) -> &[f64] {
        match self.on_tiles.get(s) {
            Some(true) => &self.tiled,
            _ => &self.whole,
        }
    }

    /// The slowest stage's seconds under `part`.
    pub fn slowest(&self, part: &Partition) -> f64 {
        (part.stages.iter().enumerate())
            .map(|(s, r)| self.of_stage(s)[r.clone()].iter().sum::<f64>())
            .fold(0.0, f64::max)
    }
}

/// Each rank's memory against a capacity, by the analytic model ([`crate::plan::footprint`]).
pub struct Limit<'a> {
    /// Bytes each rank may hold.
    pub cap: u64,
    /// What a stage of given nodes holds.
    pub stages: &'a dyn StageMemory,
    /// Per rank (one per stage), the moments of its task list.
    pub moments: &'a [Vec<Moment>],
    /// Rank r also holds stage P-1-r (the mirrored replica of MAST and MASTER).
    pub mirrored: bool,
    /// Per rank (pipeline position), the tiles its samples are split into: its stages'
    /// activations are spread over them, each tile holding the whole weights.
    pub tiles: Vec<usize>,
}

impl Limit<'_> {
    /// The bytes of rank `r` holding `own` (its stage r) and, mirrored, `mirror` (stage P-1-r).
    fn rank(&self, r: usize, own: StageBytes, mirror: StageBytes) -> u64 {
        let (own, mirror) = (own.on_tiles(self.tiles[r]), mirror.on_tiles(self.tiles[r]));
        if self.mirrored {
            held_bytes(&[own, mirror], &self.moments[r])
        } else {
            held_bytes(&[own], &self.moments[r])
        }
    }
}

/// Every split of `g` into `p` stages at its cut points, if there are at most `limit`.
pub fn every_split(g: &Graph, p: usize, limit: usize) -> Option<Vec<Partition>> {
    let cuts = cut_points(g);
    let k = p.checked_sub(1)?;
    // C(cuts, k): each step's product divides exactly; an overflow is "too many".
    let mut count: usize = 1;
    for i in 0..k {
        count = count.checked_mul(cuts.len().checked_sub(i)?)? / (i + 1);
    }
    if count > limit {
        return None;
    }
    let n = g.nodes.len();
    let mut out = Vec::with_capacity(count);
    let mut pick: Vec<usize> = (0..k).collect();
    loop {
        let bounds: Vec<usize> = std::iter::once(0)
            .chain(pick.iter().map(|&i| cuts[i]))
            .chain(std::iter::once(n))
            .collect();
        out.push(Partition::from_bounds(&bounds));
        // The next k-combination of the cut indices, in lexicographic order.
        let Some(i) = (0..k).rev().find(|&i| pick[i] < cuts.len() - k + i) else {
            return Some(out);
        };
        pick[i] += 1;
        for j in i + 1..k {
            pick[j] = pick[j - 1] + 1;
        }
    }
}

/// The split into `p` stages whose slowest stage (by `cost` per node) is fastest among those
/// whose ranks all fit `limit` (among all splits without one); `None` when none fits.
///
/// Exact for one stage per rank (dynamic programming over the cut points, O(P·C²) for C cut
/// points, less where costs prune). Mirrored ranks couple stages p and P-1-p, so their search
/// runs over pairs (end of the first j stages, start of the last j) from the outside in: for a
/// bound on the slowest stage, the pairs reachable with every rank so far fitting, then the
/// least bound that reaches the middle (searched over the stage costs that occur). It is exact
/// over the positions it considers: every cut point up to [`MIRRORED_POSITIONS`] of them;
/// beyond, the fastest split over every cut point if it fits, else the best over the cut
/// points that carry one value (thinned evenly to that many).
/// Both rely on a stage's cost and bytes never shrinking when its range grows.
pub fn balanced(
    g: &Graph,
    p: usize,
    cost: &Cost,
    limit: Option<&Limit>,
) -> Result<Option<Partition>> {
    let pos = positions(g, p, limit)?;
    if let (Some(l), Some(all)) = (limit, &pos.all) {
        let fastest = search(all, p, cost, None).expect("a split exists");
        let bytes: Vec<_> = fastest
            .windows(2)
            .map(|w| l.stages.stage(w[0]..w[1]))
            .collect();
        if (0..p).all(|r| l.rank(r, bytes[r], bytes[p - 1 - r]) <= l.cap) {
            return Ok(Some(Partition::from_bounds(&fastest)));
        }
    }
    Ok(search(&pos.searched, p, cost, limit).map(|b| Partition::from_bounds(&b)))
}

/// The split into `p` stages whose fullest rank under `limit` needs least (for mirrored ranks:
/// within 0.4%, over the positions [`balanced`] searches), with that rank and its need.
pub fn least_memory(g: &Graph, p: usize, cost: &Cost, limit: &Limit) -> Result<Shortfall> {
    let pos = positions(g, p, Some(limit))?;
    Ok(Chain::new(&pos.searched, p, cost, Some(limit)).shortfall(limit.cap))
}

/// The positions a search considers (0, cut points, node count), and every cut point's where
/// those are fewer.
struct Positions {
    searched: Vec<usize>,
    all: Option<Vec<usize>>,
}

fn positions(g: &Graph, p: usize, limit: Option<&Limit>) -> Result<Positions> {
    let cuts = cut_points(g);
    if p == 0 {
        return Err(Error::Config("a model needs at least one stage".into()));
    }
    if p > cuts.len() + 1 {
        return Err(too_many(g, p, cuts.len()));
    }
    let with_ends = |cuts: Vec<usize>| {
        let mut pos = vec![0];
        pos.extend(cuts);
        pos.push(g.nodes.len());
        pos
    };
    if limit.is_some_and(|l| l.mirrored) && cuts.len() > MIRRORED_POSITIONS {
        let carried = carried(g);
        let one: Vec<usize> = cuts
            .iter()
            .copied()
            .filter(|&c| carried[c].as_ref().is_some_and(|v| v.len() == 1))
            .collect();
        if one.len() + 1 >= p {
            let step = one.len().div_ceil(MIRRORED_POSITIONS);
            return Ok(Positions {
                searched: with_ends(one.into_iter().step_by(step).collect()),
                all: Some(with_ends(cuts)),
            });
        }
    }
    Ok(Positions {
        searched: with_ends(cuts),
        all: None,
    })
}

/// The stage boundaries (node indices, `p + 1` of them) of the split of the chain cut at
/// `pos` (0, cut points, node count) that `balanced` describes.
fn search(pos: &[usize], p: usize, cost: &Cost, limit: Option<&Limit>) -> Option<Vec<usize>> {
    let chain = Chain::new(pos, p, cost, limit);
    let span = |j: usize, a: usize, b: usize| chain.span(j, a, b);
    let found = match limit {
        None => chain.min_max(span, |_, _, _| true).map(|(_, b)| b),
        Some(l) if !l.mirrored => chain
            .min_max(span, |j, a, b| chain.rank_bytes(j, a..b, a..b) <= l.cap)
            .map(|(_, b)| b),
        Some(l) => chain.fastest_mirrored(l.cap),
    }?;
    Some(found.iter().map(|&i| pos[i]).collect())
}

/// The first of `r` where `f` holds, `f` holding from there on (`r.end` where it never does).
fn first(r: Range<usize>, f: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (r.start, r.end.max(r.start));
    while lo < hi {
        let mid = (lo + hi) / 2;
        if f(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

/// A chain of positions with prefix costs, and the ranks' memory over position ranges.
struct Chain<'a> {
    pos: &'a [usize],
    p: usize,
    /// Prefix costs on one rank, then on a rank of a tile group.
    prefix: [Vec<f64>; 2],
    on_tiles: &'a [bool],
    limit: Option<&'a Limit<'a>>,
    /// Bytes of every position range (mirrored searches, which revisit them often, over at
    /// most [`MIRRORED_POSITIONS`] cut points).
    table: Vec<StageBytes>,
}

impl<'a> Chain<'a> {
    fn new(pos: &'a [usize], p: usize, cost: &'a Cost, limit: Option<&'a Limit<'a>>) -> Self {
        let prefix = |cost: &[f64]| {
            let mut prefix = vec![0.0];
            for c in cost {
                prefix.push(prefix.last().unwrap() + c);
            }
            prefix
        };
        let m = pos.len();
        let table = match limit {
            Some(l) if l.mirrored && m <= MIRRORED_POSITIONS + 2 => (0..m * m)
                .map(|i| {
                    let (a, b) = (i / m, i % m);
                    if a < b {
                        l.stages.stage(pos[a]..pos[b])
                    } else {
                        StageBytes::default()
                    }
                })
                .collect(),
            _ => Vec::new(),
        };
        Chain {
            pos,
            p,
            prefix: [prefix(&cost.whole), prefix(&cost.tiled)],
            on_tiles: &cost.on_tiles,
            limit,
            table,
        }
    }

    /// The seconds of stage `j` over positions `a..b`.
    fn span(&self, j: usize, a: usize, b: usize) -> f64 {
        let prefix = &self.prefix[(self.on_tiles.get(j) == Some(&true)) as usize];
        prefix[self.pos[b]] - prefix[self.pos[a]]
    }

    fn bytes(&self, r: Range<usize>) -> StageBytes {
        match self.limit {
            _ if !self.table.is_empty() => self.table[r.start * self.pos.len() + r.end],
            Some(l) => l.stages.stage(self.pos[r.start]..self.pos[r.end]),
            None => StageBytes::default(),
        }
    }

    /// The fuller of the ranks holding stage `j` over `a` and, mirrored, stage P-1-j over `b`.
    fn rank_bytes(&self, j: usize, a: Range<usize>, b: Range<usize>) -> u64 {
        let Some(l) = self.limit else { return 0 };
        let own = self.bytes(a);
        if !l.mirrored {
            return l.rank(j, own, own);
        }
        let mirror = self.bytes(b);
        l.rank(j, own, mirror)
            .max(l.rank(self.p - 1 - j, mirror, own))
    }

    /// Each rank's bytes under the split at position indices `bounds`.
    fn needs(&self, bounds: &[usize]) -> Vec<u64> {
        let Some(l) = self.limit else {
            return vec![0; self.p];
        };
        let stages: Vec<_> = bounds.windows(2).map(|w| self.bytes(w[0]..w[1])).collect();
        (0..self.p)
            .map(|r| l.rank(r, stages[r], stages[self.p - 1 - r]))
            .collect()
    }

    /// One stage per rank: the split (position indices) least in the largest `value(stage,
    /// start, end)` among those where `fits` holds for every stage, with that value. Both must
    /// be monotone: a larger range never has a smaller value nor fits where a smaller does not.
    fn min_max(
        &self,
        value: impl Fn(usize, usize, usize) -> f64,
        fits: impl Fn(usize, usize, usize) -> bool,
    ) -> Option<(f64, Vec<usize>)> {
        let (m, p) = (self.pos.len(), self.p);
        // best[j][i]: least largest value of j stages over positions 0..i; from[j][i]: where
        // the last of them starts.
        let mut best = vec![vec![f64::INFINITY; m]; p + 1];
        let mut from = vec![vec![0usize; m]; p + 1];
        best[0][0] = 0.0;
        let mut records = Vec::new();
        for j in 1..=p {
            let ends = if j == p { m - 1..m } else { j..m - (p - j) };
            for i in ends {
                // Where the last stage starts, later starts first (the stage only grows): each
                // start better than all later ones, up to the first whose stage alone is no
                // better. Of these, the earliest whose stage fits is best, and since a stage
                // that fits still fits shorter, it is found by bisection.
                records.clear();
                let mut least = f64::INFINITY;
                for k in (j - 1..i).rev() {
                    if best[j - 1][k] >= least {
                        continue;
                    }
                    let v = value(j - 1, k, i);
                    if v >= least {
                        break;
                    }
                    least = best[j - 1][k].max(v);
                    records.push((least, k));
                }
                let fitting = records.partition_point(|&(_, k)| fits(j - 1, k, i));
                if let Some(&(v, k)) = fitting.checked_sub(1).map(|r| &records[r]) {
                    (best[j][i], from[j][i]) = (v, k);
                }
            }
        }
        if best[p][m - 1].is_infinite() {
            return None;
        }
        let mut bounds = vec![m - 1];
        for j in (1..=p).rev() {
            bounds.push(from[j][*bounds.last().unwrap()]);
        }
        bounds.reverse();
        Some((best[p][m - 1], bounds))
    }

    /// Mirrored ranks: the split (position indices) whose slowest stage is fastest among those
    /// that fit `cap`.
    fn fastest_mirrored(&self, cap: u64) -> Option<Vec<usize>> {
        let within = |t: f64| {
            move |j: usize, a: Range<usize>, b: Range<usize>| {
                self.span(j, a.start, a.end) <= t
                    && self.span(self.p - 1 - j, b.start, b.end) <= t
                    && self.rank_bytes(j, a, b) <= cap
            }
        };
        // No split is faster than the fastest regardless of memory; if that does not fit, a
        // split of any speed that fits bounds the search from above (and if none does, there
        // is nothing to search). In between, the stage costs that occur are tried at doubling
        // steps from the fastest until one reaches, then bisected; each split reached bounds
        // the search by its own slowest stage.
        let (fastest, _) = self.min_max(|j, a, b| self.span(j, a, b), |_, _, _| true)?;
        if let Some(split) = self.reach(within(fastest)) {
            return Some(split);
        }
        let mut found = self.reach(within(f64::INFINITY))?;
        let m = self.pos.len();
        let slowest = self.slowest(&found);
        // Spans on one rank and on a rank of a tile group (the same without tiles).
        let mut bounds: Vec<f64> = (0..m)
            .flat_map(|a| (a + 1..m).map(move |b| (a, b)))
            .flat_map(|(a, b)| {
                self.prefix
                    .iter()
                    .map(move |s| s[self.pos[b]] - s[self.pos[a]])
            })
            .filter(|&t| t > fastest && t < slowest)
            .collect();
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let (mut lo, mut hi, mut step, mut doubling) = (0, bounds.len(), 1, true);
        while lo < hi {
            let at = if doubling {
                (lo + step - 1).min(hi - 1)
            } else {
                (lo + hi) / 2
            };
            match self.reach(within(bounds[at])) {
                Some(split) => {
                    let t = self.slowest(&split);
                    (hi, found, doubling) = (bounds.partition_point(|&b| b < t), split, false);
                }
                None => (lo, step) = (at + 1, step * 2),
            }
        }
        Some(found)
    }

    /// The slowest stage's cost under the split at position indices `bounds`.
    fn slowest(&self, bounds: &[usize]) -> f64 {
        (bounds.windows(2).enumerate())
            .map(|(j, w)| self.span(j, w[0], w[1]))
            .fold(0.0, f64::max)
    }

    /// Mirrored ranks: a split (position indices) where `ok(j, a, b)` holds for the ranks
    /// holding stage j over `a` and stage P-1-j over `b`, if any. `ok` must keep holding when
    /// either range shrinks.
    fn reach(&self, ok: impl Fn(usize, Range<usize>, Range<usize>) -> bool) -> Option<Vec<usize>> {
        let (m, p) = (self.pos.len(), self.p);
        // Level j: pairs (x, y) such that stages 0..j end at x, stages P-j.. start at y, and
        // their ranks fit. Levels with stages left strictly between come first.
        let outer = (p - 1) / 2;
        let mut levels = vec![vec![false; m * m]];
        levels[0][m - 1] = true;
        for j in 0..outer {
            let between = p - 2 * j - 2;
            let cur = &levels[j];
            // Per row x', +1 where a run of reachable y' starts and -1 past its end.
            let mut delta = vec![0i32; m * m + 1];
            for x in 0..m {
                for y in x + 1..m {
                    if !cur[x * m + y] {
                        continue;
                    }
                    // The smallest start y' of stage P-1-j that fits beside stage j over
                    // x..x': it only rises with x', from where it fits beside one segment.
                    let mut low = first(x + 1 + between..y, |c| ok(j, x..x + 1, c..y));
                    for x2 in x + 1..m {
                        low = low.max(x2 + between);
                        while low < y && !ok(j, x..x2, low..y) {
                            low += 1;
                        }
                        if low >= y {
                            break;
                        }
                        delta[x2 * m + low] += 1;
                        delta[x2 * m + y] -= 1;
                    }
                }
            }
            let mut next = vec![false; m * m];
            for x in 0..m {
                let mut run = 0;
                for y in 0..m {
                    run += delta[x * m + y];
                    next[x * m + y] = run > 0;
                }
            }
            if !next.contains(&true) {
                return None;
            }
            levels.push(next);
        }
        // The middle: one stage held twice, or two adjacent stages on one pair of ranks.
        let j = outer;
        let cur = &levels[j];
        let mut bounds = vec![0; p + 1];
        bounds[p] = m - 1;
        let found = (0..m)
            .flat_map(|x| (x + 1..m).map(move |y| (x, y)))
            .find(|&(x, y)| {
                if !cur[x * m + y] {
                    return false;
                }
                if p % 2 == 1 {
                    bounds[j] = x;
                    bounds[j + 1] = y;
                    return ok(j, x..y, x..y);
                }
                // Where the two stages meet: stage j must fit beside one segment of stage j+1,
                // and the other way round.
                let from = first(x + 1..y, |c| ok(j, x..x + 1, c..y));
                let to = first(x + 1..y, |c| !ok(j, x..c, y - 1..y));
                match (from..to).find(|&c| ok(j, x..c, c..y)) {
                    Some(c) => {
                        (bounds[j], bounds[j + 1], bounds[j + 2]) = (x, c, y);
                        true
                    }
                    None => false,
                }
            });
        found?;
        // Back to the outside: a reachable pair each level came from.
        for j in (0..outer).rev() {
            let (x2, y2) = (bounds[j + 1], bounds[p - j - 1]);
            let (x, y) = (0..x2)
                .flat_map(|x| (y2 + 1..m).map(move |y| (x, y)))
                .find(|&(x, y)| levels[j][x * m + y] && ok(j, x..x2, y2..y))
                .expect("a reached pair has a predecessor");
            bounds[j] = x;
            bounds[p - j] = y;
        }
        Some(bounds)
    }

    /// The split that needs least on its fullest rank: that rank and its need against `cap`.
    fn shortfall(&self, cap: u64) -> Shortfall {
        let bounds = match self.limit {
            Some(l) if l.mirrored => {
                // Bisect on the bytes allowed, up to what the fastest split needs, to within
                // 0.4%; each split reached bounds it by what it needs itself.
                let (_, mut best) = self
                    .min_max(|j, a, b| self.span(j, a, b), |_, _, _| true)
                    .expect("a split exists");
                let most = |b: &[usize]| *self.needs(b).iter().max().unwrap_or(&0);
                let (mut lo, mut hi) = (0, most(&best));
                while hi - lo > 1 + hi / 256 {
                    let mid = lo + (hi - lo) / 2;
                    match self.reach(|j, a, b| self.rank_bytes(j, a, b) <= mid) {
                        Some(b) => (hi, best) = (most(&b), b),
                        None => lo = mid,
                    }
                }
                best
            }
            _ => {
                self.min_max(
                    |j, a, b| self.rank_bytes(j, a..b, a..b) as f64,
                    |_, _, _| true,
                )
                .expect("a split exists")
                .1
            }
        };
        let needs = self.needs(&bounds);
        let (rank, &need) = needs
            .iter()
            .enumerate()
            .max_by_key(|&(_, n)| n)
            .expect("a rank");
        Shortfall {
            stages: self.p,
            rank,
            need,
            cap,
        }
    }
}

/// The split given as a number of segments (the pieces between consecutive cut points) per
/// stage.
pub fn from_balance(g: &Graph, balance: &[usize]) -> Result<Partition> {
    let cuts = cut_points(g);
    let segments = cuts.len() + 1;
    if balance.contains(&0) {
        return Err(Error::Config(
            "every stage of a balance needs at least one segment".into(),
        ));
    }
    if balance.len() > segments {
        return Err(too_many(g, balance.len(), cuts.len()));
    }
    let total: usize = balance.iter().sum();
    if total != segments {
        return Err(Error::Config(format!(
            "the balance adds up to {total} segments, but {} has {segments} (segments are the pieces between its {} cut points)",
            g.name,
            cuts.len()
        )));
    }
    let mut pos = vec![0];
    pos.extend(&cuts);
    pos.push(g.nodes.len());
    let mut stages = Vec::new();
    let mut at = 0;
    for &b in balance {
        stages.push(pos[at]..pos[at + b]);
        at += b;
    }
    Ok(Partition { stages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models;
    use crate::ops::tiles::Grid;
    use crate::plan::cuts::{crossing, MAX_CUT_VALUES};
    use crate::plan::footprint;
    use crate::schemes::admission::Admission;
    use crate::schemes::schedule::{self, StageCosts};
    use crate::schemes::{Kind, Order, Scheme};
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_split_lists_each_split_once_or_none_past_the_limit() {
        let g = models::build("resnet20v2", 32, 10).unwrap();
        let (cuts, n) = (cut_points(&g).len(), g.nodes.len());
        let all = every_split(&g, 3, 10_000).unwrap();
        assert_eq!(all.len(), cuts * (cuts - 1) / 2);
        let distinct: std::collections::HashSet<_> = all.iter().map(|p| p.stages.clone()).collect();
        assert_eq!(distinct.len(), all.len());
        for p in &all {
            assert_eq!(
                (p.stages.len(), p.stages[0].start, p.stages[2].end),
                (3, 0, n)
            );
            assert!(p.stages.iter().all(|r| !r.is_empty()));
        }
        assert!(every_split(&g, 3, all.len() - 1).is_none());
        assert_eq!(every_split(&g, 1, 1).unwrap().len(), 1);
    }

    /// A chain whose nodes have random costs and bytes; a stage's peaks are the most of its
    /// saved prefix plus one node's transient, so they grow with the range like real ones.
    struct RandomChain {
        cost: Vec<f64>,
        params: Vec<u64>,
        saved: Vec<u64>,
        forward: Vec<u64>,
        backward: Vec<u64>,
    }

    impl RandomChain {
        fn new(rng: &mut impl Rng, n: usize) -> Self {
            let mut draw = |hi: u64| (0..n).map(|_| rng.random_range(0..hi)).collect::<Vec<_>>();
            let (params, saved, forward, backward) = (draw(100), draw(60), draw(80), draw(80));
            RandomChain {
                cost: (0..n).map(|_| rng.random_range(0.0..1.0)).collect(),
                params,
                saved,
                forward,
                backward,
            }
        }
    }

    impl StageMemory for RandomChain {
        fn stage(&self, r: Range<usize>) -> StageBytes {
            let mut acc = 0;
            let (mut forward, mut backward) = (0, 0);
            for i in r.clone() {
                forward = forward.max(acc + self.forward[i]);
                acc += self.saved[i];
                backward = backward.max(acc + self.backward[i]);
            }
            StageBytes {
                params: self.params[r.clone()].iter().sum(),
                stats: self.params[r].len() as u64,
                saved: acc,
                forward,
                backward,
            }
        }
    }

    /// Every split of `n` nodes into `p` nonempty stages, as boundaries.
    fn all_splits(n: usize, p: usize) -> Vec<Vec<usize>> {
        if p == 1 {
            return vec![vec![0, n]];
        }
        (p - 1..n)
            .flat_map(|last| {
                all_splits(last, p - 1).into_iter().map(move |mut b| {
                    b.push(n);
                    b
                })
            })
            .collect()
    }

    #[test]
    fn memory_capped_split_is_optimal_on_random_chains() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let mut outcomes = [0usize; 2];
        for trial in 0..400 {
            let n = rng.random_range(4..11);
            let p = 1 + trial % 4;
            if p > n {
                continue;
            }
            let chain = RandomChain::new(&mut rng, n);
            let order = if rng.random_bool(0.5) {
                Order::GPipe
            } else {
                Order::OneFOneB
            };
            let m = rng.random_range(1..4);
            let (kind, replicas) = match trial / 4 % 3 {
                0 => (Kind::Mp, 1),
                1 => (Kind::Mast, 2),
                _ => (Kind::Master, 4),
            };
            // The first stage (and the mirrored last) on tiles, or none.
            let grid = [(1, 1), (1, 2), (2, 2)][trial / 12 % 3];
            let grid = Grid {
                rows: grid.0,
                cols: grid.1,
            };
            let scheme = Scheme::new(kind, p, m, replicas, 1, order).with_spatial(grid);
            // On tiles: a share of the compute plus an exchange that varies by node.
            let cost = Cost {
                whole: chain.cost.clone(),
                tiled: (0..n)
                    .map(|i| chain.cost[i] / grid.tiles() as f64 + chain.forward[i] as f64 / 400.0)
                    .collect(),
                on_tiles: (0..p).map(|s| scheme.tiled(s)).collect(),
            };
            let bound = match replicas > 1 && rng.random_bool(0.3) {
                true => Admission::Count(m),
                false => Admission::Free,
            };
            let costs = StageCosts {
                forward: (0..p).map(|_| rng.random_range(0.5..2.0)).collect(),
                backward: (0..p).map(|_| rng.random_range(1.0..4.0)).collect(),
                input: vec![0.0; p],
                weight: vec![0.0; p],
                transfer: vec![0.0; p],
                reduce: vec![],
                step: vec![],
                offload: vec![],
                copies_overlap: false,
            };
            let moments = footprint::moments(&schedule::build(&scheme, &costs, &bound).unwrap());
            let mirrored = replicas > 1;
            let splits = all_splits(n, p);
            let need = |b: &Vec<usize>| -> u64 {
                let bytes: Vec<_> = b.windows(2).map(|w| chain.stage(w[0]..w[1])).collect();
                footprint::rank_bytes(&scheme, &moments, &bytes)
                    .into_iter()
                    .max()
                    .unwrap()
            };
            let slowest = |b: &Vec<usize>| cost.slowest(&Partition::from_bounds(b));
            let mut needs: Vec<u64> = splits.iter().map(need).collect();
            needs.sort_unstable();
            // Caps around and at what the splits need, so that some fit and some do not.
            let cap = match rng.random_range(0..3) {
                0 => needs[rng.random_range(0..needs.len())],
                1 => needs[0] - 1,
                _ => rng.random_range(needs[0] / 2..needs[needs.len() - 1] + 2),
            };
            let limit = Limit {
                cap,
                stages: &chain,
                moments: &moments,
                mirrored,
                tiles: (0..p).map(|s| scheme.width(s)).collect(),
            };
            let pos: Vec<usize> = (0..=n).collect();
            let brute = splits
                .iter()
                .filter(|b| need(b) <= cap)
                .map(slowest)
                .fold(f64::INFINITY, f64::min);
            let what = format!("trial {trial}: {scheme:?} bound {bound:?} cap {cap}");
            match search(&pos, p, &cost, Some(&limit)) {
                Some(b) => {
                    outcomes[0] += 1;
                    assert!(need(&b) <= cap, "{what}: {b:?} does not fit");
                    assert!(
                        (slowest(&b) - brute).abs() < 1e-12,
                        "{what}: search {} vs brute force {brute}",
                        slowest(&b)
                    );
                }
                None => {
                    outcomes[1] += 1;
                    assert!(brute.is_infinite(), "{what}: brute force found {brute}");
                }
            }
            // The split that needs least: exact for one stage per rank, within 0.4% for
            // mirrored ranks.
            let least = Chain::new(&pos, p, &cost, Some(&limit)).shortfall(cap);
            let slack = if mirrored { 1 + least.need / 256 } else { 0 };
            assert!(
                (needs[0]..=needs[0] + slack).contains(&least.need),
                "{what}: {} vs the least any split needs, {}",
                least.need,
                needs[0]
            );
            // Without a cap: the fastest split.
            let b = search(&pos, p, &cost, None).unwrap();
            let fastest = splits.iter().map(slowest).fold(f64::INFINITY, f64::min);
            assert!((slowest(&b) - fastest).abs() < 1e-12, "{what}: no cap");
        }
        assert!(
            outcomes.iter().all(|&k| k > 50),
            "fits / no fit: {outcomes:?}"
        );
    }

    #[test]
    fn resnet_cut_points_carry_at_most_two_values() {
        let g = models::build("resnet20v2", 32, 10).unwrap();
        let cuts = cut_points(&g);
        assert!(cuts.len() > 20, "{cuts:?}");
        for &c in &cuts {
            assert!(crossing(&g, c).len() <= MAX_CUT_VALUES);
        }
        // Between the two blocks of a stage the block's output alone crosses.
        let start = g
            .nodes
            .iter()
            .position(|n| n.name.starts_with("layer1.1."))
            .unwrap();
        assert!(cuts.contains(&start));
        assert_eq!(crossing(&g, start).len(), 1);
    }

    /// The least max-stage cost over every way to choose the cuts.
    fn brute(pos: &[usize], prefix: &[f64], p: usize, from: usize) -> f64 {
        let last = pos.len() - 1;
        if p == 1 {
            return prefix[pos[last]] - prefix[pos[from]];
        }
        ((from + 1)..last)
            .filter(|&k| last - k >= p - 1)
            .map(|k| (prefix[pos[k]] - prefix[pos[from]]).max(brute(pos, prefix, p - 1, k)))
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    fn balanced_split_is_optimal() {
        use rand::{Rng, SeedableRng};
        let g = models::build("resnet20v2", 32, 10).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for trial in 0..20 {
            let cost: Vec<f64> = (0..g.nodes.len())
                .map(|_| rng.random_range(0.0..1.0))
                .collect();
            let p = 1 + trial % 5;
            let part = balanced(&g, p, &Cost::whole(cost.clone()), None)
                .unwrap()
                .unwrap();
            assert_eq!(part.stages.len(), p);
            assert_eq!(part.stages.first().unwrap().start, 0);
            assert_eq!(part.stages.last().unwrap().end, g.nodes.len());
            let cuts = cut_points(&g);
            for w in part.stages.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(cuts.contains(&w[0].end));
            }
            let worst = part
                .stages
                .iter()
                .map(|r| cost[r.clone()].iter().sum::<f64>())
                .fold(0.0, f64::max);
            let mut pos = vec![0];
            pos.extend(&cuts);
            pos.push(g.nodes.len());
            let mut prefix = vec![0.0];
            for c in &cost {
                prefix.push(prefix.last().unwrap() + c);
            }
            // Brute force is exponential in p: compare up to 3 stages.
            if p <= 3 {
                let opt = brute(&pos, &prefix, p, 0);
                assert!(
                    (worst - opt).abs() < 1e-12,
                    "p={p}: dp {worst} vs brute force {opt}"
                );
            }
        }
    }

    #[test]
    fn explicit_balance_and_errors() {
        let g = models::build("resnet20v2", 32, 10).unwrap();
        let n = cut_points(&g).len() + 1;
        let part = from_balance(&g, &[1, n - 1]).unwrap();
        assert_eq!(part.stages.len(), 2);
        assert!(from_balance(&g, &[1, 1])
            .unwrap_err()
            .to_string()
            .contains("adds up to 2"));
        assert!(
            balanced(&g, n + 1, &Cost::whole(vec![1.0; g.nodes.len()]), None)
                .unwrap_err()
                .to_string()
                .contains("at most")
        );
    }
}
