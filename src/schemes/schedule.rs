//! Per-rank task lists. The builder is a list scheduler: every (replica, stage) copy keeps its
//! pipeline order (GPipe or 1F1B), and whenever a rank could start several copies' next tasks,
//! the one that can start earliest under the predicted costs runs first, subject to a bound on
//! the forward passes whose activations a rank holds at once. The same replay gives the
//! predicted timeline, so the schedule the runtime runs and the one the planner predicts are
//! the same list.

use super::{Order, Scheme};
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
/// Which pass of a micro-batch a task runs.
pub enum Pass {
    /// Forward through a stage.
    Forward,
    /// Backward through a stage.
    Backward,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
/// One unit of a schedule: a pass of one micro-batch through one stage of one replica.
pub struct Task {
    /// Forward or backward.
    pub pass: Pass,
    /// Which model replica (MAST and MASTER run more than one).
    pub replica: usize,
    /// Which pipeline stage.
    pub stage: usize,
    /// Which micro-batch of the step.
    pub micro: usize,
}

/// Predicted seconds of one micro-batch's forward and backward per stage, and of moving its
/// boundary tensors (activations forward, their gradients backward) from stage s to s + 1.
#[derive(Clone, Debug, PartialEq)]
pub struct StageCosts {
    /// Seconds of each stage's forward.
    pub forward: Vec<f64>,
    /// Seconds of each stage's backward.
    pub backward: Vec<f64>,
    /// Seconds to move a micro-batch's boundary tensors from stage s to s + 1.
    pub transfer: Vec<f64>,
}

impl StageCosts {
    /// Every stage costs `f` forward and `b` backward.
    pub fn uniform(stages: usize, f: f64, b: f64) -> Self {
        StageCosts {
            forward: vec![f; stages],
            backward: vec![b; stages],
            transfer: vec![0.0; stages],
        }
    }
}

/// A task with its predicted start and end.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timed {
    /// The task.
    pub task: Task,
    /// Seconds from the start of the step.
    pub start: f64,
    /// Seconds from the start of the step.
    pub end: f64,
}

/// Each rank's ordered tasks for one step of one data-parallel group (all groups run the same).
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// Each rank's tasks in the order it runs them.
    pub ranks: Vec<Vec<Timed>>,
}

impl Schedule {
    /// Seconds from the first task's start to the last one's end.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flatten()
            .map(|t| t.end)
            .fold(0.0, f64::max)
    }

    /// Seconds each rank computes.
    pub fn busy(&self) -> Vec<f64> {
        self.ranks
            .iter()
            .map(|r| r.iter().map(|t| t.end - t.start).sum())
            .collect()
    }
}

/// One stage's passes over `m` micro-batches in pipeline order.
fn stage_sequence(order: Order, stages: usize, stage: usize, m: usize) -> Vec<(Pass, usize)> {
    match order {
        Order::GPipe => (0..m)
            .map(|k| (Pass::Forward, k))
            .chain((0..m).rev().map(|k| (Pass::Backward, k)))
            .collect(),
        Order::OneFOneB => {
            let warm = (stages - 1 - stage).min(m);
            let mut seq: Vec<_> = (0..warm).map(|k| (Pass::Forward, k)).collect();
            for k in 0..m - warm {
                seq.push((Pass::Forward, warm + k));
                seq.push((Pass::Backward, k));
            }
            seq.extend((m - warm..m).map(|k| (Pass::Backward, k)));
            seq
        }
    }
}

/// Builds the schedule of `scheme` under `costs`, holding at most `max_in_flight` forward
/// passes' activations per rank (`None`: no bound). Under a bound, replicas enter each rank in
/// replica order (a later replica's forward waits until the earlier ones' forwards there are
/// done), so the first replica is never starved of the memory the bound leaves.
pub fn build(
    scheme: &Scheme,
    costs: &StageCosts,
    max_in_flight: Option<usize>,
) -> Result<Schedule> {
    replay(scheme, costs, max_in_flight, false)
}

/// The task list of an evaluation on one group: `micro` micro-batches' forwards through replica
/// 0's stages, in order, with no backward. One replica is enough: every copy of a stage holds
/// the same weights, and a second would only shorten a pass that is short already.
pub fn evaluation(scheme: &Scheme, costs: &StageCosts, micro: usize) -> Result<Schedule> {
    let one = Scheme {
        replicas: 1,
        parts: micro,
        order: Order::GPipe,
        ..*scheme
    };
    replay(&one, costs, None, true)
}

