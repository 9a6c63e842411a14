//! Element-wise kernels, the loss and the optimizer update.

use rayon::prelude::*;

use super::{simd, Float};
use crate::backend::{ChannelGeom, SgdStep};
use crate::core::rng::uniform;

/// Below this many elements a parallel loop costs more than it saves.
const PAR_MIN: usize = 1 << 15;

/// y = f(a, b) element by element: blocks of PAR_MIN elements in parallel, each a plain loop
/// the compiler vectorizes (element-wise rayon iterators did not vectorize).
pub fn zip<T: Float>(a: &[T], b: &[T], y: &mut [T], f: impl Fn(T, T) -> T + Sync + Copy) {
    let block = |y: &mut [T], a: &[T], b: &[T]| {
        simd(
            #[inline(always)]
            || {
                for (y, (&a, &b)) in y.iter_mut().zip(a.iter().zip(b)) {
                    *y = f(a, b);
                }
            },
        )
    };
    if y.len() <= PAR_MIN {
        return block(y, a, b);
    }
    y.par_chunks_mut(PAR_MIN)
        .zip(a.par_chunks(PAR_MIN).zip(b.par_chunks(PAR_MIN)))
        .for_each(|(y, (a, b))| block(y, a, b));
}

pub fn relu<T: Float>(x: &[T], y: &mut [T]) {
    zip(x, x, y, |x, _| if x > T::zero() { x } else { T::zero() });
}

pub fn relu_backward<T: Float>(y: &[T], dy: &[T], dx: &mut [T]) {
    zip(
        y,
        dy,
        dx,
        |y, dy| if y > T::zero() { dy } else { T::zero() },
    );
}

pub fn add_assign<T: Float>(y: &mut [T], x: &[T]) {
    let block = |y: &mut [T], x: &[T]| {
        simd(
            #[inline(always)]
            || {
                for (y, &x) in y.iter_mut().zip(x) {
                    *y += x;
                }
            },
        )
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

pub fn dropout_mask<T: Float>(mask: &mut [T], p: f64, seed: u64) {
    let keep = T::of(1.0 / (1.0 - p));
    mask.par_iter_mut().enumerate().for_each(|(i, m)| {
        *m = if uniform(seed, i as u64) < p {
            T::zero()
        } else {
            keep
        }
    });
}

pub fn softmax_cross_entropy<T: Float>(
    logits: &[T],
    labels: &[u32],
    probs: &mut [T],
    n: usize,
    k: usize,
) -> f64 {
    let mut loss = 0.0;
    for i in 0..n {
        let row = &logits[i * k..(i + 1) * k];
        let p = &mut probs[i * k..(i + 1) * k];
        let max = row.iter().fold(T::neg_infinity(), |m, &v| m.max(v));
        let mut sum = T::zero();
        for (p, &v) in p.iter_mut().zip(row) {
            *p = (v - max).exp();
            sum += *p;
        }
        p.iter_mut().for_each(|p| *p = *p / sum);
        let label = labels[i] as usize;
        loss += (sum.ln() - (row[label] - max)).f64();
    }
    loss / n as f64
}

pub fn softmax_cross_entropy_backward<T: Float>(
    probs: &[T],
    labels: &[u32],
    dlogits: &mut [T],
    scale: f64,
    n: usize,
    k: usize,
) {
    let s = T::of(scale);
    for i in 0..n {
        for j in 0..k {
            let onehot = if labels[i] as usize == j {
                T::one()
            } else {
                T::zero()
            };
            dlogits[i * k + j] = s * (probs[i * k + j] - onehot);
        }
    }
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
