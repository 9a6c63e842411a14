//! Where a graph may be cut into stages: a cut point is a boundary between consecutive nodes
//! that at most [`MAX_CUT_VALUES`] values cross (a chain carries one tensor; a residual block or
//! an AmoebaNet cell boundary carries two). Below both the partitioner and the memory model,
//! which each need the values a boundary carries.

use crate::graph::{Graph, ValueId};

/// The most values a cut may carry.
pub const MAX_CUT_VALUES: usize = 2;

/// Values produced before boundary `at` (or the graph input) and consumed at or after it.
pub fn crossing(g: &Graph, at: usize) -> Vec<ValueId> {
    (0..g.values.len())
        .filter(|&v| g.values[v].producer.is_none_or(|p| p < at))
        .filter(|&v| g.values[v].consumers.iter().any(|&c| c >= at))
        .collect()
}

/// For every boundary 0..=nodes, the values crossing it where at most [`MAX_CUT_VALUES`] do
/// (`None` where more do).
pub fn carried(g: &Graph) -> Vec<Option<Vec<ValueId>>> {
    // Value v crosses boundaries producer + 1 ..= its last consumer (difference array).
    let n = g.nodes.len();
    let span = |v: &crate::graph::Value| {
        let last = *v.consumers.iter().max()?;
        let first = v.producer.map_or(0, |p| p + 1);
        (first <= last).then_some(first..=last)
    };
    let mut delta = vec![0i64; n + 2];
    for r in g.values.iter().filter_map(span) {
        delta[*r.start()] += 1;
        delta[r.end() + 1] -= 1;
    }
    let mut live = 0;
    let mut out: Vec<Option<Vec<ValueId>>> = delta[..=n]
        .iter()
        .map(|d| {
            live += d;
            (live as usize <= MAX_CUT_VALUES).then(Vec::new)
        })
        .collect();
    for (v, value) in g.values.iter().enumerate() {
        for at in span(value).into_iter().flatten() {
            if let Some(list) = &mut out[at] {
                list.push(v);
            }
        }
    }
    out
}

/// Boundaries (1..nodes) where a graph may be cut.
pub fn cut_points(g: &Graph) -> Vec<usize> {
    let n = g.nodes.len();
    carried(g)
        .iter()
        .enumerate()
        .filter(|&(i, c)| i > 0 && i < n && c.is_some())
        .map(|(i, _)| i)
        .collect()
}
