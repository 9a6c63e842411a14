//! The default CPU cost model: each op family's seconds as a fixed part plus parts per image,
//! per output plane, per FLOP, per byte of activations (and per byte beyond what stays in
//! cache) and per byte of parameters, fitted to calibrations of this project's kernels (`gems
//! calibrate` over a corpus of models, `scripts/fit_cpu_costs.sh`) and committed as
//! `src/plan/cpu_costs.json`, one fit per thread count measured.
//!
//! A family whose op splits its backward (the convolutions) also has a [`Split`]: what its B
//! and W cost called apart, as a ratio to the fitted fused backward and W's share (B + W
//! within about 1% of one call, W about half of it, nearly three quarters for a transposed
//! convolution, and all of a first layer's, which computes no input gradient).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use super::calibrate::Calibration;
use crate::graph::{Graph, Node, ValueId};
use crate::ops::Op;
use crate::tensor::DType;
use crate::{Error, Result};

/// What one call does: the terms its seconds are fitted on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Samples (images) the call computes on: kernels loop over them, at a cost apart from
    /// their FLOPs and bytes (fitted without this term, resnet20v2's 3×3 convolutions at 32
    /// images of 32² came out at half their measured time).
    pub images: f64,
    /// Planes of its output, an image's channel each: kernels loop over them too (the fused
    /// batch norm and ReLU over 32 images of 32² measured three times the time per element of
    /// 2 images of 128²).
    pub planes: f64,
    /// FLOPs.
    pub flops: f64,
    /// Bytes of activations read and written.
    pub bytes: f64,
    /// Bytes of parameters (read once per call, and their gradients written in backward).
    pub param_bytes: f64,
}

impl Work {
    /// Node `n` of `g` at `batch` samples in `dtype`.
    pub fn of(g: &Graph, n: &Node, batch: usize, dtype: DType) -> Work {
        let params: usize = n
            .params
            .clone()
            .map(|p| g.params[p].spec.shape.numel())
            .sum();
        let dims = g.values[n.output].shape.dims();
        let planes: usize = dims[..dims.len().saturating_sub(2)].iter().product();
        Work {
            images: batch as f64,
            planes: (planes * batch) as f64,
            flops: g.node_flops(n) as f64 * batch as f64,
            bytes: g.node_bytes(n, dtype) as f64 * batch as f64,
            param_bytes: (params * dtype.size()) as f64,
        }
    }

    /// The terms a [`Rate`] multiplies: a call, then each of the others, the bytes beyond
    /// `cache` apart as well.
    fn terms(&self, cache: f64) -> [f64; TERMS] {
        [
            1.0,
            self.images,
            self.planes,
            self.flops,
            self.bytes,
            (self.bytes - cache).max(0.0),
            self.param_bytes,
        ]
    }
}

/// How many terms a [`Rate`] has.
const TERMS: usize = 7;

/// Where the bytes beyond the cache sit among [`Work::terms`].
const COLD_TERM: usize = 5;

/// Seconds of one call: a fixed part plus parts per image, per output plane, per FLOP, per
/// byte of activations (and per byte beyond what stays in cache) and per byte of parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rate {
    /// Seconds every call costs.
    pub call: f64,
    /// Seconds per image.
    #[serde(default)]
    pub per_image: f64,
    /// Seconds per output plane.
    #[serde(default)]
    pub per_plane: f64,
    /// Seconds per FLOP.
    pub per_flop: f64,
    /// Seconds per byte of activations.
    pub per_byte: f64,
    /// Seconds per byte of activations beyond the fit's `cache_bytes`: a call whose tensors
    /// stay in cache runs faster per byte than one that streams them from memory.
    #[serde(default)]
    pub per_cold_byte: f64,
    /// Seconds per byte of parameters.
    pub per_param_byte: f64,
}

impl Rate {
    fn coefficients(&self) -> [f64; TERMS] {
        [
            self.call,
            self.per_image,
            self.per_plane,
            self.per_flop,
            self.per_byte,
            self.per_cold_byte,
            self.per_param_byte,
        ]
    }

    /// Seconds of a call doing `w`, on a machine that keeps `cache` bytes of a call's
    /// activations in cache.
    pub fn seconds(&self, w: &Work, cache: f64) -> f64 {
        let (c, t) = (self.coefficients(), w.terms(cache));
        (0..TERMS).map(|i| c[i] * t[i]).sum()
    }
}

/// One op family's forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FamilyRates {
    /// Forward.
    pub forward: Rate,
    /// Backward (input and weight gradients).
    pub backward: Rate,
    /// How its backward divides when split into B and W (an op that splits its backward,
    /// fitted to calibrations that timed the two calls apart); none: into halves costing
    /// what the fused backward does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    /// Ops the fit saw.
    pub samples: usize,
}

