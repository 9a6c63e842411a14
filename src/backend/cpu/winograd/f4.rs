//! F(4×4, 3×3): each 4×4 tile of outputs from a 6×6 tile of inputs, 36 points. The
//! transforms' coefficients (up to 8, down to 1/24) round more than F(2×2, 3×3)'s: in f32,
//! over 256 input channels, 4·10⁻⁶ of the largest output against 9·10⁻⁷ for F(2×2, 3×3) and
//! for im2col + gemm (`f32_forward_rounding_stays_at_its_documented_level`). Input rows are
//! read split by column modulo 4, so a 6×6 tile's columns are six aligned streams (the four
//! phases of tile q, then the first two of tile q + 1).

use std::ops::Range;

use super::{add_filter_grad_by, channel_rows, transform_weights_by, Tile, Tiling};
use crate::backend::cpu::{Float, SharedOut};
use crate::backend::ConvGeom;

/// Outputs a tile has along each side, inputs it reads, and its points.
const OUT: usize = 4;
const SIDE: usize = OUT + 2;
const POINTS: usize = SIDE * SIDE;

/// Tiles processed at once by the transforms: their streams live on the stack.
const BLOCK: usize = 32;

pub(super) struct F4;

impl Tile for F4 {
    const OUT: usize = OUT;
    const POINTS: usize = POINTS;

    fn transform_weights<T: Float>(w: &[T], u: &mut [T], count: usize) {
        transform_weights_by::<T, SIDE, BLOCK>(w, u, count, g_t);
    }

    fn add_filter_grad<T: Float>(du: &[T], dw: &mut [T], count: usize) {
        add_filter_grad_by::<T, SIDE, BLOCK>(du, dw, count, g_adjoint);
    }

