//! From a decoded image to the model's input: a window (random position, size and flips when
//! augmenting; otherwise the centred largest square, or with `resize` the whole image),
//! resampled to the model's side with an antialiasing linear filter, then normalized per
//! channel.

use rand::Rng;

use super::{Image, Mask, CHANNELS};

/// ImageNet's per-channel mean and standard deviation, the convention pretrained CNNs expect.
pub const MEAN: [f32; CHANNELS] = [0.485, 0.456, 0.406];
/// ImageNet's per-channel standard deviation (see [`MEAN`]).
pub const STD: [f32; CHANNELS] = [0.229, 0.224, 0.225];

/// The smallest side of a random crop, as a fraction of the image's shorter side.
const MIN_CROP: f64 = 0.8;

/// How an input's channels are scaled once resampled. Decoded images hold planes in [0, 1]
/// (8-bit values divided by 255); each variant says what the model sees.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Normalize {
    /// (x − [`MEAN`]) / [`STD`]: ImageNet's statistics, as torchvision's pretrained models
    /// expect.
    #[default]
    ImageNet,
    /// The planes as decoded, in [0, 1]: 0–255 values divided by 255 (milesial's U-Net).
    Unit,
    /// The 0–255 values themselves.
    Raw,
    /// (x − mean) / std per channel, both on the [0, 1] scale of decoded planes.
    PerChannel {
        /// Per channel (R, G, B).
        mean: [f32; CHANNELS],
        /// Per channel (R, G, B), each positive.
        std: [f32; CHANNELS],
    },
}

impl Normalize {
    /// Channel `c`'s (mean, scale): the model sees (x − mean) · scale. A product rather than
    /// a division per value: a division costs several.
    fn channel(&self, c: usize) -> (f32, f32) {
        match self {
            Normalize::ImageNet => (MEAN[c], 1.0 / STD[c]),
            Normalize::Unit => (0.0, 1.0),
            Normalize::Raw => (0.0, 255.0),
            Normalize::PerChannel { mean, std } => (mean[c], 1.0 / std[c]),
        }
    }
}

impl std::fmt::Display for Normalize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[f32]| v.iter().map(f32::to_string).collect::<Vec<_>>().join(",");
        match self {
            Normalize::ImageNet => write!(f, "imagenet"),
            Normalize::Unit => write!(f, "unit"),
            Normalize::Raw => write!(f, "none"),
            Normalize::PerChannel { mean, std } => write!(f, "{}/{}", list(mean), list(std)),
        }
    }
}

impl std::str::FromStr for Normalize {
    type Err = String;