/// A family's backward called as B then W, against one call: B and W are fitted as shares of
/// the fused backward's fitted seconds rather than as rates of their own, so that fitting
/// errors do not make up a difference between the two that was not measured.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Split {
    /// Seconds of B + W over those of the fused backward.
    pub ratio: f64,
    /// W's share of B + W.
    pub weight: f64,
}

impl Split {
    /// B's and W's seconds for a fused backward of `backward` seconds.
    pub fn of(&self, backward: f64) -> (f64, f64) {
        let both = self.ratio * backward;
        (both * (1.0 - self.weight), both * self.weight)
    }

    /// The split of `samples` (all of one family whose op splits its backward, from
    /// calibrations that timed B and W): the medians of each sample's ratio and W's share,
    /// each sample weighted by its share of its model's op seconds (the ops that take a
    /// model's time count, as in the rates' fit); none without a sample timed apart. Medians,
    /// not ratios of sums: on a busy machine a few ops' fused backward is timed several times
    /// too long, and a sum follows them.
    fn fit(samples: &[OpSample]) -> Option<Split> {
        let timed: Vec<(f64, f64, f64, f64)> = (samples.iter())
            .filter_map(|s| {
                let (b, w) = s.split?;
                let ok = s.model_seconds > 0.0 && s.backward > 0.0 && b + w > 0.0;
                ok.then_some((s.backward, b, w, s.model_seconds))
            })
            .collect();
        Some(Split {
            ratio: weighted_median(timed.iter().map(|&(f, b, w, k)| ((b + w) / f, f / k)))?,
            weight: weighted_median(timed.iter().map(|&(_, b, w, k)| (w / (b + w), (b + w) / k)))?,
        })
    }
}

/// The weighted median of `(value, weight)` pairs: the least value with at least half the
/// weight at or below it; none without a pair of positive weight.
fn weighted_median(pairs: impl Iterator<Item = (f64, f64)>) -> Option<f64> {
    let mut v: Vec<(f64, f64)> = pairs.filter(|(x, w)| x.is_finite() && *w > 0.0).collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let half = v.iter().map(|p| p.1).sum::<f64>() / 2.0;
    let mut below = 0.0;
    v.into_iter()
        .find(|&(_, w)| {
            below += w;
            below >= half
        })
        .map(|p| p.0)
}

/// The cache sizes a fit tries, in MiB: from a core's L2 to a large L3.
pub const CACHE_SIZES: [f64; 6] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];

const MIB: f64 = 1024.0 * 1024.0;

/// Op costs of one machine at one thread count.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FittedCosts {
    /// The machine measured.
    pub machine: String,
    /// Threads the ops ran on.
    pub threads: usize,
    /// Each op family's rates (see [`family`]).
    pub families: BTreeMap<String, FamilyRates>,
    /// Bytes of a call's activations that stay in cache: the size among [`CACHE_SIZES`] that
    /// fits the calibrations best.
    #[serde(default)]
    pub cache_bytes: f64,
    /// Making and uploading a micro-batch: per byte of input.
    pub data: Rate,
    /// Scoring a micro-batch at an output (loss, gradient, predictions): per image, per
    /// class map and per byte of logits (none in a fit made before losses were timed).
    #[serde(default)]
    pub loss: Rate,
    /// One optimizer step: per byte of parameters.
    pub optimizer: Rate,
    /// How many times as long a rank's ops take while several ranks compute at once on these
    /// threads as the fit at its share of them predicts (two ranks on two threads: the
    /// one-thread fit): what they share besides the cores (cache, memory bandwidth, the
    /// pool's hand-offs, the heap). Fitted to measured steps of two-rank pipelines
    /// (`scripts/fit_at_once.py`); 1 where none were measured.
    #[serde(default = "unmeasured")]
    pub at_once: f64,
}

fn unmeasured() -> f64 {
    1.0
}

/// What node `n` of `g` is for the cost model: a convolution by kernel, stride and grouping
/// (each has its own algorithm on the CPU), an adaptive pool that enlarges (nearest
/// upsampling) apart from one that reduces, any other op by its kind.
pub fn family(g: &Graph, n: &Node) -> String {
    match &n.op {
        Op::AdaptiveAvgPool(p) => {
            let d = g.values[n.inputs[0]].shape.dims();
            match p.out.0 * p.out.1 > d[d.len() - 2] * d[d.len() - 1] {
                true => "upsample-nearest".into(),
                false => "adaptive-avgpool".into(),
            }
        }
        Op::Conv2d(c) => {
            let mut s = format!("conv {}x{}", c.kernel.0, c.kernel.1);
            if c.stride != (1, 1) {
                s += &format!("/{}", c.stride.0);
            }
            if c.dilation != (1, 1) {
                s += " dilated";
            }
            if c.groups != 1 {
                s += " grouped";
            }
            s
        }
        Op::ConvTranspose2d(c) => format!("conv-transpose {}x{}", c.kernel.0, c.kernel.1),
        Op::Custom(c) => format!("custom {}", c.label()),
        other => other
            .describe()
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string(),
    }
}

