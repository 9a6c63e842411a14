//! From a decoded image to the model's input: a square window (random position, size and
//! flips when augmenting; the centred largest square otherwise), resampled to the model's
//! side with an antialiasing linear filter, then normalized per channel.

use rand::Rng;

use super::{Image, CHANNELS};

/// ImageNet's per-channel mean and standard deviation, the convention pretrained CNNs expect.
pub const MEAN: [f32; CHANNELS] = [0.485, 0.456, 0.406];
pub const STD: [f32; CHANNELS] = [0.229, 0.224, 0.225];

/// The smallest side of a random crop, as a fraction of the image's shorter side.
const MIN_CROP: f64 = 0.8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Transform {
    /// Random crop and horizontal and vertical flips (training); the centred square otherwise.
    pub augment: bool,
    /// Subtract [`MEAN`] and divide by [`STD`] (decoded files; synthetic data is already
    /// centred).
    pub normalize: bool,
}

impl Transform {
    /// Writes `img` prepared as a `size`² model input (CHW) into `out`; `rng` draws the
    /// augmentation.
    pub fn apply(&self, img: &Image, size: usize, rng: &mut impl Rng, out: &mut [f64]) {
        let short = img.height.min(img.width);
        let (side, y0, x0, flip_x, flip_y) = if self.augment {
            let side = ((short as f64 * rng.random_range(MIN_CROP..=1.0)).round() as usize)
                .clamp(1, short);
            (
                side,
                rng.random_range(0..=img.height - side),
                rng.random_range(0..=img.width - side),
                rng.random_bool(0.5),
                rng.random_bool(0.5),
            )
        } else {
            (
                short,
                (img.height - short) / 2,
                (img.width - short) / 2,
                false,
                false,
            )
        };
        let plane = img.height * img.width;
        let norm = |c: usize| match self.normalize {
            true => (MEAN[c], STD[c]),
            false => (0.0, 1.0),
        };
        if side == size {
            // Nothing to resample (a tile cut at the model's side): copy, flip, normalize.
            for c in 0..CHANNELS {
                let (mean, std) = norm(c);
                let src = &img.pixels[c * plane..(c + 1) * plane];
                let dst = &mut out[c * size * size..(c + 1) * size * size];
                for y in 0..size {
                    let row = &src[(y0 + y) * img.width + x0..][..size];
                    let ty = if flip_y { size - 1 - y } else { y };
                    let target = &mut dst[ty * size..(ty + 1) * size];
                    for (x, &v) in row.iter().enumerate() {
                        let tx = if flip_x { size - 1 - x } else { x };
                        target[tx] = ((v - mean) / std) as f64;
                    }
                }
            }
            return;
        }
        let rows = filter(y0, side, size);
        let cols = filter(x0, side, size);
        // Columns first into a size-wide strip of every source row the window needs.
        let mut strip = vec![0.0f32; img.height * size];
        for c in 0..CHANNELS {
            let src = &img.pixels[c * plane..(c + 1) * plane];
            for y in y0..y0 + side {
                let row = &src[y * img.width..(y + 1) * img.width];
                for (o, (start, w)) in cols.iter().enumerate() {
                    strip[y * size + o] = dot(&row[*start..*start + w.len()], w);
                }
            }
            let (mean, std) = norm(c);
            let dst = &mut out[c * size * size..(c + 1) * size * size];
            let mut acc = vec![0.0f32; size];
            for (oy, (start, w)) in rows.iter().enumerate() {
                // Row by row, so the inner loop runs over contiguous memory.
                acc.fill(0.0);
                for (k, &wk) in w.iter().enumerate() {
                    let src = &strip[(start + k) * size..(start + k + 1) * size];
                    acc.iter_mut().zip(src).for_each(|(a, &v)| *a += wk * v);
                }
                let ty = if flip_y { size - 1 - oy } else { oy };
                let target = &mut dst[ty * size..(ty + 1) * size];
                for (ox, &v) in acc.iter().enumerate() {
                    let tx = if flip_x { size - 1 - ox } else { ox };
                    target[tx] = ((v - mean) / std) as f64;
                }
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// For each of `size` outputs over the source span [`from`, `from + span`): the first source
/// index it reads and its weights (a triangle filter as wide as the scale when shrinking, so
/// every source pixel counts; plain linear interpolation when enlarging).
fn filter(from: usize, span: usize, size: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = span as f64 / size as f64;
    let support = scale.max(1.0);
    let last = (from + span - 1) as f64;
    (0..size)
        .map(|o| {
            let centre = from as f64 + (o as f64 + 0.5) * scale;
            let lo = ((centre - support).floor().max(from as f64)) as usize;
            let hi = ((centre + support).ceil().min(last + 1.0)) as usize;
            let mut w: Vec<f32> = (lo..hi)
                .map(|i| (1.0 - ((i as f64 + 0.5 - centre) / support).abs()).max(0.0) as f32)
                .collect();
            let total: f32 = w.iter().sum();
            if total > 0.0 {
                w.iter_mut().for_each(|x| *x /= total);
            } else {
                // The centre falls outside every pixel's reach: take the nearest one.
                w.fill(0.0);
                let nearest = (centre.floor() as usize).clamp(lo, hi - 1);
                w[nearest - lo] = 1.0;
            }
            (lo, w)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn ramp(h: usize, w: usize) -> Image {
        let mut pixels = Vec::new();
        for c in 0..CHANNELS {
            for y in 0..h {
                for x in 0..w {
                    pixels.push((c * 100 + y * w + x) as f32);
                }
            }
        }
        Image {
            height: h,
            width: w,
            pixels,
        }
    }

    const PLAIN: Transform = Transform {
        augment: false,
        normalize: false,
    };

    #[test]
    fn same_size_is_a_copy_and_centres_the_square() {
        let img = ramp(6, 8);
        let mut out = vec![0.0; 3 * 36];
        PLAIN.apply(&img, 6, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        for c in 0..3 {
            for y in 0..6 {
                for x in 0..6 {
                    assert_eq!(
                        out[c * 36 + y * 6 + x],
                        img.pixels[c * 48 + y * 8 + x + 1] as f64
                    );
                }
            }
        }
    }

    #[test]
    fn halving_averages_and_constants_stay_constant() {
        let img = Image {
            height: 4,
            width: 4,
            pixels: (0..48).map(|i| ((i / 16) as f32) * 0.25 + 0.1).collect(),
        };
        let mut out = vec![0.0; 3 * 4];
        PLAIN.apply(&img, 2, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        for (i, v) in out.iter().enumerate() {
            let want = (i / 4) as f64 * 0.25 + 0.1;
            assert!((v - want).abs() < 1e-6, "{v} vs {want}");
        }
        // A ramp shrinks to the means of its pixel pairs, symmetric about the centre.
        let img = ramp(4, 4);
        PLAIN.apply(&img, 2, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        assert!((out[0] + out[3] - (img.pixels[0] + img.pixels[15]) as f64).abs() < 1e-4);
    }

    #[test]
    fn augmentation_is_seeded_and_normalization_applies() {
        let img = ramp(40, 40);
        let t = Transform {
            augment: true,
            normalize: true,
        };
        let run = |seed| {
            let mut out = vec![0.0; 3 * 16 * 16];
            t.apply(&img, 16, &mut ChaCha8Rng::seed_from_u64(seed), &mut out);
            out
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        let grey = Image {
            height: 8,
            width: 8,
            pixels: vec![0.5; 3 * 64],
        };
        let mut out = vec![0.0; 3 * 16];
        t.apply(&grey, 4, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        for c in 0..3 {
            let want = ((0.5 - MEAN[c]) / STD[c]) as f64;
            assert!(out[c * 16..(c + 1) * 16]
                .iter()
                .all(|v| (v - want).abs() < 1e-6));
        }
    }
}
