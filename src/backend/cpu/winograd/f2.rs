//! F(2×2, 3×3): each 2×2 tile of outputs from a 4×4 tile of inputs, 16 points. The
//! transforms' coefficients are 0, ±1 and ½, so the rounding stays close to a direct sum. The
//! transforms run over rows of tiles as contiguous vectors: input rows are read split into even
//! and odd columns, so a 4×4 tile's columns are four aligned streams.

use std::ops::Range;

use super::{add_filter_grad_by, channel_rows, transform_weights_by, Tile, Tiling};
use crate::backend::cpu::{Float, SharedOut};
use crate::backend::ConvGeom;

/// Outputs a tile has along each side, and its points.
const OUT: usize = 2;
const POINTS: usize = 16;

/// Tiles processed at once by the transforms: their streams live on the stack.
const BLOCK: usize = 64;

pub(super) struct F2;

impl Tile for F2 {
    const OUT: usize = OUT;
    const POINTS: usize = POINTS;

    fn transform_weights<T: Float>(w: &[T], u: &mut [T], count: usize) {
        transform_weights_by::<T, 4, BLOCK>(w, u, count, g_t);
    }

    fn add_filter_grad<T: Float>(du: &[T], dw: &mut [T], count: usize) {
        add_filter_grad_by::<T, 4, BLOCK>(du, dw, count, g_adjoint);
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
            // Input rows 2·ti - ph + r, columns 2(q0 + q) - pw + s split by s's parity: the even
            // and odd columns of tile q, and of q + 1, which are tile q's last two.
            let mut even = [[T::zero(); BLOCK + 1]; 4];
            let mut odd = [[T::zero(); BLOCK + 1]; 4];
            let (mut ve, mut vo) = (even, odd);
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = &x[(n * c_in + c) * plane_len..][..plane_len];
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    for r in 0..4 {
                        let (e, o) = (&mut even[r][..=len], &mut odd[r][..=len]);
                        match (2 * ti + r).checked_sub(g.pad.0).filter(|&ih| ih < g.h) {
                            Some(ih) => {
                                let row = &plane[ih * g.w..(ih + 1) * g.w];
                                split_columns(row, 2 * q0, g.pad.1, e, o);
                            }
                            None => {
                                e.fill(T::zero());
                                o.fill(T::zero());
                            }
                        }
                    }
                    // Bᵀ d: along the tile's rows, on the even and the odd streams.
                    for (s, v) in [(&even, &mut ve), (&odd, &mut vo)] {
                        let [a, b, c, d] = v;
                        b_t(
                            [&s[0][..=len], &s[1][..=len], &s[2][..=len], &s[3][..=len]],
                            [
                                &mut a[..=len],
                                &mut b[..=len],
                                &mut c[..=len],
                                &mut d[..=len],
                            ],
                        );
                    }
                    // (Bᵀ d) B: along the columns: even q, odd q, even q + 1, odd q + 1.
                    let at = i * t.tw + q0;
                    for (r, quad) in points.chunks_exact_mut(4).enumerate() {
                        let (e, o) = (&ve[r], &vo[r]);
                        b_t(
                            [&e[..len], &o[..len], &e[1..=len], &o[1..=len]],
                            stretches(quad, at, len),
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
            let mut even = [[T::zero(); BLOCK + 1]; 2];
            let mut odd = [[T::zero(); BLOCK + 1]; 2];
            let (mut ve, mut vo) = ([[T::zero(); BLOCK]; 4], [[T::zero(); BLOCK]; 4]);
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = &dy[(n * c_out + k) * plane_len..][..plane_len];
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    for a in 0..2 {
                        let (e, o) = (&mut even[a][..len], &mut odd[a][..len]);
                        let oh = 2 * ti + a;
                        if oh < g.h_out {
                            split_columns(&plane[oh * g.w_out..][..g.w_out], 2 * q0, 0, e, o);
                        } else {
                            e.fill(T::zero());
                            o.fill(T::zero());
                        }
                    }
                    // A dy: along the tile's rows, on the even and the odd streams.
                    for (s, v) in [(&even, &mut ve), (&odd, &mut vo)] {
                        let [a, b, c, d] = v;
                        a_col(
                            [&s[0][..len], &s[1][..len]],
                            [&mut a[..len], &mut b[..len], &mut c[..len], &mut d[..len]],
                        );
                    }
                    // (A dy) Aᵀ: along the columns.
                    let at = i * t.tw + q0;
                    for (r, quad) in points.chunks_exact_mut(4).enumerate() {
                        a_col([&ve[r][..len], &vo[r][..len]], stretches(quad, at, len));
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
            let mut s = [[[T::zero(); BLOCK]; 4]; 2];
            let (mut even, mut odd) = ([T::zero(); BLOCK], [T::zero(); BLOCK]);
            for (i, r) in rows.clone().enumerate() {
                let (n, ti) = (r / t.th, r % t.th);
                let plane = (n * c_out + k) * plane_len;
                for q0 in (0..t.tw).step_by(BLOCK) {
                    let len = BLOCK.min(t.tw - q0);
                    let at = i * t.tw + q0;
                    let point = |p: usize| &points[p][at..at + len];
                    // Aᵀ M: along the tile's rows, for each of its columns j.
                    for j in 0..4 {
                        let [s0, s1] = &mut s;
                        a_t(
                            [point(j), point(4 + j), point(8 + j), point(12 + j)],
                            [&mut s0[j][..len], &mut s1[j][..len]],
                        );
                    }
                    // (Aᵀ M) A: along the columns; output row a's even and odd columns.
                    for (a, s) in s.iter().enumerate() {
                        let oh = 2 * ti + a;
                        if oh >= g.h_out {
                            break;
                        }
                        a_t(
                            [&s[0][..len], &s[1][..len], &s[2][..len], &s[3][..len]],
                            [&mut even[..len], &mut odd[..len]],
                        );
                        let first = 2 * q0;
                        let width = (2 * len).min(g.w_out - first);
                        // SAFETY: row oh < h_out, columns first..first + width ≤ w_out of a plane
                        // of y; the caller's contract gives this thread the row.
                        let row = unsafe {
                            std::slice::from_raw_parts_mut(
                                y.at(plane + oh * g.w_out + first),
                                width,
                            )
                        };
                        let mut pairs = row.chunks_exact_mut(2);
                        for ((pair, e), o) in (&mut pairs).zip(&even).zip(&odd) {
                            pair[0] = *e;
                            pair[1] = *o;
                        }
                        if let [last] = pairs.into_remainder() {
                            *last = even[width / 2];
                        }
                    }
                }
            }
        });
    }
}

/// Columns at..at + len of four points' rows.
fn stretches<'a, T>(quad: &'a mut [&mut [T]], at: usize, len: usize) -> [&'a mut [T]; 4] {
    let [a, b, c, d] = quad else {
        unreachable!("four points")
    };
    [a, b, c, d].map(|r| &mut r[at..at + len])
}

