//! 3×3 stride-1 convolution by Winograd's minimal filtering F(m×m, 3×3) (Lavin and Gray,
//! "Fast Algorithms for Convolutional Neural Networks", 2016): each m×m tile of outputs comes
//! from an (m+2)×(m+2) tile of inputs with (m+2)² products per channel pair instead of 9m².
//! The weights (U = G w Gᵀ) and the input tiles (V = Bᵀ d B) are transformed into (m+2)²
//! planes, one per point ξ of the tile; every point is one plain product M[ξ] = U[ξ] (C_out ×
//! C_in) · V[ξ] (C_in × tiles); each tile's points transform back into its outputs (Y = Aᵀ M A).
//!
//! Two tile sizes, each with its own transforms ([`f2`], [`f4`]): F(4×4, 3×3), 4× fewer
//! products than a direct sum, where planes and channels are large enough (see
//! [`large_tiles`]); F(2×2, 3×3), 2.25× fewer and closer to a direct sum's rounding,
//! elsewhere. On small planes the larger tile pads more outputs, reads its 2.25× larger U
//! for few columns, and runs its transforms over short rows.
//!
//! Tiles are cut into chunks of whole rows of tiles (across samples where planes are small),
//! run one after another, each in three parallel phases: input transform by channel, the
//! products by point, output transform by channel. A chunk's V and M are the workspace, sized
//! to stay in the shared cache yet wide enough that each product amortizes reading its U.

mod f2;
mod f4;

use std::ops::Range;

use rayon::prelude::*;

use super::{gemm, Float, SharedOut, View};
use crate::backend::ConvGeom;
use f2::F2;
use f4::F4;

/// A tile size's transforms, over one channel of a chunk's rows of tiles.
trait Tile {
    /// Outputs a tile has along each side.
    const OUT: usize;
    /// Points of a tile: the products a chunk runs.
    const POINTS: usize;
    /// u[ξ][i] = (G w_i Gᵀ)[ξ] for each of the `count` 3×3 filters w_i.
    fn transform_weights<T: Float>(w: &[T], u: &mut [T], count: usize);
    /// dw_i += Gᵀ dU_i G for each of the `count` filters, dU[ξ][i]; the adjoint of
    /// `transform_weights`.
    fn add_filter_grad<T: Float>(du: &[T], dw: &mut [T], count: usize);
    /// V[ξ][c][j] (`cols` columns a row) = (Bᵀ d B)[ξ] for the input tiles d of channel c and
    /// column j = (row of tiles - rows.start)·tw + tile, zero in the padding columns.
    ///
    /// # Safety
    /// `v` must hold POINTS × c_in rows of `cols` elements, and no other thread may touch
    /// channel c's rows during the call.
    unsafe fn transform_input<T: Float>(
        x: &[T],
        v: SharedOut<T>,
        c: usize,
        cols: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    );
    /// D[ξ][k][j] = (A dy_q Aᵀ)[ξ] for the output-gradient tiles of channel k, j as in
    /// `transform_input` (zero outside the output and in the padding columns).
    ///
    /// # Safety
    /// `d` must hold POINTS × c_out rows of `cols` elements, and no other thread may touch
    /// channel k's rows during the call.
    unsafe fn transform_grad<T: Float>(
        dy: &[T],
        d: SharedOut<T>,
        k: usize,
        cols: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    );
    /// Channel k's output rows of `rows` (rows of tiles) = Aᵀ M_q A for their tiles q,
    /// M[ξ][k][j] with `cols` columns a row.
    ///
    /// # Safety
    /// `y` must hold every sample's output planes, and no other thread may touch channel k's
    /// output rows of `rows` during the call.
    unsafe fn transform_output<T: Float>(
        m: &[T],
        cols: usize,
        y: SharedOut<T>,
        k: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    );
}

/// Elements of a chunk (V and M) to aim for: 4 MiB of f32, within the shared cache.
const CHUNK_ELEMS: usize = 1 << 20;

/// Tiles a chunk holds at least, where the batch has them: each of its products reads U[ξ]
/// (C_out × C_in) once for this many columns.
const MIN_TILES: usize = 256;

