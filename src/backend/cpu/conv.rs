//! Convolution as tiled im2col + gemm. The output of each sample is cut into tiles of whole
//! output rows whose im2col matrix stays cache-resident (~TILE_ELEMS elements), so the
//! unfolded input never makes a round trip through memory and its workspace stays small even
//! for 1024² images. A pointwise (1×1, stride 1, unpadded) convolution multiplies the input
//! directly; a 3×3 stride-1 one runs all three passes by [`winograd`] (2.25× fewer products).
//!
//! Work is split into contiguous runs of items, one run per lane (a rayon task with its own
//! slice of the workspace). An item is a tile of one sample's output rows or, where planes are
//! small, whole samples side by side, so that every product has enough columns to be worth
//! packing its weights (see [`ColumnTiles`]). Filter gradients are summed per lane, then over
//! lanes in lane order; their lanes are a fixed number ([`REDUCTION_LANES`]), not one per
//! thread, so a gradient's rounding depends neither on thread timing nor on the thread count.
//! Strided data gradients overlap between tiles (col2im adds into shared rows), so they are
//! split by sample instead.

use std::ops::Range;

use rayon::prelude::*;

use super::{gemm, gemm_raw, winograd, Float, SharedOut, View};
use crate::backend::ConvGeom;

/// Elements of one im2col tile: small enough to stay in a core's L2 cache.
const TILE_ELEMS: usize = 1 << 17;

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

/// `lanes` disjoint slices of `len` elements from the front of `ws` (empty ones for 0).
fn lane_slices<T>(ws: &mut [T], lanes: usize, len: usize) -> Vec<&mut [T]> {
    if len == 0 {
        return (0..lanes).map(|_| <&mut [T]>::default()).collect();
    }
    ws[..lanes * len].chunks_mut(len).collect()
}

/// Workspace elements of forward: Winograd's where it applies, else its lanes' (im2col
/// columns and, for samples side by side, the product before it goes to each sample).
fn forward_len(g: &ConvGeom) -> usize {
    if winograd::applies(g) {
        winograd::workspace(g)
    } else {
        let ct = ColumnTiles::forward(g);
        lanes(ct.items(g)) * (ct.col_len(g) + ct.gathered_len(g))
    }
}

/// Workspace elements: what every pass needs (backward-data the transposed weights and, as
/// a forward convolution, that convolution's workspace, else its lanes as forward's;
/// backward-filter its lanes).
pub fn workspace(g: &ConvGeom) -> usize {
    let data = weights_len(g)
        + transposed(g).map_or_else(
            || {
                let ct = ColumnTiles::forward(g);
                lanes(g.n.div_ceil(ct.samples)) * (ct.col_len(g) + ct.gathered_len(g))
            },
            |t| forward_len(&t),
        );
    let filter = if winograd::applies(g) {
        winograd::workspace(g)
    } else {
        let ct = ColumnTiles::of(g);
        reduction_lanes(ct.items(g)) * ct.filter_lane_len(g)
    };
    forward_len(g).max(data).max(filter)
}

/// Columns a product takes at least, where the batch has them. With fewer, a forward product
/// packs its weights for little work, and a filter-gradient product rereads and rewrites its
/// C_out × C_in·k² partial sums for little work (resnet50's last stage at 224²: 49 columns a
/// sample against 512 × 4608 weights).
const MIN_COLS: usize = 256;

/// How forward and backward-filter cut their columns, (sample, output position), into items:
/// tiles of `rows` output rows of one sample, im2col-sized (~[`TILE_ELEMS`]) but at least
/// [`MIN_COLS`] columns; or where a whole sample has fewer, groups of `samples` whole samples,
/// their columns side by side. Depends on the geometry only, so the sums' order does too.
#[derive(Clone, Copy)]
struct ColumnTiles {
    rows: usize,
    tiles: usize,
    samples: usize,
}

impl ColumnTiles {
    fn of(g: &ConvGeom) -> Self {
        let (k, w_out, hw_out) = (g.c_in * g.kh * g.kw, g.w_out.max(1), g.h_out * g.w_out);
        let rows = (TILE_ELEMS / (k * w_out).max(1))
            .max(MIN_COLS.div_ceil(w_out))
            .clamp(1, g.h_out.max(1));
        let tiles = g.h_out.div_ceil(rows);
        let mut samples = 1;
        if tiles == 1 && hw_out > 0 && g.n > 1 {
            // As few groups as reach the depth, as even as the batch allows.
            let groups = g.n.div_ceil(MIN_COLS.div_ceil(hw_out).min(g.n));
            samples = g.n.div_ceil(groups);
        }
        ColumnTiles {
            rows,
            tiles,
            samples,
        }
    }

