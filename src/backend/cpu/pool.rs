//! Max, average and adaptive-average pooling, one (n, c) plane per parallel task.

use rayon::prelude::*;

use super::Float;
use crate::backend::PoolGeom;

/// The input rows and columns window (oh, ow) covers, clipped to the image.
fn window(g: &PoolGeom, oh: usize, ow: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let h0 = (oh * g.stride.0) as isize - g.pad.0 as isize;
    let w0 = (ow * g.stride.1) as isize - g.pad.1 as isize;
    let clip = |a: isize, k: usize, n: usize| {
        (a.max(0) as usize)..((a + k as isize).min(n as isize).max(0) as usize)
    };
    (clip(h0, g.kh, g.h), clip(w0, g.kw, g.w))
}

/// The flat index of the first maximum of window (oh, ow) in plane `x`.
fn argmax<T: Float>(x: &[T], g: &PoolGeom, oh: usize, ow: usize) -> usize {
    let (rows, cols) = window(g, oh, ow);
    let mut best = (T::neg_infinity(), usize::MAX);
    for ih in rows {
        for iw in cols.clone() {
            let v = x[ih * g.w + iw];
            if v > best.0 || best.1 == usize::MAX {
                best = (v, ih * g.w + iw);
            }
        }
    }
    best.1
}

pub fn max_forward<T: Float>(x: &[T], y: &mut [T], g: &PoolGeom) {
    y.par_chunks_mut(g.h_out * g.w_out)
        .zip(x.par_chunks(g.h * g.w))
        .for_each(|(yp, xp)| {
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    yp[oh * g.w_out + ow] = xp[argmax(xp, g, oh, ow)];
                }
            }
        });
}

pub fn max_backward<T: Float>(x: &[T], dy: &[T], dx: &mut [T], g: &PoolGeom) {
    dx.par_chunks_mut(g.h * g.w)
        .zip(
            x.par_chunks(g.h * g.w)
                .zip(dy.par_chunks(g.h_out * g.w_out)),
        )
        .for_each(|(dxp, (xp, dyp))| {
            dxp.fill(T::zero());
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    dxp[argmax(xp, g, oh, ow)] += dyp[oh * g.w_out + ow];
                }
            }
        });
}

/// The divisor of window (oh, ow): its size clipped to the padded input, padding counted.
/// That is kh·kw except for a ceil-mode last window that runs past the padded input.
fn area(g: &PoolGeom, oh: usize, ow: usize) -> f64 {
    let span = |o: usize, s: usize, k: usize, p: usize, n: usize| {
        let start = o * s; // in padded coordinates
        (start + k).min(n + 2 * p) - start
    };
    (span(oh, g.stride.0, g.kh, g.pad.0, g.h) * span(ow, g.stride.1, g.kw, g.pad.1, g.w)) as f64
}

pub fn avg_forward<T: Float>(x: &[T], y: &mut [T], g: &PoolGeom) {
    y.par_chunks_mut(g.h_out * g.w_out)
        .zip(x.par_chunks(g.h * g.w))
        .for_each(|(yp, xp)| {
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let (rows, cols) = window(g, oh, ow);
                    let mut s = T::zero();
                    for ih in rows {
                        s += xp[ih * g.w + cols.start..ih * g.w + cols.end]
                            .iter()
                            .copied()
                            .sum::<T>();
                    }
                    yp[oh * g.w_out + ow] = s / T::of(area(g, oh, ow));
                }
            }
        });
}

pub fn avg_backward<T: Float>(dy: &[T], dx: &mut [T], g: &PoolGeom) {
    dx.par_chunks_mut(g.h * g.w)
        .zip(dy.par_chunks(g.h_out * g.w_out))
        .for_each(|(dxp, dyp)| {
            dxp.fill(T::zero());
            for oh in 0..g.h_out {
                for ow in 0..g.w_out {
                    let (rows, cols) = window(g, oh, ow);
                    let d = dyp[oh * g.w_out + ow] / T::of(area(g, oh, ow));
                    for ih in rows {
                        dxp[ih * g.w + cols.start..ih * g.w + cols.end]
                            .iter_mut()
                            .for_each(|v| *v += d);
                    }
                }
            }
        });
}

pub fn adaptive_avg_forward<T: Float>(x: &[T], y: &mut [T], g: &PoolGeom) {
    y.par_chunks_mut(g.h_out * g.w_out)
        .zip(x.par_chunks(g.h * g.w))
        .for_each(|(yp, xp)| {
            for oh in 0..g.h_out {
                let rows = PoolGeom::adaptive_window(oh, g.h, g.h_out);
                for ow in 0..g.w_out {
                    let cols = PoolGeom::adaptive_window(ow, g.w, g.w_out);
                    let area = T::of((rows.len() * cols.len()) as f64);
                    let mut s = T::zero();
                    for ih in rows.clone() {
                        s += xp[ih * g.w + cols.start..ih * g.w + cols.end]
                            .iter()
                            .copied()
                            .sum::<T>();
                    }
                    yp[oh * g.w_out + ow] = s / area;
                }
            }
        });
}

pub fn adaptive_avg_backward<T: Float>(dy: &[T], dx: &mut [T], g: &PoolGeom) {
    dx.par_chunks_mut(g.h * g.w)
        .zip(dy.par_chunks(g.h_out * g.w_out))
        .for_each(|(dxp, dyp)| {
            dxp.fill(T::zero());
            for oh in 0..g.h_out {
                let rows = PoolGeom::adaptive_window(oh, g.h, g.h_out);
                for ow in 0..g.w_out {
                    let cols = PoolGeom::adaptive_window(ow, g.w, g.w_out);
                    let d = dyp[oh * g.w_out + ow] / T::of((rows.len() * cols.len()) as f64);
                    for ih in rows.clone() {
                        dxp[ih * g.w + cols.start..ih * g.w + cols.end]
                            .iter_mut()
                            .for_each(|v| *v += d);
                    }
                }
            }
        });
}