/// One timed op: its family, work and seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct OpSample {
    /// Its family.
    pub family: String,
    /// What its forward does at the micro-batch timed.
    pub work: Work,
    /// Forward seconds.
    pub forward: f64,
    /// Backward seconds.
    pub backward: f64,
    /// B's and W's seconds, for an op that splits its backward in a calibration that timed
    /// them.
    pub split: Option<(f64, f64)>,
    /// Its model's op seconds, forward and backward, at that micro-batch.
    pub model_seconds: f64,
}

/// The ops of `cal`, a calibration of `g`, as samples.
pub fn samples(g: &Graph, cal: &Calibration) -> Vec<OpSample> {
    let total: f64 = cal.forward.iter().chain(&cal.backward).sum();
    let timed_apart = cal.input.len() == g.nodes.len() && cal.weight.len() == g.nodes.len();
    g.nodes
        .iter()
        .enumerate()
        .zip(cal.forward.iter().zip(&cal.backward))
        .map(|((i, n), (&forward, &backward))| OpSample {
            family: family(g, n),
            work: Work::of(g, n, cal.micro_batch, cal.dtype),
            forward,
            backward,
            split: (timed_apart && n.op.get().splits_weights())
                .then(|| (cal.input[i], cal.weight[i])),
            model_seconds: total,
        })
        .collect()
}

/// Making a micro-batch of `batch` inputs of `g`: its images and bytes.
fn input_work(g: &Graph, batch: usize, dtype: DType) -> Work {
    Work {
        images: batch as f64,
        bytes: (g.input_shape().numel() * batch * dtype.size()) as f64,
        ..Work::default()
    }
}

/// Scoring a micro-batch of `batch` samples at output `value` of `g`: its images, class
/// maps (one per sample and class) and bytes of logits.
fn loss_work(g: &Graph, value: ValueId, batch: usize, dtype: DType) -> Work {
    let shape = &g.values[value].shape;
    Work {
        images: batch as f64,
        planes: (shape.dim(0) * batch) as f64,
        bytes: (shape.numel() * batch * dtype.size()) as f64,
        ..Work::default()
    }
}

/// Of the calibrations of each configuration (model, input side, classes, micro-batch and
/// activations' dtype), the one with the least op time, in the order they came.
fn fastest_of_each(runs: &[(Graph, Calibration)]) -> Vec<(Graph, Calibration)> {
    let key = |c: &Calibration| {
        (
            c.model.clone(),
            c.image_size,
            c.classes,
            c.micro_batch,
            c.dtype,
        )
    };
    let ops = |c: &Calibration| c.forward.iter().chain(&c.backward).sum::<f64>();
    let mut fastest: Vec<(Graph, Calibration)> = Vec::new();
    for (g, cal) in runs {
        match fastest.iter_mut().find(|(_, c)| key(c) == key(cal)) {
            Some(kept) if ops(cal) < ops(&kept.1) => *kept = (g.clone(), cal.clone()),
            Some(_) => {}
            None => fastest.push((g.clone(), cal.clone())),
        }
    }
    fastest
}

/// An optimizer step over `g`'s parameters: their bytes.
fn param_work(g: &Graph, dtype: DType) -> Work {
    let n: usize = g.params.iter().map(|p| p.spec.shape.numel()).sum();
    Work {
        param_bytes: (n * dtype.size()) as f64,
        ..Work::default()
    }
}

