//! Synthetic images whose class is told apart by structure: each class is a sinusoidal grating
//! at its own orientation, with random frequency, phase, per-channel contrast and pixel noise.
//! Sample i depends only on (seed, i), so any sample can be made anywhere, in any order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

use super::{Image, Source, CHANNELS};
use crate::core::rng::splitmix64;
use crate::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// Synthetic images: each a pure function of (seed, index), labelled by class.
pub struct Synthetic {
    /// The stream's seed.
    pub seed: u64,
    /// Classes to draw labels from.
    pub classes: usize,
    /// Side of the square images.
    pub image_size: usize,
}

impl Synthetic {
    fn rng(&self, index: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(splitmix64(self.seed ^ splitmix64(index)))
    }

    /// The label of sample `index`, without making its image.
    pub fn label(&self, index: u64) -> u32 {
        self.rng(index).random_range(0..self.classes as u32)
    }

    /// Writes sample `index` (C×H×W) into `out` and returns its label.
    pub fn sample(&self, index: u64, out: &mut [f64]) -> u32 {
        let mut rng = self.rng(index);
        let label = rng.random_range(0..self.classes as u32);
        let s = self.image_size;
        let step = std::f64::consts::PI / self.classes as f64;
        let theta = step * label as f64 + rng.random_range(-0.2..0.2) * step;
        let cycles = rng.random_range(2.0..5.0);
        let phase = rng.random_range(0.0..std::f64::consts::TAU);
        let k = std::f64::consts::TAU * cycles / s as f64;
        let (kx, ky) = (k * theta.cos(), k * theta.sin());
        for (c, plane) in out.chunks_mut(s * s).enumerate().take(CHANNELS) {
            let gain = rng.random_range(0.5..1.0) * if c == 1 { -1.0 } else { 1.0 };
            let offset = rng.random_range(-0.2..0.2);
            for (y, row) in plane.chunks_mut(s).enumerate() {
                for (x, v) in row.iter_mut().enumerate() {
                    let noise: f64 = StandardNormal.sample(&mut rng);
                    *v =
                        gain * (kx * x as f64 + ky * y as f64 + phase).sin() + offset + 0.3 * noise;
                }
            }
        }
        label
    }

    /// Samples first..first+n as one NCHW batch and its labels.
    pub fn batch(&self, first: u64, n: usize) -> (Vec<f64>, Vec<u32>) {
        let len = CHANNELS * self.image_size * self.image_size;
        let mut pixels = vec![0.0; n * len];
        let labels = pixels
            .par_chunks_mut(len)
            .enumerate()
            .map(|(i, img)| self.sample(first + i as u64, img))
            .collect();
        (pixels, labels)
    }
}

/// Synthetic data as an unbounded [`Source`], classes named by their number.
pub struct Stream {
    /// What the images are.
    pub data: Synthetic,
    names: Vec<String>,
}

impl Stream {
    /// The stream of `data`, its classes named `0`, `1`, …
    pub fn new(data: Synthetic) -> Stream {
        let names = (0..data.classes).map(|c| c.to_string()).collect();
        Stream { data, names }
    }
}

impl Source for Stream {
    fn samples(&self) -> Option<usize> {
        None
    }

    fn classes(&self) -> &[String] {
        &self.names
    }

    fn label(&self, index: usize) -> Result<u32> {
        Ok(self.data.label(index as u64))
    }

    fn read(&self, index: usize) -> Result<Image> {
        let s = self.data.image_size;
        let mut planes = vec![0.0; CHANNELS * s * s];
        self.data.sample(index as u64, &mut planes);
        Ok(Image {
            height: s,
            width: s,
            pixels: planes.iter().map(|&v| v as f32).collect(),
        })
    }

    fn describe(&self, index: usize) -> String {
        format!("synthetic image {index}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_varied() {
        let d = Synthetic {
            seed: 7,
            classes: 10,
            image_size: 32,
        };
        let (a, la) = d.batch(100, 4);
        let (b, lb) = d.batch(100, 4);
        assert_eq!(a, b);
        assert_eq!(la, lb);
        // One sample alone equals the same sample inside a batch.
        let mut one = vec![0.0; 3 * 32 * 32];
        assert_eq!(d.sample(101, &mut one), la[1]);
        assert_eq!(d.label(101), la[1]);
        assert_eq!(one, a[3 * 32 * 32..2 * 3 * 32 * 32]);
        let (_, labels) = d.batch(0, 1000);
        for c in 0..10 {
            let n = labels.iter().filter(|&&l| l == c).count();
            assert!((60..140).contains(&n), "class {c} drawn {n} times in 1000");
        }
    }
}
