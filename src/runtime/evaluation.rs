//! Evaluation on held-out samples: forward only, BN in eval mode, no dropout; the loss and a
//! confusion matrix of the first output used outside training.

use crate::data::Pipeline;
use crate::graph::{Graph, ValueId};
use crate::ops::loss;
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
    /// Fraction predicted correctly.
    pub accuracy: f64,
    /// The class names, in label order.
    pub classes: Vec<String>,
    /// `confusion[true][predicted]` counts.
    pub confusion: Vec<Vec<usize>>,
    /// Each sample's result, by position in the data's order.
    pub per_sample: Vec<SampleScore>,
}

/// One sample's result in an evaluation.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleScore {
    /// Its position in the evaluated data's order ([`Pipeline::index`] names the sample).
    pub position: u64,
    /// Its true class.
    pub label: u32,
    /// The most probable class.
    pub predicted: u32,
    /// Its cross-entropy loss, computed in f64 from the logits.
    #[serde(with = "crate::runtime::f64_bits")]
    pub loss: f64,
}

impl Evaluation {
    /// Samples of each true class.
    pub fn per_class(&self) -> Vec<usize> {
        self.confusion.iter().map(|row| row.iter().sum()).collect()
    }
}

/// An evaluation's running totals: the loss summed over samples, the confusion counts, and
/// each sample's result.
pub(crate) struct Tally {
    pub loss: f64,
    pub confusion: Vec<Vec<usize>>,
    pub samples: Vec<SampleScore>,
}

impl Tally {
    pub fn new(classes: usize) -> Tally {
        Tally {
            loss: 0.0,
            confusion: vec![vec![0; classes]; classes],
            samples: Vec::new(),
        }
    }

    /// Scores one batch's logits against its labels; its samples are at positions `first`,
    /// `first + 1`, … of the data's order.
    pub fn add(
        &mut self,
        device: &Device,
        logits: &Tensor,
        labels: &[u32],
        first: u64,
    ) -> Result<()> {
        let ce = loss::softmax_cross_entropy(device, logits, labels, None)?;
        self.loss += ce.loss * labels.len() as f64;
        let losses = loss::per_sample(logits, labels, None)?;
        let predicted = loss::predictions(&ce.probs)?;
        for (i, ((&t, p), l)) in labels.iter().zip(predicted).zip(losses).enumerate() {
            self.confusion[t as usize][p as usize] += 1;
            self.samples.push(SampleScore {
                position: first + i as u64,
                label: t,
                predicted: p,
                loss: l,
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
        }
    }

    /// The evaluation over the samples scored: their count comes from the tally, so a batch
    /// scored twice or not at all shows.
    pub fn finish(self, classes: &[String], per_sample: Vec<SampleScore>) -> Evaluation {
        let samples: usize = self.confusion.iter().flatten().sum();
        let correct: usize = (0..classes.len()).map(|c| self.confusion[c][c]).sum();
        let n = samples.max(1) as f64;
        Evaluation {
            samples,
            loss: self.loss / n,
            accuracy: correct as f64 / n,
            classes: classes.to_vec(),
            confusion: self.confusion,
            per_sample,
        }
    }
}

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
