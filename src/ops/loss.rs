//! Softmax cross-entropy of a classifier's logits (N × K, one label per sample) or a
//! segmenter's (N × K × H × W, one label per pixel), with unlabelled places and class weights.
//! Not a graph op: the trainer applies it to each graph output with that output's weight.
//!
//! Two reductions ([`Reduction`]): by default the mean over the N samples of each sample's
//! weighted mean over its labelled places; or PyTorch's, Σ w·ℓ over the whole batch's labelled
//! places divided by their Σ w. The host folds either into one weight per place (0 where
//! unlabelled), and the backend sums weight · `(−log p[label])` over the places.

use super::tiles::Rect;
use crate::backend::LossGeom;
use crate::data::UNLABELLED;
use crate::memory::Category;
use crate::tensor::{DType, Device, Shape, Tensor};
use crate::{Error, Result};

/// How a batch's per-place losses ℓ, with class weights w, make its loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Reduction {
    /// The mean over the batch's samples of each sample's Σ w·ℓ / Σ w over its labelled
    /// places (a sample with none counts 0): every sample weighs the same.
    #[default]
    SampleMean,
    /// Σ w·ℓ / Σ w over all the batch's labelled places, as PyTorch's
    /// `CrossEntropyLoss(weight=w, ignore_index=255)` (0 where no place is labelled, where
    /// PyTorch gives NaN): a sample weighs its labelled pixels' total weight.
    Pytorch,
}

impl std::str::FromStr for Reduction {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sample-mean" => Ok(Reduction::SampleMean),
            "pytorch" => Ok(Reduction::Pytorch),
            _ => Err(format!(
                "unknown loss reduction '{s}' (sample-mean, pytorch)"
            )),
        }
    }
}

impl std::fmt::Display for Reduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reduction::SampleMean => "sample-mean",
            Reduction::Pytorch => "pytorch",
        })
    }
}

/// What one call's Σ w·ℓ is divided by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Norm {
    /// [`Reduction::SampleMean`] of the logits given.
    PerSample,
    /// This total weight: a micro-batch's part of [`Reduction::Pytorch`] when it is the whole
    /// batch's [`total_weight`], so that the parts add up to the batch's loss.
    Total(f64),
}

/// A scored batch: its loss, the softmax probabilities (for backward and predictions), and
/// the labels and weights per place backward needs.
pub struct CrossEntropy {
    /// The loss as [`softmax_cross_entropy`] defines it.
    pub loss: f64,
    /// softmax(logits) over the classes, the logits' shape, in their compute type.
    pub probs: Tensor,
    labels: Vec<u32>,
    weights: Vec<f64>,
}

/// Softmax cross-entropy of logits N×K (labels: one per sample) or N×K×H×W (labels: one per
/// pixel, N·H·W of them, sample-major, row-major), UNLABELLED places left out, each place's
/// term ℓ scaled by its class's weight w (`class_weights`, one per class, all 1 when None),
/// reduced as `norm` says. With one place per sample, or no unlabelled places and no weights,
/// both reductions are the plain mean over all places.
pub fn softmax_cross_entropy(
    device: &Device,
    logits: &Tensor,
    labels: &[u32],
    class_weights: Option<&[f64]>,
    norm: Norm,
) -> Result<CrossEntropy> {
    // A classifier's N×K logits are N×K×1×1 maps.
    let hw = match logits.shape().dims() {
        [_, _, h, w] => (*h, *w),
        _ => (1, 1),
    };
    let whole = Rect::new(0..hw.0, 0..hw.1);
    softmax_cross_entropy_part(device, logits, labels, hw, &whole, class_weights, norm)
}

/// [`softmax_cross_entropy`] of a part of N×K×H×W logits (a tile): `logits` hold the
/// rectangle `part` of maps of size `hw`, `labels` the whole maps'. Places are weighed as in
/// the whole maps (`norm` over the whole samples), so the parts' losses add up to the whole
/// maps' loss and each place's gradient is what it is in the whole.
pub fn softmax_cross_entropy_part(
    device: &Device,
    logits: &Tensor,
    labels: &[u32],
    hw: (usize, usize),
    part: &Rect,
    class_weights: Option<&[f64]>,
    norm: Norm,
) -> Result<CrossEntropy> {
    let g = geometry(logits.shape())?;
    if g.positions != part.size().0 * part.size().1 {
        return Err(Error::Shape(format!(
            "logits {} do not hold a {:?} part of {hw:?} maps",
            logits.shape(),
            part.size()
        )));
    }
    let whole = LossGeom {
        positions: hw.0 * hw.1,
        ..g
    };
    let (labels, weights) = place_weights(&whole, labels, class_weights, norm, hw, part)?;
    let mut probs = device.empty(
        logits.shape().clone(),
        logits.dtype().compute(),
        Category::Activations,
    )?;
    let loss = device.backend().softmax_cross_entropy(
        logits.storage(),
        &labels,
        &weights,
        probs.storage_mut()?,
        &g,
    )?;
    Ok(CrossEntropy {
        loss,
        probs,
        labels,
        weights,
    })
}

