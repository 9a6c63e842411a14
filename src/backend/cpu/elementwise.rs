//! Element-wise kernels, the loss and the optimizer update.

use rayon::prelude::*;

use super::Float;
use crate::backend::{AdamStep, ChannelGeom, LossGeom, MaskGeom, Nonlinearity, SgdStep};
use crate::core::rng::uniform;

/// Below this many elements a parallel loop costs more than it saves.
const PAR_MIN: usize = 1 << 15;

/// y = f(a, b) element by element: blocks of PAR_MIN elements in parallel, each a plain loop
/// the compiler vectorizes (element-wise rayon iterators did not vectorize).
pub fn zip<T: Float>(a: &[T], b: &[T], y: &mut [T], f: impl Fn(T, T) -> T + Sync + Copy) {
    let block = |y: &mut [T], a: &[T], b: &[T]| {
        simd!(|| {
            for (y, (&a, &b)) in y.iter_mut().zip(a.iter().zip(b)) {
                *y = f(a, b);
            }
        })
    };
    if y.len() <= PAR_MIN {
        return block(y, a, b);
    }
    y.par_chunks_mut(PAR_MIN)
        .zip(a.par_chunks(PAR_MIN).zip(b.par_chunks(PAR_MIN)))
        .for_each(|(y, (a, b))| block(y, a, b));
}

/// max(x, 0), NaN and -0 to +0.
#[inline(always)]
fn relu_of<T: Float>(x: T) -> T {
    if x > T::zero() {
        x
    } else {
        T::zero()
    }
}

pub fn relu<T: Float>(x: &[T], y: &mut [T]) {
    zip(x, x, y, |x, _| relu_of(x));
}

/// max(a + b, 0), the sum rounded to T first, as `add` then `relu` would.
pub fn add_relu<T: Float>(a: &[T], b: &[T], y: &mut [T]) {
    zip(a, b, y, |a, b| relu_of(a + b));
}

pub fn relu_backward<T: Float>(y: &[T], dy: &[T], dx: &mut [T]) {
    zip(
        y,
        dy,
        dx,
        |y, dy| if y > T::zero() { dy } else { T::zero() },
    );
}

/// σ(x) = 1/(1 + e^(−x)): 0 (not NaN) where e^(−x) overflows.
#[inline(always)]
fn sigmoid_of<T: Float>(x: T) -> T {
    T::one() / (T::one() + (-x).exp())
}

/// √(2/π), the tanh GELU's scale (PyTorch's kBeta).
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The tanh GELU's cubic coefficient (PyTorch's kKappa).
const GELU_CUBIC: f64 = 0.044715;
/// 1/√(2π), the normal density's factor (the exact GELU's gradient).
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// y = f(x) as PyTorch defines each (see [`Nonlinearity`]).
pub fn nonlinearity<T: Float>(f: Nonlinearity, x: &[T], y: &mut [T]) {
    let (one, half) = (T::one(), T::of(0.5));
    let (k, c) = (T::of(SQRT_2_OVER_PI), T::of(GELU_CUBIC));
    let r2 = T::of(std::f64::consts::FRAC_1_SQRT_2);
    match f {
        Nonlinearity::Silu => zip(x, x, y, |x, _| x * sigmoid_of(x)),
        Nonlinearity::Gelu => zip(x, x, y, move |x, _| half * x * (one + (x * r2).erf())),
        Nonlinearity::GeluTanh => zip(x, x, y, move |x, _| {
            half * x * (one + (k * (x + c * x * x * x)).tanh())
        }),
        Nonlinearity::Sigmoid => zip(x, x, y, |x, _| sigmoid_of(x)),
    }
}

