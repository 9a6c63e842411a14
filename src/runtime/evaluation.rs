//! Evaluation on held-out samples: forward only, BN in eval mode, no dropout; the loss and a
//! confusion matrix of the first output used outside training, over samples for a classifier
//! and over labelled pixels for a segmentation model (with each class's IoU and Dice).

use crate::data::{Pipeline, UNLABELLED};
use crate::graph::{Graph, ValueId};
use crate::ops::loss;
use crate::ops::tiles::{Rect, Tiles};
use crate::tensor::Device;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// Loss, accuracy and confusion counts over held-out samples.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Evaluation {
    /// Samples scored.
    pub samples: usize,
    /// Mean loss per sample.
    pub loss: f64,
    /// Fraction of the scored places predicted correctly: samples for a classifier, labelled
    /// pixels (pixel accuracy) for a segmentation model.
    pub accuracy: f64,
    /// The class names, in label order.
    pub classes: Vec<String>,
    /// `confusion[true][predicted]` counts of samples, or of labelled pixels.
    pub confusion: Vec<Vec<usize>>,
    /// Whether the model predicts a class per pixel (the counts are of pixels).
    pub per_pixel: bool,
    /// Each sample's result, by position in the data's order.
    pub per_sample: Vec<SampleScore>,
}

/// One sample's result in an evaluation.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleScore {
    /// Its position in the evaluated data's order ([`Pipeline::index`] names the sample).
    pub position: u64,
    /// Its true class; for a segmented sample, the class most of its labelled pixels have
    /// ([`UNLABELLED`] when none is labelled).
    pub label: u32,
    /// The most probable class; for a segmented sample, the class predicted at most pixels.
    pub predicted: u32,
    /// Its loss as training defines it, computed in f64 from the logits.
    #[serde(with = "crate::runtime::f64_bits")]
    pub loss: f64,
    /// Per class: its softmax probability, or for a segmented sample the fraction of its
    /// pixels predicted as that class.
    pub scores: Vec<f32>,
    /// A segmented sample's predicted classes at every `map_every`-th pixel each way (the
    /// centre pixel of each block), row-major, when the evaluation was asked to keep them.
    pub map: Vec<u32>,
}

impl Evaluation {
    /// Samples (or labelled pixels) of each true class.
    pub fn per_class(&self) -> Vec<usize> {
        self.confusion.iter().map(|row| row.iter().sum()).collect()
    }

    /// Each class's intersection over union, TP / (TP + FP + FN); `None` for a class neither
    /// present nor predicted.
    pub fn iou(&self) -> Vec<Option<f64>> {
        self.overlap(|tp, fp, fn_| tp / (tp + fp + fn_))
    }

    /// Each class's Dice coefficient, 2·TP / (2·TP + FP + FN); `None` as for [`Self::iou`].
    pub fn dice(&self) -> Vec<Option<f64>> {
        self.overlap(|tp, fp, fn_| 2.0 * tp / (2.0 * tp + fp + fn_))
    }

    /// The mean of the classes' IoU over the classes present or predicted.
    pub fn mean_iou(&self) -> f64 {
        let known: Vec<f64> = self.iou().into_iter().flatten().collect();
        known.iter().sum::<f64>() / known.len().max(1) as f64
    }

    /// `f(TP, FP, FN)` of each class from the confusion counts.
    fn overlap(&self, f: impl Fn(f64, f64, f64) -> f64) -> Vec<Option<f64>> {
        let k = self.confusion.len();
        (0..k)
            .map(|c| {
                let tp = self.confusion[c][c] as f64;
                let fn_ = self.confusion[c].iter().sum::<usize>() as f64 - tp;
                let fp = (0..k).map(|t| self.confusion[t][c]).sum::<usize>() as f64 - tp;
                (tp + fp + fn_ > 0.0).then(|| f(tp, fp, fn_))
            })
            .collect()
    }
}

/// An evaluation's running totals: the loss summed over samples, the confusion counts, and
/// each sample's result.
pub(crate) struct Tally {
    pub loss: f64,
    pub confusion: Vec<Vec<usize>>,
    pub samples: Vec<SampleScore>,
    /// Keep each segmented sample's predicted classes at every this many pixels (0: none).
    pub map_every: usize,
}