/// Whether a convolution runs here: 3×3, stride 1, undilated, ungrouped, with enough input
/// channels that the products outweigh the transforms.
pub fn applies(g: &ConvGeom) -> bool {
    (g.kh, g.kw, g.stride, g.dilation, g.groups) == (3, 3, (1, 1), (1, 1), 1)
        && g.c_in >= 8
        && g.h_out > 0
        && g.w_out > 0
}

/// Whether F(4×4, 3×3) runs it: planes of at least 24 × 24 outputs between at least 32
/// channels. Measured (2-core Zen 4, f32, against F(2×2)): 64 channels at 56², B = 8, 1.2–1.9×
/// faster by pass, 128 at 28² 1.1–1.2×, 32 at 128², B = 1, 1.2–1.4×; 256 at 14² and 512 at 7²
/// 1.2–1.5× slower (a quarter of their outputs padding), 16 at 32², B = 32, 1.5–1.8× slower.
fn large_tiles(g: &ConvGeom) -> bool {
    g.h_out >= 24 && g.w_out >= 24 && g.c_in >= 32 && g.c_out >= 32
}

/// How the output is cut: `tw` tiles a row, `th` rows of tiles a sample, `rows` rows of tiles
/// (over the batch's n·th) a chunk.
struct Tiling {
    tw: usize,
    th: usize,
    rows: usize,
}

impl Tiling {
    fn of<F: Tile>(g: &ConvGeom) -> Self {
        let (tw, th) = (g.w_out.div_ceil(F::OUT), g.h_out.div_ceil(F::OUT));
        let per_row = F::POINTS * (g.c_in + g.c_out) * tw;
        let all = (g.n * th).max(1);
        let most = (CHUNK_ELEMS / per_row)
            .max(MIN_TILES.div_ceil(tw))
            .clamp(1, all);
        // As few chunks as that allows, as even as the rows allow.
        let rows = all.div_ceil(all.div_ceil(most));
        Tiling { tw, th, rows }
    }

    fn chunks(&self, g: &ConvGeom) -> usize {
        (g.n * self.th).div_ceil(self.rows)
    }
}

/// Columns of a product: its tiles rounded up to whole register blocks of the f32 kernel
/// (a ragged end would run scalar), and a block more where rows would lie a multiple of
/// 4 KiB apart (they would share cache sets, and the kernel would copy them); the extra
/// columns are zero and never read back.
fn padded(tiles: usize) -> usize {
    let cols = tiles.next_multiple_of(16);
    if cols.is_multiple_of(1024) {
        cols + 16
    } else {
        cols
    }
}

/// Workspace elements: the transformed weights and a chunk's V and M.
pub fn workspace(g: &ConvGeom) -> usize {
    fn of<F: Tile>(g: &ConvGeom) -> usize {
        let t = Tiling::of::<F>(g);
        F::POINTS * (g.c_in * g.c_out + (g.c_in + g.c_out) * padded(t.rows * t.tw))
    }
    if large_tiles(g) {
        of::<F4>(g)
    } else {
        of::<F2>(g)
    }
}

/// y = the convolution of x by w (see the module's notes); `ws` holds [`workspace`] elements.
pub fn forward<T: Float>(x: &[T], w: &[T], y: &mut [T], ws: &mut [T], g: &ConvGeom) {
    if large_tiles(g) {
        forward_by::<T, F4>(x, w, y, ws, g)
    } else {
        forward_by::<T, F2>(x, w, y, ws, g)
    }
}