    /// Forward's items: backward-filter's, but with samples side by side only where the
    /// weights outgrow a core's L2 cache ([`TILE_ELEMS`]), so that packing them again for each
    /// sample would read them from memory; smaller ones cost less to pack again than the
    /// copies of x and y cost. A pointwise convolution reads its input in place, so it has
    /// no tile to keep in cache: one product a sample (backward-filter keeps its tiles, the
    /// lanes of a batch of one).
    fn forward(g: &ConvGeom) -> Self {
        let mut ct = Self::of(g);
        if weights_len(g) < TILE_ELEMS {
            ct.samples = 1;
        }
        if g.is_pointwise() && ct.samples == 1 {
            (ct.rows, ct.tiles) = (g.h_out.max(1), 1);
        }
        ct
    }

    fn items(&self, g: &ConvGeom) -> usize {
        if self.samples > 1 {
            g.n.div_ceil(self.samples)
        } else {
            g.n * self.tiles
        }
    }

    /// (first sample, samples, output rows) of item `i`.
    fn item(&self, g: &ConvGeom, i: usize) -> (usize, usize, Range<usize>) {
        if self.samples > 1 {
            let n0 = i * self.samples;
            (n0, self.samples.min(g.n - n0), 0..g.h_out)
        } else {
            let t = i % self.tiles;
            (
                i / self.tiles,
                1,
                t * self.rows..((t + 1) * self.rows).min(g.h_out),
            )
        }
    }

    /// The most columns of an item.
    fn cols(&self, g: &ConvGeom) -> usize {
        self.samples * self.rows * g.w_out
    }

    /// Whether items read the input in place: a pointwise convolution, one sample an item.
    fn in_place(&self, g: &ConvGeom) -> bool {
        g.is_pointwise() && self.samples == 1
    }

    /// Per lane: the im2col columns (none where the input is read in place); for groups of
    /// samples, C_out rows of their columns side by side (forward's product, backward-filter's
    /// copy of dy); backward-filter's partial sums.
    fn col_len(&self, g: &ConvGeom) -> usize {
        if self.in_place(g) {
            0
        } else {
            g.c_in * g.kh * g.kw * self.cols(g)
        }
    }

    fn gathered_len(&self, g: &ConvGeom) -> usize {
        if self.samples > 1 {
            g.c_out * self.cols(g)
        } else {
            0
        }
    }

    fn filter_lane_len(&self, g: &ConvGeom) -> usize {
        self.col_len(g) + self.gathered_len(g) + g.c_out * g.col_rows()
    }
}

fn weights_len(g: &ConvGeom) -> usize {
    g.c_out * g.col_rows()
}

