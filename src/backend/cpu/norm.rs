//! Batch normalization over (N, H, W) per channel. Statistics are two-pass (mean, then the
//! centred sum of squares) and every per-channel sum is accumulated in f64, for accuracy
//! (a channel of a 1024² image sums millions of terms; f32 terms enter in partial sums of up
//! to 8); channels run in parallel.

use rayon::prelude::*;

use super::Float;
use crate::backend::ChannelGeom;

/// Interleaved partial sums: independent f64 chains the compiler vectorizes (one chain adds
/// an element every 4 cycles at best), summed in a fixed order at the end. At 8 lanes LLVM
/// unrolls the lane loop and fails to vectorize a sum of two terms; at 32 it vectorizes it.
const LANES: usize = 32;

/// Σ f(a[i], b[i]) over i, each of the K terms accumulated in f64 in [`LANES`] partial sums.
/// f32 terms are first summed up to [`F32_ROWS`] to a lane in f32: a conversion to f64 per
/// element made the statistics compute-bound (one element per cycle); f64 terms go straight in.
pub(super) fn lane_sums<T: Float, const K: usize>(
    a: &[T],
    b: &[T],
    f: impl Fn(T, T) -> [T; K],
) -> [f64; K] {
    let rows = if std::mem::size_of::<T>() < 8 {
        F32_ROWS
    } else {
        1
    };
    simd!(|| {
        let mut acc = [[0.0f64; LANES]; K];
        // Whole rows of lanes in blocks of `rows` (the last may be shorter: a small plane,
        // 8² or 7², is one or two rows); only a tail shorter than a row goes element-wise.
        let whole = a.len() / LANES * LANES;
        let (ac, bc) = (
            a[..whole].chunks(rows * LANES),
            b[..whole].chunks(rows * LANES),
        );
        let (ar, br) = (&a[whole..], &b[whole..]);
        for (a, b) in ac.zip(bc) {
            let mut part = [[T::zero(); LANES]; K];
            for (a, b) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
                let (a, b): (&[T; LANES], &[T; LANES]) =
                    (a.try_into().unwrap(), b.try_into().unwrap());
                for l in 0..LANES {
                    let v = f(a[l], b[l]);
                    for k in 0..K {
                        part[k][l] += v[k];
                    }
                }
            }
            for k in 0..K {
                for l in 0..LANES {
                    acc[k][l] += part[k][l].f64();
                }
            }
        }
        for (i, (&a, &b)) in ar.iter().zip(br).enumerate() {
            let v = f(a, b);
            for k in 0..K {
                acc[k][i % LANES] += v[k].f64();
            }
        }
        acc.map(|lanes| lanes.iter().sum())
    })
}

/// f32 terms a lane sums in f32 before adding them in f64: a relative error of at most
/// 8 units in the last place of f32 per partial sum, far below the statistics' own noise.
const F32_ROWS: usize = 8;

/// Σ over the planes of channel c of `lane_sums` of (a, b).
fn channel_sums<T: Float, const K: usize>(
    c: usize,
    g: &ChannelGeom,
    a: &[T],
    b: &[T],
    f: impl Fn(T, T) -> [T; K] + Copy,
) -> [f64; K] {
    let mut acc = [0.0; K];
    for n in 0..g.n {
        let p = plane(g, n, c);
        let s = lane_sums(&a[p.clone()], &b[p], f);
        for k in 0..K {
            acc[k] += s[k];
        }
    }
    acc
}

/// Channel c's (mean, biased variance), two passes over its planes (the second from cache).
fn channel_stats<T: Float>(c: usize, g: &ChannelGeom, x: &[T]) -> (T, T) {
    let m = T::of((g.n * g.hw) as f64);
    let [sum] = channel_sums(c, g, x, x, move |x, _| [x]);
    let mean = T::of(sum) / m;
    let [sq] = channel_sums(c, g, x, x, move |x, _| [(x - mean) * (x - mean)]);
    (mean, T::of(sq) / m)
}

fn stats<T: Float>(x: &[T], g: &ChannelGeom) -> Vec<(T, T)> {
    (0..g.c)
        .into_par_iter()
        .map(|c| channel_stats(c, g, x))
        .collect()
}