impl FittedCosts {
    /// Fits every family seen in `runs` (graphs with a calibration of each, all at one thread
    /// count on one machine): the rates with the least relative error, none negative. Of
    /// several calibrations of one configuration only the fastest counts: on a shared machine
    /// a neighbour only adds time, and the fastest round is the machine's own speed.
    pub fn fit(machine: &str, threads: usize, runs: &[(Graph, Calibration)]) -> Result<Self> {
        if runs.is_empty() {
            return Err(Error::Config("nothing to fit: no calibration given".into()));
        }
        let runs = &fastest_of_each(runs)[..];
        let mut by_family: BTreeMap<String, Vec<OpSample>> = BTreeMap::new();
        for (g, cal) in runs {
            for s in samples(g, cal) {
                by_family.entry(s.family.clone()).or_default().push(s);
            }
        }
        // Every family at each cache size; the size with the least error over all is kept.
        let fit_families = |cache: f64| -> (BTreeMap<String, FamilyRates>, f64) {
            let mut total = 0.0;
            let families = (by_family.iter())
                .map(|(name, ss)| {
                    let work: Vec<Work> = ss.iter().map(|s| s.work).collect();
                    let forward: Vec<f64> = ss.iter().map(|s| s.forward).collect();
                    let backward: Vec<f64> = ss.iter().map(|s| s.backward).collect();
                    let scale: Vec<f64> = ss.iter().map(|s| s.model_seconds).collect();
                    let (f, f_err) = fit_rate(&work, &forward, &scale, cache);
                    let (b, b_err) = fit_rate(&work, &backward, &scale, cache);
                    total += f_err + b_err;
                    let rates = FamilyRates {
                        forward: f,
                        backward: b,
                        split: Split::fit(ss),
                        samples: ss.len(),
                    };
                    (name.clone(), rates)
                })
                .collect();
            (families, total)
        };
        let (cache_bytes, (families, _)) = CACHE_SIZES
            .iter()
            .map(|&mib| (mib * MIB, fit_families(mib * MIB)))
            .min_by(|(_, (_, a)), (_, (_, b))| a.total_cmp(b))
            .expect("at least one cache size");
        // Data and optimizer, one call per profile, each relative to its own time.
        let own = |of: fn(&Calibration) -> f64| -> (Vec<f64>, Vec<f64>) {
            let t: Vec<f64> = runs.iter().map(|(_, c)| of(c)).collect();
            (t.clone(), t)
        };
        let (data, data_scale) = own(|c| c.data);
        // Losses, one call per output of each profile that timed them.
        let (scorings, scoring): (Vec<Work>, Vec<f64>) = (runs.iter())
            .flat_map(|(g, c)| {
                (g.outputs.iter().zip(&c.loss))
                    .map(|(o, &t)| (loss_work(g, o.value, c.micro_batch, c.dtype), t))
            })
            .unzip();
        let (optimizer, optimizer_scale) = own(|c| c.optimizer);
        let bytes_of = |runs: &[(Graph, Calibration)], input: bool| -> Vec<Work> {
            runs.iter()
                .map(|(g, c)| match input {
                    true => input_work(g, c.micro_batch, c.dtype),
                    false => param_work(g, c.dtype),
                })
                .collect()
        };
        let fit = |work: &[Work], seconds: &[f64], scale: &[f64]| {
            fit_rate(work, seconds, scale, cache_bytes).0
        };
        Ok(FittedCosts {
            machine: machine.to_string(),
            threads,
            families,
            cache_bytes,
            data: fit(&bytes_of(runs, true), &data, &data_scale),
            loss: fit(&scorings, &scoring, &scoring),
            optimizer: fit(&bytes_of(runs, false), &optimizer, &optimizer_scale),
            at_once: unmeasured(),
        })
    }

    /// Forward and backward seconds of node `n` at `batch` samples, or `None` for a family
    /// the fit has not seen.
    pub fn node(&self, g: &Graph, n: &Node, batch: usize, dtype: DType) -> Option<(f64, f64)> {
        let r = self.families.get(&family(g, n))?;
        let w = Work::of(g, n, batch, dtype);
        let cache = self.cache_bytes;
        Some((r.forward.seconds(&w, cache), r.backward.seconds(&w, cache)))
    }

    /// Node `n`'s backward of `backward` seconds as a zero-bubble order runs it, B's and W's
    /// seconds, where `n`'s op splits its backward and the fit has a split for its family.
    pub fn split(&self, g: &Graph, n: &Node, backward: f64) -> Option<(f64, f64)> {
        let split = self.families.get(&family(g, n))?.split?;
        n.op.get().splits_weights().then(|| split.of(backward))
    }

    /// Seconds to make a micro-batch of `batch` inputs of `g`.
    pub fn data(&self, g: &Graph, batch: usize, dtype: DType) -> f64 {
        self.data
            .seconds(&input_work(g, batch, dtype), self.cache_bytes)
    }

    /// Seconds of scoring a micro-batch of `batch` samples at output `value` of `g`.
    pub fn loss(&self, g: &Graph, value: ValueId, batch: usize, dtype: DType) -> f64 {
        self.loss
            .seconds(&loss_work(g, value, batch, dtype), self.cache_bytes)
    }