/// Backward-data of a stride-1 convolution as the forward convolution of dy with the weights
/// flipped in space and transposed in channels (padding d·(k-1) - p), so it runs like forward:
/// tiles of dx rows on every lane, each a plain product, no col2im adding into shared rows. A
/// pointwise one gains too: its product reads the weights row-major, which the gemm crate
/// packs faster than their transpose (resnet50's 1024 → 256 at 14², B = 8: 0.63× the time).
fn transposed(g: &ConvGeom) -> Option<ConvGeom> {
    let pad = |k: usize, d: usize, p: usize| (d * (k - 1)).checked_sub(p);
    if g.stride != (1, 1) {
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
    let (ci_g, co_g) = (g.c_in / g.groups, g.c_out / g.groups);
    swap_channels(w, wt, g.groups, (co_g, ci_g), g.kh * g.kw, true);
}

/// wt[gi][r][b] = w[gi·co_g + b][r] (r over C_in/groups · k²): each group's weights transposed,
/// for the strided backward-data's products.
fn transpose_weights<T: Float>(w: &[T], wt: &mut [T], g: &ConvGeom) {
    swap_channels(
        w,
        wt,
        g.groups,
        (g.c_out / g.groups, g.col_rows()),
        1,
        false,
    );
}

/// wt[gi][a][b][..] = w[gi][b][a][..] for each group of `outer` × `inner` runs of `run`
/// elements, each run reversed where asked. In parallel blocks of rows of wt and of b, so that
/// both sides stay in cache (a pointwise convolution's is a plain transpose, 2048 × 512 in
/// resnet50).
fn swap_channels<T: Float>(
    w: &[T],
    wt: &mut [T],
    groups: usize,
    (outer, inner): (usize, usize),
    run: usize,
    reverse: bool,
) {
    const BLOCK: usize = 16;
    let (row, stride) = (outer * run, inner * run);
    wt[..groups * inner * row]
        .par_chunks_mut(BLOCK * row)
        .enumerate()
        .for_each(|(i, rows)| {
            for b0 in (0..outer).step_by(BLOCK) {
                let b1 = (b0 + BLOCK).min(outer);
                for (r, dst_row) in rows.chunks_mut(row).enumerate() {
                    let (gi, a) = ((i * BLOCK + r) / inner, (i * BLOCK + r) % inner);
                    // Run b of this row of wt is run a of w's row gi·outer + b.
                    let src = &w[(gi * outer + b0) * stride + a * run..];
                    let dst = &mut dst_row[b0 * run..b1 * run];
                    // Element loops without bounds checks, not memcpy: runs are 1 to 9 long
                    // (a pointwise convolution's, single elements, were half its backward-data).
                    if run == 1 {
                        dst.iter_mut()
                            .zip(src.iter().step_by(stride))
                            .for_each(|(d, s)| *d = *s);
                    } else {
                        for (d, s) in dst.chunks_exact_mut(run).zip(src.chunks(stride)) {
                            if reverse {
                                d.iter_mut()
                                    .zip(s[..run].iter().rev())
                                    .for_each(|(d, s)| *d = *s);
                            } else {
                                d.copy_from_slice(&s[..run]);
                            }
                        }
                    }
                }
            }
        });
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

/// col[(c·kh + i)·kw + j][t·w_out + ow] = x[c][ih][iw] for output rows `oh` (0 outside),
/// `ld` elements between col's rows.
fn im2col<T: Float>(x: &[T], col: &mut [T], ld: usize, g: &ConvGeom, oh: Range<usize>) {
    let cols = oh.len() * g.w_out;
    for r in 0..g.c_in * g.kh * g.kw {
        let row = &mut col[r * ld..r * ld + cols];
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
            gather(&mut dst[valid.clone()], &src[iw0..], g.stride.1);
        }
    }
}

/// dst[k] = src[k·stride] (dst not empty). Stride 2 by pairs, which vectorize; an index per
/// element did not (the 7×7/2 stem's im2col, 147 rows of 112² columns a sample).
fn gather<T: Float>(dst: &mut [T], src: &[T], stride: usize) {
    let n = dst.len();
    match stride {
        1 => dst.copy_from_slice(&src[..n]),
        2 => simd!(|| {
            // The last element alone: its pair may run past the row.
            for (d, pair) in dst[..n - 1].iter_mut().zip(src.chunks_exact(2)) {
                *d = pair[0];
            }
            dst[n - 1] = src[2 * (n - 1)];
        }),
        _ => {
            for (d, &v) in dst.iter_mut().zip(src.iter().step_by(stride)) {
                *d = v;
            }
        }
    }
}

/// The adjoint of im2col for channel `c`: plane[ih][iw] += col[...] over output rows `oh`.
fn col2im_channel<T: Float>(
    col: &[T],
    ld: usize,
    plane: &mut [T],
    c: usize,
    g: &ConvGeom,
    oh: Range<usize>,
) {
    let cols = oh.len() * g.w_out;
    for i in 0..g.kh {
        for j in 0..g.kw {
            let r = (c * g.kh + i) * g.kw + j;
            let row = &col[r * ld..r * ld + cols];
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
                scatter_add(&mut dst[iw0..], &src[valid.clone()], g.stride.1);
            }
        }
    }
}

/// dst[k·stride] += src[k] (src not empty): [`gather`]'s adjoint, stride 2 by pairs as there.
fn scatter_add<T: Float>(dst: &mut [T], src: &[T], stride: usize) {
    let n = src.len();
    match stride {
        1 => dst[..n].iter_mut().zip(src).for_each(|(d, &v)| *d += v),
        2 => simd!(|| {
            for (pair, &v) in dst.chunks_exact_mut(2).zip(&src[..n - 1]) {
                pair[0] += v;
            }
            dst[2 * (n - 1)] += src[n - 1];
        }),
        _ => {
            for (d, &v) in dst.iter_mut().step_by(stride).zip(src) {
                *d += v;
            }
        }
    }
}

/// The input of group `gi` for output rows starting at column `off`: (rows of group) × cols,
/// read in place from a pointwise convolution's sample `x_n`, else from the im2col columns.
fn rhs_view<'a, T: Float>(
    g: &ConvGeom,
    x_n: Option<&'a [T]>,
    col: &'a [T],
    gi: usize,
    off: usize,
    cols: usize,
) -> View<'a, T> {
    let rows_g = g.col_rows();
    match x_n {
        Some(x_n) => View::rows(&x_n[gi * rows_g * g.h * g.w + off..], g.h * g.w),
        None => View::rows(&col[gi * rows_g * cols..], cols),
    }
}