/// The planes of `t` (N·C planes of HW values) grouped by channel, plane n·C + c in group c:
/// for work by channel, each group on one thread.
fn planes_by_channel<'a, T>(t: &'a mut [T], g: &ChannelGeom) -> Vec<Vec<&'a mut [T]>> {
    let mut groups: Vec<Vec<&mut [T]>> = (0..g.c).map(|_| Vec::with_capacity(g.n)).collect();
    for (p, plane) in t[..g.n * g.c * g.hw].chunks_mut(g.hw).enumerate() {
        groups[p % g.c].push(plane);
    }
    groups
}

/// The values of plane n·C + c.
fn plane(g: &ChannelGeom, n: usize, c: usize) -> std::ops::Range<usize> {
    (n * g.c + c) * g.hw..(n * g.c + c + 1) * g.hw
}

/// Per channel (scale, shift) of the normalization as an affine map: scale = γ/√(var + eps),
/// shift = β - mean·scale. The fused BN+ReLU's backward recomputes its mask with them.
fn coefficients<T: Float>(gamma: &[T], beta: &[T], mean: &[T], var: &[T], eps: f64) -> Vec<(T, T)> {
    (0..gamma.len())
        .map(|c| coefficient(gamma[c], beta[c], mean[c], var[c], eps))
        .collect()
}

fn coefficient<T: Float>(gamma: T, beta: T, mean: T, var: T, eps: f64) -> (T, T) {
    let scale = gamma / (var + T::of(eps)).sqrt();
    (scale, beta - mean * scale)
}

/// y = x · scale[c] + shift[c] over planes (shift holding the mean's part), then with `relu`
/// max(y, 0) in the same pass.
fn affine<T: Float>(x: &[T], y: &mut [T], g: &ChannelGeom, coef: &[(T, T)], relu: bool) {
    y.par_chunks_mut(g.hw)
        .zip(x.par_chunks(g.hw))
        .enumerate()
        .for_each(|(p, (yp, xp))| affine_plane(xp, yp, coef[p % g.c], relu));
}

