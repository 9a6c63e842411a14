//! Synthetic images whose class is told apart by structure: each class is a sinusoidal grating
//! at its own orientation, with random frequency, phase, per-channel contrast and pixel noise.
//! For segmentation, [`Scenes`]: a few shapes of class-coloured gratings on a background.
//! Sample i depends only on (seed, i), so any sample can be made anywhere, in any order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

use super::{Image, Mask, Source, Task, CHANNELS};
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

/// Synthetic segmentation samples: one to three shapes (discs and rectangles) on a background
/// of class 0, each shape of a class from 1 on, later shapes drawn over earlier ones. A class
/// shows as its own colour and grating orientation, under pixel noise, so a small U-Net learns
/// the masks in a few hundred steps. Each sample is a pure function of (seed, index), and its
/// mask is computed from the shapes alone, without painting the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scenes {
    /// The stream's seed.
    pub seed: u64,
    /// Classes, the background's included (at least 2).
    pub classes: usize,
    /// Side of the square images.
    pub image_size: usize,
}

/// A shape of a scene, in pixels, and its class.
#[derive(Clone, Copy, Debug)]
enum Shape {
    Disc {
        x: f64,
        y: f64,
        r: f64,
        class: u32,
    },
    Rect {
        x: [f64; 2],
        y: [f64; 2],
        class: u32,
    },
}

impl Shape {
    /// The shape's class at the point (x, y), if the shape holds it.
    fn at(&self, px: f64, py: f64) -> Option<u32> {
        match *self {
            Shape::Disc { x, y, r, class } => {
                ((px - x).powi(2) + (py - y).powi(2) < r * r).then_some(class)
            }
            Shape::Rect { x, y, class } => {
                (px >= x[0] && px < x[1] && py >= y[0] && py < y[1]).then_some(class)
            }
        }
    }
}

impl Scenes {
    /// The stream of (seed, index): the shapes are drawn first, so the mask needs no more.
    fn rng(&self, index: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(splitmix64(self.seed ^ splitmix64(index)))
    }

    fn shapes(&self, rng: &mut ChaCha8Rng) -> Vec<Shape> {
        let s = self.image_size as f64;
        (0..rng.random_range(1..=3))
            .map(|_| {
                let class = rng.random_range(1..self.classes as u32);
                let (x, y) = (
                    rng.random_range(0.1..0.9) * s,
                    rng.random_range(0.1..0.9) * s,
                );
                let half = rng.random_range(0.12..0.3) * s;
                match rng.random_bool(0.5) {
                    true => Shape::Disc {
                        x,
                        y,
                        r: half,
                        class,
                    },
                    false => {
                        let aspect = rng.random_range(0.5..2.0f64).sqrt();
                        let (w, h) = (half * aspect, half / aspect);
                        Shape::Rect {
                            x: [x - w, x + w],
                            y: [y - h, y + h],
                            class,
                        }
                    }
                }
            })
            .collect()
    }

    /// The class of each pixel: the last shape holding the pixel's centre, else 0.
    fn classes_of(&self, shapes: &[Shape]) -> Mask {
        let s = self.image_size;
        let labels = (0..s * s)
            .map(|i| {
                let (x, y) = ((i % s) as f64 + 0.5, (i / s) as f64 + 0.5);
                shapes.iter().rev().find_map(|sh| sh.at(x, y)).unwrap_or(0)
            })
            .collect();
        Mask {
            height: s,
            width: s,
            labels,
        }
    }

    /// The mask of sample `index`, without painting its image.
    pub fn mask(&self, index: u64) -> Mask {
        self.classes_of(&self.shapes(&mut self.rng(index)))
    }

    /// Sample `index`: its image (C×H×W, centred near 0) and its mask.
    pub fn sample(&self, index: u64) -> (Image, Mask) {
        let mut rng = self.rng(index);
        let mask = self.classes_of(&self.shapes(&mut rng));
        let s = self.image_size;
        // Per class: a colour around the hue wheel (the background grey) and a grating whose
        // orientation, frequency and phase this image draws.
        let look: Vec<([f64; CHANNELS], f64, f64, f64)> = (0..self.classes)
            .map(|c| {
                let hue = std::f64::consts::TAU * c as f64 / (self.classes - 1) as f64;
                let colour = match c {
                    0 => [0.0; CHANNELS],
                    _ => [0, 1, 2]
                        .map(|k| 0.6 * (hue - std::f64::consts::TAU * k as f64 / 3.0).cos()),
                };
                let theta = std::f64::consts::PI * c as f64 / self.classes as f64;
                let k = std::f64::consts::TAU * rng.random_range(3.0..6.0) / s as f64;
                (
                    colour,
                    k * theta.cos(),
                    k * theta.sin(),
                    rng.random_range(0.0..6.3),
                )
            })
            .collect();
        let mut pixels = vec![0.0f32; CHANNELS * s * s];
        for (i, &class) in mask.labels.iter().enumerate() {
            let (colour, kx, ky, phase) = look[class as usize];
            let wave = 0.3 * (kx * (i % s) as f64 + ky * (i / s) as f64 + phase).sin();
            for (c, &base) in colour.iter().enumerate() {
                let noise: f64 = StandardNormal.sample(&mut rng);
                pixels[c * s * s + i] = (base + wave + 0.2 * noise) as f32;
            }
        }
        let image = Image {
            height: s,
            width: s,
            pixels,
        };
        (image, mask)
    }
}