/// sum = Σ over the lanes' partial sums, in lane order, of their elements at..at + sum.len().
fn lane_sum<'a, T: Float>(parts: &[&[T]], at: usize, sum: &'a mut [T]) -> &'a [T] {
    let len = sum.len();
    sum.copy_from_slice(&parts[0][at..at + len]);
    for p in &parts[1..] {
        simd!(|| {
            sum.iter_mut()
                .zip(&p[at..at + len])
                .for_each(|(s, p)| *s += *p)
        });
    }
    sum
}

/// y[n] = W · im2col(x[n]) per group, item by item (see [`ColumnTiles`]); 3×3 stride-1 by
/// [`winograd`].
pub fn forward<T: Float>(x: &[T], w: &[T], y: &mut [T], ws: &mut [T], g: &ConvGeom) {
    if winograd::applies(g) {
        return winograd::forward(x, w, y, ws, g);
    }
    let (x_len, hw_out) = (g.c_in * g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let ct = ColumnTiles::forward(g);
    let items = ct.items(g);
    let lanes = lanes(items);
    let per = items.div_ceil(lanes);
    let par_gemm = lanes < rayon::current_num_threads();
    let (cl, gl) = (ct.col_len(g), ct.gathered_len(g));
    let in_place = ct.in_place(g);
    assert!(y.len() >= g.n * y_len && x.len() >= g.n * x_len);
    let out = SharedOut(y.as_mut_ptr());
    lane_slices(ws, lanes, cl + gl)
        .into_par_iter()
        .enumerate()
        .for_each(|(l, lane)| {
            let (col, gathered) = lane.split_at_mut(cl);
            for item in l * per..((l + 1) * per).min(items) {
                let (n0, samples, oh) = ct.item(g, item);
                let (off, cols) = (oh.start * g.w_out, samples * oh.len() * g.w_out);
                if !in_place {
                    for s in 0..samples {
                        let x_n = &x[(n0 + s) * x_len..(n0 + s + 1) * x_len];
                        im2col(x_n, &mut col[s * hw_out..], cols, g, oh.clone());
                    }
                }
                let x_n = in_place.then(|| &x[n0 * x_len..(n0 + 1) * x_len]);
                for gi in 0..g.groups {
                    let lhs = View::rows(&w[gi * co_g * rows_g..], rows_g);
                    let rhs = rhs_view(g, x_n, col, gi, off, cols);
                    // One sample's rows go to y in place; samples side by side to `gathered`.
                    let (dst, dst_rs) = if samples == 1 {
                        (out.at(n0 * y_len + gi * co_g * hw_out + off), hw_out)
                    } else {
                        (gathered[gi * co_g * cols..].as_mut_ptr(), cols)
                    };
                    // SAFETY: item (n0, rows) and group gi write rows [gi·co_g, (gi+1)·co_g)
                    // of sample n0 at columns [off, off + cols): inside y (asserted above) and
                    // disjoint from every other (item, group); or of the lane's own
                    // `gathered`, which holds C_out × cols.
                    unsafe { gemm_raw(co_g, cols, rows_g, dst, dst_rs, lhs, rhs, false, par_gemm) };
                }
                if samples == 1 {
                    continue;
                }
                for (co, row) in gathered.chunks(cols).take(g.c_out).enumerate() {
                    for (s, src) in row.chunks(hw_out).enumerate() {
                        // SAFETY: row co of sample n0 + s, of this item alone: inside y
                        // (asserted above), written by no other item.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                src.as_ptr(),
                                out.at((n0 + s) * y_len + co * hw_out),
                                hw_out,
                            )
                        };
                    }
                }
            }
        });
}