fn affine_plane<T: Float>(x: &[T], y: &mut [T], (scale, shift): (T, T), relu: bool) {
    simd!(|| {
        for (y, &x) in y.iter_mut().zip(x) {
            let v = x * scale + shift;
            *y = if relu { v.max(T::zero()) } else { v };
        }
    })
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
    // By channel: its statistics, then its normalization while its planes are still in cache
    // (x read once from memory, not twice; the results are forward_eval's with these stats).
    let st: Vec<(T, T)> = planes_by_channel(y, g)
        .into_par_iter()
        .enumerate()
        .map(|(c, ys)| {
            let (m, v) = channel_stats(c, g, x);
            let coef = coefficient(gamma[c], beta[c], m, v, eps);
            for (n, yp) in ys.into_iter().enumerate() {
                affine_plane(&x[plane(g, n, c)], yp, coef, relu);
            }
            (m, v)
        })
        .collect();
    for (c, &(m, v)) in st.iter().enumerate() {
        mean[c] = m;
        var[c] = v;
    }
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

/// Per channel (mean, biased variance) of x, for a caller that combines the statistics of
/// several parts of one batch (the tiles of a spatially split batch norm).
pub fn statistics<T: Float>(x: &[T], g: &ChannelGeom) -> Vec<(f64, f64)> {
    stats(x, g)
        .into_iter()
        .map(|(m, v)| (m.f64(), v.f64()))
        .collect()
}

/// Per channel (Σdy, Σ(dy·x̂)) in f64 over x's planes; with the β of a fused BN+ReLU
/// (`relu_beta`), dy counts only where its output was positive, recomputed from x as the
/// forward computed it.
#[allow(clippy::too_many_arguments)]
pub fn backward_sums<T: Float>(
    x: &[T],
    dy: &[T],
    relu_beta: Option<&[T]>,
    gamma: &[T],
    mean: &[T],
    var: &[T],
    eps: f64,
    g: &ChannelGeom,
) -> Vec<(f64, f64)> {
    let masks = relu_beta.map(|beta| coefficients(gamma, beta, mean, var, eps));
    (0..g.c)
        .into_par_iter()
        .map(|c| {
            let mask = masks.as_ref().map(|k| k[c]);
            channel_backward_sums(c, g, x, dy, mask, mean[c], invstd(var, c, eps))
        })
        .collect()
}

/// Channel c's (Σdy, Σ(dy·x̂)), dy passing only where the fused ReLU's `mask` (its input's
/// affine map) was positive.
fn channel_backward_sums<T: Float>(
    c: usize,
    g: &ChannelGeom,
    x: &[T],
    dy: &[T],
    mask: Option<(T, T)>,
    mean: T,
    invstd: T,
) -> (f64, f64) {
    let term = move |d: T, x: T| [d, d * ((x - mean) * invstd)];
    let [sdy, sdyx] = match mask {
        Some(k) => channel_sums(c, g, dy, x, |d, x| term(relu_pass(d, x, k), x)),
        None => channel_sums(c, g, dy, x, term),
    };
    (sdy, sdyx)
}

fn invstd<T: Float>(var: &[T], c: usize, eps: f64) -> T {
    T::one() / (var[c] + T::of(eps)).sqrt()
}

/// dx = γ·invstd/M · (M·dy - Σdy - x̂·Σ(dy·x̂)) from the sums of [`backward_sums`] over a batch
/// of `count` values per channel (x's planes may be a part of that batch).
#[allow(clippy::too_many_arguments)]
pub fn backward_dx<T: Float>(
    x: &[T],
    dy: &[T],
    relu_beta: Option<&[T]>,
    gamma: &[T],
    mean: &[T],
    var: &[T],
    sums: &[(f64, f64)],
    count: usize,
    dx: &mut [T],
    eps: f64,
    g: &ChannelGeom,
) {
    let span = |p: usize| p * g.hw..(p + 1) * g.hw;
    let masks = relu_beta.map(|beta| coefficients(gamma, beta, mean, var, eps));
    dx.par_chunks_mut(g.hw).enumerate().for_each(|(p, dxp)| {
        let c = p % g.c;
        let k = DxCoefficients::new(gamma[c], mean[c], invstd(var, c, eps), sums[c], count);
        let mask = masks.as_ref().map(|k| k[c]);
        dx_plane(dxp, &dy[span(p)], &x[span(p)], k, mask);
    });
}

/// What dx of one channel needs besides dy and x.
#[derive(Clone, Copy)]
struct DxCoefficients<T> {
    /// γ·invstd/M.
    k: T,
    mean: T,
    invstd: T,
    /// M, Σdy, Σ(dy·x̂).
    m: T,
    sdy: T,
    sdyx: T,
}

impl<T: Float> DxCoefficients<T> {
    fn new(gamma: T, mean: T, invstd: T, (sdy, sdyx): (f64, f64), count: usize) -> Self {
        let m = T::of(count as f64);
        DxCoefficients {
            k: gamma * invstd / m,
            mean,
            invstd,
            m,
            sdy: T::of(sdy),
            sdyx: T::of(sdyx),
        }
    }
}

fn dx_plane<T: Float>(
    dxp: &mut [T],
    dy: &[T],
    x: &[T],
    k: DxCoefficients<T>,
    mask: Option<(T, T)>,
) {
    // Copies in `move` closures: through references LLVM reloads them every element.
    let dx = move |d: T, x: T| {
        let xhat = (x - k.mean) * k.invstd;
        k.k * (k.m * d - k.sdy - xhat * k.sdyx)
    };
    let out = dxp.iter_mut().zip(dy.iter().zip(x));
    simd!(move || match mask {
        Some(a) => out.for_each(move |(o, (&d, &x))| *o = dx(relu_pass(d, x, a), x)),
        None => out.for_each(move |(o, (&d, &x))| *o = dx(d, x)),
    })
}

/// dx = γ·invstd/M · (M·dy - Σdy - x̂·Σ(dy·x̂)); dγ += Σ(dy·x̂); dβ += Σdy, over x's batch.
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
    // By channel: its sums, then its dx while its planes of x and dy are still in cache (each
    // read once from memory, not twice; the results are backward_sums' and backward_dx's).
    let masks = relu_beta.map(|beta| coefficients(gamma, beta, mean, var, eps));
    let sums: Vec<(f64, f64)> = planes_by_channel(dx, g)
        .into_par_iter()
        .enumerate()
        .map(|(c, dxs)| {
            let (mask, invstd) = (masks.as_ref().map(|k| k[c]), invstd(var, c, eps));
            let s = channel_backward_sums(c, g, x, dy, mask, mean[c], invstd);
            let k = DxCoefficients::new(gamma[c], mean[c], invstd, s, g.n * g.hw);
            for (n, dxp) in dxs.into_iter().enumerate() {
                let p = plane(g, n, c);
                dx_plane(dxp, &dy[p.clone()], &x[p], k, mask);
            }
            s
        })
        .collect();
    for (c, &(sdy, sdyx)) in sums.iter().enumerate() {
        dbeta[c] += T::of(sdy);
        dgamma[c] += T::of(sdyx);
    }
}