    unsafe fn transform_input<T: Float>(
        x: &[T],
        v: SharedOut<T>,
        c: usize,
        cols: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    ) {
        let (c_in, plane_len, tiles) = (g.c_in, g.h * g.w, rows.len() * t.tw);
        // SAFETY: the caller's contract.
        let mut points = unsafe { channel_rows::<_, POINTS>(v, c_in, c, cols) };
        simd!(|| {
            // Input rows 4·ti - ph + r, columns 4(q0 + q) - pw + s split by s modulo 4: the four
            // phases of tile q, and of q + 1, whose first two are tile q's last two columns.
            let mut phases = [[[T::zero(); BLOCK + 1]; OUT]; SIDE];
            let mut along = phases;
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = &x[(n * c_in + c) * plane_len..][..plane_len];
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    for (r, ph) in phases.iter_mut().enumerate() {
                        let ph = ph.each_mut().map(|p| &mut p[..=len]);
                        match (OUT * ti + r).checked_sub(g.pad.0).filter(|&ih| ih < g.h) {
                            Some(ih) => {
                                let row = &plane[ih * g.w..(ih + 1) * g.w];
                                split_columns(row, OUT * q0, g.pad.1, ph);
                            }
                            None => ph.into_iter().for_each(|p| p.fill(T::zero())),
                        }
                    }
                    // Bᵀ d: along the tile's rows, on each phase.
                    for s in 0..OUT {
                        b_t(
                            phases.each_ref().map(|ph| &ph[s][..=len]),
                            along.each_mut().map(|a| &mut a[s][..=len]),
                        );
                    }
                    // (Bᵀ d) B: along the columns: the four phases of q, the first two of q + 1.
                    let at = i * t.tw + q0;
                    for (r, six) in points.chunks_exact_mut(SIDE).enumerate() {
                        let [p0, p1, p2, p3] = &along[r];
                        b_t(
                            [
                                &p0[..len],
                                &p1[..len],
                                &p2[..len],
                                &p3[..len],
                                &p0[1..=len],
                                &p1[1..=len],
                            ],
                            stretches(six, at, len),
                        );
                    }
                }
            }
            for p in points.iter_mut() {
                p[tiles..].fill(T::zero());
            }
        });
    }

    unsafe fn transform_grad<T: Float>(
        dy: &[T],
        d: SharedOut<T>,
        k: usize,
        cols: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    ) {
        let (c_out, plane_len, tiles) = (g.c_out, g.h_out * g.w_out, rows.len() * t.tw);
        // SAFETY: the caller's contract.
        let mut points = unsafe { channel_rows::<_, POINTS>(d, c_out, k, cols) };
        simd!(|| {
            // Output rows 4·ti + a split by column modulo 4; then A along the rows.
            let mut phases = [[[T::zero(); BLOCK]; OUT]; OUT];
            let mut along = [[[T::zero(); BLOCK]; OUT]; SIDE];
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = &dy[(n * c_out + k) * plane_len..][..plane_len];
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    for (a, ph) in phases.iter_mut().enumerate() {
                        let oh = OUT * ti + a;
                        let ph = ph.each_mut().map(|p| &mut p[..len]);
                        if oh < g.h_out {
                            split_columns(&plane[oh * g.w_out..][..g.w_out], OUT * q0, 0, ph);
                        } else {
                            ph.into_iter().for_each(|p| p.fill(T::zero()));
                        }
                    }
                    // A dy: along the tile's rows, on each phase.
                    for s in 0..OUT {
                        a_col(
                            phases.each_ref().map(|ph| &ph[s][..len]),
                            along.each_mut().map(|a| &mut a[s][..len]),
                        );
                    }
                    // (A dy) Aᵀ: along the columns.
                    let at = i * t.tw + q0;
                    for (r, six) in points.chunks_exact_mut(SIDE).enumerate() {
                        a_col(
                            along[r].each_ref().map(|p| &p[..len]),
                            stretches(six, at, len),
                        );
                    }
                }
            }
            for p in points.iter_mut() {
                p[tiles..].fill(T::zero());
            }
        });
    }

    unsafe fn transform_output<T: Float>(
        m: &[T],
        cols: usize,
        y: SharedOut<T>,
        k: usize,
        rows: Range<usize>,
        t: &Tiling,
        g: &ConvGeom,
    ) {
        let (c_out, plane_len) = (g.c_out, g.h_out * g.w_out);
        let points: [&[T]; POINTS] = std::array::from_fn(|p| &m[(p * c_out + k) * cols..][..cols]);
        simd!(|| {
            let mut s = [[[T::zero(); BLOCK]; SIDE]; OUT];
            let mut phases = [[T::zero(); BLOCK]; OUT];
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = (n * c_out + k) * plane_len;
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    let at = i * t.tw + q0;
                    // Aᵀ M: along the tile's rows, for each of its columns j.
                    for j in 0..SIDE {
                        a_t(
                            std::array::from_fn(|r| &points[SIDE * r + j][at..at + len]),
                            s.each_mut().map(|s| &mut s[j][..len]),
                        );
                    }
                    // (Aᵀ M) A: along the columns; output row a's four phases.
                    for (a, s) in s.iter().enumerate() {
                        let oh = OUT * ti + a;
                        if oh >= g.h_out {
                            break;
                        }
                        a_t(
                            s.each_ref().map(|s| &s[..len]),
                            phases.each_mut().map(|p| &mut p[..len]),
                        );
                        let first = OUT * q0;
                        let width = (OUT * len).min(g.w_out - first);
                        // SAFETY: row oh < h_out, columns first..first + width ≤ w_out of a plane
                        // of y; the caller's contract gives this thread the row.
                        let row = unsafe {
                            std::slice::from_raw_parts_mut(
                                y.at(plane + oh * g.w_out + first),
                                width,
                            )
                        };
                        let [p0, p1, p2, p3] = &phases;
                        let mut quads = row.chunks_exact_mut(OUT);
                        for (q, quad) in (&mut quads).enumerate() {
                            quad.copy_from_slice(&[p0[q], p1[q], p2[q], p3[q]]);
                        }
                        let q = width / OUT;
                        for (s, v) in quads.into_remainder().iter_mut().enumerate() {
                            *v = phases[s][q];
                        }
                    }
                }
            }
        });
    }
}