fn forward_by<T: Float, F: Tile>(x: &[T], w: &[T], y: &mut [T], ws: &mut [T], g: &ConvGeom) {
    let (c_in, c_out) = (g.c_in, g.c_out);
    assert!(
        x.len() >= g.n * c_in * g.h * g.w && y.len() >= g.n * c_out * g.h_out * g.w_out,
        "winograd operands out of bounds"
    );
    let t = Tiling::of::<F>(g);
    let (u, ws) = ws.split_at_mut(F::POINTS * c_out * c_in);
    F::transform_weights(w, u, c_out * c_in);
    let u = &*u;
    let out = SharedOut(y.as_mut_ptr());
    let all_rows = g.n * t.th;
    for chunk in 0..t.chunks(g) {
        let rows = chunk * t.rows..((chunk + 1) * t.rows).min(all_rows);
        let cols = padded(rows.len() * t.tw);
        let (v, rest) = ws.split_at_mut(F::POINTS * c_in * cols);
        let m = &mut rest[..F::POINTS * c_out * cols];
        let vs = SharedOut(v.as_mut_ptr());
        (0..c_in).into_par_iter().for_each(|c| {
            // SAFETY: v holds the chunk's POINTS × c_in rows of cols; this call writes
            // channel c's, which no other call writes.
            unsafe { F::transform_input(x, vs, c, cols, rows.clone(), &t, g) }
        });
        let v = &*v;
        m.par_chunks_mut(c_out * cols)
            .enumerate()
            .for_each(|(p, m)| {
                let lhs = View::rows(&u[p * c_out * c_in..], c_in);
                let rhs = View::rows(&v[p * c_in * cols..], cols);
                gemm(c_out, cols, c_in, m, cols, lhs, rhs, false, false);
            });
        let m = &*m;
        (0..c_out).into_par_iter().for_each(|k| {
            // SAFETY: y holds every sample's planes (asserted above); this call writes channel
            // k's output rows of this chunk's rows of tiles, which no other call writes.
            unsafe { F::transform_output(m, cols, out, k, rows.clone(), &t, g) }
        });
    }
}

/// dw += the filter gradient of the convolution for dy: with y = Aᵀ (U ⊙ V) A per tile and
/// U = G w Gᵀ, dU = Σ over tiles (A dy Aᵀ) ⊙ V, which is one product per point over the
/// tiles, summed chunk after chunk, and dw += Gᵀ dU G. Points run in parallel, each product
/// on one thread, so the sums' order depends on the geometry only.
pub fn backward_filter<T: Float>(x: &[T], dy: &[T], dw: &mut [T], ws: &mut [T], g: &ConvGeom) {
    if large_tiles(g) {
        backward_filter_by::<T, F4>(x, dy, dw, ws, g)
    } else {
        backward_filter_by::<T, F2>(x, dy, dw, ws, g)
    }
}

fn backward_filter_by<T: Float, F: Tile>(
    x: &[T],
    dy: &[T],
    dw: &mut [T],
    ws: &mut [T],
    g: &ConvGeom,
) {
    let (c_in, c_out) = (g.c_in, g.c_out);
    assert!(
        x.len() >= g.n * c_in * g.h * g.w && dy.len() >= g.n * c_out * g.h_out * g.w_out,
        "winograd operands out of bounds"
    );
    let t = Tiling::of::<F>(g);
    let (du, ws) = ws.split_at_mut(F::POINTS * c_out * c_in);
    let all_rows = g.n * t.th;
    for chunk in 0..t.chunks(g) {
        let rows = chunk * t.rows..((chunk + 1) * t.rows).min(all_rows);
        let cols = padded(rows.len() * t.tw);
        let (v, rest) = ws.split_at_mut(F::POINTS * c_in * cols);
        let d = &mut rest[..F::POINTS * c_out * cols];
        let (vs, ds) = (SharedOut(v.as_mut_ptr()), SharedOut(d.as_mut_ptr()));
        (0..c_in + c_out).into_par_iter().for_each(|c| {
            // SAFETY: v and d hold the chunk's POINTS × c_in and POINTS × c_out rows of
            // cols; this call writes channel c's of one of them, which no other call writes.
            unsafe {
                match c.checked_sub(c_in) {
                    None => F::transform_input(x, vs, c, cols, rows.clone(), &t, g),
                    Some(k) => F::transform_grad(dy, ds, k, cols, rows.clone(), &t, g),
                }
            }
        });
        let (v, d) = (&*v, &*d);
        du.par_chunks_mut(c_out * c_in)
            .enumerate()
            .for_each(|(p, du)| {
                let lhs = View::rows(&d[p * c_out * cols..], cols);
                let rhs = View::rows(&v[p * c_in * cols..], cols).t();
                gemm(c_out, c_in, cols, du, c_in, lhs, rhs, chunk > 0, false);
            });
    }
    F::add_filter_grad(du, dw, c_out * c_in);
}

