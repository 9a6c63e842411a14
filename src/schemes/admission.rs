//! What a rank holds at each moment of its task list, and the rule that admits a forward
//! pass: the bytes of a stage ([`StageBytes`], from the planner's footprint model), a moment
//! of a rank's step ([`Moment`]), what a rank holds at its worst moment ([`held_bytes`]), and
//! the [`Admission`] of the schedule builders, which starts a micro-batch's forward only where
//! the rank's free bytes hold it. The same rule makes the schedule that the runtime runs, the
//! meter measures and the planner predicts.

use super::Scheme;

/// What one stage holds, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageBytes {
    /// Weights and buffers, gradients, momentum.
    pub params: u64,
    /// Batch statistics of one micro-batch (held from its forward to the end of the step).
    pub stats: u64,
    /// Saved for backward per micro-batch in flight.
    pub saved: u64,
    /// The most a micro-batch holds while its forward runs, and while its backward runs.
    pub forward: u64,
    /// The most a micro-batch holds while its backward runs.
    pub backward: u64,
}

impl StageBytes {
    /// What each rank holds where the stage's samples are split into `tiles` tiles: a share
    /// of the activations (halo buffers, small beside a tile, not counted), the whole weights
    /// and the batch statistics (per channel, the same on every tile).
    pub fn on_tiles(self, tiles: usize) -> StageBytes {
        let share = |b: u64| b.div_ceil(tiles as u64);
        StageBytes {
            saved: share(self.saved),
            forward: share(self.forward),
            backward: share(self.backward),
            ..self
        }
    }
}

/// One moment of a rank's step: for each copy (orientation: even or odd replicas), the
/// micro-batches it holds (the running one included) and those it has run forward (whose batch
/// statistics wait for the end of the step); and which copy runs which pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Moment {
    /// Micro-batches of each copy whose saved tensors the rank holds (the running one included).
    pub held: [usize; 2],
    /// Micro-batches of each copy run forward whose batch statistics wait for the end of the step.
    pub forwarded: [usize; 2],
    /// Which copy runs the task at this moment.
    pub running: usize,
    /// Whether that task is a backward pass.
    pub backward: bool,
}

impl Moment {
    /// Holds at least what `other` holds, running the same pass.
    pub fn covers(&self, other: &Moment) -> bool {
        (self.running, self.backward) == (other.running, other.backward)
            && (0..2)
                .all(|c| self.held[c] >= other.held[c] && self.forwarded[c] >= other.forwarded[c])
    }
}

/// The bytes of a rank holding `copies` (one per orientation) at its worst moment of `at`.
pub fn held_bytes(copies: &[StageBytes], at: &[Moment]) -> u64 {
    let params: u64 = copies.iter().map(|s| s.params).sum();
    let most = at
        .iter()
        .map(|m| {
            // The running micro-batch counts with what its pass holds.
            let waiting: u64 = copies
                .iter()
                .enumerate()
                .map(|(c, s)| {
                    let held = (m.held[c] - (c == m.running) as usize) as u64;
                    held * s.saved + m.forwarded[c] as u64 * s.stats
                })
                .sum();
            let run = &copies[m.running];
            waiting
                + if m.backward {
                    run.backward
                } else {
                    run.forward
                }
        })
        .max()
        .unwrap_or(0);
    params + most
}

/// The copies of stages that rank `rank` holds under `scheme` (one per orientation: even and
/// odd replicas), with what each holds on that rank (a share where the stage runs on tiles).
pub fn rank_copies(scheme: &Scheme, rank: usize, stages: &[StageBytes]) -> Vec<StageBytes> {
    (0..scheme.replicas.min(2))
        .map(|o| stages[scheme.place(o, rank)].on_tiles(scheme.width(rank)))
        .collect()
}

/// What bounds the micro-batches a rank holds at once (from a forward to its backward) in the
/// orders whose builder admits forwards (GPipe and 1F1B; the zero-bubble orders hold what 1F1B
/// holds).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Admission {
    /// Every forward starts as soon as it can.
    #[default]
    Free,
    /// At most this many micro-batches per rank, later replicas' forwards after the earlier
    /// ones' on the same rank (a user's bound by count).
    Count(usize),
    /// A forward starts when the rank's free bytes hold it ([`Budget::admits`]).
    Bytes(Budget),
}

/// What a copy of a stage holds at a moment, for [`Budget::admits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// Micro-batches whose saved tensors it holds.
    pub held: usize,
    /// Micro-batches it has run forward (their batch statistics wait for the end of the step).
    pub forwarded: usize,
    /// Whether it still runs a forward while holding them (its forward's peak then counts).
    pub forwards: bool,
}

/// Each rank's device capacity and the bytes of the copies of stages it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Budget {
    /// Device bytes per rank.
    pub capacity: u64,
    /// Per rank, its copies' bytes (one per orientation, as [`rank_copies`] gives them).
    pub ranks: Vec<Vec<StageBytes>>,
}

impl Budget {
    /// `scheme`'s ranks on devices of `capacity` bytes, its stages holding `stages`.
    pub fn new(scheme: &Scheme, capacity: u64, stages: &[StageBytes]) -> Budget {
        Budget {
            capacity,
            ranks: (0..scheme.stages)
                .map(|r| rank_copies(scheme, r, stages))
                .collect(),
        }
    }

    /// The admission rule: whether rank `rank`'s free bytes (its capacity less its copies'
    /// parameters and the micro-batches they hold) hold a forward once its copies hold
    /// `after` (the forward's micro-batch counted), at every moment that state allows: each
    /// copy that still runs a forward running one, each copy that holds a micro-batch running
    /// its backward. The schedule builder puts the most each earlier replica will still hold on
    /// the rank into `after`, so the memory a later replica takes never holds an earlier one
    /// back.
    pub fn admits(&self, rank: usize, after: &[Holding]) -> bool {
        let copies = &self.ranks[rank];
        let held = |k: usize| after.get(k).map_or(0, |h| h.held);
        let forwarded = |k: usize| after.get(k).map_or(0, |h| h.forwarded);
        let state = Moment {
            held: [held(0), held(1)],
            forwarded: [forwarded(0), forwarded(1)],
            running: 0,
            backward: false,
        };
        let mut at = Vec::new();
        for (k, h) in after.iter().enumerate().take(copies.len()) {
            if h.held == 0 {
                continue;
            }
            if h.forwards {
                at.push(Moment {
                    running: k,
                    ..state
                });
            }
            at.push(Moment {
                running: k,
                backward: true,
                ..state
            });
        }
        held_bytes(copies, &at) <= self.capacity
    }
}