/// [`build`], or with `forward_only` its forward tasks alone.
fn replay(
    scheme: &Scheme,
    costs: &StageCosts,
    max_in_flight: Option<usize>,
    forward_only: bool,
) -> Result<Schedule> {
    let p = scheme.stages;
    // Per rank, its copies' sequences: a copy is one orientation (even or odd replicas) of one
    // stage; its replicas run one after another on it.
    let mut seqs: Vec<Vec<Vec<Task>>> = vec![Vec::new(); p];
    for orientation in 0..scheme.replicas.min(2) {
        for stage in 0..p {
            let mut seq = Vec::new();
            for replica in (orientation..scheme.replicas).step_by(2) {
                for (pass, micro) in stage_sequence(scheme.order, p, stage, scheme.parts) {
                    if forward_only && pass == Pass::Backward {
                        continue;
                    }
                    seq.push(Task {
                        pass,
                        replica,
                        stage,
                        micro,
                    });
                }
            }
            seqs[scheme.place(orientation, stage)].push(seq);
        }
    }
    let total: usize = seqs.iter().flatten().map(Vec::len).sum();
    let mut next = vec![vec![0usize; 2]; p];
    let mut free_at = vec![0.0f64; p];
    let mut in_flight = vec![0usize; p];
    // Forward passes not yet scheduled, per rank and replica.
    let mut forwards_left = vec![vec![scheme.parts; scheme.replicas]; p];
    let mut done: std::collections::HashMap<Task, f64> = std::collections::HashMap::new();
    let mut out: Vec<Vec<Timed>> = vec![Vec::new(); p];
    for _ in 0..total {
        let mut best: Option<(f64, usize, usize, usize)> = None; // (start, replica, rank, copy)
        for rank in 0..p {
            for (c, seq) in seqs[rank].iter().enumerate() {
                let Some(&t) = seq.get(next[rank][c]) else {
                    continue;
                };
                let dep = match t.pass {
                    Pass::Forward if t.stage > 0 => Some(Task {
                        stage: t.stage - 1,
                        ..t
                    }),
                    Pass::Backward if t.stage + 1 < p => Some(Task {
                        stage: t.stage + 1,
                        ..t
                    }),
                    _ => None,
                };
                let ready = match dep {
                    Some(d) => match done.get(&d) {
                        Some(&e) => e + costs.transfer[t.stage.min(d.stage)],
                        None => continue,
                    },
                    None => 0.0,
                };
                if t.pass == Pass::Forward
                    && max_in_flight.is_some_and(|b| {
                        in_flight[rank] >= b
                            || forwards_left[rank][..t.replica].iter().any(|&n| n > 0)
                    })
                {
                    continue;
                }
                let start = free_at[rank].max(ready);
                if best.is_none_or(|b| (start, t.replica, rank) < (b.0, b.1, b.2)) {
                    best = Some((start, t.replica, rank, c));
                }
            }
        }
        let Some((start, _, rank, c)) = best else {
            return Err(Error::Config(format!(
                "no schedule holds at most {} forward passes per rank: the bound is too small",
                max_in_flight.unwrap_or(0)
            )));
        };
        let t = seqs[rank][c][next[rank][c]];
        next[rank][c] += 1;
        let cost = match t.pass {
            Pass::Forward => costs.forward[t.stage],
            Pass::Backward => costs.backward[t.stage],
        };
        let end = start + cost;
        free_at[rank] = end;
        match t.pass {
            Pass::Forward => {
                in_flight[rank] += 1;
                forwards_left[rank][t.replica] -= 1;
            }
            Pass::Backward => in_flight[rank] -= 1,
        }
        done.insert(t, end);
        out[rank].push(Timed {
            task: t,
            start,
            end,
        });
    }
    Ok(Schedule { ranks: out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schemes::Kind;

    fn scheme(kind: Kind, stages: usize, parts: usize, replicas: usize, order: Order) -> Scheme {
        Scheme::new(kind, stages, parts, replicas, 1, order)
    }

    const F: f64 = 1.0;
    const B: f64 = 2.0;

    #[test]
    fn mp_basic_takes_p_times_f_plus_b_per_sample() {
        for p in [2, 3, 4, 8] {
            let s = build(
                &scheme(Kind::Mp, p, 1, 1, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                None,
            )
            .unwrap();
            assert_eq!(s.makespan(), p as f64 * (F + B));
        }
    }

    #[test]
    fn gpipe_and_1f1b_fill_and_drain() {
        for order in [Order::GPipe, Order::OneFOneB] {
            let (p, m) = (4, 8);
            let s = build(
                &scheme(Kind::Mp, p, m, 1, order),
                &StageCosts::uniform(p, F, B),
                None,
            )
            .unwrap();
            // (m + P - 1) slots of f + b: the pipeline bubble of both orders.
            assert_eq!(s.makespan(), (m + p - 1) as f64 * (F + B), "{order:?}");
            let held = |r: &Vec<Timed>| {
                let mut n: i32 = 0;
                let mut most = 0;
                for t in r {
                    n += if t.task.pass == Pass::Forward { 1 } else { -1 };
                    most = most.max(n);
                }
                most
            };
            // 1F1B holds at most P - s micro-batches on stage s; GPipe all m.
            let want = |s: usize| if order == Order::GPipe { m } else { p - s };
            for (rank, r) in s.ranks.iter().enumerate() {
                assert_eq!(held(r) as usize, want(rank), "{order:?} rank {rank}");
            }
        }
    }

    #[test]
    fn mast_with_room_for_both_replicas_overlaps_fully() {
        for p in [2, 4, 8] {
            let s = build(
                &scheme(Kind::Mast, p, 1, 2, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                None,
            )
            .unwrap();
            // Replica B starts at time 0 on rank P-1 while A starts on rank 0 ...
            let first = |rank: usize, replica: usize| {
                s.ranks[rank]
                    .iter()
                    .find(|t| t.task.replica == replica)
                    .unwrap()
                    .start
            };
            assert_eq!(first(0, 0), 0.0);
            assert_eq!(first(p - 1, 1), 0.0);
            // ... and two samples take what MP-Basic needs for one.
            assert_eq!(s.makespan(), p as f64 * (F + B), "P = {p}");
        }
        // An odd P works too: the middle rank serves both replicas of its stage in turn.
        let s = build(
            &scheme(Kind::Mast, 3, 1, 2, Order::GPipe),
            &StageCosts::uniform(3, F, B),
            None,
        )
        .unwrap();
        assert_eq!(s.ranks[1].len(), 4);
        assert!(s.makespan() < 2.0 * 3.0 * (F + B));
    }

    #[test]
    fn mast_with_room_for_one_replica_waits_for_the_first() {
        for p in [2, 4, 8] {
            let s = build(
                &scheme(Kind::Mast, p, 1, 2, Order::GPipe),
                &StageCosts::uniform(p, F, B),
                Some(1),
            )
            .unwrap();
            assert_eq!(
                s.makespan(),
                (p + 1) as f64 * F + 2.0 * p as f64 * B,
                "P = {p}"
            );
            // MP-Basic would take 2P(f + b) for the same two samples.
            assert!(s.makespan() < 2.0 * p as f64 * (F + B));
            for r in &s.ranks {
                let mut n = 0;
                for t in r {
                    n += if t.task.pass == Pass::Forward { 1 } else { -1 };
                    assert!(n <= 1);
                }
            }
        }
    }

    #[test]
    fn master_runs_rounds_of_the_pair() {
        let s = build(
            &scheme(Kind::Master, 4, 2, 4, Order::GPipe),
            &StageCosts::uniform(4, F, B),
            None,
        )
        .unwrap();
        let tasks: usize = s.ranks.iter().map(Vec::len).sum();
        assert_eq!(tasks, 4 * 4 * 2 * 2); // replicas · stages · micro-batches · (F, B)
        assert!(build(
            &scheme(Kind::Mast, 2, 1, 2, Order::GPipe),
            &StageCosts::uniform(2, F, B),
            Some(0)
        )
        .is_err());
    }

    #[test]
    fn evaluation_runs_replica_0_forwards_in_order() {
        for (kind, replicas) in [(Kind::Mp, 1), (Kind::Mast, 2), (Kind::Master, 4)] {
            let (p, m) = (3, 5);
            let s = evaluation(
                &scheme(kind, p, 2, replicas, Order::OneFOneB),
                &StageCosts::uniform(p, F, B),
                m,
            )
            .unwrap();
            for (rank, tasks) in s.ranks.iter().enumerate() {
                let got: Vec<Task> = tasks.iter().map(|t| t.task).collect();
                let want: Vec<Task> = (0..m)
                    .map(|micro| Task {
                        pass: Pass::Forward,
                        replica: 0,
                        stage: rank,
                        micro,
                    })
                    .collect();
                assert_eq!(got, want, "{kind:?} rank {rank}");
            }
            // Forwards pipelined: the last stage finishes P - 1 slots after the first.
            assert_eq!(s.makespan(), (m + p - 1) as f64 * F);
        }
        // A group with nothing to evaluate has nothing to do.
        let s = evaluation(
            &scheme(Kind::Mp, 2, 1, 1, Order::GPipe),
            &StageCosts::uniform(2, F, B),
            0,
        )
        .unwrap();
        assert!(s.ranks.iter().all(Vec::is_empty));
    }

    #[test]
    fn validation() {
        let ok = scheme(Kind::Mast, 4, 2, 2, Order::GPipe);
        assert!(ok.validate(4).is_ok());
        assert!(ok
            .validate(3)
            .unwrap_err()
            .to_string()
            .contains("micro-batches"));
        assert!(scheme(Kind::Master, 4, 1, 3, Order::GPipe)
            .validate(1)
            .unwrap_err()
            .to_string()
            .contains("even"));
        assert!(scheme(Kind::Mast, 4, 1, 4, Order::GPipe)
            .validate(1)
            .is_err());
        assert!(scheme(Kind::Mp, 4, 1, 2, Order::GPipe).validate(1).is_err());
    }
}