/// The gradient `d` through a fused ReLU whose input x had the affine map (scale, shift):
/// passing where the output x·scale + shift was positive (not NaN), as ReLU's backward does.
#[inline(always)]
fn relu_pass<T: Float>(d: T, x: T, (scale, shift): (T, T)) -> T {
    if x * scale + shift > T::zero() {
        d
    } else {
        T::zero()
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
    use crate::backend::{Backend, ChannelGeom, Storage};
    use crate::core::DType;

    fn values(n: usize, seed: u64, offset: f64) -> Storage {
        let v: Vec<f64> = (0..n as u64).map(|i| uniform(seed, i) - offset).collect();
        Cpu.upload(&v, DType::F64).unwrap()
    }

    fn f64s(s: &Storage) -> Vec<f64> {
        s.to_f64_vec().unwrap()
    }

    /// f32 BN+ReLU, forward and backward, against the definition computed in f64: planes of
    /// whole blocks of partial sums and a remainder, values far from zero mean.
    #[test]
    fn f32_batchnorm_relu_matches_the_definition_in_f64() {
        let g = ChannelGeom {
            n: 2,
            c: 3,
            hw: 600,
        };
        let (n, eps) = (g.n * g.c * g.hw, 1e-5);
        let x: Vec<f64> = (0..n as u64).map(|i| 3.0 + uniform(1, i)).collect();
        let dy: Vec<f64> = (0..n as u64).map(|i| uniform(2, i) - 0.5).collect();
        let (gamma, beta) = (vec![0.5, 1.0, 2.0], vec![0.1, -0.2, 0.0]);
        let f32s = |v: &[f64]| Cpu.upload(v, DType::F32).unwrap();
        let zeros = |n| Cpu.zeros(n, DType::F32).unwrap();
        let (mut y, mut mean, mut var) = (zeros(n), zeros(g.c), zeros(g.c));
        let (xs, gs, bs) = (f32s(&x), f32s(&gamma), f32s(&beta));
        Cpu.batchnorm_relu_forward_train(&xs, &gs, &bs, &mut y, &mut mean, &mut var, eps, &g)
            .unwrap();
        let (mut dx, mut dg, mut db) = (zeros(n), zeros(g.c), zeros(g.c));
        Cpu.batchnorm_relu_backward(
            &xs,
            &f32s(&dy),
            &gs,
            &bs,
            &mean,
            &var,
            &mut dx,
            &mut dg,
            &mut db,
            eps,
            &g,
        )
        .unwrap();

        let close = |got: &Storage, want: &[f64], what: &str| {
            let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in f64s(got).iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-5 * scale,
                    "{what}[{i}]: {a} against {b}"
                );
            }
        };
        let m = (g.n * g.hw) as f64;
        let at =
            |c: usize| (0..g.n).flat_map(move |s| (s * g.c + c) * g.hw..(s * g.c + c + 1) * g.hw);
        let (mut want_y, mut want_dx) = (vec![0.0; n], vec![0.0; n]);
        let (mut want_mean, mut want_var, mut want_dg, mut want_db) =
            (vec![], vec![], vec![], vec![]);
        for c in 0..g.c {
            let mu = at(c).map(|i| x[i]).sum::<f64>() / m;
            let v = at(c).map(|i| (x[i] - mu).powi(2)).sum::<f64>() / m;
            let invstd = 1.0 / (v + eps).sqrt();
            let xhat = |i: usize| (x[i] - mu) * invstd;
            let pass = |i: usize| {
                if gamma[c] * xhat(i) + beta[c] > 0.0 {
                    dy[i]
                } else {
                    0.0
                }
            };
            let (sdy, sdyx) = (
                at(c).map(pass).sum::<f64>(),
                at(c).map(|i| pass(i) * xhat(i)).sum::<f64>(),
            );
            for i in at(c) {
                want_y[i] = (gamma[c] * xhat(i) + beta[c]).max(0.0);
                want_dx[i] = gamma[c] * invstd / m * (m * pass(i) - sdy - xhat(i) * sdyx);
            }
            want_mean.push(mu);
            want_var.push(v);
            want_dg.push(sdyx);
            want_db.push(sdy);
        }
        close(&y, &want_y, "y");
        close(&mean, &want_mean, "mean");
        close(&var, &want_var, "var");
        close(&dx, &want_dx, "dx");
        close(&dg, &want_dg, "dgamma");
        close(&db, &want_db, "dbeta");
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