/// Columns at..at + len of six points' rows.
fn stretches<'a, T>(six: &'a mut [&mut [T]], at: usize, len: usize) -> [&'a mut [T]; SIDE] {
    let [a, b, c, d, e, f] = six else {
        unreachable!("six points")
    };
    [a, b, c, d, e, f].map(|r| &mut r[at..at + len])
}

/// The six A combinations of four streams, A = Aᵀᵀ (see [`a_t`]).
#[inline(always)]
fn a_col<T: Float>(y: [&[T]; OUT], out: [&mut [T]; SIDE]) {
    let [o0, o1, o2, o3, o4, o5] = out;
    let n = o0.len();
    let (y0, y1, y2, y3) = (&y[0][..n], &y[1][..n], &y[2][..n], &y[3][..n]);
    let (o1, o2, o3, o4, o5) = (
        &mut o1[..n],
        &mut o2[..n],
        &mut o3[..n],
        &mut o4[..n],
        &mut o5[..n],
    );
    let (two, four, eight) = (T::of(2.0), T::of(4.0), T::of(8.0));
    for q in 0..n {
        let (even, odd) = (y0[q] + y2[q], y1[q] + y3[q]);
        let (even2, odd2) = (y0[q] + four * y2[q], two * y1[q] + eight * y3[q]);
        o0[q] = y0[q];
        o1[q] = even + odd;
        o2[q] = even - odd;
        o3[q] = even2 + odd2;
        o4[q] = even2 - odd2;
        o5[q] = y3[q];
    }
}

/// The three Gᵀ combinations of six streams (see [`g_t`] for G).
#[inline(always)]
fn g_adjoint<T: Float>(u: [&[T]; SIDE], out: &mut [[T; BLOCK]; 3], n: usize) {
    let (quarter, sixth, twelfth, twentyfourth) = (
        T::of(0.25),
        T::of(1.0 / 6.0),
        T::of(1.0 / 12.0),
        T::of(1.0 / 24.0),
    );
    let [o0, o1, o2] = out;
    let [u0, u1, u2, u3, u4, u5] = u.map(|u| &u[..n]);
    for q in 0..n {
        let (sum12, dif12) = (u1[q] + u2[q], u2[q] - u1[q]);
        let (sum34, dif34) = (u3[q] + u4[q], u3[q] - u4[q]);
        o0[q] = quarter * u0[q] - sixth * sum12 + twentyfourth * sum34;
        o1[q] = sixth * dif12 + twelfth * dif34;
        o2[q] = sixth * (sum34 - sum12) + u5[q];
    }
}

/// The six G combinations of three streams, G = [¼ 0 0; -⅙ -⅙ -⅙; -⅙ ⅙ -⅙; 1/24 1/12 ⅙;
/// 1/24 -1/12 ⅙; 0 0 1].
#[inline(always)]
fn g_t<T: Float>(a: &[T], b: &[T], c: &[T], out: &mut [[T; BLOCK]; SIDE], n: usize) {
    let (quarter, sixth, twelfth, twentyfourth) = (
        T::of(0.25),
        T::of(1.0 / 6.0),
        T::of(1.0 / 12.0),
        T::of(1.0 / 24.0),
    );
    let [o0, o1, o2, o3, o4, o5] = out;
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    for q in 0..n {
        let (ac6, b6) = (sixth * (a[q] + c[q]), sixth * b[q]);
        let (ac, b12) = (twentyfourth * a[q] + sixth * c[q], twelfth * b[q]);
        o0[q] = quarter * a[q];
        o1[q] = -(ac6 + b6);
        o2[q] = b6 - ac6;
        o3[q] = ac + b12;
        o4[q] = ac - b12;
        o5[q] = c[q];
    }
}