/// The places of rectangle `part` of every sample's `hw` map among `places` (sample-major,
/// row-major), in the same order.
pub fn part_of<T: Copy>(places: &[T], hw: (usize, usize), part: &Rect) -> Vec<T> {
    let rows = part.rows.0 as usize..part.rows.1 as usize;
    let cols = part.cols.0 as usize..part.cols.1 as usize;
    places
        .chunks(hw.0 * hw.1)
        .flat_map(|sample| {
            let cols = cols.clone();
            rows.clone()
                .flat_map(move |r| &sample[r * hw.1 + cols.start..r * hw.1 + cols.end])
        })
        .copied()
        .collect()
}

impl CrossEntropy {
    /// d(weight · loss)/d logits, as activations of `dtype`.
    pub fn backward(&self, device: &Device, weight: f64, dtype: DType) -> Result<Tensor> {
        let g = geometry(self.probs.shape())?;
        let mut d = device.empty(self.probs.shape().clone(), dtype, Category::Activations)?;
        device.backend().softmax_cross_entropy_backward(
            self.probs.storage(),
            &self.labels,
            &self.weights,
            d.storage_mut()?,
            weight,
            &g,
        )?;
        Ok(d)
    }
}

/// The most probable class at every place (N·positions, sample-major; the first of equals).
pub fn predictions(probs: &Tensor) -> Result<Vec<u32>> {
    let g = geometry(probs.shape())?;
    let p = probs.to_f64_vec()?;
    Ok((0..g.places())
        .map(|q| {
            let (s, pos) = (q / g.positions, q % g.positions);
            let at = |j: usize| p[(s * g.k + j) * g.positions + pos];
            (0..g.k).fold(0, |b, j| if at(j) > at(b) { j } else { b }) as u32
        })
        .collect())
}

/// Each sample's loss as [`softmax_cross_entropy`] defines it, from the logits in f64 on the
/// host.
pub fn per_sample(
    logits: &Tensor,
    labels: &[u32],
    class_weights: Option<&[f64]>,
) -> Result<Vec<f64>> {
    let hw = match logits.shape().dims() {
        [_, _, h, w] => (*h, *w),
        _ => (1, 1),
    };
    let whole = Rect::new(0..hw.0, 0..hw.1);
    per_sample_part(logits, labels, hw, &whole, class_weights)
}

/// Each sample's share of its loss as [`softmax_cross_entropy`] defines it, from the logits
/// of the rectangle `part` of `hw` maps (all of it for a classifier's N×K), in f64 on the
/// host: Σ w·ℓ over the part's labelled places divided by the whole sample's Σ w (`labels`
/// are the whole maps'), so the parts' shares add up to the sample's loss.
pub fn per_sample_part(
    logits: &Tensor,
    labels: &[u32],
    hw: (usize, usize),
    part: &Rect,
    class_weights: Option<&[f64]>,
) -> Result<Vec<f64>> {
    let g = geometry(logits.shape())?;
    let whole = LossGeom {
        positions: hw.0 * hw.1,
        ..g
    };
    check(&whole, labels, class_weights)?;
    if g.positions != part.size().0 * part.size().1 {
        return Err(Error::Shape(format!(
            "logits {} do not hold a {:?} part of {hw:?} maps",
            logits.shape(),
            part.size()
        )));
    }
    let mine = part_of(labels, hw, part);
    let x = logits.to_f64_vec()?;
    Ok((0..g.n)
        .map(|s| {
            let sample = &labels[s * whole.positions..][..whole.positions];
            let total: f64 = sample.iter().map(|&l| class_weight(l, class_weights)).sum();
            let mut sum = 0.0;
            for pos in 0..g.positions {
                let label = mine[s * g.positions + pos];
                if label == UNLABELLED {
                    continue;
                }
                let at = |j: usize| x[(s * g.k + j) * g.positions + pos];
                let max = (0..g.k).map(at).fold(f64::NEG_INFINITY, f64::max);
                let lse = max + (0..g.k).map(|j| (at(j) - max).exp()).sum::<f64>().ln();
                sum += class_weight(label, class_weights) * (lse - at(label as usize));
            }
            if total > 0.0 {
                sum / total
            } else {
                0.0
            }
        })
        .collect())
}

