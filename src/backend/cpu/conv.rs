//! Convolution as tiled im2col + gemm. The output of each sample is cut into tiles of whole
//! output rows whose im2col matrix stays cache-resident (~TILE_ELEMS elements), so the
//! unfolded input never makes a round trip through memory and its workspace stays small even
//! for 1024² images. A pointwise (1×1, stride 1, unpadded) convolution multiplies the input
//! directly.
//!
//! Work is split into contiguous runs of (sample, tile) items, one run per lane (a rayon task
//! with its own slice of the workspace). Filter gradients are summed per lane, then over lanes
//! in lane order; their lanes are a fixed number ([`REDUCTION_LANES`]), not one per thread,
//! so a gradient's rounding depends neither on thread timing nor on the thread count. Data
//! gradients overlap between tiles (col2im adds into shared rows), so they are split by
//! sample instead.

use std::ops::Range;

use rayon::prelude::*;

use super::{gemm, gemm_raw, Float, View};
use crate::backend::ConvGeom;

/// Elements of one im2col tile: small enough to stay in a core's L2 cache.
const TILE_ELEMS: usize = 1 << 17;

/// Output rows per tile and tiles per sample.
fn tiling(g: &ConvGeom) -> (usize, usize) {
    let k = g.c_in * g.kh * g.kw;
    let rows = (TILE_ELEMS / (k * g.w_out).max(1)).clamp(1, g.h_out.max(1));
    (rows, g.h_out.div_ceil(rows))
}

/// Parallel lanes for `items` work items that sum nothing across items.
fn lanes(items: usize) -> usize {
    items.clamp(1, rayon::current_num_threads())
}

/// Lanes of a reduction over items (the filter gradient): a constant, so the partial sums and
/// hence the result are the same on any number of threads. Threads beyond it run each lane's
/// products in parallel, which splits rows and columns, never the sum.
const REDUCTION_LANES: usize = 4;

fn reduction_lanes(items: usize) -> usize {
    items.clamp(1, REDUCTION_LANES)
}

fn col_tile_len(g: &ConvGeom) -> usize {
    if g.is_pointwise() {
        0
    } else {
        g.c_in * g.kh * g.kw * tiling(g).0 * g.w_out
    }
}

fn lane_len(g: &ConvGeom) -> usize {
    col_tile_len(g) + g.c_out * g.col_rows()
}

/// Workspace elements of forward and backward-filter: per lane, an im2col tile and a
/// filter-gradient partial sum.
fn lanes_len(g: &ConvGeom) -> usize {
    let items = g.n * tiling(g).1;
    lanes(items).max(reduction_lanes(items)) * lane_len(g)
}

/// Workspace elements: what every pass needs (backward-data as a forward convolution: its
/// flipped weights and that convolution's lanes).
pub fn workspace(g: &ConvGeom) -> usize {
    let data = transposed(g).map_or(0, |t| weights_len(g) + lanes_len(&t));
    lanes_len(g).max(data)
}

fn weights_len(g: &ConvGeom) -> usize {
    g.c_out * g.col_rows()
}

/// Backward-data of a stride-1 convolution as the forward convolution of dy with the weights
/// flipped in space and transposed in channels (padding d·(k-1) - p), so it runs like forward:
/// tiles of dx rows on every lane, each a plain product, no col2im adding into shared rows.
fn transposed(g: &ConvGeom) -> Option<ConvGeom> {
    let pad = |k: usize, d: usize, p: usize| (d * (k - 1)).checked_sub(p);
    if g.stride != (1, 1) || g.is_pointwise() {
        return None;
    }
    Some(ConvGeom {
        c_in: g.c_out,
        h: g.h_out,
        w: g.w_out,
        c_out: g.c_in,
        pad: (
            pad(g.kh, g.dilation.0, g.pad.0)?,
            pad(g.kw, g.dilation.1, g.pad.1)?,
        ),
        h_out: g.h,
        w_out: g.w,
        ..*g
    })
}

