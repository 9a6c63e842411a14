//! Batch normalization over (N, H, W) per channel. Statistics are two-pass (mean, then the
//! centred sum of squares) for accuracy; channels run in parallel.

use rayon::prelude::*;

use super::Float;
use crate::backend::ChannelGeom;

/// Σ f(x) over the elements of channel c.
fn channel_fold<T: Float>(c: usize, g: &ChannelGeom, f: impl Fn(usize) -> T) -> T {
    let mut acc = T::zero();
    for n in 0..g.n {
        let start = (n * g.c + c) * g.hw;
        for i in start..start + g.hw {
            acc += f(i);
        }
    }
    acc
}

fn stats<T: Float>(x: &[T], g: &ChannelGeom) -> Vec<(T, T)> {
    let m = T::of((g.n * g.hw) as f64);
    (0..g.c)
        .into_par_iter()
        .map(|c| {
            let mean = channel_fold(c, g, |i| x[i]) / m;
            let var = channel_fold(c, g, |i| (x[i] - mean) * (x[i] - mean)) / m;
            (mean, var)
        })
        .collect()
}

/// y = (x - mean) · scale[c] + shift[c] over planes.
fn affine<T: Float>(x: &[T], y: &mut [T], g: &ChannelGeom, coef: &[(T, T)]) {
    y.par_chunks_mut(g.hw)
        .zip(x.par_chunks(g.hw))
        .enumerate()
        .for_each(|(p, (yp, xp))| {
            let (scale, shift) = coef[p % g.c];
            for (y, &x) in yp.iter_mut().zip(xp) {
                *y = x * scale + shift;
            }
        });
}

#[allow(clippy::too_many_arguments)]
pub fn forward_train<T: Float>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    y: &mut [T],
    mean: &mut [T],
    var: &mut [T],
    eps: f64,
    g: &ChannelGeom,
) {
    let st = stats(x, g);
    for (c, &(m, v)) in st.iter().enumerate() {
        mean[c] = m;
        var[c] = v;
    }
    forward_eval(x, gamma, beta, mean, var, y, eps, g);
}

#[allow(clippy::too_many_arguments)]
pub fn forward_eval<T: Float>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    mean: &[T],
    var: &[T],
    y: &mut [T],
    eps: f64,
    g: &ChannelGeom,
) {
    let coef: Vec<(T, T)> = (0..g.c)
        .map(|c| {
            let scale = gamma[c] / (var[c] + T::of(eps)).sqrt();
            (scale, beta[c] - mean[c] * scale)
        })
        .collect();
    affine(x, y, g, &coef);
}

/// dx = γ·invstd/M · (M·dy - Σdy - x̂·Σ(dy·x̂)); dγ += Σ(dy·x̂); dβ += Σdy.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    gamma: &[T],
    mean: &[T],
    var: &[T],
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
    eps: f64,
    g: &ChannelGeom,
) {
    let m = T::of((g.n * g.hw) as f64);
    let sums: Vec<(T, T)> = (0..g.c)
        .into_par_iter()
        .map(|c| {
            let invstd = T::one() / (var[c] + T::of(eps)).sqrt();
            let sdy = channel_fold(c, g, |i| dy[i]);
            let sdyx = channel_fold(c, g, |i| dy[i] * (x[i] - mean[c]) * invstd);
            (sdy, sdyx)
        })
        .collect();
    for (c, &(sdy, sdyx)) in sums.iter().enumerate() {
        dbeta[c] += sdy;
        dgamma[c] += sdyx;
    }
    dx.par_chunks_mut(g.hw)
        .zip(dy.par_chunks(g.hw).zip(x.par_chunks(g.hw)))
        .enumerate()
        .for_each(|(p, (dxp, (dyp, xp)))| {
            let c = p % g.c;
            let invstd = T::one() / (var[c] + T::of(eps)).sqrt();
            let (sdy, sdyx) = sums[c];
            let k = gamma[c] * invstd / m;
            for ((dx, &dy), &x) in dxp.iter_mut().zip(dyp).zip(xp) {
                let xhat = (x - mean[c]) * invstd;
                *dx = k * (m * dy - sdy - xhat * sdyx);
            }
        });
}

pub fn update_running<T: Float>(
    rm: &mut [T],
    rv: &mut [T],
    mean: &[T],
    var: &[T],
    momentum: f64,
    count: usize,
) {
    let mo = T::of(momentum);
    let unbias = T::of(count as f64 / (count.max(2) - 1) as f64);
    for c in 0..rm.len() {
        rm[c] = (T::one() - mo) * rm[c] + mo * mean[c];
        rv[c] = (T::one() - mo) * rv[c] + mo * var[c] * unbias;
    }
}
