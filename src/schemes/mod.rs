//! The GEMS schemes: a placement of (replica, stage) on ranks plus a schedule builder that
//! orders each rank's tasks. Notation as in DESIGN.md: P stages, m micro-batches per replica
//! pass, η replicas per step, D data-parallel groups; world = P·D ranks.

pub mod schedule;

use std::fmt;
use std::str::FromStr;

use crate::ops::tiles::Grid;
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// The scheme's family.
pub enum Kind {
    /// The whole model on one rank.
    Single,
    /// P = 1 on each of D ranks.
    Dp,
    /// MP-Basic: stage p on rank p, micro-batches pipelined.
    Mp,
    /// Two replicas, the second placed mirrored (stage P-1-p on rank p), flowing the other way.
    Mast,
    /// η > 2 (even) replicas: η/2 rounds of the MAST pair per step.
    Master,
}

impl FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "single" => Ok(Kind::Single),
            "dp" => Ok(Kind::Dp),
            "mp" => Ok(Kind::Mp),
            "mast" => Ok(Kind::Mast),
            "master" => Ok(Kind::Master),
            _ => Err(format!(
                "unknown scheme '{s}' (single, dp, mp, mast, master)"
            )),
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Single => "single",
            Kind::Dp => "dp",
            Kind::Mp => "mp",
            Kind::Mast => "mast",
            Kind::Master => "master",
        })
    }
}

/// The order of a stage's forward and backward passes over its micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Fill-drain: every forward, then every backward (in reverse micro-batch order).
    GPipe,
    /// One forward, one backward after a warm-up of P-1-s forwards (PipeDream-flush).
    OneFOneB,
}

impl FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gpipe" => Ok(Order::GPipe),
            "1f1b" => Ok(Order::OneFOneB),
            _ => Err(format!("unknown pipeline order '{s}' (gpipe, 1f1b)")),
        }
    }
}

/// A scheme with its sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheme {
    /// The family.
    pub kind: Kind,
    /// P: pipeline stages.
    pub stages: usize,
    /// m: micro-batches per replica pass.
    pub parts: usize,
    /// η: replicas per step (1 for single, dp and mp).
    pub replicas: usize,
    /// D: data-parallel groups.
    pub dp: usize,
    /// The pipeline's order of forward and backward passes.
    pub order: Order,
    /// Spatial parallelism: each sample of the first stage (and, flowing the other way, of
    /// MAST's mirrored replica) split into this grid of tiles, one rank each.
    pub spatial: Grid,
}

impl Scheme {
    /// A scheme of `kind` with P `stages`, m `parts`, η `replicas` and D `dp` groups; checked
    /// when a run lays it out. [`Scheme::of`] and its named settings say the same by name.
    pub fn new(
        kind: Kind,
        stages: usize,
        parts: usize,
        replicas: usize,
        dp: usize,
        order: Order,
    ) -> Scheme {
        Scheme {
            kind,
            stages,
            parts,
            replicas,
            dp,
            order,
            spatial: Grid::ONE,
        }
    }

    /// A scheme of `kind` with the replicas it runs (2 for mast, 4 for master, else 1), one
    /// stage, one micro-batch, one group, in GPipe order, untiled: the named settings below
    /// change the rest (`Scheme::mast().stages(2).micro_batches(4)`).
    pub fn of(kind: Kind) -> Scheme {
        let replicas = match kind {
            Kind::Mast => 2,
            Kind::Master => 4,
            _ => 1,
        };
        Scheme::new(kind, 1, 1, replicas, 1, Order::GPipe)
    }
    /// MP-Basic (see [`Scheme::of`]).
    pub fn mp() -> Scheme {
        Scheme::of(Kind::Mp)
    }
    /// MAST: two replicas flowing opposite ways (see [`Scheme::of`]).
    pub fn mast() -> Scheme {
        Scheme::of(Kind::Mast)
    }
    /// MASTER: four replicas, two MAST rounds (see [`Scheme::of`]).
    pub fn master() -> Scheme {
        Scheme::of(Kind::Master)
    }
    /// Data parallelism: one stage per rank (see [`Scheme::of`]).
    pub fn dp() -> Scheme {
        Scheme::of(Kind::Dp)
    }
    /// The same scheme with P = `stages` pipeline stages.
    pub fn stages(self, stages: usize) -> Scheme {
        Scheme { stages, ..self }
    }
    /// The same scheme with m = `parts` micro-batches per replica pass.
    pub fn micro_batches(self, parts: usize) -> Scheme {
        Scheme { parts, ..self }
    }
    /// The same scheme with η = `replicas` replicas per step.
    pub fn replicas(self, replicas: usize) -> Scheme {
        Scheme { replicas, ..self }
    }
    /// The same scheme with D = `dp` data-parallel groups.
    pub fn groups(self, dp: usize) -> Scheme {
        Scheme { dp, ..self }
    }
    /// The same scheme with its pipeline in `order`.
    pub fn order(self, order: Order) -> Scheme {
        Scheme { order, ..self }
    }
    /// The same scheme with its first stage's samples split into `grid` tiles.
    pub fn with_spatial(self, grid: Grid) -> Scheme {
        Scheme {
            spatial: grid,
            ..self
        }
    }

