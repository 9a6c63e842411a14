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

/// The taps of the outputs `at..at + len` of an axis of `out`, from an `input` axis whose
/// window starts at `from`: source indices relative to the window (which holds them all,
/// [`ResizeGeom::check`]).
fn taps<T: Float>(
    (at, len): (usize, usize),
    from: usize,
    input: usize,
    out: usize,
    align_corners: bool,
) -> Vec<Tap<T>> {
    (at..at + len)
        .map(|o| {
            let t = source::<T>(o, input, out, align_corners);
            Tap {
                i0: t.i0 - from,
                i1: t.i1 - from,
                ..t
            }
        })
        .collect()
}

/// The row and column taps of the output window.
fn window_taps<T: Float>(g: &ResizeGeom) -> (Vec<Tap<T>>, Vec<Tap<T>>) {
    let (i, o) = (&g.input, &g.output);
    (
        taps((o.row, o.h), i.row, g.h, g.h_out, g.align_corners),
        taps((o.col, o.w), i.col, g.w, g.w_out, g.align_corners),
    )
}

pub fn forward<T: Float>(x: &[T], y: &mut [T], g: &ResizeGeom) {
    let (rows, cols) = window_taps::<T>(g);
    let w = g.input.w;
    y.par_chunks_mut(g.output.h * g.output.w)
        .zip(x.par_chunks(g.input.h * w))
        .for_each(|(y, x)| {
            for (r, yrow) in rows.iter().zip(y.chunks_mut(g.output.w)) {
                let (x0, x1) = (&x[r.i0 * w..], &x[r.i1 * w..]);
                for (c, y) in cols.iter().zip(yrow) {
                    *y = r.l0 * (c.l0 * x0[c.i0] + c.l1 * x0[c.i1])
                        + r.l1 * (c.l0 * x1[c.i0] + c.l1 * x1[c.i1]);
                }
            }
        });
}

/// The adjoint: each output gradient of the window added to its four sources, plane by plane
/// in output order (deterministic).
pub fn backward<T: Float>(dy: &[T], dx: &mut [T], g: &ResizeGeom) {
    let (rows, cols) = window_taps::<T>(g);
    let w = g.input.w;
    dx.par_chunks_mut(g.input.h * w)
        .zip(dy.par_chunks(g.output.h * g.output.w))
        .for_each(|(dx, dy)| {
            dx.fill(T::zero());
            for (r, dyrow) in rows.iter().zip(dy.chunks(g.output.w)) {
                for (c, &d) in cols.iter().zip(dyrow) {
                    dx[r.i0 * w + c.i0] += r.l0 * c.l0 * d;
                    dx[r.i0 * w + c.i1] += r.l0 * c.l1 * d;
                    dx[r.i1 * w + c.i0] += r.l1 * c.l0 * d;
                    dx[r.i1 * w + c.i1] += r.l1 * c.l1 * d;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows a window of outputs reads ([`ResizeGeom::reads`]) hold the taps of each of its
    /// outputs, as f64 and as f32 compute them, on odd and even sides, enlarging and
    /// shrinking: a tile's halo is never a row short.
    #[test]
    fn reads_hold_every_tap_of_the_window() {
        for align_corners in [false, true] {
            for len in 1..14 {
                for out_len in 1..30 {
                    for o0 in 0..out_len {
                        for o1 in o0 + 1..=out_len {
                            let r = ResizeGeom::reads(o0..o1, len, out_len, align_corners);
                            assert!(r.start < r.end && r.end <= len);
                            for o in o0..o1 {
                                let a = source::<f64>(o, len, out_len, align_corners);
                                let b = source::<f32>(o, len, out_len, align_corners);
                                for i in [a.i0, a.i1, b.i0, b.i1] {
                                    assert!(
                                        r.contains(&i),
                                        "{len} -> {out_len} ac={align_corners}: outputs \
                                         {o0}..{o1} read {r:?}, output {o} row {i}"
                                    );
                                }
                            }
                            // No more than the margin: a row before and two after
                            // the exact taps, which f64 may place a row off.
                            let first = source::<f64>(o0, len, out_len, align_corners).i0;
                            let last = source::<f64>(o1 - 1, len, out_len, align_corners).i0;
                            assert!(first <= r.start + 2 && r.end <= last + 4);
                        }
                    }
                }
            }
        }
    }
}