/// Synthetic scenes as an unbounded segmentation [`Source`]: classes `background`, `1`, `2`, …
pub struct SceneStream {
    /// What the images are.
    pub data: Scenes,
    names: Vec<String>,
}

impl SceneStream {
    /// The stream of `data` (at least 2 classes: a background and a shape).
    pub fn new(data: Scenes) -> SceneStream {
        let names = std::iter::once("background".to_string())
            .chain((1..data.classes).map(|c| c.to_string()))
            .collect();
        SceneStream { data, names }
    }
}

impl Source for SceneStream {
    fn samples(&self) -> Option<usize> {
        None
    }

    fn classes(&self) -> &[String] {
        &self.names
    }

    /// The class at the image's centre.
    fn label(&self, index: usize) -> Result<u32> {
        let s = self.data.image_size;
        Ok(self.data.mask(index as u64).labels[s / 2 * s + s / 2])
    }

    fn read(&self, index: usize) -> Result<Image> {
        Ok(self.data.sample(index as u64).0)
    }

    fn describe(&self, index: usize) -> String {
        format!("synthetic scene {index}")
    }

    fn task(&self) -> Task {
        Task::Segment
    }

    fn mask(&self, index: usize) -> Result<Mask> {
        Ok(self.data.mask(index as u64))
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

    #[test]
    fn scenes_are_deterministic_and_their_masks_show_in_the_colours() {
        let d = Scenes {
            seed: 3,
            classes: 4,
            image_size: 48,
        };
        let mut seen = [0usize; 4];
        for index in 0..40 {
            let (img, mask) = d.sample(index);
            assert_eq!(d.sample(index).0, img);
            assert_eq!(d.mask(index), mask);
            // Each class's mean colour is its own: the background near 0, the others apart.
            for (class, n) in seen.iter_mut().enumerate() {
                let pixels: Vec<usize> = (0..48 * 48)
                    .filter(|&i| mask.labels[i] == class as u32)
                    .collect();
                *n += pixels.len();
                if pixels.len() < 50 {
                    continue;
                }
                let red =
                    pixels.iter().map(|&i| img.pixels[i] as f64).sum::<f64>() / pixels.len() as f64;
                let want = if class == 0 {
                    0.0
                } else {
                    0.6 * (std::f64::consts::TAU * class as f64 / 3.0).cos()
                };
                assert!(
                    (red - want).abs() < 0.15,
                    "class {class}: red {red} vs {want}"
                );
            }
        }
        assert!(seen.iter().all(|&n| n > 48 * 48), "{seen:?}");
        // The grating moves every channel alike, the class colours sum to 0 over channels:
        // less each pixel's channel mean, the nearest class colour names most pixels.
        let colour = |c: usize| -> [f64; 3] {
            let hue = std::f64::consts::TAU * c as f64 / 3.0;
            match c {
                0 => [0.0; 3],
                _ => [0, 1, 2].map(|k| 0.6 * (hue - std::f64::consts::TAU * k as f64 / 3.0).cos()),
            }
        };
        let (img, mask) = d.sample(99);
        let right = (0..48 * 48)
            .filter(|&i| {
                let px = [0, 1, 2].map(|c| img.pixels[c * 48 * 48 + i] as f64);
                let mean = px.iter().sum::<f64>() / 3.0;
                let far = |c: usize| -> f64 {
                    let k = colour(c);
                    (0..3).map(|j| (px[j] - mean - k[j]).powi(2)).sum()
                };
                let best = (0..4).min_by(|&a, &b| far(a).total_cmp(&far(b))).unwrap();
                best as u32 == mask.labels[i]
            })
            .count();
        assert!(right > 48 * 48 * 8 / 10, "{right} of {} pixels", 48 * 48);
        let (a, _) = d.sample(0);
        let (b, _) = Scenes { seed: 4, ..d }.sample(0);
        assert_ne!(a, b);
    }
}