impl Tally {
    pub fn new(classes: usize, map_every: usize) -> Tally {
        Tally {
            loss: 0.0,
            confusion: vec![vec![0; classes]; classes],
            samples: Vec::new(),
            map_every,
        }
    }

    /// Scores one batch's logits (N×K, or N×K×H×W per pixel) against its targets (one per
    /// sample, or per pixel, of the whole maps); its samples are at positions `first`,
    /// `first + 1`, … of the data's order. With `tile` (the group and the whole maps' H×W),
    /// the logits are this rank's tile of the maps: it scores the pixels it owns and the
    /// group sums every tile's counts, so each tile ends with the whole batch's.
    pub fn add(
        &mut self,
        device: &Device,
        logits: &Tensor,
        labels: &[u32],
        class_weights: Option<&[f64]>,
        first: u64,
        tile: Option<(&Tiles, (usize, usize))>,
    ) -> Result<()> {
        let dims = logits.shape().dims().to_vec();
        let (n, k) = (dims[0], dims[1]);
        let hw = match (tile, &dims[..]) {
            (Some((_, hw)), _) => hw,
            (None, [_, _, h, w]) => (*h, *w),
            (None, _) => (1, 1),
        };
        let part = match tile {
            Some((t, hw)) => t.own(hw),
            None => Rect::new(0..hw.0, 0..hw.1),
        };
        let (places, mine) = (hw.0 * hw.1, part.size().0 * part.size().1);
        let ce = loss::softmax_cross_entropy_part(
            device,
            logits,
            labels,
            hw,
            &part,
            class_weights,
            loss::Norm::PerSample,
        )?;
        let losses = loss::per_sample_part(logits, labels, hw, &part, class_weights)?;
        let predicted = loss::predictions(&ce.probs)?;
        let truths = loss::part_of(labels, hw, &part);
        // A segmented sample's kept pixels: (row, column) of every `map_every`-th each way.
        let kept: Vec<(usize, usize)> = match (places, self.map_every) {
            (1, _) | (_, 0) => Vec::new(),
            (_, every) => (every / 2..hw.0)
                .step_by(every)
                .flat_map(|y| (every / 2..hw.1).step_by(every).map(move |x| (y, x)))
                .collect(),
        };
        // What the tiles sum: the loss and the confusion counts, then per sample its loss,
        // its labelled pixels and its predictions per class, and its kept pixels' classes
        // (each from the tile that owns it, 0 from the others).
        let per_sample = 1 + 2 * k + kept.len();
        let mut sums = vec![0.0; 1 + k * k + n * per_sample];
        let (totals, samples) = sums.split_at_mut(1 + k * k);
        totals[0] = ce.loss * n as f64;
        let (h, w) = part.size();
        for ((i, loss), sample) in losses
            .into_iter()
            .enumerate()
            .zip(samples.chunks_mut(per_sample))
        {
            let truth = &truths[i * mine..][..mine];
            let guess = &predicted[i * mine..][..mine];
            sample[0] = loss;
            let (present, rest) = sample[1..].split_at_mut(k);
            let (chosen, map) = rest.split_at_mut(k);
            for (&t, &p) in truth.iter().zip(guess) {
                chosen[p as usize] += 1.0;
                if t != UNLABELLED {
                    totals[1 + t as usize * k + p as usize] += 1.0;
                    present[t as usize] += 1.0;
                }
            }
            for (slot, &(y, x)) in map.iter_mut().zip(&kept) {
                let (r, c) = (y as isize - part.rows.0, x as isize - part.cols.0);
                if (0..h as isize).contains(&r) && (0..w as isize).contains(&c) {
                    *slot = guess[r as usize * w + c as usize] as f64;
                }
            }
        }
        if let Some((t, _)) = tile {
            sums = t.sum(sums)?;
        }
        // A classifier's probabilities, for each sample's scores.
        let probs = match places {
            1 => ce.probs.to_f64_vec()?,
            _ => Vec::new(),
        };
        self.loss += sums[0];
        for (t, row) in self.confusion.iter_mut().enumerate() {
            for (p, count) in row.iter_mut().enumerate() {
                *count += sums[1 + t * k + p] as usize;
            }
        }
        for i in 0..n {
            let at = 1 + k * k + i * per_sample;
            let (present, chosen) = (&sums[at + 1..][..k], &sums[at + 1 + k..][..k]);
            let map = &sums[at + 1 + 2 * k..at + per_sample];
            let most = |counts: &[f64]| {
                (0..k).fold(0, |b, c| if counts[c] > counts[b] { c } else { b }) as u32
            };
            let label = match places {
                1 => labels[i],
                _ if present.iter().all(|&c| c == 0.0) => UNLABELLED,
                _ => most(present),
            };
            let scores = match places {
                1 => probs[i * k..][..k].iter().map(|&p| p as f32).collect(),
                _ => chosen.iter().map(|&c| c as f32 / places as f32).collect(),
            };
            self.samples.push(SampleScore {
                position: first + i as u64,
                label,
                predicted: most(chosen),
                loss: sums[at],
                scores,
                map: map.iter().map(|&c| c as u32).collect(),
            });
        }
        Ok(())
    }

