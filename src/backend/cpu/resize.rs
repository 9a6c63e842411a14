//! Bilinear resizing, PyTorch's `upsample_bilinear2d`: per plane, in parallel over planes.

use rayon::prelude::*;

use super::Float;
use crate::backend::ResizeGeom;

/// Where output index `o` of `out` reads along an axis of `input`: the two source indices and
/// their weights, PyTorch's `area_pixel_compute_source_index` computed in `T` as PyTorch
/// computes it in the op's accumulate type.
pub fn source<T: Float>(o: usize, input: usize, out: usize, align_corners: bool) -> Tap<T> {
    let src = if align_corners {
        let scale = if out > 1 {
            T::of((input - 1) as f64) / T::of((out - 1) as f64)
        } else {
            T::zero()
        };
        scale * T::of(o as f64)
    } else {
        let scale = T::of(input as f64) / T::of(out as f64);
        let src = scale * (T::of(o as f64) + T::of(0.5)) - T::of(0.5);
        src.max(T::zero())
    };
    let i0 = (src.to_usize().unwrap_or(0)).min(input - 1);
    let i1 = if i0 + 1 < input { i0 + 1 } else { i0 };
    let l1 = src - T::of(i0 as f64);
    Tap {
        i0,
        i1,
        l0: T::one() - l1,
        l1,
    }
}

/// Two source indices and their weights.
#[derive(Clone, Copy)]
pub struct Tap<T> {
    pub i0: usize,
    pub i1: usize,
    pub l0: T,
    pub l1: T,
}

fn taps<T: Float>(input: usize, out: usize, align_corners: bool) -> Vec<Tap<T>> {
    (0..out)
        .map(|o| source(o, input, out, align_corners))
        .collect()
}

pub fn forward<T: Float>(x: &[T], y: &mut [T], g: &ResizeGeom) {
    let (rows, cols) = (
        taps::<T>(g.h, g.h_out, g.align_corners),
        taps::<T>(g.w, g.w_out, g.align_corners),
    );
    y.par_chunks_mut(g.h_out * g.w_out)
        .zip(x.par_chunks(g.h * g.w))
        .for_each(|(y, x)| {
            for (r, yrow) in rows.iter().zip(y.chunks_mut(g.w_out)) {
                let (x0, x1) = (&x[r.i0 * g.w..], &x[r.i1 * g.w..]);
                for (c, y) in cols.iter().zip(yrow) {
                    *y = r.l0 * (c.l0 * x0[c.i0] + c.l1 * x0[c.i1])
                        + r.l1 * (c.l0 * x1[c.i0] + c.l1 * x1[c.i1]);
                }
            }
        });
}

/// The adjoint: each output gradient added to its four sources, plane by plane in output
/// order (deterministic).
pub fn backward<T: Float>(dy: &[T], dx: &mut [T], g: &ResizeGeom) {
    let (rows, cols) = (
        taps::<T>(g.h, g.h_out, g.align_corners),
        taps::<T>(g.w, g.w_out, g.align_corners),
    );
    dx.par_chunks_mut(g.h * g.w)
        .zip(dy.par_chunks(g.h_out * g.w_out))
        .for_each(|(dx, dy)| {
            dx.fill(T::zero());
            for (r, dyrow) in rows.iter().zip(dy.chunks(g.w_out)) {
                for (c, &d) in cols.iter().zip(dyrow) {
                    dx[r.i0 * g.w + c.i0] += r.l0 * c.l0 * d;
                    dx[r.i0 * g.w + c.i1] += r.l0 * c.l1 * d;
                    dx[r.i1 * g.w + c.i0] += r.l1 * c.l0 * d;
                    dx[r.i1 * g.w + c.i1] += r.l1 * c.l1 * d;
                }
            }
        });
}