    /// `imagenet`, `unit`, `none`, or `M1,M2,M3/S1,S2,S3`: a mean and a standard deviation
    /// per channel (R, G, B) on the [0, 1] scale, each deviation positive.
    fn from_str(s: &str) -> Result<Normalize, String> {
        match s {
            "imagenet" => return Ok(Normalize::ImageNet),
            "unit" => return Ok(Normalize::Unit),
            "none" => return Ok(Normalize::Raw),
            _ => {}
        }
        let usage = "imagenet, unit, none, or a mean and a standard deviation per channel \
                     on the [0, 1] scale, MEAN,MEAN,MEAN/STD,STD,STD (e.g. \
                     0.485,0.456,0.406/0.229,0.224,0.225)";
        let (mean, std) = s
            .split_once('/')
            .ok_or_else(|| format!("the normalization is {usage}, not '{s}'"))?;
        let channels = |what: &str, list: &str| -> Result<[f32; CHANNELS], String> {
            let values = list
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<Result<Vec<f32>, _>>()
                .map_err(|_| format!("the normalization's {what} '{list}' is not numbers"))?;
            let values: [f32; CHANNELS] = values.try_into().map_err(|v: Vec<f32>| {
                format!(
                    "the normalization's {what} takes {CHANNELS} values (R, G, B), not {}",
                    v.len()
                )
            })?;
            match values.iter().all(|v| v.is_finite()) {
                true => Ok(values),
                false => Err(format!("the normalization's {what} '{list}' is not finite")),
            }
        };
        let (mean, std) = (channels("mean", mean)?, channels("std", std)?);
        if let Some(bad) = std.iter().find(|&&s| s <= 0.0) {
            return Err(format!(
                "the normalization's standard deviations are positive, not {bad}"
            ));
        }
        Ok(Normalize::PerChannel { mean, std })
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
/// How a decoded image becomes a model's input.
pub struct Transform {
    /// Random crop and horizontal and vertical flips (training); the centred square otherwise.
    pub augment: bool,
    /// How the channels are scaled (synthetic data is generated centred: [`Normalize::Unit`]
    /// keeps it as it is).
    pub normalize: Normalize,
    /// The whole image resampled to the model's side (both dimensions, so a non-square image
    /// is stretched) instead of its centred largest square; augmenting, the random crop keeps
    /// the image's proportions.
    pub resize: bool,
}

impl Transform {
    /// Writes `img` prepared as a `size`² model input (CHW) into `out`; `rng` draws the
    /// augmentation.
    pub fn apply(&self, img: &Image, size: usize, rng: &mut impl Rng, out: &mut [f32]) {
        let mut targets = out.chunks_exact_mut(size);
        self.rows(img, size, rng, |row| {
            let target = targets.next().expect("room for the prepared input");
            target.copy_from_slice(row);
        });
    }

    /// Appends what [`Transform::apply`] writes to `out` (so a batch needs no zeroed buffer).
    pub fn append(&self, img: &Image, size: usize, rng: &mut impl Rng, out: &mut Vec<f32>) {
        out.reserve(CHANNELS * size * size);
        self.rows(img, size, rng, |row| out.extend_from_slice(row));
    }

    /// Appends `mask` prepared as `size`² targets (row-major) to `out`: the window, the
    /// resampling (nearest) and the flips [`Transform::append`] gives its image when `rng`
    /// is in the same state, so each target lines up with its input pixel.
    pub fn append_mask(&self, mask: &Mask, size: usize, rng: &mut impl Rng, out: &mut Vec<u32>) {
        let Window {
            height,
            width,
            y0,
            x0,
            flip_x,
            flip_y,
        } = self.window(mask.height, mask.width, rng);
        // The source pixel holding each output pixel's centre.
        let nearest = |from: usize, span: usize, o: usize| {
            let centre = from as f64 + (o as f64 + 0.5) * span as f64 / size as f64;
            (centre as usize).clamp(from, from + span - 1)
        };
        let flip = |o: usize, flipped: bool| if flipped { size - 1 - o } else { o };
        let cols: Vec<usize> = (0..size)
            .map(|tx| nearest(x0, width, flip(tx, flip_x)))
            .collect();
        out.reserve(size * size);
        for ty in 0..size {
            let y = nearest(y0, height, flip(ty, flip_y));
            let row = &mask.labels[y * mask.width..][..mask.width];
            out.extend(cols.iter().map(|&x| row[x]));
        }
    }

    /// The window of a `height × width` image an input shows (see [`Window::draw`]).
    fn window(&self, height: usize, width: usize, rng: &mut impl Rng) -> Window {
        Window::draw(self.augment, self.resize, height, width, rng)
    }

    /// Hands `emit` the rows of `img` prepared as a `size`² model input, in CHW order.
    fn rows(&self, img: &Image, size: usize, rng: &mut impl Rng, mut emit: impl FnMut(&[f32])) {
        let Window {
            height,
            width,
            y0,
            x0,
            flip_x,
            flip_y,
        } = self.window(img.height, img.width, rng);
        let plane = img.height * img.width;
        let mut row = vec![0.0f32; size];
        // Normalizes and flips a resampled row, then hands it on.
        let mut finish = |row: &mut [f32], c: usize| {
            if self.normalize != Normalize::Unit {
                let (mean, scale) = self.normalize.channel(c);
                row.iter_mut().for_each(|v| *v = (*v - mean) * scale);
            }
            if flip_x {
                row.reverse();
            }
            emit(row);
        };
        // Output rows in order: which window row each comes from.
        let source_row = |ty: usize| if flip_y { size - 1 - ty } else { ty };
        if (height, width) == (size, size) {
            // Nothing to resample (a tile cut at the model's side): copy, flip, normalize.
            for c in 0..CHANNELS {
                let src = &img.pixels[c * plane..(c + 1) * plane];
                for ty in 0..size {
                    let y = y0 + source_row(ty);
                    row.copy_from_slice(&src[y * img.width + x0..][..size]);
                    finish(&mut row, c);
                }
            }
            return;
        }
        let rows = Filter::new(y0, height, size);
        let cols = Filter::new(x0, width, size);
        // Columns first, into a size-wide strip of the window's rows.
        let mut strip = vec![0.0f32; height * size];
        for c in 0..CHANNELS {
            let src = &img.pixels[c * plane..(c + 1) * plane];
            for (y, out) in (y0..).zip(strip.chunks_exact_mut(size)) {
                cols.resample(&src[y * img.width..][..img.width], out);
            }
            for ty in 0..size {
                let (start, w) = rows.taps(source_row(ty));
                // Strip rows whole, so the inner loop runs over contiguous memory.
                row.fill(0.0);
                for (k, &wk) in w.iter().enumerate() {
                    let src = &strip[(start - y0 + k) * size..][..size];
                    row.iter_mut().zip(src).for_each(|(a, &v)| *a += wk * v);
                }
                finish(&mut row, c);
            }
        }
    }
}

/// The rectangle of an image an input shows (its height, width, top and left) and its flips.
struct Window {
    height: usize,
    width: usize,
    y0: usize,
    x0: usize,
    flip_x: bool,
    flip_y: bool,
}

impl Window {
    /// The window of a `height × width` image: drawn from `rng` when augmenting (a square, or
    /// with `resize` a rectangle of the image's proportions), else the centred largest square
    /// (with `resize`, the whole image). Inputs and targets both draw it here, so they line up.
    fn draw(
        augment: bool,
        resize: bool,
        height: usize,
        width: usize,
        rng: &mut impl Rng,
    ) -> Window {
        let short = height.min(width);
        // The window's sides: the image's (resizing), else its shorter side's square.
        let (full_h, full_w) = match resize {
            true => (height, width),
            false => (short, short),
        };
        if !augment {
            return Window {
                height: full_h,
                width: full_w,
                y0: (height - full_h) / 2,
                x0: (width - full_w) / 2,
                flip_x: false,
                flip_y: false,
            };
        }
        let scale = rng.random_range(MIN_CROP..=1.0);
        let side = |full: usize| ((full as f64 * scale).round() as usize).clamp(1, full);
        let (h, w) = (side(full_h), side(full_w));
        Window {
            height: h,
            width: w,
            y0: rng.random_range(0..=height - h),
            x0: rng.random_range(0..=width - w),
            flip_x: rng.random_bool(0.5),
            flip_y: rng.random_bool(0.5),
        }
    }
}

/// Resampling weights along one axis: output `o` is the weighted sum of the `taps` source
/// pixels from `starts[o]`, with weights `weights[o * taps..][..taps]`. Every output has the
/// same number of taps (zero weights pad the shorter ones), so the loops have one shape.
struct Filter {
    taps: usize,
    starts: Vec<usize>,
    weights: Vec<f32>,
}

impl Filter {
    /// For each of `size` outputs over the source span [`from`, `from + span`): a triangle
    /// filter as wide as the scale when shrinking, so every source pixel counts; plain linear
    /// interpolation when enlarging.
    fn new(from: usize, span: usize, size: usize) -> Filter {
        let scale = span as f64 / size as f64;
        let support = scale.max(1.0);
        let last = (from + span - 1) as f64;
        let each: Vec<(usize, Vec<f32>)> = (0..size)
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
                // Zero weights at the ends add nothing (linear interpolation has 2 taps, not 3).
                let first = w.iter().position(|&x| x != 0.0).unwrap_or(0);
                let end = w.iter().rposition(|&x| x != 0.0).map_or(w.len(), |i| i + 1);
                (lo + first, w[first..end].to_vec())
            })
            .collect();
        let taps = each.iter().map(|(_, w)| w.len()).max().unwrap_or(1);
        let mut starts = Vec::with_capacity(size);
        let mut weights = vec![0.0; size * taps];
        for ((lo, w), padded) in each.iter().zip(weights.chunks_exact_mut(taps)) {
            // Near the span's end the taps start earlier, so they stay inside it.
            let start = (*lo).min(from + span - taps);
            padded[lo - start..][..w.len()].copy_from_slice(w);
            starts.push(start);
        }
        Filter {
            taps,
            starts,
            weights,
        }
    }