/// Samples, classes and places per sample of logits (or probabilities) N×K or N×K×H×W.
fn geometry(shape: &Shape) -> Result<LossGeom> {
    let (n, k, positions) = match shape.dims() {
        [n, k] => (*n, *k, 1),
        [n, k, h, w] => (*n, *k, h * w),
        _ => {
            return Err(Error::Shape(format!(
                "logits must be N×K or N×K×H×W, got {shape}"
            )))
        }
    };
    if k == 0 || positions == 0 {
        return Err(Error::Shape(format!(
            "logits {shape} have no classes or no places"
        )));
    }
    Ok(LossGeom { n, k, positions })
}

/// Refuses labels and class weights that do not fit `g`.
fn check(g: &LossGeom, labels: &[u32], class_weights: Option<&[f64]>) -> Result<()> {
    if labels.len() != g.places() {
        return Err(Error::Shape(format!(
            "{} labels for {} samples of {} places",
            labels.len(),
            g.n,
            g.positions
        )));
    }
    if let Some(&bad) = labels
        .iter()
        .find(|&&l| l as usize >= g.k && l != UNLABELLED)
    {
        return Err(Error::Config(format!(
            "label {bad} is out of range for {} classes",
            g.k
        )));
    }
    if let Some(cw) = class_weights {
        if cw.len() != g.k {
            return Err(Error::Config(format!(
                "{} class weights for {} classes",
                cw.len(),
                g.k
            )));
        }
        if let Some(bad) = cw.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
            return Err(Error::Config(format!(
                "class weight {bad} is not a finite number ≥ 0"
            )));
        }
    }
    Ok(())
}

/// The sum of the class weights of the labelled places among `labels` of `classes` classes
/// (all 1 when `class_weights` is None): [`Norm::Total`]'s divisor for a batch with these
/// labels.
pub fn total_weight(labels: &[u32], classes: usize, class_weights: Option<&[f64]>) -> Result<f64> {
    let g = LossGeom {
        n: 1,
        k: classes,
        positions: labels.len(),
    };
    check(&g, labels, class_weights)?;
    Ok(labels.iter().map(|&l| class_weight(l, class_weights)).sum())
}

/// Label `l`'s weight: its class's, 0 where unlabelled.
fn class_weight(l: u32, class_weights: Option<&[f64]>) -> f64 {
    match l {
        UNLABELLED => 0.0,
        l => class_weights.map_or(1.0, |cw| cw[l as usize]),
    }
}

/// The label for the backend (UNLABELLED as class 0) and the weight of each place of the
/// rectangle `part` of the `hw` maps of `labels` (whole maps, `g` their geometry): its
/// class's weight divided by what `norm` says (N times its sample's total weight over the
/// whole map, or the total given; 0 where unlabelled, and where that divisor is 0), so that
/// Σ weight · ℓ over every part is the loss.
fn place_weights(
    g: &LossGeom,
    labels: &[u32],
    class_weights: Option<&[f64]>,
    norm: Norm,
    hw: (usize, usize),
    part: &Rect,
) -> Result<(Vec<u32>, Vec<f64>)> {
    check(g, labels, class_weights)?;
    let divisors: Vec<f64> = match norm {
        Norm::PerSample => labels
            .chunks(g.positions)
            .map(|sample| {
                let total: f64 = sample.iter().map(|&l| class_weight(l, class_weights)).sum();
                g.n as f64 * total
            })
            .collect(),
        Norm::Total(total) => vec![total; g.n],
    };
    let labels = part_of(labels, hw, part);
    let per_sample = part.size().0 * part.size().1;
    let weights = labels
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let (w, by) = (class_weight(l, class_weights), divisors[i / per_sample]);
            if by > 0.0 {
                w / by
            } else {
                w
            }
        })
        .collect();
    let labels = labels
        .into_iter()
        .map(|l| if l == UNLABELLED { 0 } else { l })
        .collect();
    Ok((labels, weights))
}
