//! Batch normalization over (N, H, W) per channel. Statistics are two-pass (mean, then the
//! centred sum of squares) and every per-channel sum is accumulated in f64, for accuracy
//! (a channel of a 1024² image sums millions of terms); channels run in parallel.

use rayon::prelude::*;

use super::Float;
use crate::backend::ChannelGeom;

/// Σ f(x) over the elements of channel c, accumulated in f64.
fn channel_fold<T: Float>(c: usize, g: &ChannelGeom, f: impl Fn(usize) -> T) -> T {
    let mut acc = 0.0;
    for n in 0..g.n {
        let start = (n * g.c + c) * g.hw;
        for i in start..start + g.hw {
            acc += f(i).f64();
        }
    }
    T::of(acc)
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

/// Per channel (scale, shift) of the normalization as an affine map: scale = γ/√(var + eps),
/// shift = β - mean·scale. The fused BN+ReLU's backward recomputes its mask with them.
fn coefficients<T: Float>(gamma: &[T], beta: &[T], mean: &[T], var: &[T], eps: f64) -> Vec<(T, T)> {
    (0..gamma.len())
        .map(|c| {
            let scale = gamma[c] / (var[c] + T::of(eps)).sqrt();
            (scale, beta[c] - mean[c] * scale)
        })
        .collect()
}

/// y = x · scale[c] + shift[c] over planes (shift holding the mean's part), then with `relu`
/// max(y, 0) in the same pass.
fn affine<T: Float>(x: &[T], y: &mut [T], g: &ChannelGeom, coef: &[(T, T)], relu: bool) {
    y.par_chunks_mut(g.hw)
        .zip(x.par_chunks(g.hw))
        .enumerate()
        .for_each(|(p, (yp, xp))| {
            let (scale, shift) = coef[p % g.c];
            for (y, &x) in yp.iter_mut().zip(xp) {
                let v = x * scale + shift;
                *y = if relu { v.max(T::zero()) } else { v };
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
    relu: bool,
) {
    let st = stats(x, g);
    for (c, &(m, v)) in st.iter().enumerate() {
        mean[c] = m;
        var[c] = v;
    }
    forward_eval(x, gamma, beta, mean, var, y, eps, g, relu);
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
    relu: bool,
) {
    affine(x, y, g, &coefficients(gamma, beta, mean, var, eps), relu);
}

/// dx = γ·invstd/M · (M·dy - Σdy - x̂·Σ(dy·x̂)); dγ += Σ(dy·x̂); dβ += Σdy. With the β of a
/// fused BN+ReLU (`relu_beta`), dy counts only where its output was positive, recomputed
/// from x as the forward computed it.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Float>(
    x: &[T],
    dy: &[T],
    relu_beta: Option<&[T]>,
    gamma: &[T],
    mean: &[T],
    var: &[T],
    dx: &mut [T],
    dgamma: &mut [T],
    dbeta: &mut [T],
    eps: f64,
    g: &ChannelGeom,
) {
    let plane = |p: usize| p * g.hw..(p + 1) * g.hw;
    let coef = relu_beta.map(|beta| coefficients(gamma, beta, mean, var, eps));
    // The ReLU's mask of plane p: its input x and the channel's affine map.
    let mask = |p: usize| coef.as_ref().map(|k| (&x[plane(p)], k[p % g.c]));
    let m = T::of((g.n * g.hw) as f64);
    let invstd = |c: usize| T::one() / (var[c] + T::of(eps)).sqrt();
    let sums: Vec<(T, T)> = (0..g.c)
        .into_par_iter()
        .map(|c| {
            let (invstd, mean) = (invstd(c), mean[c]);
            let (mut sdy, mut sdyx) = (0.0, 0.0);
            for n in 0..g.n {
                let p = n * g.c + c;
                let xs = &x[plane(p)];
                each_gradient(&dy[plane(p)], mask(p), |j, d| {
                    sdy += d.f64();
                    sdyx += d.f64() * ((xs[j] - mean) * invstd).f64();
                });
            }
            (T::of(sdy), T::of(sdyx))
        })
        .collect();
    for (c, &(sdy, sdyx)) in sums.iter().enumerate() {
        dbeta[c] += sdy;
        dgamma[c] += sdyx;
    }
    dx.par_chunks_mut(g.hw).enumerate().for_each(|(p, dxp)| {
        let c = p % g.c;
        let (invstd, mean, (sdy, sdyx)) = (invstd(c), mean[c], sums[c]);
        let k = gamma[c] * invstd / m;
        let xs = &x[plane(p)];
        each_gradient(&dy[plane(p)], mask(p), |j, d| {
            let xhat = (xs[j] - mean) * invstd;
            dxp[j] = k * (m * d - sdy - xhat * sdyx);
        });
    });
}

/// `f(j, d)` over a plane's gradient `dy`, or with a ReLU's `mask` (the plane's input and
/// affine map), over it masked as ReLU's backward does: passing where the output
/// x·scale + shift is positive (not NaN). Generic, so each use compiles to one loop.
fn each_gradient<T: Float>(dy: &[T], mask: Option<(&[T], (T, T))>, mut f: impl FnMut(usize, T)) {
    match mask {
        Some((x, (scale, shift))) => (dy.iter().zip(x)).enumerate().for_each(|(j, (&d, &x))| {
            f(
                j,
                if x * scale + shift > T::zero() {
                    d
                } else {
                    T::zero()
                },
            )
        }),
        None => dy.iter().enumerate().for_each(|(j, &d)| f(j, d)),
    }
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

#[cfg(test)]
mod tests {
    use crate::backend::cpu::{uniform, Cpu};
    use crate::backend::Storage;
    use crate::backend::{Backend, ChannelGeom};
    use crate::core::DType;

    fn values(n: usize, seed: u64, offset: f64) -> Storage {
        let v: Vec<f64> = (0..n as u64).map(|i| uniform(seed, i) - offset).collect();
        Cpu.upload(&v, DType::F64).unwrap()
    }

    fn f64s(s: &Storage) -> Vec<f64> {
        s.to_f64_vec().unwrap()
    }

    /// The fused op is BN then ReLU, and its backward is ReLU's then BN's, to the last bit.
    #[test]
    fn fused_batchnorm_relu_is_the_two_ops_in_turn() {
        let g = ChannelGeom { n: 3, c: 4, hw: 10 };
        let n = g.n * g.c * g.hw;
        let (x, dy) = (values(n, 1, 0.5), values(n, 2, 0.5));
        let (gamma, beta) = (values(g.c, 3, -0.5), values(g.c, 4, 0.5));
        let zeros = |n| Cpu.zeros(n, DType::F64).unwrap();
        let (mut y, mut mean, mut var) = (zeros(n), zeros(g.c), zeros(g.c));
        Cpu.batchnorm_forward_train(&x, &gamma, &beta, &mut y, &mut mean, &mut var, 1e-5, &g)
            .unwrap();
        let mut r = zeros(n);
        Cpu.relu_forward(&y, &mut r).unwrap();
        let (mut fused, mut fmean, mut fvar) = (zeros(n), zeros(g.c), zeros(g.c));
        Cpu.batchnorm_relu_forward_train(
            &x, &gamma, &beta, &mut fused, &mut fmean, &mut fvar, 1e-5, &g,
        )
        .unwrap();
        assert_eq!(f64s(&fused), f64s(&r));
        assert!(f64s(&r).contains(&0.0) && f64s(&r).iter().any(|&v| v > 0.0));

        let mut masked = zeros(n);
        Cpu.relu_backward(&r, &dy, &mut masked).unwrap();
        let (mut dx, mut dg, mut db) = (zeros(n), zeros(g.c), zeros(g.c));
        Cpu.batchnorm_backward(
            &x, &masked, &gamma, &mean, &var, &mut dx, &mut dg, &mut db, 1e-5, &g,
        )
        .unwrap();
        let (mut fdx, mut fdg, mut fdb) = (zeros(n), zeros(g.c), zeros(g.c));
        Cpu.batchnorm_relu_backward(
            &x, &dy, &gamma, &beta, &mean, &var, &mut fdx, &mut fdg, &mut fdb, 1e-5, &g,
        )
        .unwrap();
        assert_eq!(f64s(&fdx), f64s(&dx));
        assert_eq!(f64s(&fdg), f64s(&dg));
        assert_eq!(f64s(&fdb), f64s(&db));
    }
}
