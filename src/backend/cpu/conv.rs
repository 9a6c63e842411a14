//! Convolution as im2col + gemm. Samples are split into contiguous runs, one per lane
//! (a lane is one rayon task with its own slice of the workspace); with a single sample the
//! gemm itself runs in parallel instead. Filter gradients are summed per lane, then over lanes
//! in lane order, so results do not depend on thread timing.

use rayon::prelude::*;

use super::{matmul, Float};
use crate::backend::ConvGeom;

/// Parallel lanes for a batch of `n` samples.
fn lanes(n: usize) -> usize {
    n.clamp(1, rayon::current_num_threads())
}

fn col_len(g: &ConvGeom) -> usize {
    if g.is_pointwise() {
        0
    } else {
        g.c_in * g.kh * g.kw * g.h_out * g.w_out
    }
}

fn filter_len(g: &ConvGeom) -> usize {
    g.c_out * g.col_rows()
}

fn lane_len(g: &ConvGeom) -> usize {
    col_len(g) + filter_len(g)
}

/// Workspace elements: per lane, an im2col matrix and a filter-gradient partial sum.
pub fn workspace(g: &ConvGeom) -> usize {
    lanes(g.n) * lane_len(g)
}

/// Samples per lane (the last lane may get fewer).
fn run_len(g: &ConvGeom) -> usize {
    g.n.div_ceil(lanes(g.n))
}

/// col[(c·kh + i)·kw + j][oh·w_out + ow] = x[c][oh·sh - ph + i·dh][ow·sw - pw + j·dw], or 0 outside.
fn im2col<T: Float>(x: &[T], col: &mut [T], g: &ConvGeom) {
    let hw_out = g.h_out * g.w_out;
    for c in 0..g.c_in {
        let plane = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = ((c * g.kh + i) * g.kw + j) * hw_out;
                let out = &mut col[row..row + hw_out];
                for oh in 0..g.h_out {
                    let ih = (oh * g.stride.0 + i * g.dilation.0) as isize - g.pad.0 as isize;
                    let dst = &mut out[oh * g.w_out..(oh + 1) * g.w_out];
                    if ih < 0 || ih >= g.h as isize {
                        dst.fill(T::zero());
                        continue;
                    }
                    let src = &plane[ih as usize * g.w..(ih as usize + 1) * g.w];
                    for (ow, d) in dst.iter_mut().enumerate() {
                        let iw = (ow * g.stride.1 + j * g.dilation.1) as isize - g.pad.1 as isize;
                        *d = if iw < 0 || iw >= g.w as isize {
                            T::zero()
                        } else {
                            src[iw as usize]
                        };
                    }
                }
            }
        }
    }
}

/// The adjoint of im2col: x[c][ih][iw] += col[...] for every position that read it.
fn col2im<T: Float>(col: &[T], x: &mut [T], g: &ConvGeom) {
    let hw_out = g.h_out * g.w_out;
    x.fill(T::zero());
    for c in 0..g.c_in {
        let plane = &mut x[c * g.h * g.w..(c + 1) * g.h * g.w];
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = ((c * g.kh + i) * g.kw + j) * hw_out;
                let src_rows = &col[row..row + hw_out];
                for oh in 0..g.h_out {
                    let ih = (oh * g.stride.0 + i * g.dilation.0) as isize - g.pad.0 as isize;
                    if ih < 0 || ih >= g.h as isize {
                        continue;
                    }
                    let dst = &mut plane[ih as usize * g.w..(ih as usize + 1) * g.w];
                    for (ow, &v) in src_rows[oh * g.w_out..(oh + 1) * g.w_out]
                        .iter()
                        .enumerate()
                    {
                        let iw = (ow * g.stride.1 + j * g.dilation.1) as isize - g.pad.1 as isize;
                        if iw >= 0 && iw < g.w as isize {
                            dst[iw as usize] += v;
                        }
                    }
                }
            }
        }
    }
}

