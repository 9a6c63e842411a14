//! Max, average and adaptive-average pooling, one (n, c) plane per parallel task.

use std::hint::select_unpredictable;

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

/// Outputs whose windows lie wholly inside the image along one axis: o·s ≥ p and
/// o·s - p + k ≤ n.
fn inside(o_len: usize, n: usize, k: usize, s: usize, p: usize) -> std::ops::Range<usize> {
    let lo = p.div_ceil(s).min(o_len);
    let hi = if n + p >= k {
        ((n + p - k) / s + 1).min(o_len)
    } else {
        0
    };
    lo..hi.max(lo)
}

/// Outputs a block of the row-wise fold holds (on the stack).
const BLOCK: usize = 64;

/// best[q] (and at[q], where given): the first maximum, and its flat index, of the windows
/// (oh, ow0 + q), which lie inside the image, visited as [`argmax`] visits them (rows, then
/// columns, a later value kept only if greater), for a block of outputs at once.
#[inline(always)]
fn fold_max<T: Float>(
    x: &[T],
    g: &PoolGeom,
    oh: usize,
    ow0: usize,
    best: &mut [T],
    at: Option<&mut [usize]>,
) {
    // A stride known at compile time lets the loads vectorize (stride 2 as pairs).
    match g.stride.1 {
        1 => fold_max_by::<T, 1>(x, g, oh, ow0, best, at),
        2 => fold_max_by::<T, 2>(x, g, oh, ow0, best, at),
        _ => fold_max_by::<T, 0>(x, g, oh, ow0, best, at),
    }
}

/// [`fold_max`] for column stride `S`, or the geometry's where `S` is 0.
#[inline(always)]
fn fold_max_by<T: Float, const S: usize>(
    x: &[T],
    g: &PoolGeom,
    oh: usize,
    ow0: usize,
    best: &mut [T],
    mut at: Option<&mut [usize]>,
) {
    let (n, s) = (best.len(), if S == 0 { g.stride.1 } else { S });
    let (ih0, iw0) = (oh * g.stride.0 - g.pad.0, ow0 * s - g.pad.1);
    for i in 0..g.kh {
        for j in 0..g.kw {
            let base = (ih0 + i) * g.w + iw0 + j;
            let src = &x[base..base + (n - 1) * s + 1];
            let first = i == 0 && j == 0;
            for (q, b) in best.iter_mut().enumerate() {
                let v = src[q * s];
                // Without branches: where the maximum lies is as unpredictable as the data.
                let take = first || v > *b;
                *b = select_unpredictable(take, v, *b);
                if let Some(at) = at.as_deref_mut() {
                    at[q] = select_unpredictable(take, base + q * s, at[q]);
                }
            }
        }
    }
}

pub fn max_forward<T: Float>(x: &[T], y: &mut [T], g: &PoolGeom) {
    let (rows, cols) = (
        inside(g.h_out, g.h, g.kh, g.stride.0, g.pad.0),
        inside(g.w_out, g.w, g.kw, g.stride.1, g.pad.1),
    );
    y.par_chunks_mut(g.h_out * g.w_out)
        .zip(x.par_chunks(g.h * g.w))
        .for_each(|(yp, xp)| {
            simd!(|| {
                for (oh, yr) in yp.chunks_mut(g.w_out).enumerate() {
                    let inner = if rows.contains(&oh) {
                        cols.clone()
                    } else {
                        0..0
                    };
                    for ow in (0..inner.start).chain(inner.end..g.w_out) {
                        yr[ow] = xp[argmax(xp, g, oh, ow)];
                    }
                    for (b, best) in yr[inner.clone()].chunks_mut(BLOCK).enumerate() {
                        fold_max(xp, g, oh, inner.start + b * BLOCK, best, None);
                    }
                }
            })
        });
}

pub fn max_backward<T: Float>(x: &[T], dy: &[T], dx: &mut [T], g: &PoolGeom) {
    let (rows, cols) = (
        inside(g.h_out, g.h, g.kh, g.stride.0, g.pad.0),
        inside(g.w_out, g.w, g.kw, g.stride.1, g.pad.1),
    );
    dx.par_chunks_mut(g.h * g.w)
        .zip(
            x.par_chunks(g.h * g.w)
                .zip(dy.par_chunks(g.h_out * g.w_out)),
        )
        .for_each(|(dxp, (xp, dyp))| {
            dxp.fill(T::zero());
            let (mut best, mut at) = ([T::zero(); BLOCK], [0; BLOCK]);
            for (oh, dyr) in dyp.chunks(g.w_out).enumerate() {
                let inner = if rows.contains(&oh) {
                    cols.clone()
                } else {
                    0..0
                };
                // Outputs in order, so gradients meeting in one input add in the same order.
                for ow in 0..inner.start {
                    dxp[argmax(xp, g, oh, ow)] += dyr[ow];
                }
                for (b, d) in dyr[inner.clone()].chunks(BLOCK).enumerate() {
                    let len = d.len();
                    simd!(|| {
                        fold_max(
                            xp,
                            g,
                            oh,
                            inner.start + b * BLOCK,
                            &mut best[..len],
                            Some(&mut at[..len]),
                        )
                    });
                    for (&i, &d) in at[..len].iter().zip(d) {
                        dxp[i] += d;
                    }
                }
                for ow in inner.end..g.w_out {
                    dxp[argmax(xp, g, oh, ow)] += dyr[ow];
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The block fold against the window-by-window argmax, bit for bit, on values with many
    /// ties and NaNs, for windows with and without padding, strides 1–3 and narrow images.
    #[test]
    fn max_pool_matches_window_by_window() {
        for (h, w, k, s, p) in [
            (9, 150, 3, 2, 1),
            (7, 8, 3, 1, 1),
            (12, 70, 2, 2, 0),
            (5, 4, 3, 3, 2),
            (6, 2, 3, 1, 0),
        ] {
            let out = |n: usize| (n + 2 * p).saturating_sub(k) / s + 1;
            let g = PoolGeom {
                n: 2,
                c: 3,
                h,
                w,
                kh: k,
                kw: k,
                stride: (s, s),
                pad: (p, p),
                h_out: out(h),
                w_out: out(w),
            };
            let plane = h * w;
            let x: Vec<f32> = (0..2 * 3 * plane)
                .map(|i| match (i * 7919) % 23 {
                    0 => f32::NAN,
                    1 => -0.0,
                    v => (v % 5) as f32 - 2.0,
                })
                .collect();
            let dy: Vec<f32> = (0..2 * 3 * g.h_out * g.w_out)
                .map(|i| (i % 13) as f32 * 0.25)
                .collect();
            let (mut y, mut dx) = (vec![0.0; dy.len()], vec![0.0; x.len()]);
            max_forward(&x, &mut y, &g);
            max_backward(&x, &dy, &mut dx, &g);
            let (mut y_ref, mut dx_ref) = (vec![0.0f32; dy.len()], vec![0.0f32; x.len()]);
            let o = g.h_out * g.w_out;
            for (c, (xp, dxp)) in x.chunks(plane).zip(dx_ref.chunks_mut(plane)).enumerate() {
                for oh in 0..g.h_out {
                    for ow in 0..g.w_out {
                        let i = argmax(xp, &g, oh, ow);
                        y_ref[c * o + oh * g.w_out + ow] = xp[i];
                        dxp[i] += dy[c * o + oh * g.w_out + ow];
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(&y_ref), "forward {g:?}");
            assert_eq!(bits(&dx), bits(&dx_ref), "backward {g:?}");
        }
    }
}
