//! Softmax cross-entropy on logits (N × K), the mean over the batch. Not a graph op: the
//! trainer applies it to each graph output with that output's weight.

use crate::tensor::Device;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The mean loss and the softmax probabilities (kept for backward and accuracy).
pub fn softmax_cross_entropy(
    device: &Device,
    logits: &Tensor,
    labels: &[u32],
) -> Result<(f64, Tensor)> {
    let (n, k) = match logits.shape().dims() {
        [n, k] => (*n, *k),
        _ => {
            return Err(Error::Shape(format!(
                "logits must be N×K, got {}",
                logits.shape()
            )))
        }
    };
    if labels.len() != n {
        return Err(Error::Shape(format!(
            "{} labels for a batch of {n}",
            labels.len()
        )));
    }
    if let Some(&bad) = labels.iter().find(|&&l| l as usize >= k) {
        return Err(Error::Config(format!(
            "label {bad} is out of range for {k} classes"
        )));
    }
    let mut probs = device.zeros(
        logits.shape().clone(),
        logits.dtype().compute(),
        crate::memory::Category::Activations,
    )?;
    let loss = device.backend().softmax_cross_entropy(
        logits.storage(),
        labels,
        probs.storage_mut()?,
        n,
        k,
    )?;
    Ok((loss, probs))
}

/// d(weight · mean loss)/d logits, as activations of `dtype`.
pub fn softmax_cross_entropy_backward(
    device: &Device,
    probs: &Tensor,
    labels: &[u32],
    weight: f64,
    dtype: crate::tensor::DType,
) -> Result<Tensor> {
    let (n, k) = (probs.shape().dim(0), probs.shape().dim(1));
    let mut d = device.zeros(
        probs.shape().clone(),
        dtype,
        crate::memory::Category::Activations,
    )?;
    device.backend().softmax_cross_entropy_backward(
        probs.storage(),
        labels,
        d.storage_mut()?,
        weight / n as f64,
        n,
        k,
    )?;
    Ok(d)
}

/// How many rows have their largest probability at the label.
pub fn correct(probs: &Tensor, labels: &[u32]) -> Result<usize> {
    Ok(predictions(probs)?
        .iter()
        .zip(labels)
        .filter(|(p, l)| p == l)
        .count())
}

/// Each row's cross-entropy, log Σ exp(logits) - logits[label], in f64 on the host.
pub fn per_sample(logits: &Tensor, labels: &[u32]) -> Result<Vec<f64>> {
    let k = logits.shape().dim(1);
    Ok(logits
        .to_f64_vec()?
        .chunks(k)
        .zip(labels)
        .map(|(row, &label)| {
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|&z| (z - max).exp()).sum();
            max + sum.ln() - row[label as usize]
        })
        .collect())
}

/// The most probable class of each row (the first of equals).
pub fn predictions(probs: &Tensor) -> Result<Vec<u32>> {
    let k = probs.shape().dim(1);
    Ok(probs
        .to_f64_vec()?
        .chunks(k)
        .map(|row| (0..k).fold(0, |b, j| if row[j] > row[b] { j } else { b }) as u32)
        .collect())
}