/// y[n] = W · im2col(x[n]) per group.
pub fn forward<T: Float>(x: &[T], w: &[T], y: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (x_len, y_len) = (g.c_in * g.h * g.w, g.c_out * g.h_out * g.w_out);
    let (rows, hw_out) = (g.col_rows(), g.h_out * g.w_out);
    let co_g = g.c_out / g.groups;
    let run = run_len(g);
    let par_gemm = lanes(g.n) == 1;
    y.par_chunks_mut(run * y_len)
        .zip(x.par_chunks(run * x_len))
        .zip(ws.par_chunks_mut(lane_len(g)))
        .for_each(|((ys, xs), lane)| {
            for (yn, xn) in ys.chunks_mut(y_len).zip(xs.chunks(x_len)) {
                let col: &[T] = if g.is_pointwise() {
                    xn
                } else {
                    im2col(xn, &mut lane[..col_len(g)], g);
                    &lane[..col_len(g)]
                };
                for gi in 0..g.groups {
                    matmul(
                        co_g,
                        hw_out,
                        rows,
                        &mut yn[gi * co_g * hw_out..],
                        &w[gi * co_g * rows..],
                        false,
                        &col[gi * rows * hw_out..],
                        false,
                        false,
                        par_gemm,
                    );
                }
            }
        });
}

/// dx[n] = col2im(Wᵀ · dy[n]) per group.
pub fn backward_data<T: Float>(dy: &[T], w: &[T], dx: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (x_len, y_len) = (g.c_in * g.h * g.w, g.c_out * g.h_out * g.w_out);
    let (rows, hw_out) = (g.col_rows(), g.h_out * g.w_out);
    let co_g = g.c_out / g.groups;
    let run = run_len(g);
    let par_gemm = lanes(g.n) == 1;
    dx.par_chunks_mut(run * x_len)
        .zip(dy.par_chunks(run * y_len))
        .zip(ws.par_chunks_mut(lane_len(g)))
        .for_each(|((dxs, dys), lane)| {
            for (dxn, dyn_) in dxs.chunks_mut(x_len).zip(dys.chunks(y_len)) {
                let dcol: &mut [T] = if g.is_pointwise() {
                    dxn
                } else {
                    &mut lane[..col_len(g)]
                };
                for gi in 0..g.groups {
                    matmul(
                        rows,
                        hw_out,
                        co_g,
                        &mut dcol[gi * rows * hw_out..],
                        &w[gi * co_g * rows..],
                        true,
                        &dyn_[gi * co_g * hw_out..],
                        false,
                        false,
                        par_gemm,
                    );
                }
                if !g.is_pointwise() {
                    col2im(&lane[..col_len(g)], dxn, g);
                }
            }
        });
}

/// dW += Σₙ dy[n] · im2col(x[n])ᵀ per group.
pub fn backward_filter<T: Float>(x: &[T], dy: &[T], dw: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (x_len, y_len) = (g.c_in * g.h * g.w, g.c_out * g.h_out * g.w_out);
    let (rows, hw_out) = (g.col_rows(), g.h_out * g.w_out);
    let co_g = g.c_out / g.groups;
    let run = run_len(g);
    let par_gemm = lanes(g.n) == 1;
    let (cl, fl) = (col_len(g), filter_len(g));
    ws.par_chunks_mut(lane_len(g))
        .zip(x.par_chunks(run * x_len))
        .zip(dy.par_chunks(run * y_len))
        .for_each(|((lane, xs), dys)| {
            let (col_buf, part) = lane.split_at_mut(cl);
            part.fill(T::zero());
            for (xn, dyn_) in xs.chunks(x_len).zip(dys.chunks(y_len)) {
                let col: &[T] = if g.is_pointwise() {
                    xn
                } else {
                    im2col(xn, col_buf, g);
                    col_buf
                };
                for gi in 0..g.groups {
                    matmul(
                        co_g,
                        rows,
                        hw_out,
                        &mut part[gi * co_g * rows..],
                        &dyn_[gi * co_g * hw_out..],
                        false,
                        &col[gi * rows * hw_out..],
                        true,
                        true,
                        par_gemm,
                    );
                }
            }
        });
    for lane in ws.chunks(lane_len(g)).take(g.n.div_ceil(run)) {
        for (d, p) in dw.iter_mut().zip(&lane[cl..cl + fl]) {
            *d += *p;
        }
    }
}