/// dx = dy·f′(x), the derivatives PyTorch's backward computes (in the CUDA kernels' order).
pub fn nonlinearity_backward<T: Float>(f: Nonlinearity, x: &[T], dy: &[T], dx: &mut [T]) {
    let (one, half) = (T::one(), T::of(0.5));
    let (k, c) = (T::of(SQRT_2_OVER_PI), T::of(GELU_CUBIC));
    let (r2, density) = (
        T::of(std::f64::consts::FRAC_1_SQRT_2),
        T::of(FRAC_1_SQRT_2PI),
    );
    match f {
        Nonlinearity::Silu => zip(x, dy, dx, move |x, d| {
            let s = sigmoid_of(x);
            d * (s * (one + x * (one - s)))
        }),
        // Φ(x) + x·φ(x).
        Nonlinearity::Gelu => zip(x, dy, dx, move |x, d| {
            let cdf = half * (one + (x * r2).erf());
            d * (cdf + x * density * (-half * x * x).exp())
        }),
        Nonlinearity::GeluTanh => zip(x, dy, dx, move |x, d| {
            let t = (k * (x + c * x * x * x)).tanh();
            let inner = k * (one + T::of(3.0) * c * x * x);
            d * (half * (one + t) + half * x * (one - t * t) * inner)
        }),
        Nonlinearity::Sigmoid => zip(x, dy, dx, move |x, d| {
            let s = sigmoid_of(x);
            d * (s * (one - s))
        }),
    }
}

pub fn add_assign<T: Float>(y: &mut [T], x: &[T]) {
    let block = |y: &mut [T], x: &[T]| {
        simd!(|| {
            for (y, &x) in y.iter_mut().zip(x) {
                *y += x;
            }
        })
    };
    if y.len() <= PAR_MIN {
        return block(y, x);
    }
    y.par_chunks_mut(PAR_MIN)
        .zip(x.par_chunks(PAR_MIN))
        .for_each(|(y, x)| block(y, x));
}

/// (src_channels, src_offset) → (dst_channels, dst_offset), `count` channels per sample.
pub fn copy_channels<T: Float>(
    src: &[T],
    dst: &mut [T],
    (sc, so): (usize, usize),
    (dc, doff): (usize, usize),
    count: usize,
    n: usize,
    hw: usize,
) {
    for i in 0..n {
        let s = &src[(i * sc + so) * hw..(i * sc + so + count) * hw];
        dst[(i * dc + doff) * hw..(i * dc + doff + count) * hw].copy_from_slice(s);
    }
}

pub fn add_channel_bias<T: Float>(y: &mut [T], bias: &[T], g: &ChannelGeom) {
    y.par_chunks_mut(g.hw)
        .enumerate()
        .for_each(|(p, plane)| plane.iter_mut().for_each(|v| *v += bias[p % g.c]));
}

pub fn channel_sum<T: Float>(dy: &[T], db: &mut [T], g: &ChannelGeom) {
    for (c, d) in db.iter_mut().enumerate() {
        for n in 0..g.n {
            let start = (n * g.c + c) * g.hw;
            *d += dy[start..start + g.hw].iter().copied().sum::<T>();
        }
    }
}

pub fn dropout_mask<T: Float>(mask: &mut [T], p: f64, seed: u64, g: &MaskGeom) {
    let keep = T::of(1.0 / (1.0 - p));
    let win = g.window;
    mask.par_iter_mut().enumerate().for_each(|(i, m)| {
        // The element's index in the whole maps' mask.
        let (plane, r, c) = (i / (win.h * win.w), i / win.w % win.h, i % win.w);
        let at = (plane * g.h + win.row + r) * g.w + win.col + c;
        *m = if uniform(seed, at as u64) < p {
            T::zero()
        } else {
            keep
        }
    });
}

/// Places per parallel task of the loss: fixed, so the f64 sum's order (places in order within
/// a block, blocks in order) does not depend on the thread count.
const LOSS_BLOCK: usize = 1024;

/// `data` (n × k × positions) cut into blocks of at most LOSS_BLOCK places of one sample, each
/// as its k class rows, with the index of the block's first place (sample-major).
fn place_blocks<'a, T>(data: &'a mut [T], g: &LossGeom) -> Vec<(usize, Vec<&'a mut [T]>)> {
    let mut blocks = Vec::new();
    for (s, sample) in data.chunks_mut(g.k * g.positions).enumerate() {
        let mut rows: Vec<_> = sample
            .chunks_mut(g.positions)
            .map(|r| r.chunks_mut(LOSS_BLOCK))
            .collect();
        for b in 0..g.positions.div_ceil(LOSS_BLOCK) {
            let first = s * g.positions + b * LOSS_BLOCK;
            blocks.push((first, rows.iter_mut().filter_map(Iterator::next).collect()));
        }
    }
    blocks
}