    /// Seconds of one optimizer step over `g`'s parameters.
    pub fn optimizer(&self, g: &Graph, dtype: DType) -> f64 {
        self.optimizer
            .seconds(&param_work(g, dtype), self.cache_bytes)
    }
}

static CPU_FITS: OnceLock<Vec<FittedCosts>> = OnceLock::new();

/// The fits of this project's CPU kernels the default model uses, one per thread count
/// measured: the committed ones (`src/plan/cpu_costs.json`) unless [`use_cpu_fits`] chose others.
pub fn cpu() -> &'static [FittedCosts] {
    CPU_FITS.get_or_init(|| {
        serde_json::from_str(include_str!("cpu_costs.json"))
            .expect("src/plan/cpu_costs.json is checked by the tests")
    })
}

/// Makes the default CPU model use the fits `gems fit-costs` wrote to `path` (another
/// machine's, or a refit) instead of the committed ones, for the rest of the process: called
/// before anything is planned.
pub fn use_cpu_fits(path: &std::path::Path) -> Result<()> {
    let text = crate::core::files::read_text(path)?;
    let fits: Vec<FittedCosts> = serde_json::from_str(&text).map_err(|e| {
        Error::Config(format!(
            "{}: not a CPU cost fit as `gems fit-costs` writes it: {e}",
            path.display()
        ))
    })?;
    if fits.is_empty() {
        return Err(Error::Config(format!("{}: no fit in it", path.display())));
    }
    CPU_FITS.set(fits).map_err(|_| {
        Error::Config("the CPU cost fits are chosen before anything is planned".into())
    })
}

/// The default model's fit for ranks running on `threads` threads: the one measured at the most
/// threads not above it (the fewest measured, below that).
pub fn cpu_for(threads: usize) -> &'static FittedCosts {
    let fits = cpu();
    fits.iter()
        .filter(|f| f.threads <= threads)
        .max_by_key(|f| f.threads)
        .or_else(|| fits.iter().min_by_key(|f| f.threads))
        .expect("src/plan/cpu_costs.json holds at least one fit")
}

/// What each of `ranks` ranks computing at once on `threads` threads pays: the fit at its
/// share of the threads, and how many times its times they take: for two ranks or more, the
/// [`FittedCosts::at_once`] of the fit at `threads`, times the turns ranks take where there
/// are more ranks than threads. `None` where no fit was measured at `threads`, or none at
/// the share.
pub fn cpu_shared(threads: usize, ranks: usize) -> Option<(&'static FittedCosts, f64)> {
    let alone = cpu().iter().find(|f| f.threads == threads)?;
    if ranks <= 1 {
        return Some((alone, 1.0));
    }
    let share = match threads % ranks {
        0 => threads / ranks,
        _ if ranks > threads => 1,
        _ => return None,
    };
    let fit = cpu().iter().find(|f| f.threads == share)?;
    let turns = (ranks as f64 / threads as f64).max(1.0);
    Some((fit, alone.at_once * turns))
}

/// The non-negative `Rate` with the least squared error over `work → seconds` with `cache`
/// bytes in cache, and that error, each call's error relative to its `scale` (its model's op
/// seconds: each model's step counts alike, and within it the ops that take its time): each
/// subset of the terms is solved by least squares and the best one with no negative
/// coefficient kept.
fn fit_rate(work: &[Work], seconds: &[f64], scale: &[f64], cache: f64) -> (Rate, f64) {
    let rows: Vec<([f64; TERMS], f64)> = work
        .iter()
        .zip(seconds.iter().zip(scale))
        .filter(|(_, (&t, &k))| t.is_finite() && t >= 0.0 && k > 0.0)
        .map(|(w, (&t, &k))| (w.terms(cache).map(|x| x / k), t / k))
        .collect();
    // Columns scaled to unit size keep the normal equations well conditioned.
    let norm: Vec<f64> = (0..TERMS)
        .map(|j| {
            let m = rows.iter().map(|(x, _)| x[j].abs()).fold(0.0, f64::max);
            if m > 0.0 {
                m
            } else {
                1.0
            }
        })
        .collect();
    // A price per byte beyond the cache is only told from noise where some op reaches well
    // past it: fitted on ops that barely pass the cache, it extrapolates wildly.
    let cold = work.iter().map(|w| w.bytes - cache).fold(0.0, f64::max) >= cache;
    let mut best: Option<([f64; TERMS], f64)> = None;
    for mask in (1u8..1 << TERMS).filter(|m| cold || m & (1 << COLD_TERM) == 0) {
        let cols: Vec<usize> = (0..TERMS).filter(|j| mask & (1 << j) != 0).collect();
        let k = cols.len();
        let mut ata = vec![vec![0.0; k]; k];
        let mut atb = vec![0.0; k];
        for (x, y) in &rows {
            for (a, &i) in cols.iter().enumerate() {
                let xi = x[i] / norm[i];
                atb[a] += xi * y;
                for (b, &j) in cols.iter().enumerate() {
                    ata[a][b] += xi * x[j] / norm[j];
                }
            }
        }
        let Some(sol) = solve(ata, atb) else { continue };
        if sol.iter().any(|&v| v < 0.0) {
            continue;
        }
        let mut coef = [0.0; TERMS];
        for (a, &i) in cols.iter().enumerate() {
            coef[i] = sol[a] / norm[i];
        }
        let err: f64 = rows
            .iter()
            .map(|(x, y)| ((0..TERMS).map(|j| coef[j] * x[j]).sum::<f64>() - y).powi(2))
            .sum();
        if best.is_none_or(|(_, e)| err < e) {
            best = Some((coef, err));
        }
    }
    let ([call, per_image, per_plane, per_flop, per_byte, per_cold_byte, per_param_byte], err) =
        best.unwrap_or(([0.0; TERMS], 0.0));
    let rate = Rate {
        call,
        per_image,
        per_plane,
        per_flop,
        per_byte,
        per_cold_byte,
        per_param_byte,
    };
    (rate, err)
}