/// w'[gi·ci_g + a][b][i][j] = w[gi·co_g + b][a][kh-1-i][kw-1-j]: the weights of `transposed`.
fn flip_weights<T: Float>(w: &[T], wt: &mut [T], g: &ConvGeom) {
    let (ci_g, co_g, kk) = (g.c_in / g.groups, g.c_out / g.groups, g.kh * g.kw);
    for gi in 0..g.groups {
        for b in 0..co_g {
            for a in 0..ci_g {
                let src = &w[((gi * co_g + b) * ci_g + a) * kk..][..kk];
                let dst = &mut wt[((gi * ci_g + a) * co_g + b) * kk..][..kk];
                for (d, s) in dst.iter_mut().zip(src.iter().rev()) {
                    *d = *s;
                }
            }
        }
    }
}

/// Output rows of tile `t`.
fn tile_rows(g: &ConvGeom, t: usize) -> Range<usize> {
    let rows = tiling(g).0;
    t * rows..((t + 1) * rows).min(g.h_out)
}

/// The output columns ow whose input column ow·sw + j·dw - pw lies inside the image.
fn valid_cols(g: &ConvGeom, j: usize) -> Range<usize> {
    let (s, off) = (g.stride.1, j * g.dilation.1);
    let lo = g.pad.1.saturating_sub(off).div_ceil(s);
    let hi = if g.w + g.pad.1 <= off {
        0
    } else {
        (g.w - 1 + g.pad.1 - off) / s + 1
    };
    lo.min(g.w_out)..hi.clamp(lo.min(g.w_out), g.w_out)
}

/// The input row read by output row `oh` at kernel row `i`, if inside the image.
fn input_row(g: &ConvGeom, oh: usize, i: usize) -> Option<usize> {
    (oh * g.stride.0 + i * g.dilation.0)
        .checked_sub(g.pad.0)
        .filter(|&r| r < g.h)
}

/// col[(c·kh + i)·kw + j][t·w_out + ow] = x[c][ih][iw] for output rows `oh` (0 outside).
fn im2col<T: Float>(x: &[T], col: &mut [T], g: &ConvGeom, oh: Range<usize>) {
    let cols = oh.len() * g.w_out;
    for (r, row) in col.chunks_mut(cols).take(g.c_in * g.kh * g.kw).enumerate() {
        let (c, i, j) = (r / (g.kh * g.kw), r / g.kw % g.kh, r % g.kw);
        let plane = &x[c * g.h * g.w..(c + 1) * g.h * g.w];
        let valid = valid_cols(g, j);
        for (t, dst) in oh.clone().zip(row.chunks_mut(g.w_out)) {
            let Some(ih) = input_row(g, t, i) else {
                dst.fill(T::zero());
                continue;
            };
            dst[..valid.start].fill(T::zero());
            dst[valid.end..].fill(T::zero());
            // A kernel column that only ever reads padding (a wide kernel on a narrow image).
            if valid.is_empty() {
                continue;
            }
            let src = &plane[ih * g.w..(ih + 1) * g.w];
            let iw0 = valid.start * g.stride.1 + j * g.dilation.1 - g.pad.1;
            if g.stride.1 == 1 {
                dst[valid.clone()].copy_from_slice(&src[iw0..iw0 + valid.len()]);
            } else {
                for (k, d) in dst[valid.clone()].iter_mut().enumerate() {
                    *d = src[iw0 + k * g.stride.1];
                }
            }
        }
    }
}

/// The adjoint of im2col for channel `c`: plane[ih][iw] += col[...] over output rows `oh`.
fn col2im_channel<T: Float>(col: &[T], plane: &mut [T], c: usize, g: &ConvGeom, oh: Range<usize>) {
    let cols = oh.len() * g.w_out;
    for i in 0..g.kh {
        for j in 0..g.kw {
            let r = (c * g.kh + i) * g.kw + j;
            let row = &col[r * cols..(r + 1) * cols];
            let valid = valid_cols(g, j);
            if valid.is_empty() {
                continue;
            }
            for (t, src) in oh.clone().zip(row.chunks(g.w_out)) {
                let Some(ih) = input_row(g, t, i) else {
                    continue;
                };
                let dst = &mut plane[ih * g.w..(ih + 1) * g.w];
                let iw0 = valid.start * g.stride.1 + j * g.dilation.1 - g.pad.1;
                for (k, &v) in src[valid.clone()].iter().enumerate() {
                    dst[iw0 + k * g.stride.1] += v;
                }
            }
        }
    }
}