    /// One rank running `parts` micro-batches per step: the reference every scheme matches.
    pub fn single(parts: usize) -> Scheme {
        Scheme::new(Kind::Single, 1, parts, 1, 1, Order::GPipe)
    }
    /// Checks the sizes against each other and against a batch of `batch` images per replica
    /// pass, before any work starts.
    pub fn validate(&self, batch: usize) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.stages == 0 || self.parts == 0 || self.dp == 0 || self.replicas == 0 {
            return bad(
                "stages, parts, replicas and data-parallel groups must all be at least 1".into(),
            );
        }
        match self.kind {
            Kind::Single if self.stages != 1 || self.dp != 1 || self.replicas != 1 => {
                return bad("single runs one stage, one replica, one group".into())
            }
            Kind::Dp if self.stages != 1 || self.replicas != 1 => {
                return bad("dp runs one stage per rank and one replica".into())
            }
            Kind::Mp if self.replicas != 1 => {
                return bad("mp runs one replica per step; use mast or master for more".into())
            }
            Kind::Mast if self.replicas != 2 => {
                return bad(format!(
                    "mast runs exactly 2 replicas, not {}",
                    self.replicas
                ))
            }
            Kind::Master if self.replicas <= 2 || !self.replicas.is_multiple_of(2) => {
                return bad(format!(
                    "master needs an even number of replicas above 2, not {}",
                    self.replicas
                ))
            }
            _ => {}
        }
        if batch == 0 || !batch.is_multiple_of(self.parts) {
            return bad(format!(
                "a batch of {batch} does not split into {} equal micro-batches",
                self.parts
            ));
        }
        Ok(())
    }

    /// World size: the ranks of a group, times D.
    pub fn world(&self) -> usize {
        self.group_size() * self.dp
    }

    /// Ranks of one data-parallel group: one per pipeline position, R·C where the stages
    /// placed there run on tiles.
    pub fn group_size(&self) -> usize {
        (0..self.stages).map(|p| self.width(p)).sum()
    }

    /// Whether the stages at pipeline position `slot` run on tiles: the first position, and
    /// where a mirrored replica starts (MAST, MASTER), the last too.
    pub fn tiled(&self, slot: usize) -> bool {
        self.spatial.is_split() && (slot == 0 || (self.replicas >= 2 && slot + 1 == self.stages))
    }

    /// Ranks at pipeline position `slot`: its tiles, or one.
    pub fn width(&self, slot: usize) -> usize {
        if self.tiled(slot) {
            self.spatial.tiles()
        } else {
            1
        }
    }

    /// The first rank (within a group) at pipeline position `slot`; its tile t is that + t.
    pub fn first_rank(&self, slot: usize) -> usize {
        (0..slot).map(|p| self.width(p)).sum()
    }

    /// (pipeline position, tile) of rank `local` of a group.
    pub fn slot_of(&self, local: usize) -> (usize, usize) {
        let mut first = 0;
        for slot in 0..self.stages {
            if local < first + self.width(slot) {
                return (slot, local - first);
            }
            first += self.width(slot);
        }
        (self.stages, 0)
    }

    /// The pipeline position (within a data-parallel group) that runs `stage` of `replica`:
    /// even replicas flow from position 0, odd ones (MAST's second replica) from P-1.
    pub fn place(&self, replica: usize, stage: usize) -> usize {
        if replica % 2 == 1 {
            self.stages - 1 - stage
        } else {
            stage
        }
    }

    /// Micro-batches per step over all replicas and groups: the reference's accumulation count.
    pub fn micro_batches_per_step(&self) -> usize {
        self.dp * self.replicas * self.parts
    }

    /// Index of (group, replica, micro-batch) in the step's global micro-batch order.
    pub fn global_micro(&self, group: usize, replica: usize, micro: usize) -> usize {
        (group * self.replicas + replica) * self.parts + micro
    }
}