/// u[ξ][i] = (G w_i Gᵀ)[ξ], ξ = SIDE·a + j, for each of the `count` 3×3 filters w_i, BLOCK
/// filters at a time, each tap a stream: `g_t` applies a tile's G (SIDE × 3) to three streams,
/// along the filters' rows, then along their columns.
fn transform_weights_by<T: Float, const SIDE: usize, const BLOCK: usize>(
    w: &[T],
    u: &mut [T],
    count: usize,
    g_t: impl Fn(&[T], &[T], &[T], &mut [[T; BLOCK]; SIDE], usize) + Sync + Copy,
) {
    let us = SharedOut(u.as_mut_ptr());
    let blocks = count.div_ceil(BLOCK);
    (0..blocks).into_par_iter().for_each(|b| {
        let (i0, len) = (b * BLOCK, BLOCK.min(count - b * BLOCK));
        simd!(|| {
            let mut taps = [[T::zero(); BLOCK]; 9];
            for (i, f) in w[i0 * 9..(i0 + len) * 9].chunks_exact(9).enumerate() {
                for (tap, &v) in taps.iter_mut().zip(f) {
                    tap[i] = v;
                }
            }
            let mut rows = [[[T::zero(); BLOCK]; SIDE]; 3];
            for (r, row) in rows.iter_mut().enumerate() {
                let [a, b, c] = [0, 1, 2].map(|s| &taps[3 * r + s][..len]);
                g_t(a, b, c, row, len);
            }
            let mut point = [[[T::zero(); BLOCK]; SIDE]; SIDE];
            for (j, col) in point.iter_mut().enumerate() {
                let [a, b, c] = [0, 1, 2].map(|r| &rows[r][j][..len]);
                g_t(a, b, c, col, len);
            }
            for (j, col) in point.iter().enumerate() {
                for (a, p) in col.iter().enumerate() {
                    // SAFETY: u holds SIDE² × count elements; this block alone writes filters
                    // i0..i0 + len of each point.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(us.at((SIDE * a + j) * count + i0), len)
                    };
                    dst.copy_from_slice(&p[..len]);
                }
            }
        })
    });
}

/// dw_i += Gᵀ dU_i G for each of the `count` filters, dU[ξ][i], BLOCK filters at a time: the
/// adjoint of [`transform_weights_by`], `g_adjoint` applying Gᵀ to SIDE streams.
fn add_filter_grad_by<T: Float, const SIDE: usize, const BLOCK: usize>(
    du: &[T],
    dw: &mut [T],
    count: usize,
    g_adjoint: impl Fn([&[T]; SIDE], &mut [[T; BLOCK]; 3], usize) + Sync + Copy,
) {
    dw[..count * 9]
        .par_chunks_mut(BLOCK * 9)
        .enumerate()
        .for_each(|(b, dw)| {
            let (i0, len) = (b * BLOCK, dw.len() / 9);
            simd!(|| {
                // Gᵀ along dU's rows (SIDE points each), then along its columns.
                let mut rows = [[[T::zero(); BLOCK]; 3]; SIDE];
                for (a, row) in rows.iter_mut().enumerate() {
                    let p = std::array::from_fn(|j| &du[(SIDE * a + j) * count + i0..][..len]);
                    g_adjoint(p, row, len);
                }
                let mut taps = [[[T::zero(); BLOCK]; 3]; 3];
                for s in 0..3 {
                    let p = std::array::from_fn(|a| &rows[a][s][..len]);
                    let mut col = [[T::zero(); BLOCK]; 3];
                    g_adjoint(p, &mut col, len);
                    for r in 0..3 {
                        taps[r][s] = col[r];
                    }
                }
                for (i, f) in dw.chunks_exact_mut(9).enumerate() {
                    for (tap, d) in f.iter_mut().enumerate() {
                        *d += taps[tap / 3][tap % 3][i];
                    }
                }
            })
        });
}

/// The N rows, one per point ξ, of channel `ch` in a chunk's transformed planes laid out
/// [ξ][channel][column], `cols` columns a row.
///
/// # Safety
/// `planes` must hold N × `channels` rows of `cols` elements, and no other thread may touch
/// channel `ch`'s rows while the returned slices live.
unsafe fn channel_rows<'a, T, const N: usize>(
    planes: SharedOut<T>,
    channels: usize,
    ch: usize,
    cols: usize,
) -> [&'a mut [T]; N] {
    // SAFETY: within `planes` and this thread's alone (the caller's contract).
    std::array::from_fn(|p| unsafe {
        std::slice::from_raw_parts_mut(planes.at((p * channels + ch) * cols), cols)
    })
}