pub fn softmax_cross_entropy<T: Float>(
    logits: &[T],
    labels: &[u32],
    weights: &[f64],
    probs: &mut [T],
    g: &LossGeom,
) -> f64 {
    let partial: Vec<f64> = place_blocks(probs, g)
        .into_par_iter()
        .map(|(first, mut p)| {
            let (s, q0) = (first / g.positions, first % g.positions);
            let x = |j: usize, q: usize| logits[(s * g.k + j) * g.positions + q0 + q];
            let mut loss = 0.0;
            for q in 0..p[0].len() {
                let max = (0..g.k).fold(T::neg_infinity(), |m, j| m.max(x(j, q)));
                let mut sum = T::zero();
                for (j, row) in p.iter_mut().enumerate() {
                    row[q] = (x(j, q) - max).exp();
                    sum += row[q];
                }
                p.iter_mut().for_each(|row| row[q] = row[q] / sum);
                let label = labels[first + q] as usize;
                loss += weights[first + q] * (sum.ln() - (x(label, q) - max)).f64();
            }
            loss
        })
        .collect();
    partial.iter().sum()
}

pub fn softmax_cross_entropy_backward<T: Float>(
    probs: &[T],
    labels: &[u32],
    weights: &[f64],
    dlogits: &mut [T],
    scale: f64,
    g: &LossGeom,
) {
    place_blocks(dlogits, g)
        .into_par_iter()
        .for_each(|(first, mut d)| {
            let (s, q0) = (first / g.positions, first % g.positions);
            for (j, row) in d.iter_mut().enumerate() {
                let p = &probs[(s * g.k + j) * g.positions + q0..];
                for (q, d) in row.iter_mut().enumerate() {
                    let onehot = if labels[first + q] as usize == j {
                        T::one()
                    } else {
                        T::zero()
                    };
                    *d = T::of(scale * weights[first + q]) * (p[q] - onehot);
                }
            }
        });
}

/// PyTorch's Adam and AdamW (`torch.optim.Adam`'s single-tensor path, operation for
/// operation; see `GemsAdamStep` in include/gems_kernels.h): g = grad_scale·grad (+ wd·w for
/// Adam), w ·= 1 - lr·wd (AdamW), m += (1-β1)(g - m), v = β2·v + (1-β2)·g², then
/// w -= step_size·(m / (√v / √bc2 + eps)).
pub fn adam<T: Float>(w: &mut [T], grad: &[T], m: &mut [T], v: &mut [T], s: &AdamStep) {
    let (step_size, bc2_sqrt) = s.bias_corrections();
    let (l2, decay) = s.decay_terms();
    let (step_size, bc2_sqrt, l2, decay) =
        (T::of(step_size), T::of(bc2_sqrt), T::of(l2), T::of(decay));
    let (b2, eps) = (T::of(s.betas.1), T::of(s.eps));
    let (one_b1, one_b2) = (T::of(1.0 - s.betas.0), T::of(1.0 - s.betas.1));
    let unscale = T::of(s.grad_scale);
    w.par_iter_mut()
        .with_min_len(PAR_MIN)
        .zip(grad.par_iter().zip(m.par_iter_mut().zip(v.par_iter_mut())))
        .for_each(|(w, (&g, (m, v)))| {
            // l2 is 0 for AdamW and decay 1 for Adam: adding 0·w and multiplying by 1 are exact.
            let g = unscale * g + l2 * *w;
            *w *= decay;
            // torch's lerp(m, g, 1-β1) for a weight below ½; addcmul's (value·g)·g.
            *m += one_b1 * (g - *m);
            *v = b2 * *v + one_b2 * g * g;
            let denom = v.sqrt() / bc2_sqrt + eps;
            *w -= step_size * (*m / denom);
        });
}

/// PyTorch's SGD: g = grad_scale·grad + wd·w; buf = momentum·buf + g; step along buf (or
/// g + momentum·buf with Nesterov). A zero buffer makes the first step buf = g, as in PyTorch.
pub fn sgd<T: Float>(w: &mut [T], grad: &[T], buf: &mut [T], s: &SgdStep) {
    let (lr, mom, wd) = (T::of(s.lr), T::of(s.momentum), T::of(s.weight_decay));
    let unscale = T::of(s.grad_scale);
    w.par_iter_mut()
        .with_min_len(PAR_MIN)
        .zip(grad.par_iter().zip(buf.par_iter_mut()))
        .for_each(|(w, (&g, b))| {
            let g = unscale * g + wd * *w;
            *b = mom * *b + g;
            let step = if s.nesterov { g + mom * *b } else { *b };
            *w -= lr * step;
        });
}
