//! The GEMS schemes: a placement of (replica, stage) on ranks plus a schedule builder that
//! orders each rank's tasks. Notation as in DESIGN.md: P stages, m micro-batches per replica
//! pass, η replicas per step, D data-parallel groups; world = P·D ranks.

pub mod admission;
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
    /// Zero-bubble ZB-H1 (Qi et al., ICLR 2024): 1F1B's memory, each backward split into B
    /// (input gradients, sent upstream at once) and W (weight gradients), the W passes filling
    /// the pipeline's bubbles.
    ZbH1,
    /// Interleaved 1F1B (Megatron-LM): V model chunks per rank, chunk v of rank r being stage
    /// v·P + r, so a micro-batch loops over the ranks V times and the bubble shrinks V-fold.
    Interleaved,
    /// Zero-bubble ZB-V: two chunks per rank in a V (stage s on rank s going down, stage
    /// 2P−1−s coming back), so the first rank also holds the last stage; B and W split.
    ZbV,
}

impl Order {
    /// Every built-in order.
    pub const ALL: [Order; 5] = [
        Order::GPipe,
        Order::OneFOneB,
        Order::Interleaved,
        Order::ZbH1,
        Order::ZbV,
    ];

    /// Model chunks each rank holds under this order with `virtual_stages` asked for.
    pub fn chunks(self, virtual_stages: usize) -> usize {
        match self {
            Order::Interleaved => virtual_stages,
            Order::ZbV => 2,
            _ => 1,
        }
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Order::GPipe => "gpipe",
            Order::OneFOneB => "1f1b",
            Order::ZbH1 => "zbh1",
            Order::Interleaved => "interleaved",
            Order::ZbV => "zbv",
        })
    }
}

impl FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "gpipe" => Ok(Order::GPipe),
            "1f1b" => Ok(Order::OneFOneB),
            "zbh1" => Ok(Order::ZbH1),
            "interleaved" => Ok(Order::Interleaved),
            "zbv" => Ok(Order::ZbV),
            _ => Err(format!(
                "unknown pipeline order '{s}' (gpipe, 1f1b, interleaved, zbh1, zbv)"
            )),
        }
    }
}

/// The most ranks a scheme may span (P·D, with R·C for each tiled stage).
pub const MAX_RANKS: usize = 1024;

/// The most micro-batch passes (m·η·V) a rank may run per step.
pub const MAX_PASSES: usize = 4096;

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
    /// V: model chunks per rank (interleaved 1F1B; ZB-V holds 2 whatever it says): the model
    /// is split into P·V stages.
    pub virtual_stages: usize,
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
            virtual_stages: 1,
        }
    }

    /// The same scheme with `v` model chunks per rank (interleaved 1F1B).
    pub fn with_virtual_stages(self, v: usize) -> Scheme {
        Scheme {
            virtual_stages: v,
            ..self
        }
    }

    /// Model chunks each rank holds: V for interleaved 1F1B, 2 for ZB-V, else 1.
    pub fn chunks(&self) -> usize {
        self.order.chunks(self.virtual_stages)
    }

    /// Stages the model is split into: P·chunks.
    pub fn model_stages(&self) -> usize {
        self.stages * self.chunks()
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
        let sizes = [
            ("P (--split)", self.stages),
            ("m (--parts)", self.parts),
            ("η (--replicas)", self.replicas),
            ("D (--dp)", self.dp),
            ("V (--virtual-stages)", self.virtual_stages),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return bad(format!("{name} must be at least 1, got 0"));
        }
        // Every rank's schedule and meter are held in this process while planning, so sizes
        // are bounded by what that bookkeeping leaves room for (checked: products can wrap).
        let world = (0..self.stages.min(MAX_RANKS + 1))
            .try_fold(0usize, |n, p| n.checked_add(self.width(p)))
            .and_then(|group| group.checked_mul(self.dp))
            .filter(|&w| w <= MAX_RANKS && self.stages <= MAX_RANKS);
        if world.is_none() {
            return bad(format!(
                "P·D (with R·C tiles at each tiled stage) = {}·{} with {} tiles is more than the \
                 {MAX_RANKS} ranks gems plans and runs (each rank's schedule and memory plan are \
                 kept in one process)",
                self.stages,
                self.dp,
                self.spatial.tiles()
            ));
        }
        let passes = self
            .parts
            .checked_mul(self.replicas)
            .and_then(|n| n.checked_mul(self.virtual_stages));
        if passes.is_none_or(|n| n > MAX_PASSES) {
            return bad(format!(
                "m·η·V = {}·{}·{} micro-batch passes per rank and step is more than the {MAX_PASSES} \
                 whose tasks a schedule holds",
                self.parts, self.replicas, self.virtual_stages
            ));
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
        let zero_bubble = matches!(self.order, Order::ZbH1 | Order::ZbV);
        if (zero_bubble || self.order == Order::Interleaved) && self.replicas != 1 {
            return bad(format!(
                "the {} order runs one replica per step, not {} (mp, dp or single)",
                self.order, self.replicas
            ));
        }
        if self.chunks() > 1 {
            if self.spatial.is_split() {
                return bad(format!(
                    "the {} order holds several model chunks per rank; spatial parallelism \
                     tiles the first stage of one chunk per rank (use gpipe, 1f1b or zbh1)",
                    self.order
                ));
            }
            if self.order == Order::Interleaved && !self.parts.is_multiple_of(self.stages) {
                return bad(format!(
                    "interleaved 1F1B runs micro-batches in rounds of P = {}: {} micro-batches \
                     are not a multiple of it",
                    self.stages, self.parts
                ));
            }
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
    /// even replicas flow from position 0, odd ones (MAST's second replica) from P-1; with
    /// model chunks, stage s on position s mod P (interleaved) or in a V (ZB-V: down the
    /// ranks, then back up).
    pub fn place(&self, replica: usize, stage: usize) -> usize {
        let p = self.stages;
        match self.order {
            Order::Interleaved => stage % p,
            Order::ZbV if stage >= p => 2 * p - 1 - stage,
            _ if replica % 2 == 1 => p - 1 - stage,
            _ => stage,
        }
    }

    /// The model stages position `slot` holds for `replica`, in stage order.
    pub fn stages_at(&self, replica: usize, slot: usize) -> Vec<usize> {
        (0..self.model_stages())
            .filter(|&s| self.place(replica, s) == slot)
            .collect()
    }

    /// The model stages position `slot` holds a copy of, for any replica, in stage order.
    pub fn holds(&self, slot: usize) -> Vec<usize> {
        (0..self.model_stages())
            .filter(|&s| (0..self.replicas.min(2)).any(|r| self.place(r, s) == slot))
            .collect()
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
