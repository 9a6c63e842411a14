//! Group normalization: each sample's groups of channels normalized over their own values.
//! A (sample, group) pair is one contiguous run of (c / groups)·hw values, so the pairs run in
//! parallel, each two-pass (mean, then the centred sum of squares) with its sums in f64 as
//! batch normalization's (`norm::lane_sums`).

use rayon::prelude::*;

use super::norm::lane_sums;
use super::Float;
use crate::backend::GroupGeom;

/// Mean and biased variance of one group's values.
fn group_stats<T: Float>(x: &[T]) -> (T, T) {
    let m = T::of(x.len() as f64);
    let [sum] = lane_sums(x, x, |x, _| [x]);
    let mean = T::of(sum) / m;
    let [sq] = lane_sums(x, x, move |x, _| [(x - mean) * (x - mean)]);
    (mean, T::of(sq) / m)
}

fn invstd<T: Float>(var: T, eps: f64) -> T {
    T::one() / (var + T::of(eps)).sqrt()
}

#[allow(clippy::too_many_arguments)]
pub fn forward<T: Float>(
    x: &[T],
    gamma: &[T],
    beta: &[T],
    y: &mut [T],
    mean: &mut [T],
    var: &mut [T],
    eps: f64,
    g: &GroupGeom,
) {
    let (len, per) = (g.group_len(), g.c / g.groups);
    let stats: Vec<(T, T)> = y
        .par_chunks_mut(len)
        .zip(x.par_chunks(len))
        .enumerate()
        .map(|(k, (yk, xk))| {
            let (m, v) = group_stats(xk);
            let is = invstd(v, eps);
            let first = k % g.groups * per;
            for (j, (yp, xp)) in yk.chunks_mut(g.hw).zip(xk.chunks(g.hw)).enumerate() {
                // Centred first, (x - m)·scale + β: a group of few values can have a mean far
                // larger than its spread, where x·scale + (β - m·scale) would cancel.
                let (scale, b) = (gamma[first + j] * is, beta[first + j]);
                for (y, &x) in yp.iter_mut().zip(xp) {
                    *y = (x - m) * scale + b;
                }
            }
            (m, v)
        })
        .collect();
    for (k, (m, v)) in stats.into_iter().enumerate() {
        mean[k] = m;
        var[k] = v;
    }
}

/// With x̂ = (x − mean)·invstd and dx̂ = dy·γ[c], over a group of M values:
/// dx = invstd/M · (M·dx̂ − Σdx̂ − x̂·Σ(dx̂·x̂)); dγ[c] += Σ dy·x̂ and dβ[c] += Σ dy over the
/// channel's planes in every sample (summed in f64 in sample order, so the bits do not
/// depend on the threads).
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
    g: &GroupGeom,
) {
    let (len, per) = (g.group_len(), g.c / g.groups);
    // Per (sample, channel): (Σdy, Σdy·x̂) over its plane.
    let planes: Vec<Vec<(f64, f64)>> = dx
        .par_chunks_mut(len)
        .zip(x.par_chunks(len).zip(dy.par_chunks(len)))
        .enumerate()
        .map(|(k, (dxk, (xk, dyk)))| {
            let (m, is) = (mean[k], invstd(var[k], eps));
            let first = k % g.groups * per;
            let sums: Vec<(f64, f64)> = xk
                .chunks(g.hw)
                .zip(dyk.chunks(g.hw))
                .map(|(xp, dp)| {
                    let [sdy, sdyx] = lane_sums(dp, xp, move |d, x| [d, d * ((x - m) * is)]);
                    (sdy, sdyx)
                })
                .collect();
            let (mut a, mut b) = (0.0, 0.0);
            for (j, &(sdy, sdyx)) in sums.iter().enumerate() {
                a += gamma[first + j].f64() * sdy;
                b += gamma[first + j].f64() * sdyx;
            }
            let count = T::of(len as f64);
            let (a, b, k) = (T::of(a), T::of(b), is / count);
            for (j, (dp, (xp, dyp))) in dxk
                .chunks_mut(g.hw)
                .zip(xk.chunks(g.hw).zip(dyk.chunks(g.hw)))
                .enumerate()
            {
                let gm = gamma[first + j];
                for (o, (&x, &d)) in dp.iter_mut().zip(xp.iter().zip(dyp)) {
                    let xhat = (x - m) * is;
                    *o = k * (count * d * gm - a - xhat * b);
                }
            }
            sums
        })
        .collect();
    let mut channels = vec![(0.0, 0.0); g.c];
    for (k, sums) in planes.iter().enumerate() {
        let first = k % g.groups * per;
        for (j, &(sdy, sdyx)) in sums.iter().enumerate() {
            channels[first + j].0 += sdy;
            channels[first + j].1 += sdyx;
        }
    }
    for (c, (sdy, sdyx)) in channels.into_iter().enumerate() {
        dbeta[c] += T::of(sdy);
        dgamma[c] += T::of(sdyx);
    }
}
