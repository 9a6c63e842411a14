//! Cutting a graph into pipeline stages. A cut point is a boundary between consecutive nodes
//! that at most [`MAX_CUT_VALUES`] values cross (a chain carries one tensor; a residual block or
//! an AmoebaNet cell boundary carries two). Stages are contiguous node ranges between cuts,
//! chosen to balance predicted cost (dynamic programming over the cut points) or given
//! explicitly as a balance list.

use std::ops::Range;

use crate::graph::{Graph, ValueId};
use crate::{Error, Result};

/// The most values a cut may carry.
pub const MAX_CUT_VALUES: usize = 2;

/// Contiguous node ranges, one per stage, covering the graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub stages: Vec<Range<usize>>,
}

/// Values produced before boundary `at` (or the graph input) and consumed at or after it.
pub fn crossing(g: &Graph, at: usize) -> Vec<ValueId> {
    (0..g.values.len())
        .filter(|&v| g.values[v].producer.is_none_or(|p| p < at))
        .filter(|&v| g.values[v].consumers.iter().any(|&c| c >= at))
        .collect()
}

/// Boundaries (1..nodes) where a graph may be cut.
pub fn cut_points(g: &Graph) -> Vec<usize> {
    // Values crossing boundary i: those with producer < i ≤ last consumer (difference array).
    let n = g.nodes.len();
    let mut delta = vec![0i64; n + 2];
    for v in &g.values {
        let Some(&last) = v.consumers.iter().max() else {
            continue;
        };
        let first = v.producer.map_or(0, |p| p + 1);
        if first <= last {
            delta[first] += 1;
            delta[last + 1] -= 1;
        }
    }
    let mut live = 0;
    let mut cuts = Vec::new();
    for (i, d) in delta.iter().enumerate().take(n) {
        live += d;
        if i > 0 && live as usize <= MAX_CUT_VALUES {
            cuts.push(i);
        }
    }
    cuts
}

fn too_many(g: &Graph, p: usize, cuts: usize) -> Error {
    Error::Config(format!(
        "{} has {cuts} cut points, so it splits into at most {} stages, not {p}",
        g.name,
        cuts + 1
    ))
}

/// The split into `p` stages whose slowest stage (by `cost` per node) is fastest.
pub fn balanced(g: &Graph, p: usize, cost: &[f64]) -> Result<Partition> {
    let cuts = cut_points(g);
    if p == 0 {
        return Err(Error::Config("a model needs at least one stage".into()));
    }
    if p > cuts.len() + 1 {
        return Err(too_many(g, p, cuts.len()));
    }
    // Positions: 0, the cut points, n. best[j][i]: least max-stage cost of the nodes before
    // position i in j stages; from[j][i]: where the last of those stages starts.
    let mut pos = vec![0];
    pos.extend(&cuts);
    pos.push(g.nodes.len());
    let mut prefix = vec![0.0];
    for c in cost {
        prefix.push(prefix.last().unwrap() + c);
    }
    let span = |a: usize, b: usize| prefix[pos[b]] - prefix[pos[a]];
    let m = pos.len();
    let mut best = vec![vec![f64::INFINITY; m]; p + 1];
    let mut from = vec![vec![0usize; m]; p + 1];
    best[0][0] = 0.0;
    for j in 1..=p {
        for i in j..m {
            for k in (j - 1)..i {
                let v = best[j - 1][k].max(span(k, i));
                if v < best[j][i] {
                    best[j][i] = v;
                    from[j][i] = k;
                }
            }
        }
    }
    let mut bounds = vec![m - 1];
    for j in (1..=p).rev() {
        bounds.push(from[j][*bounds.last().unwrap()]);
    }
    bounds.reverse();
    Ok(Partition {
        stages: bounds.windows(2).map(|w| pos[w[0]]..pos[w[1]]).collect(),
    })
}

/// The split given as a number of segments (the pieces between consecutive cut points) per
/// stage.
pub fn from_balance(g: &Graph, balance: &[usize]) -> Result<Partition> {
    let cuts = cut_points(g);
    let segments = cuts.len() + 1;
    if balance.contains(&0) {
        return Err(Error::Config(
            "every stage of --balance needs at least one segment".into(),
        ));
    }
    if balance.len() > segments {
        return Err(too_many(g, balance.len(), cuts.len()));
    }
    let total: usize = balance.iter().sum();
    if total != segments {
        return Err(Error::Config(format!(
            "--balance adds up to {total} segments, but {} has {segments} (segments are the pieces between its {} cut points)",
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
            let part = balanced(&g, p, &cost).unwrap();
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
        assert!(balanced(&g, n + 1, &vec![1.0; g.nodes.len()])
            .unwrap_err()
            .to_string()
            .contains("at most"));
    }
}