/// A pointer shared by lanes that write disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut<T>(*mut T);
// SAFETY: lanes write disjoint (sample, tile) regions through it; see `forward`.
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// Through a method, so closures capture the wrapper (which is Sync), not the raw field.
    fn at(&self, offset: usize) -> *mut T {
        self.0.wrapping_add(offset)
    }
}

/// The input of group `gi` for output rows starting at column `off`: (rows of group) × cols.
fn rhs_view<'a, T: Float>(
    g: &ConvGeom,
    x_n: &'a [T],
    col: &'a [T],
    gi: usize,
    off: usize,
    cols: usize,
) -> View<'a, T> {
    let rows_g = g.col_rows();
    if g.is_pointwise() {
        View::rows(&x_n[gi * rows_g * g.h * g.w + off..], g.h * g.w)
    } else {
        View::rows(&col[gi * rows_g * cols..], cols)
    }
}

/// y[n] = W · im2col(x[n]) per group, tile by tile.
pub fn forward<T: Float>(x: &[T], w: &[T], y: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (x_len, hw_out) = (g.c_in * g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let tiles = tiling(g).1;
    let items = g.n * tiles;
    let per = items.div_ceil(lanes(items));
    let par_gemm = items == 1;
    assert!(y.len() >= g.n * y_len && x.len() >= g.n * x_len);
    let out = SharedOut(y.as_mut_ptr());
    ws[..lanes(items) * lane_len(g)]
        .par_chunks_mut(lane_len(g))
        .enumerate()
        .for_each(|(l, lane)| {
            let col = &mut lane[..col_tile_len(g)];
            for item in l * per..((l + 1) * per).min(items) {
                let (n, oh) = (item / tiles, tile_rows(g, item % tiles));
                let (off, cols) = (oh.start * g.w_out, oh.len() * g.w_out);
                let x_n = &x[n * x_len..(n + 1) * x_len];
                if !g.is_pointwise() {
                    im2col(x_n, col, g, oh);
                }
                for gi in 0..g.groups {
                    let lhs = View::rows(&w[gi * co_g * rows_g..], rows_g);
                    let rhs = rhs_view(g, x_n, col, gi, off, cols);
                    let start = n * y_len + gi * co_g * hw_out + off;
                    // SAFETY: item (n, tile) and group gi write rows [gi·co_g, (gi+1)·co_g) of
                    // sample n at columns [off, off + cols): inside y (asserted above) and
                    // disjoint from every other (item, group).
                    unsafe {
                        gemm_raw(
                            co_g,
                            cols,
                            rows_g,
                            out.at(start),
                            hw_out,
                            lhs,
                            rhs,
                            false,
                            par_gemm,
                        )
                    };
                }
            }
        });
}

/// dx = the forward convolution of dy by the flipped weights where the stride is 1 (see
/// [`transposed`]), else dx[n] = col2im(Wᵀ · dy[n]) per group; lanes split samples, tiles
/// run in order.
pub fn backward_data<T: Float>(dy: &[T], w: &[T], dx: &mut [T], ws: &mut [T], g: &ConvGeom) {
    if let Some(t) = transposed(g) {
        let (wt, ws) = ws.split_at_mut(weights_len(g));
        flip_weights(w, wt, g);
        return forward(dy, wt, dx, ws, &t);
    }
    let (x_len, hw, hw_out) = (g.c_in * g.h * g.w, g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let tiles = tiling(g).1;
    let per = g.n.div_ceil(lanes(g.n));
    let par = lanes(g.n) == 1;
    dx.par_chunks_mut(per * x_len)
        .zip(dy.par_chunks(per * y_len))
        .zip(ws.par_chunks_mut(lane_len(g)))
        .for_each(|((dxs, dys), lane)| {
            let dcol = &mut lane[..col_tile_len(g)];
            for (dx_n, dy_n) in dxs.chunks_mut(x_len).zip(dys.chunks(y_len)) {
                // col2im adds into dx; a pointwise convolution's products overwrite all of it.
                if !g.is_pointwise() {
                    dx_n.fill(T::zero());
                }
                for t in 0..tiles {
                    let oh = tile_rows(g, t);
                    let (off, cols) = (oh.start * g.w_out, oh.len() * g.w_out);
                    for gi in 0..g.groups {
                        let lhs = View::rows(&w[gi * co_g * rows_g..], rows_g).t();
                        let rhs = View::rows(&dy_n[gi * co_g * hw_out + off..], hw_out);
                        if g.is_pointwise() {
                            gemm(
                                rows_g,
                                cols,
                                co_g,
                                &mut dx_n[gi * rows_g * hw + off..],
                                hw,
                                lhs,
                                rhs,
                                false,
                                par,
                            );
                        } else {
                            gemm(
                                rows_g,
                                cols,
                                co_g,
                                &mut dcol[gi * rows_g * cols..],
                                cols,
                                lhs,
                                rhs,
                                false,
                                par,
                            );
                        }
                    }
                    if g.is_pointwise() {
                        continue;
                    }
                    let dcol = &*dcol;
                    if par {
                        dx_n.par_chunks_mut(hw)
                            .enumerate()
                            .for_each(|(c, p)| col2im_channel(dcol, p, c, g, oh.clone()));
                    } else {
                        dx_n.chunks_mut(hw)
                            .enumerate()
                            .for_each(|(c, p)| col2im_channel(dcol, p, c, g, oh.clone()));
                    }
                }
            }
        });
}

/// dW += Σ dy[n] · im2col(x[n])ᵀ per group, tile by tile.
pub fn backward_filter<T: Float>(x: &[T], dy: &[T], dw: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (x_len, hw_out) = (g.c_in * g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let tiles = tiling(g).1;
    let items = g.n * tiles;
    let lanes = reduction_lanes(items);
    let per = items.div_ceil(lanes);
    let par_gemm = lanes < rayon::current_num_threads();
    let cl = col_tile_len(g);
    // The gemm crate runs these products (the long dimension inside both operands' rows)
    // about twice as fast with the larger of C_out and C_in·k² as the rows of the result, so
    // the partial sums are dWᵀ += im2col(x) · dyᵀ where C_in·k² is the larger.
    let transposed = rows_g >= co_g;
    if items == 0 {
        return;
    }
    // A lane past the last item (items not a multiple of the lanes) holds no partial sums.
    let busy = |l: usize| l * per < items;
    let ws = &mut ws[..lanes * lane_len(g)];
    ws.par_chunks_mut(lane_len(g))
        .enumerate()
        .filter(|(l, _)| busy(*l))
        .for_each(|(l, lane)| {
            let (col, part) = lane.split_at_mut(cl);
            for (k, item) in (l * per..((l + 1) * per).min(items)).enumerate() {
                let (n, oh) = (item / tiles, tile_rows(g, item % tiles));
                let (off, cols) = (oh.start * g.w_out, oh.len() * g.w_out);
                let x_n = &x[n * x_len..(n + 1) * x_len];
                if !g.is_pointwise() {
                    im2col(x_n, col, g, oh);
                }
                // The lane's first product sets its partial sums: no zeroing pass.
                let add = k > 0;
                for gi in 0..g.groups {
                    let im = rhs_view(g, x_n, col, gi, off, cols);
                    let d = View::rows(&dy[n * y_len + gi * co_g * hw_out + off..], hw_out);
                    let part = &mut part[gi * co_g * rows_g..];
                    if transposed {
                        gemm(rows_g, co_g, cols, part, co_g, im, d.t(), add, par_gemm);
                    } else {
                        gemm(co_g, rows_g, cols, part, rows_g, d, im.t(), add, par_gemm);
                    }
                }
            }
        });
    // The lanes summed in lane order into the first (contiguous), then added to dw once.
    let (first, rest) = ws.split_at_mut(lane_len(g));
    let total = &mut first[cl..];
    for (l, lane) in rest.chunks(lane_len(g)).enumerate() {
        if busy(l + 1) {
            total
                .iter_mut()
                .zip(&lane[cl..])
                .for_each(|(t, p)| *t += *p);
        }
    }
    for (gi, part) in total.chunks(co_g * rows_g).enumerate() {
        let dw = &mut dw[gi * co_g * rows_g..(gi + 1) * co_g * rows_g];
        if transposed {
            for (r, row) in part.chunks(co_g).enumerate() {
                for (co, p) in row.iter().enumerate() {
                    dw[co * rows_g + r] += *p;
                }
            }
        } else {
            dw.iter_mut().zip(part).for_each(|(d, p)| *d += *p);
        }
    }
}