    /// The loss, then the counts row by row: what ranks sum.
    pub fn to_vec(&self) -> Vec<f64> {
        let counts = self.confusion.iter().flatten().map(|&n| n as f64);
        std::iter::once(self.loss).chain(counts).collect()
    }

    pub fn from_vec(v: &[f64], classes: usize) -> Tally {
        Tally {
            loss: v[0],
            confusion: v[1..]
                .chunks(classes)
                .map(|row| row.iter().map(|&n| n as usize).collect())
                .collect(),
            samples: Vec::new(),
            map_every: 0,
        }
    }

    /// The evaluation over the samples scored (`per_sample`, every rank's): their count comes
    /// from them and the places from the tally, so a batch scored twice or not at all shows.
    pub fn finish(
        self,
        classes: &[String],
        per_sample: Vec<SampleScore>,
        per_pixel: bool,
    ) -> Evaluation {
        let places: usize = self.confusion.iter().flatten().sum();
        let correct: usize = (0..classes.len()).map(|c| self.confusion[c][c]).sum();
        let samples = per_sample.len();
        Evaluation {
            samples,
            loss: self.loss / samples.max(1) as f64,
            accuracy: correct as f64 / places.max(1) as f64,
            classes: classes.to_vec(),
            confusion: self.confusion,
            per_pixel,
            per_sample,
        }
    }
}

/// The most samples of an endless stream one evaluation scores.
const MAX_STREAM_SAMPLES: usize = 1 << 20;

/// Samples an evaluation of `data` covers: `samples` of them (default: all), or an error for an
/// endless stream without a count.
pub(crate) fn held_out_samples(data: &Pipeline, samples: Option<usize>) -> Result<usize> {
    let samples = match (samples, data.samples()) {
        (Some(n), Some(len)) => n.min(len),
        (Some(n), None) | (None, Some(n)) => n,
        (None, None) => {
            return Err(Error::Config(
                "say how many samples to evaluate of an endless stream".into(),
            ))
        }
    };
    if samples == 0 {
        return Err(Error::Config("evaluation needs at least one sample".into()));
    }
    // Each sample's score is kept: an endless stream is scored up to a bound.
    if data.samples().is_none() && samples > MAX_STREAM_SAMPLES {
        return Err(Error::Config(format!(
            "{samples} samples of an endless stream: at most {MAX_STREAM_SAMPLES} are scored \
             (each sample's score is kept)"
        )));
    }
    Ok(samples)
}

/// The output evaluation scores: the first one used outside training.
pub(crate) fn evaluated_output(g: &Graph) -> Result<ValueId> {
    g.outputs
        .iter()
        .find(|o| !o.training_only)
        .map(|o| o.value)
        .ok_or_else(|| Error::Config(format!("{} has no output to evaluate", g.name)))
}