/// The four A combinations of two streams, A = [1 0; 1 1; 1 -1; 0 -1].
#[inline(always)]
fn a_col<T: Float>(y: [&[T]; 2], out: [&mut [T]; 4]) {
    let [o0, o1, o2, o3] = out;
    let n = o0.len();
    let (y0, y1) = (&y[0][..n], &y[1][..n]);
    let (o1, o2, o3) = (&mut o1[..n], &mut o2[..n], &mut o3[..n]);
    for q in 0..n {
        o0[q] = y0[q];
        o1[q] = y0[q] + y1[q];
        o2[q] = y0[q] - y1[q];
        o3[q] = -y1[q];
    }
}

/// The three Gᵀ combinations of four streams, Gᵀ = [1 ½ ½ 0; 0 ½ -½ 0; 0 ½ ½ 1].
#[inline(always)]
fn g_adjoint<T: Float>(u: [&[T]; 4], out: &mut [[T; BLOCK]; 3], n: usize) {
    let half = T::of(0.5);
    let [o0, o1, o2] = out;
    let (u0, u1, u2, u3) = (&u[0][..n], &u[1][..n], &u[2][..n], &u[3][..n]);
    for q in 0..n {
        o0[q] = u0[q] + (u1[q] + u2[q]) * half;
        o1[q] = (u1[q] - u2[q]) * half;
        o2[q] = (u1[q] + u2[q]) * half + u3[q];
    }
}

/// The four G combinations of three streams, G = [1 0 0; ½ ½ ½; ½ -½ ½; 0 0 1].
#[inline(always)]
fn g_t<T: Float>(a: &[T], b: &[T], c: &[T], out: &mut [[T; BLOCK]; 4], n: usize) {
    let half = T::of(0.5);
    let [o0, o1, o2, o3] = out;
    let (b, c) = (&b[..n], &c[..n]);
    for q in 0..n {
        o0[q] = a[q];
        o1[q] = (a[q] + b[q] + c[q]) * half;
        o2[q] = (a[q] - b[q] + c[q]) * half;
        o3[q] = c[q];
    }
}

/// The four Bᵀ combinations of four streams, Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
#[inline(always)]
fn b_t<T: Float>(d: [&[T]; 4], out: [&mut [T]; 4]) {
    let [o0, o1, o2, o3] = out;
    let n = o0.len();
    let (d0, d1, d2, d3) = (&d[0][..n], &d[1][..n], &d[2][..n], &d[3][..n]);
    let (o1, o2, o3) = (&mut o1[..n], &mut o2[..n], &mut o3[..n]);
    for q in 0..n {
        o0[q] = d0[q] - d2[q];
        o1[q] = d1[q] + d2[q];
        o2[q] = d2[q] - d1[q];
        o3[q] = d1[q] - d3[q];
    }
}

/// even[q] = row[first + 2q - pad], odd[q] = row[first + 2q + 1 - pad], zero outside the row.
#[inline(always)]
fn split_columns<T: Float>(row: &[T], first: usize, pad: usize, even: &mut [T], odd: &mut [T]) {
    let len = even.len();
    // Tiles q in inner read both their columns inside the row.
    let lo = pad.saturating_sub(first).div_ceil(2).min(len);
    let hi = ((row.len() + pad).saturating_sub(first + 1) / 2).clamp(lo, len);
    let at = |c: usize| c.checked_sub(pad).and_then(|c| row.get(c)).copied();
    for q in (0..lo).chain(hi..len) {
        even[q] = at(first + 2 * q).unwrap_or(T::zero());
        odd[q] = at(first + 2 * q + 1).unwrap_or(T::zero());
    }
    if lo < hi {
        let pairs = row[first + 2 * lo - pad..][..2 * (hi - lo)].chunks_exact(2);
        for ((e, o), pair) in even[lo..hi].iter_mut().zip(&mut odd[lo..hi]).zip(pairs) {
            *e = pair[0];
            *o = pair[1];
        }
    }
}

/// The two Aᵀ combinations of four streams, Aᵀ = [1 1 1 0; 0 1 -1 -1].
#[inline(always)]
fn a_t<T: Float>(m: [&[T]; 4], out: [&mut [T]; 2]) {
    let [o0, o1] = out;
    let n = o0.len();
    let (m0, m1, m2, m3) = (&m[0][..n], &m[1][..n], &m[2][..n], &m[3][..n]);
    let o1 = &mut o1[..n];
    for q in 0..n {
        o0[q] = m0[q] + m1[q] + m2[q];
        o1[q] = m1[q] - m2[q] - m3[q];
    }
}