/// Solves the small system `a·x = b` by Gaussian elimination with partial pivoting; `None`
/// when it is singular.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for c in 0..n {
        let p = (c..n).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))?;
        if a[p][c].abs() < 1e-12 {
            return None;
        }
        a.swap(c, p);
        b.swap(c, p);
        let (pivot, below) = a.split_at_mut(c + 1);
        let pivot = &pivot[c];
        for (r, row) in below.iter_mut().enumerate() {
            let f = row[c] / pivot[c];
            for (x, p) in row[c..].iter_mut().zip(&pivot[c..]) {
                *x -= f * p;
            }
            b[c + 1 + r] -= f * b[c];
        }
    }
    let mut x = vec![0.0; n];
    for r in (0..n).rev() {
        let s: f64 = (r + 1..n).map(|k| a[r][k] * x[k]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    Some(x)
}

/// The threads of a CPU device from its report name (`cpu (2 threads)`).
pub fn cpu_threads(device: &str) -> Option<usize> {
    device
        .strip_prefix("cpu (")?
        .strip_suffix(" threads)")?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::cost::{DeviceProfile, NodeCosts};

    /// Each (model, side, micro-batch) of `runs` built with 3 classes and calibrated under
    /// `rate`.
    fn calibrated(runs: &[(&str, usize, usize)], rate: &Rate) -> Vec<(Graph, Calibration)> {
        (runs.iter())
            .map(|&(m, side, micro)| {
                let g = crate::models::build(m, side, 3).unwrap();
                let cal = calibration(&g, micro, rate);
                (g, cal)
            })
            .collect()
    }

    /// Seconds every op of `g` takes at `micro` under `rate` (backward twice forward).
    fn calibration(g: &Graph, micro: usize, rate: &Rate) -> Calibration {
        let forward: Vec<f64> = (g.nodes.iter())
            .map(|n| rate.seconds(&Work::of(g, n, micro, DType::F32), 4.0 * MIB))
            .collect();
        Calibration {
            model: g.name.clone(),
            image_size: g.image_size(),
            classes: g.classes(),
            micro_batch: micro,
            dtype: DType::F32,
            device: "cpu (1 threads)".into(),
            backward: forward.iter().map(|t| 2.0 * t).collect(),
            forward,
            input: vec![],
            weight: vec![],
            data: 1e-3 * micro as f64,
            loss: (g.outputs.iter())
                .map(|o| rate.seconds(&loss_work(g, o.value, micro, DType::F32), 4.0 * MIB))
                .collect(),
            optimizer: 2e-3,
        }
    }

    /// Two ranks on two threads run at the one-thread fit, `at_once` times over; more ranks
    /// than threads take turns; where no fit was made at the threads or at the share, none is
    /// offered.
    #[test]
    fn ranks_at_once_are_priced_at_their_share_of_the_threads() {
        let at = |threads: usize| cpu().iter().find(|f| f.threads == threads).unwrap();
        let shared = |threads, ranks| cpu_shared(threads, ranks).map(|(f, by)| (f.threads, by));
        let at_once = at(2).at_once;
        assert!(at_once >= 1.0, "{at_once}");
        assert_eq!(shared(2, 1), Some((2, 1.0)));
        assert_eq!(shared(2, 2), Some((1, at_once)));
        assert_eq!(shared(2, 3), Some((1, 1.5 * at_once)));
        assert_eq!(shared(2, 4), Some((1, 2.0 * at_once)));
        assert_eq!(shared(1, 2), Some((1, 2.0 * at(1).at_once)));
        // No fit at 4 threads, nor at 3 of them each: the caller shares the speed instead.
        assert_eq!(shared(4, 2), None);
        assert_eq!(shared(3, 1), None);
    }

    /// Op and loss times made by known rates, with 4 MiB in cache, are fitted back from the
    /// fastest of two rounds: the cache size is found, and every node's and output's seconds
    /// at micro-batches the fit did not see, in cache and beyond it, and those of a model it
    /// did not see come out as the rates say.
    #[test]
    fn a_fit_recovers_the_rates_that_made_the_times() {
        let rate = Rate {
            call: 2e-5,
            per_image: 4e-6,
            per_plane: 3e-8,
            per_flop: 1e-11,
            per_byte: 3e-10,
            per_cold_byte: 2e-10,
            per_param_byte: 5e-10,
        };
        // The largest micro-batches take every family's ops to twice the cache or more: a
        // cold byte's price needs ops well past it.
        let runs = calibrated(
            &[
                ("resnet20v2", 32, 2),
                ("resnet20v2", 32, 64),
                ("resnet20v2", 64, 2),
                ("resnet20v2", 64, 24),
                ("resnet20v2", 64, 160),
                ("unet_d2_w4", 32, 2),
                ("unet_d2_w4", 32, 40),
                ("unet_d2_w4", 32, 96),
                ("unet_d2_w4", 32, 768),
            ],
            &rate,
        );
        // Every configuration also calibrated in a slow minute (a neighbour busy, each time
        // 30% longer), before its true round: the fit keeps the fastest.
        let mut rounds: Vec<(Graph, Calibration)> = (runs.iter())
            .map(|(g, c)| {
                let mut slow = c.clone();
                for t in (slow.forward.iter_mut())
                    .chain(&mut slow.backward)
                    .chain(&mut slow.loss)
                    .chain([&mut slow.data, &mut slow.optimizer])
                {
                    *t *= 1.3;
                }
                (g.clone(), slow)
            })
            .collect();
        rounds.extend(runs.iter().cloned());
        let fit = FittedCosts::fit("test", 1, &rounds).unwrap();
        assert_eq!(fit.cache_bytes, 4.0 * MIB);
        // A model the fit has not seen, of the same families at other shapes, too.
        let unseen = crate::models::build("resnet56v2", 48, 3).unwrap();
        for g in runs.iter().map(|(g, _)| g).chain([&unseen]) {
            for micro in [4, 128] {
                for n in &g.nodes {
                    let want = rate.seconds(&Work::of(g, n, micro, DType::F32), 4.0 * MIB);
                    let (f, b) = fit.node(g, n, micro, DType::F32).unwrap();
                    assert!((f / want - 1.0).abs() < 1e-6, "{}: {f} vs {want}", n.name);
                    assert!((b / (2.0 * want) - 1.0).abs() < 1e-6, "{}", n.name);
                }
                for o in &g.outputs {
                    let want = rate.seconds(&loss_work(g, o.value, micro, DType::F32), 4.0 * MIB);
                    let loss = fit.loss(g, o.value, micro, DType::F32);
                    assert!(
                        (loss / want - 1.0).abs() < 1e-6,
                        "{}: {loss} vs {want}",
                        g.name
                    );
                }
            }
        }
        let g = &runs[0].0;
        assert!((fit.optimizer(g, DType::F32) / 2e-3 - 1.0).abs() < 1e-6);
    }

    /// Ops that barely pass the cache cannot price a byte beyond it: one of them timed 20%
    /// long (a busy minute) leaves the price at the fitted per-byte rate, and an op sixteen
    /// times the cache costs what its bytes do, not what a steep cold-byte rate would make
    /// of that minute.
    #[test]
    fn a_cold_byte_is_priced_only_where_ops_reach_well_past_the_cache() {
        let cache = 4.0 * MIB;
        let work: Vec<Work> = [1.0, 2.0, 3.0, 4.0, 4.5, 5.0]
            .map(|mib| Work {
                bytes: mib * MIB,
                ..Work::default()
            })
            .to_vec();
        let mut seconds: Vec<f64> = work.iter().map(|w| 1e-10 * w.bytes).collect();
        *seconds.last_mut().unwrap() *= 1.2;
        let (rate, _) = fit_rate(&work, &seconds, &seconds, cache);
        assert_eq!(rate.per_cold_byte, 0.0, "{rate:?}");
        let big = Work {
            bytes: 64.0 * MIB,
            ..Work::default()
        };
        let price = rate.seconds(&big, cache) / (1e-10 * big.bytes);
        assert!(
            (0.8..1.3).contains(&price),
            "{price} times its bytes' price"
        );
    }

    /// Where calibrations timed B and W apart, each family that splits its backward is
    /// fitted their ratio to the fused backward and W's share, an op timed far off moving
    /// neither, and the default model prices B and W from them; the fused backward does not
    /// move. Other families run all in B.
    #[test]
    fn a_fit_recovers_how_backward_splits() {
        let rate = Rate {
            call: 2e-5,
            per_flop: 1e-11,
            ..Rate::default()
        };
        let runs = calibrated(&[("resnet20v2", 32, 2), ("unet_d2_w4", 32, 2)], &rate);
        let fused = FittedCosts::fit("test", 1, &runs).unwrap();
        assert!(fused.families.values().all(|r| r.split.is_none()));
        // B + W 10% dearer than the fused backward, W 60% of them.
        let mut timed: Vec<(Graph, Calibration)> = (runs.iter().cloned())
            .map(|(g, mut cal)| {
                let split = g.nodes.iter().map(|n| n.op.get().splits_weights());
                (cal.input, cal.weight) = (cal.backward.iter().zip(split))
                    .map(|(&b, s)| match s {
                        true => (0.4 * 1.1 * b, 0.6 * 1.1 * b),
                        false => (b, 0.0),
                    })
                    .unzip();
                (g, cal)
            })
            .collect();
        // One convolution's B timed ten times too long (a busy machine) moves nothing.
        let (g, cal) = &mut timed[0];
        let i = (0..g.nodes.len())
            .filter(|&i| family(g, &g.nodes[i]) == "conv 3x3")
            .nth(2)
            .unwrap();
        cal.input[i] *= 10.0;
        let fit = FittedCosts::fit("test", 1, &timed).unwrap();
        for (g, _) in &timed {
            let (one, apart) = (
                NodeCosts::fitted(g, 4, DType::F32, &fused, &DeviceProfile::CPU),
                NodeCosts::fitted(g, 4, DType::F32, &fit, &DeviceProfile::CPU),
            );
            assert_eq!(
                (&one.forward, &one.backward),
                (&apart.forward, &apart.backward)
            );
            for (i, n) in g.nodes.iter().enumerate() {
                let (b, w) = (apart.input[i], apart.weight[i]);
                let split = fit.families[&family(g, n)].split;
                match n.op.get().splits_weights() {
                    true => {
                        let s = split.unwrap();
                        assert!((s.ratio - 1.1).abs() < 1e-9 && (s.weight - 0.6).abs() < 1e-9);
                        assert!(((b + w) / (1.1 * apart.backward[i]) - 1.0).abs() < 1e-9);
                        assert!((w / (b + w) - 0.6).abs() < 1e-9, "{}", n.name);
                    }
                    false => {
                        assert_eq!(split, None, "{}", n.name);
                        assert_eq!((b, w), (apart.backward[i], 0.0), "{}", n.name);
                    }
                }
            }
        }
    }

    /// The committed fits load, hold every family the built-in models are made of (a family
    /// missing would fall back to the roofline) and a split for each family that splits its
    /// backward, and no rate is negative.
    #[test]
    fn the_committed_fits_cover_every_built_in_model() {
        let fits = cpu();
        assert!(fits.iter().any(|f| f.threads == 1), "no one-thread fit");
        for f in fits {
            for (name, r) in &f.families {
                for rate in [r.forward, r.backward] {
                    let c = rate.coefficients();
                    assert!(c.iter().all(|v| v.is_finite() && *v >= 0.0), "{name}");
                }
            }
        }
        for &model in crate::models::LISTED {
            let side = if model == "inception_v3" { 299 } else { 64 };
            let g = crate::models::build(model, side, 10).unwrap();
            for n in &g.nodes {
                for f in fits {
                    assert!(
                        f.families.contains_key(&family(&g, n)),
                        "{model}: {} ({}) is of no family the {}-thread fit has",
                        n.name,
                        family(&g, n),
                        f.threads
                    );
                    // A split backward is priced from measurements, not halves.
                    if n.op.get().splits_weights() {
                        let s = f.families[&family(&g, n)].split;
                        assert!(
                            s.is_some_and(|s| (0.5..2.0).contains(&s.ratio)
                                && (0.0..=1.0).contains(&s.weight)),
                            "{model}: {} ({}): {s:?} in the {}-thread fit",
                            n.name,
                            family(&g, n),
                            f.threads
                        );
                    }
                }
            }
        }
    }
}