/// The six Bᵀ combinations of six streams, Bᵀ = [4 0 -5 0 1 0; 0 -4 -4 1 1 0;
/// 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1].
#[inline(always)]
fn b_t<T: Float>(d: [&[T]; SIDE], out: [&mut [T]; SIDE]) {
    let [o0, o1, o2, o3, o4, o5] = out;
    let n = o0.len();
    let [d0, d1, d2, d3, d4, d5] = d.map(|d| &d[..n]);
    let (o1, o2, o3, o4, o5) = (
        &mut o1[..n],
        &mut o2[..n],
        &mut o3[..n],
        &mut o4[..n],
        &mut o5[..n],
    );
    let (two, four, five) = (T::of(2.0), T::of(4.0), T::of(5.0));
    for q in 0..n {
        let (s1, s2) = (d3[q] + d4[q], four * (d1[q] + d2[q]));
        let (t1, t2) = (d4[q] - d3[q], four * (d1[q] - d2[q]));
        let (r1, r2) = (d4[q] - d2[q], two * (d3[q] - d1[q]));
        o0[q] = four * d0[q] - five * d2[q] + d4[q];
        o1[q] = s1 - s2;
        o2[q] = t1 + t2;
        o3[q] = r1 + r2;
        o4[q] = r1 - r2;
        o5[q] = four * d1[q] - five * d3[q] + d5[q];
    }
}

/// phases[s][q] = row[first + 4q + s - pad] (zero outside the row).
#[inline(always)]
fn split_columns<T: Float>(row: &[T], first: usize, pad: usize, phases: [&mut [T]; OUT]) {
    let len = phases[0].len();
    // Tiles q in lo..hi read all four of their columns inside the row.
    let lo = pad.saturating_sub(first).div_ceil(OUT).min(len);
    let hi = ((row.len() + pad).saturating_sub(first) / OUT).clamp(lo, len);
    let at = |c: usize| c.checked_sub(pad).and_then(|c| row.get(c)).copied();
    let [p0, p1, p2, p3] = phases;
    for q in (0..lo).chain(hi..len) {
        let c = first + OUT * q;
        p0[q] = at(c).unwrap_or(T::zero());
        p1[q] = at(c + 1).unwrap_or(T::zero());
        p2[q] = at(c + 2).unwrap_or(T::zero());
        p3[q] = at(c + 3).unwrap_or(T::zero());
    }
    if lo < hi {
        let quads = row[first + OUT * lo - pad..][..OUT * (hi - lo)].chunks_exact(OUT);
        let (p0, p1, p2, p3) = (
            &mut p0[lo..hi],
            &mut p1[lo..hi],
            &mut p2[lo..hi],
            &mut p3[lo..hi],
        );
        for (q, quad) in quads.enumerate() {
            p0[q] = quad[0];
            p1[q] = quad[1];
            p2[q] = quad[2];
            p3[q] = quad[3];
        }
    }
}

/// The four Aᵀ combinations of six streams, Aᵀ = [1 1 1 1 1 0; 0 1 -1 2 -2 0;
/// 0 1 1 4 4 0; 0 1 -1 8 -8 1].
#[inline(always)]
fn a_t<T: Float>(m: [&[T]; SIDE], out: [&mut [T]; OUT]) {
    let [o0, o1, o2, o3] = out;
    let n = o0.len();
    let [m0, m1, m2, m3, m4, m5] = m.map(|m| &m[..n]);
    let (o1, o2, o3) = (&mut o1[..n], &mut o2[..n], &mut o3[..n]);
    let (two, four, eight) = (T::of(2.0), T::of(4.0), T::of(8.0));
    for q in 0..n {
        let (sum12, dif12) = (m1[q] + m2[q], m1[q] - m2[q]);
        let (sum34, dif34) = (m3[q] + m4[q], m3[q] - m4[q]);
        o0[q] = m0[q] + sum12 + sum34;
        o1[q] = dif12 + two * dif34;
        o2[q] = sum12 + four * sum34;
        o3[q] = dif12 + eight * dif34 + m5[q];
    }
}