    /// Output `o`'s first source pixel and weights.
    fn taps(&self, o: usize) -> (usize, &[f32]) {
        (self.starts[o], &self.weights[o * self.taps..][..self.taps])
    }

    /// Resamples `src` (indexed as the span's pixels are) into `out`, one value per output.
    fn resample(&self, src: &[f32], out: &mut [f32]) {
        // The usual tap counts get loops of a fixed length, which the compiler unrolls.
        match self.taps {
            2 => self.resample_fixed::<2>(src, out),
            3 => self.resample_fixed::<3>(src, out),
            4 => self.resample_fixed::<4>(src, out),
            _ => {
                for (o, out) in out.iter_mut().enumerate() {
                    let (start, w) = self.taps(o);
                    *out = dot(&src[start..start + w.len()], w);
                }
            }
        }
    }

    fn resample_fixed<const N: usize>(&self, src: &[f32], out: &mut [f32]) {
        let weights = self.weights.chunks_exact(N);
        for ((o, &start), w) in out.iter_mut().zip(&self.starts).zip(weights) {
            let px: &[f32; N] = src[start..start + N].try_into().unwrap();
            let w: &[f32; N] = w.try_into().unwrap();
            *o = dot(px, w);
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
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
        normalize: Normalize::Unit,
        resize: false,
    };

    #[test]
    fn same_size_is_a_copy_and_centres_the_square() {
        let img = ramp(6, 8);
        let mut out = vec![0.0; 3 * 36];
        PLAIN.apply(&img, 6, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        for c in 0..3 {
            for y in 0..6 {
                for x in 0..6 {
                    assert_eq!(out[c * 36 + y * 6 + x], img.pixels[c * 48 + y * 8 + x + 1]);
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
            let want = (i / 4) as f32 * 0.25 + 0.1;
            assert!((v - want).abs() < 1e-6, "{v} vs {want}");
        }
        // A ramp shrinks to the means of its pixel pairs, symmetric about the centre.
        let img = ramp(4, 4);
        PLAIN.apply(&img, 2, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
        assert!((out[0] + out[3] - (img.pixels[0] + img.pixels[15])).abs() < 1e-4);
    }

    #[test]
    fn augmentation_is_seeded_and_normalization_applies() {
        let img = ramp(40, 40);
        let t = Transform {
            augment: true,
            normalize: Normalize::ImageNet,
            resize: false,
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
            let want = (0.5 - MEAN[c]) / STD[c];
            assert!(out[c * 16..(c + 1) * 16]
                .iter()
                .all(|v| (v - want).abs() < 1e-6));
        }
    }

    #[test]
    fn normalizations_parse_print_and_scale() {
        let grey = Image {
            height: 4,
            width: 4,
            pixels: vec![0.5; 3 * 16],
        };
        let custom = "0.5,0.25,0/0.5,0.25,2";
        let cases = [
            ("imagenet", [f32::NAN; 3]),
            ("unit", [0.5; 3]),
            ("none", [127.5; 3]),
            (custom, [0.0, 1.0, 0.25]),
        ];
        for (text, want) in cases {
            let n: Normalize = text.parse().unwrap();
            assert_eq!(n.to_string(), text);
            let t = Transform {
                normalize: n,
                ..PLAIN
            };
            let mut out = vec![0.0; 3 * 4];
            t.apply(&grey, 2, &mut ChaCha8Rng::seed_from_u64(0), &mut out);
            for c in 0..3 {
                let want = match n {
                    Normalize::ImageNet => (0.5 - MEAN[c]) / STD[c],
                    _ => want[c],
                };
                assert!(
                    out[c * 4..(c + 1) * 4]
                        .iter()
                        .all(|v| (v - want).abs() < 1e-5 * want.abs().max(1.0)),
                    "{text}: channel {c} {:?}, not {want}",
                    &out[c * 4..(c + 1) * 4]
                );
            }
        }
        assert_eq!(Normalize::default(), Normalize::ImageNet);
        for (bad, why) in [
            ("0.5,0.5/0.2,0.2,0.2", "takes 3 values"),
            ("0.5,0.5,0.5/0.2,0.2,0.2,0.2", "takes 3 values"),
            ("0.5,0.5,0.5/0.2,0,0.2", "positive, not 0"),
            ("0.5,0.5,0.5/0.2,-1,0.2", "positive, not -1"),
            ("0.5,0.5,0.5/0.2,inf,0.2", "not finite"),
            ("nan,0.5,0.5/0.2,0.2,0.2", "not finite"),
            ("0.5,x,0.5/0.2,0.2,0.2", "not numbers"),
            ("imagenet2", "imagenet, unit, none"),
        ] {
            let err = bad.parse::<Normalize>().unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn resizing_resamples_the_whole_image_and_its_mask() {
        // 6×12, each value its column: the centred square is columns 3..9 copied; resized, the
        // whole width is halved, each output the mean of its two columns (the triangle over
        // four pixels, symmetric about their centre), at the edges over the pixels there are.
        let (h, w) = (6, 12);
        let img = Image {
            height: h,
            width: w,
            pixels: (0..3 * h * w).map(|i| (i % w) as f32).collect(),
        };
        let rng = || ChaCha8Rng::seed_from_u64(0);
        let mut cut = vec![0.0; 3 * 36];
        PLAIN.apply(&img, 6, &mut rng(), &mut cut);
        assert_eq!(cut[..6], [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        let resize = Transform {
            resize: true,
            ..PLAIN
        };
        let mut whole = vec![0.0; 3 * 36];
        resize.apply(&img, 6, &mut rng(), &mut whole);
        let edge = (0.75 * 0.0 + 0.75 * 1.0 + 0.25 * 2.0) / 1.75;
        let want = [edge, 2.5, 4.5, 6.5, 8.5, 11.0 - edge];
        for (got, want) in whole.chunks_exact(6).zip(std::iter::repeat(want)) {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
            }
        }
        // Masks take the label of the pixel holding each output's centre: column 2x + 1.
        let mask = Mask {
            height: h,
            width: w,
            labels: (0..(h * w) as u32).collect(),
        };
        let mut targets = Vec::new();
        resize.append_mask(&mask, 6, &mut rng(), &mut targets);
        let want: Vec<u32> = (0..6)
            .flat_map(|y| (0..6).map(move |x| (y * w + 2 * x + 1) as u32))
            .collect();
        assert_eq!(targets, want);
        // Augmenting, the random window keeps the image's proportions.
        for seed in 0..20 {
            let mut r = ChaCha8Rng::seed_from_u64(seed);
            let win = Window::draw(true, true, 20, 40, &mut r);
            assert!(win.width.abs_diff(2 * win.height) <= 1, "seed {seed}");
            assert!(win.y0 + win.height <= 20 && win.x0 + win.width <= 40);
        }
    }

    /// Source values that are neither smooth nor small integers.
    fn noise(n: usize) -> Vec<f32> {
        (0..n as u64)
            .map(|i| (crate::core::rng::splitmix64(i) % 1000) as f32 / 999.0)
            .collect()
    }

    #[test]
    fn filters_compute_their_definition() {
        // Enlarging (2 taps), shrinking a little (3 or 4) and a lot (the general loop), at
        // spans that start inside the row and end at its last pixel.
        let src = noise(400);
        let cases = [
            (7, 50, 64, 2),
            (0, 90, 64, 3),
            (10, 120, 64, 4),
            (0, 400, 64, 13),
        ];
        for (from, span, size, taps) in cases {
            let f = Filter::new(from, span, size);
            assert_eq!(f.taps, taps);
            let mut got = vec![0.0; size];
            f.resample(&src, &mut got);
            let scale = span as f64 / size as f64;
            let support = scale.max(1.0);
            for (o, &got) in got.iter().enumerate() {
                // The triangle over every pixel of the span, in f64.
                let centre = from as f64 + (o as f64 + 0.5) * scale;
                let weight =
                    |i: usize| (1.0 - ((i as f64 + 0.5 - centre) / support).abs()).max(0.0);
                let pixels = from..from + span;
                let total: f64 = pixels.clone().map(weight).sum();
                let want = pixels.map(|i| weight(i) * src[i] as f64).sum::<f64>() / total;
                assert!(
                    (got as f64 - want).abs() < 1e-6,
                    "{from} {span} {size} output {o}"
                );
            }
            // The fixed-length loops agree with the general one.
            let mut general = vec![0.0; size];
            for (o, v) in general.iter_mut().enumerate() {
                let (start, w) = f.taps(o);
                *v = dot(&src[start..start + w.len()], w);
            }
            assert_eq!(got, general, "{} taps", f.taps);
        }
    }

    #[test]
    fn append_writes_what_apply_does() {
        let img = Image {
            height: 30,
            width: 40,
            pixels: noise(3 * 30 * 40),
        };
        let t = Transform {
            augment: true,
            normalize: Normalize::ImageNet,
            resize: false,
        };
        for seed in 0..8 {
            let mut written = vec![0.0; 3 * 24 * 24];
            t.apply(&img, 24, &mut ChaCha8Rng::seed_from_u64(seed), &mut written);
            let mut appended = vec![1.0];
            t.append(
                &img,
                24,
                &mut ChaCha8Rng::seed_from_u64(seed),
                &mut appended,
            );
            assert_eq!(appended[0], 1.0);
            assert_eq!(appended[1..], written[..]);
        }
    }

    #[test]
    fn masks_take_their_images_window_and_flips() {
        // Image values and mask labels both number the source pixels, so where the window is
        // copied unresampled (no crop, or a crop at the input's side), each target names the
        // pixel its input shows.
        let (h, w) = (20, 26);
        let img = Image {
            height: h,
            width: w,
            pixels: (0..CHANNELS * h * w)
                .map(|i| (i % (h * w)) as f32)
                .collect(),
        };
        let mask = Mask {
            height: h,
            width: w,
            labels: (0..(h * w) as u32).collect(),
        };
        let t = Transform {
            augment: true,
            normalize: Normalize::Unit,
            resize: false,
        };
        let mut exact = 0;
        for seed in 0..200 {
            let (mut pixels, mut targets) = (Vec::new(), Vec::new());
            let (mut a, mut b) = (
                ChaCha8Rng::seed_from_u64(seed),
                ChaCha8Rng::seed_from_u64(seed),
            );
            t.append(&img, 16, &mut a, &mut pixels);
            t.append_mask(&mask, 16, &mut b, &mut targets);
            // Both drew the same numbers.
            assert_eq!(a.random::<u64>(), b.random::<u64>());
            let window = Window::draw(true, false, h, w, &mut ChaCha8Rng::seed_from_u64(seed));
            if window.height == 16 {
                exact += 1;
                let first: Vec<u32> = pixels[..256].iter().map(|&v| v as u32).collect();
                assert_eq!(first, targets, "seed {seed}");
            }
        }
        assert!(exact > 0, "no draw cut a window of the input's side");
        // Not augmented: the centred square (columns 3..23), each output the pixel holding its
        // centre.
        let mut targets = Vec::new();
        PLAIN.append_mask(&mask, 10, &mut ChaCha8Rng::seed_from_u64(0), &mut targets);
        let want: Vec<u32> = (0..10)
            .flat_map(|y| (0..10).map(move |x| ((2 * y + 1) * w + 4 + 2 * x) as u32))
            .collect();
        assert_eq!(targets, want);
    }
}