/// dx = the forward convolution of dy by the flipped weights where the stride is 1 (see
/// [`transposed`]), else dx[n] = col2im(Wᵀ · dy[n]) per group, Wᵀ copied row-major first (the
/// gemm crate packs a transposed view slower). Items as forward's: lanes split samples, or
/// groups of samples side by side (dy's columns gathered next to each other), and a sample's
/// tiles run in order, as col2im adds into rows that neighbouring tiles share.
pub fn backward_data<T: Float>(dy: &[T], w: &[T], dx: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (wt, ws) = ws.split_at_mut(weights_len(g));
    if let Some(t) = transposed(g) {
        flip_weights(w, wt, g);
        return forward(dy, wt, dx, ws, &t);
    }
    transpose_weights(w, wt, g);
    let (x_len, hw, hw_out) = (g.c_in * g.h * g.w, g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let ct = ColumnTiles::forward(g);
    let units = g.n.div_ceil(ct.samples);
    let lanes = lanes(units);
    let per = ct.samples * units.div_ceil(lanes);
    let par = lanes < rayon::current_num_threads();
    let (cl, gl) = (ct.col_len(g), ct.gathered_len(g));
    let wt = &*wt;
    dx.par_chunks_mut(per * x_len)
        .zip(dy.par_chunks(per * y_len))
        .zip(lane_slices(ws, lanes, cl + gl))
        .for_each(|((dxs, dys), lane)| {
            let (dcol, gathered) = lane.split_at_mut(cl);
            let units = dxs
                .chunks_mut(ct.samples * x_len)
                .zip(dys.chunks(ct.samples * y_len));
            for (dx_u, dy_u) in units {
                let samples = dx_u.len() / x_len;
                // col2im adds into dx.
                dx_u.fill(T::zero());
                for t in 0..ct.tiles {
                    let oh = t * ct.rows..((t + 1) * ct.rows).min(g.h_out);
                    let (off, cols) = (oh.start * g.w_out, samples * oh.len() * g.w_out);
                    // dy's columns: in place for one sample, else copied side by side.
                    let dy_view = if samples == 1 {
                        View::rows(&dy_u[off..], hw_out)
                    } else {
                        for (co, row) in gathered.chunks_mut(cols).take(g.c_out).enumerate() {
                            for (s, dst) in row.chunks_mut(hw_out).enumerate() {
                                dst.copy_from_slice(&dy_u[s * y_len + co * hw_out..][..hw_out]);
                            }
                        }
                        View::rows(&gathered[..], cols)
                    };
                    for gi in 0..g.groups {
                        let lhs = View::rows(&wt[gi * rows_g * co_g..], co_g);
                        let rhs = View {
                            data: &dy_view.data[gi * co_g * dy_view.rs..],
                            ..dy_view
                        };
                        let dst = &mut dcol[gi * rows_g * cols..];
                        gemm(rows_g, cols, co_g, dst, cols, lhs, rhs, false, par);
                    }
                    let dcol = &*dcol;
                    let col2im = |(p, plane): (usize, &mut [T])| {
                        let (s, c) = (p / g.c_in, p % g.c_in);
                        col2im_channel(&dcol[s * hw_out..], cols, plane, c, g, oh.clone())
                    };
                    if par {
                        dx_u.par_chunks_mut(hw).enumerate().for_each(col2im);
                    } else {
                        dx_u.chunks_mut(hw).enumerate().for_each(col2im);
                    }
                }
            }
        });
}

/// dW += Σ dy[n] · im2col(x[n])ᵀ per group, item by item (see [`ColumnTiles`]); 3×3
/// stride-1 by [`winograd`].
pub fn backward_filter<T: Float>(x: &[T], dy: &[T], dw: &mut [T], ws: &mut [T], g: &ConvGeom) {
    if winograd::applies(g) {
        return winograd::backward_filter(x, dy, dw, ws, g);
    }
    let (x_len, hw_out) = (g.c_in * g.h * g.w, g.h_out * g.w_out);
    let y_len = g.c_out * hw_out;
    let (rows_g, co_g) = (g.col_rows(), g.c_out / g.groups);
    let ft = ColumnTiles::of(g);
    let items = ft.items(g);
    if items == 0 {
        return;
    }
    let lanes = reduction_lanes(items);
    let per = items.div_ceil(lanes);
    let par_gemm = lanes < rayon::current_num_threads();
    let (cl, dl, ll) = (ft.col_len(g), ft.gathered_len(g), ft.filter_lane_len(g));
    let in_place = ft.in_place(g);
    // The gemm crate runs these products (the long dimension inside both operands' rows)
    // about twice as fast with the larger of C_out and C_in·k² as the rows of the result, so
    // the partial sums are dWᵀ += im2col(x) · dyᵀ where C_in·k² is the larger.
    let transposed = rows_g >= co_g;
    // A lane past the last item (items not a multiple of the lanes) holds no partial sums.
    let busy = |l: usize| l * per < items;
    let ws = &mut ws[..lanes * ll];
    ws.par_chunks_mut(ll)
        .enumerate()
        .filter(|(l, _)| busy(*l))
        .for_each(|(l, lane)| {
            let (col, rest) = lane.split_at_mut(cl);
            let (dy_cols, part) = rest.split_at_mut(dl);
            for (k, item) in (l * per..((l + 1) * per).min(items)).enumerate() {
                let (n0, samples, oh) = ft.item(g, item);
                let (off, cols) = (oh.start * g.w_out, samples * oh.len() * g.w_out);
                // The input's columns: im2col side by side per sample, or read in place.
                if !in_place {
                    for s in 0..samples {
                        let x_n = &x[(n0 + s) * x_len..(n0 + s + 1) * x_len];
                        im2col(x_n, &mut col[s * hw_out..], cols, g, oh.clone());
                    }
                }
                // dy's columns likewise: in place for one sample, else copied side by side.
                let dy_view = if ft.samples == 1 {
                    View::rows(&dy[n0 * y_len + off..], hw_out)
                } else {
                    for (co, row) in dy_cols.chunks_mut(cols).take(g.c_out).enumerate() {
                        for (s, dst) in row.chunks_mut(hw_out).enumerate() {
                            dst.copy_from_slice(&dy[(n0 + s) * y_len + co * hw_out..][..hw_out]);
                        }
                    }
                    View::rows(&dy_cols[..], cols)
                };
                // The lane's first product sets its partial sums: no zeroing pass.
                let add = k > 0;
                for gi in 0..g.groups {
                    let x_n = in_place.then(|| &x[n0 * x_len..(n0 + 1) * x_len]);
                    let im = rhs_view(g, x_n, col, gi, off, cols);
                    let d = View {
                        data: &dy_view.data[gi * co_g * dy_view.rs..],
                        ..dy_view
                    };
                    let part = &mut part[gi * co_g * rows_g..];
                    if transposed {
                        gemm(rows_g, co_g, cols, part, co_g, im, d.t(), add, par_gemm);
                    } else {
                        gemm(co_g, rows_g, cols, part, rows_g, d, im.t(), add, par_gemm);
                    }
                }
            }
        });
    // The lanes' partial sums added in lane order, then into dw once, in parallel over blocks
    // of dw's rows: each element's sum has the same order on any number of threads. Where the
    // partial sums are dWᵀ, a block sums a run of each of TILE of their rows, then adds the
    // TILE × BLOCK tile to dw a row (of TILE adjacent elements) at a time: written a column at
    // a time, dw's rows, a power-of-two apart, would share a few L1 sets and evict each other.
    let parts: Vec<&[T]> = ws
        .chunks(ll)
        .enumerate()
        .filter(|(l, _)| busy(*l))
        .map(|(_, lane)| &lane[cl + dl..])
        .collect();
    const BLOCK: usize = 64;
    const TILE: usize = 16;
    dw[..g.c_out * rows_g]
        .par_chunks_mut(co_g * rows_g)
        .enumerate()
        .for_each(|(gi, dw)| {
            let base = gi * co_g * rows_g;
            dw.par_chunks_mut(BLOCK * rows_g)
                .enumerate()
                .for_each(|(b, block)| {
                    let mut sum = [T::zero(); BLOCK];
                    if transposed {
                        let (co0, rows) = (b * BLOCK, block.len() / rows_g);
                        let mut tile = [[T::zero(); BLOCK]; TILE];
                        for r0 in (0..rows_g).step_by(TILE) {
                            let tile = &mut tile[..TILE.min(rows_g - r0)];
                            for (t, sums) in tile.iter_mut().enumerate() {
                                lane_sum(&parts, base + (r0 + t) * co_g + co0, &mut sums[..rows]);
                            }
                            for (i, dst) in block.chunks_mut(rows_g).enumerate() {
                                for (d, sums) in dst[r0..].iter_mut().zip(tile.iter()) {
                                    *d += sums[i];
                                }
                            }
                        }
                    } else {
                        let at = base + b * BLOCK * rows_g;
                        for (i, d) in block.chunks_mut(BLOCK).enumerate() {
                            let sum = lane_sum(&parts, at + i * BLOCK, &mut sum[..d.len()]);
                            simd!(|| d.iter_mut().zip(sum.iter()).for_each(|(d, s)| *d += *s));
                        }
                    }
                });
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(
        n: usize,
        (c_in, h, w): (usize, usize, usize),
        c_out: usize,
        (k, stride, pad, dilation): (usize, usize, usize, usize),
        groups: usize,
    ) -> ConvGeom {
        let out = |len: usize| (len + 2 * pad - dilation * (k - 1) - 1) / stride + 1;
        ConvGeom {
            n,
            c_in,
            h,
            w,
            c_out,
            kh: k,
            kw: k,
            stride: (stride, stride),
            pad: (pad, pad),
            dilation: (dilation, dilation),
            groups,
            h_out: out(h),
            w_out: out(w),
        }
    }

    fn values(len: usize, seed: u64) -> Vec<f64> {
        (0..len as u64)
            .map(|i| ((i * 2_654_435_761 + seed * 40_503) % 1999) as f64 / 999.5 - 1.0)
            .collect()
    }

    /// y, dx and dw of one convolution by its definition, a loop over every tap, each element
    /// with the sum of its terms' magnitudes (what its rounding scales with).
    fn by_definition(g: &ConvGeom, x: &[f64], w: &[f64], dy: &[f64]) -> [Sums; 3] {
        let (ci_g, co_g) = (g.c_in / g.groups, g.c_out / g.groups);
        let mut y = Sums::zeros(g.n * g.c_out * g.h_out * g.w_out);
        let mut dx = Sums::zeros(x.len());
        let mut dw = Sums::zeros(w.len());
        for n in 0..g.n {
            for co in 0..g.c_out {
                for oh in 0..g.h_out {
                    for ow in 0..g.w_out {
                        let yi = ((n * g.c_out + co) * g.h_out + oh) * g.w_out + ow;
                        for a in 0..ci_g {
                            let ci = co / co_g * ci_g + a;
                            for i in 0..g.kh {
                                for j in 0..g.kw {
                                    let ih =
                                        (oh * g.stride.0 + i * g.dilation.0).wrapping_sub(g.pad.0);
                                    let iw =
                                        (ow * g.stride.1 + j * g.dilation.1).wrapping_sub(g.pad.1);
                                    if ih >= g.h || iw >= g.w {
                                        continue;
                                    }
                                    let xi = ((n * g.c_in + ci) * g.h + ih) * g.w + iw;
                                    let wi = ((co * ci_g + a) * g.kh + i) * g.kw + j;
                                    y.add(yi, w[wi] * x[xi]);
                                    dx.add(xi, w[wi] * dy[yi]);
                                    dw.add(wi, dy[yi] * x[xi]);
                                }
                            }
                        }
                    }
                }
            }
        }
        [y, dx, dw]
    }

    /// Sums and the sums of their terms' magnitudes.
    struct Sums {
        sum: Vec<f64>,
        magnitude: Vec<f64>,
    }

    impl Sums {
        fn zeros(len: usize) -> Self {
            Sums {
                sum: vec![0.0; len],
                magnitude: vec![0.0; len],
            }
        }

        fn add(&mut self, i: usize, term: f64) {
            self.sum[i] += term;
            self.magnitude[i] += term.abs();
        }
    }

    /// Within 1e-12 relative, or 1e-14 of the terms' magnitudes: a long sum through
    /// Winograd's F(4×4, 3×3) transforms (coefficients up to 8 and 1/24) rounds a few hundred
    /// ulps of its terms, more than its result's 1e-12 where terms cancel. A wrong index is
    /// off by a term's size, far beyond either.
    fn assert_close(what: &str, g: &ConvGeom, got: &[f64], want: &Sums) {
        for (i, (a, (b, m))) in got
            .iter()
            .zip(want.sum.iter().zip(&want.magnitude))
            .enumerate()
        {
            assert!(
                (a - b).abs() <= 1e-12 * (1.0 + b.abs()) + 1e-14 * m,
                "{what} [{i}]: {a} vs {b}, {g:?}"
            );
        }
    }

    /// Every pass against the definition, on geometries that take each of the passes' ways of
    /// cutting the work: tiles of rows, whole samples, groups of samples (an uneven last one),
    /// a pointwise input read in place or copied, strides, dilation, groups, and the filter
    /// gradient's partial sums as dW (C_out > C_in·k²) or as dWᵀ.
    #[test]
    fn every_pass_matches_the_definition() {
        let cases = [
            geom(2, (16, 40, 64), 8, (3, 1, 1, 1), 1), // several tiles of rows a sample
            geom(1, (8, 6, 7), 6, (3, 1, 1, 1), 1),    // one small sample
            geom(7, (8, 10, 10), 6, (3, 1, 1, 1), 1),  // groups of 3, 3 and 1 samples
            geom(2, (64, 48, 64), 12, (1, 1, 0, 1), 1), // pointwise, tiles, in place
            geom(6, (4, 5, 5), 12, (1, 1, 0, 1), 1),   // pointwise, samples side by side, dW
            geom(2, (40, 5, 6), 24, (1, 1, 0, 1), 2),  // pointwise in groups: dx transposed
            geom(2, (36, 6, 5), 20, (3, 1, 1, 1), 4),  // groups, stride 1: dx by flipped weights
            geom(3, (6, 9, 11), 4, (3, 2, 1, 2), 2),   // stride, dilation, groups
            geom(7, (64, 20, 20), 256, (3, 2, 1, 1), 1), // large weights: samples side by side, 3 + 3 + 1
            geom(2, (512, 3, 3), 256, (1, 1, 0, 1), 1),  // pointwise, large weights, side by side
            geom(5, (4, 7, 6), 4, (3, 2, 1, 1), 4),      // depthwise
            geom(2, (3, 17, 19), 8, (7, 2, 3, 1), 1),    // a 7×7/2 stem, odd sides
            geom(2, (4, 11, 13), 5, (3, 3, 1, 1), 1),    // stride 3
            geom(4, (32, 7, 7), 64, (3, 1, 1, 1), 1),    // deep and small, dWᵀ
            geom(3, (8, 96, 96), 8, (3, 1, 1, 1), 1),    // Winograd chunks across samples
            geom(3, (9, 11, 6), 5, (3, 1, 0, 1), 1),     // Winograd unpadded, odd sides
            geom(2, (10, 5, 9), 3, (3, 1, 2, 1), 1),     // Winograd padded past a tile
            geom(1, (8, 3, 141), 9, (3, 1, 1, 1), 1),    // Winograd rows of several blocks
            geom(2, (32, 26, 30), 32, (3, 1, 1, 1), 1),  // Winograd's 4×4 tiles, ragged ends
            geom(2, (33, 27, 27), 40, (3, 1, 0, 1), 1),  // 4×4 tiles unpadded, odd sides
            geom(1, (32, 24, 141), 33, (3, 1, 1, 1), 1), // 4×4 tiles, rows of several blocks
            geom(3, (32, 48, 96), 32, (3, 1, 1, 1), 1),  // 4×4 tiles, chunks across samples
        ];
        for g in &cases {
            let ws = vec![f64::NAN; workspace(g)];
            let x = values(g.n * g.c_in * g.h * g.w, 1);
            let w = values(g.c_out * g.col_rows(), 2);
            let dy = values(g.n * g.c_out * g.h_out * g.w_out, 3);
            let [y, dx, dw] = by_definition(g, &x, &w, &dy);

            let (mut got, mut scratch) = (vec![f64::NAN; y.sum.len()], ws.clone());
            forward(&x, &w, &mut got, &mut scratch, g);
            assert_close("forward", g, &got, &y);

            let (mut got, mut scratch) = (vec![f64::NAN; dx.sum.len()], ws.clone());
            backward_data(&dy, &w, &mut got, &mut scratch, g);
            assert_close("backward-data", g, &got, &dx);

            // Backward-filter adds into dW.
            let before = values(dw.sum.len(), 4);
            let (mut got, mut scratch) = (before.clone(), ws.clone());
            backward_filter(&x, &dy, &mut got, &mut scratch, g);
            let mut want = dw;
            for (i, b) in before.iter().enumerate() {
                want.add(i, *b);
            }
            assert_close("backward-filter", g, &got, &want);
        }
    }

    /// f32 rounding of the forward pass against the definition in f64, relative to the largest
    /// output, over 256 input channels: F(4×4, 3×3) at 28² (its coefficients round the most),
    /// F(2×2, 3×3) at 14², im2col + gemm at stride 2. Guards the tiles' error levels as
    /// documented in `winograd` against a change of interpolation points or transform order.
    #[test]
    fn f32_forward_rounding_stays_at_its_documented_level() {
        for (g, bound) in [
            (geom(1, (256, 28, 28), 32, (3, 1, 1, 1), 1), 1e-5),
            (geom(1, (256, 14, 14), 32, (3, 1, 1, 1), 1), 2e-6),
            (geom(1, (256, 28, 28), 32, (3, 2, 1, 1), 1), 2e-6),
        ] {
            let x = values(g.n * g.c_in * g.h * g.w, 1);
            let w: Vec<f64> = values(g.c_out * g.col_rows(), 2)
                .iter()
                .map(|v| v / (g.col_rows() as f64).sqrt())
                .collect();
            let dy = vec![0.0; g.n * g.c_out * g.h_out * g.w_out];
            let [y, _, _] = by_definition(&g, &x, &w, &dy);
            let f32s = |v: &[f64]| v.iter().map(|&v| v as f32).collect::<Vec<f32>>();
            let mut got = vec![0.0f32; y.sum.len()];
            let mut ws = vec![0.0f32; workspace(&g)];
            forward(&f32s(&x), &f32s(&w), &mut got, &mut ws, &g);
            let largest = y.sum.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&y.sum)
                .fold(0.0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
            assert!(
                worst <= bound * largest,
                "{worst:e} of {largest}, bound {bound:e}, {g:?}"
            );
            println!("{:e} of the largest output, {g:?}", worst / largest);
        }
    }
}
