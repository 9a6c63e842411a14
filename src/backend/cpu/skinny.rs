//! f32 products with a small left operand over long rows: dst (m×n) = [dst +] lhs (m×k) · rhs
//! (k×n) where m·k is at most [`MAX_LHS`] — a pointwise convolution between thin layers
//! (resnet110v2's 16 ↔ 64 channels on 256² planes), or a 3×3 convolution into 16 or 32
//! channels. The gemm crate reaches a third to a half of its large-matrix rate on these
//! (measured on the 2-core EPYC: 9–26 GFLOP/s single-threaded for m·k of 16·64 to 64·16
//! over a 256² plane). Two things cost: rows of a plane lie a multiple of 4 KiB apart, so the
//! k rows read together share cache sets; and the operands are packed for blocks far larger
//! than this lhs. Here each block of [`BLOCK`] columns of rhs is copied into a contiguous
//! scratch (one sequential read of each row) where its rows alias so or span more pages than
//! the TLB holds (else read in place, e.g. an im2col tile), and 6 rows × 16 columns of dst are
//! accumulated in registers over all of k with AVX2 FMAs.
//!
//! Every element is one fused multiply-add chain over k in order, starting from 0 or dst, in
//! the vector kernel and the scalar tail alike; threads split columns only, so the bits depend
//! neither on the thread count nor on how callers tile the columns.

use std::arch::x86_64::*;
use std::cell::RefCell;

use rayon::prelude::*;

use super::View;

/// The largest m·k taken here. Beyond it the gemm crate is as fast or faster: on Zen 4 (its
/// AVX-512 kernels, 2 threads, convolutions at B = 8–32) 256 → 64 1×1 at 8² 134–136 → 175–200
/// GFLOP/s forward, 32 → 32 3×3/2 at 32² 55–57 → 86–89, 64 → 256 1×1 at 56² 170–174 →
/// 181–189; at 16·64 and below this kernel stays ahead on large planes (16 ↔ 64 at 256²).
const MAX_LHS: usize = 1 << 12;
/// Rows and columns of dst a kernel call holds in registers (12 of the 16 ymm registers).
const MR: usize = 6;
const NR: usize = 16;
/// Columns per block at most, and the elements a block of rhs aims at (128 KiB, in L2): fewer
/// columns where k is long, never fewer than [`NR`].
const BLOCK: usize = 256;
const SCRATCH: usize = 1 << 15;
/// Rows of rhs this many elements (4 KiB) apart, or a multiple, share cache sets: those are
/// copied; others are read in place unless a column strip of them spans more pages than the
/// first-level TLB holds (Zen 3: 64 entries): resnet50's 256 → 64 at 56² read its 256 rows
/// in place at 46 GFLOP/s, and copied at 52.
const ALIASING: usize = 1024;
const TLB_PAGES: usize = 64;

/// 4 KiB pages a column strip of k rows `rs` elements apart touches, about.
fn pages(k: usize, rs: usize) -> usize {
    if rs >= ALIASING {
        k
    } else {
        (k * rs).div_ceil(ALIASING)
    }
}

/// Whether the product suits this kernel on this CPU.
pub fn suits(m: usize, n: usize, k: usize, rhs: &View<f32>) -> bool {
    m * k <= MAX_LHS
        && rhs.cs == 1
        && n >= NR
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
}

fn block_cols(k: usize) -> usize {
    (SCRATCH / k.max(1) / NR * NR).clamp(NR, BLOCK)
}

thread_local! {
    /// The packed block of rhs, per thread (like the gemm crate's own packing buffers, outside
    /// the device accounting: k × [`block_cols`] elements).
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// dst (m×n, `dst_rs` between rows) = [dst +] lhs · rhs, where [`suits`] said so.
///
/// # Safety
/// As [`super::gemm_raw`]: `dst` valid for writes at every `i·dst_rs + j` (i < m, j < n), no
/// other thread touching them; lhs and rhs hold m×k and k×n (checked by the caller).
#[allow(clippy::too_many_arguments)]
pub unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: View<f32>,
    rhs: View<f32>,
    accumulate: bool,
    parallel: bool,
) {
    let cols = block_cols(k);
    let out = super::SharedOut(dst);
    let block = |b: usize| {
        let (p0, len) = (b * cols, cols.min(n - b * cols));
        // SAFETY: block b writes columns [p0, p0 + len) of dst, disjoint from every other
        // block's; AVX2 and FMA were checked by `suits`.
        let run = |data: &[f32], ld: usize| unsafe {
            block_product(m, len, k, out.at(p0), dst_rs, lhs, data, ld, accumulate)
        };
        if !rhs.rs.is_multiple_of(ALIASING) && pages(k, rhs.rs) <= TLB_PAGES {
            return run(&rhs.data[p0..], rhs.rs);
        }
        PACKED.with(|packed| {
            let mut packed = packed.borrow_mut();
            packed.resize(k * cols, 0.0);
            for c in 0..k {
                packed[c * cols..c * cols + len]
                    .copy_from_slice(&rhs.data[c * rhs.rs + p0..][..len]);
            }
            run(&packed, cols)
        })
    };
    let blocks = n.div_ceil(cols);
    if parallel {
        (0..blocks).into_par_iter().for_each(block);
    } else {
        (0..blocks).for_each(block);
    }
}

/// dst (m×n) = [dst +] lhs · rhs, rhs's rows `ld` apart (in place or in the packed block).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_product(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: View<f32>,
    rhs: &[f32],
    ld: usize,
    accumulate: bool,
) {
    let (rs, cs) = (lhs.rs, lhs.cs);
    let w = |i: usize, c: usize| lhs.data.as_ptr().add(i * rs + c * cs);
    for i0 in (0..m).step_by(MR) {
        let (rows, l) = (MR.min(m - i0), w(i0, 0));
        let mut p = 0;
        while p + NR <= n {
            let (d, x) = (dst.add(i0 * dst_rs + p), rhs.as_ptr().add(p));
            match rows {
                6 => kernel::<6>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
                5 => kernel::<5>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
                4 => kernel::<4>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
                3 => kernel::<3>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
                2 => kernel::<2>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
                _ => kernel::<1>(k, d, dst_rs, l, rs, cs, x, ld, accumulate),
            }
            p += NR;
        }
        // The last columns, the same chain per element.
        for q in p..n {
            for i in i0..i0 + rows {
                let d = dst.add(i * dst_rs + q);
                let mut s = if accumulate { *d } else { 0.0 };
                for c in 0..k {
                    s = (*w(i, c)).mul_add(rhs[c * ld + q], s);
                }
                *d = s;
            }
        }
    }
}

/// R rows × NR columns of dst over all of k, in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel<const R: usize>(
    k: usize,
    dst: *mut f32,
    dst_rs: usize,
    lhs: *const f32,
    lrs: usize,
    lcs: usize,
    rhs: *const f32,
    ld: usize,
    accumulate: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    if accumulate {
        for (r, a) in acc.iter_mut().enumerate() {
            a[0] = _mm256_loadu_ps(dst.add(r * dst_rs));
            a[1] = _mm256_loadu_ps(dst.add(r * dst_rs + 8));
        }
    }
    for c in 0..k {
        let x0 = _mm256_loadu_ps(rhs.add(c * ld));
        let x1 = _mm256_loadu_ps(rhs.add(c * ld + 8));
        for (r, a) in acc.iter_mut().enumerate() {
            let w = _mm256_broadcast_ss(&*lhs.add(r * lrs + c * lcs));
            a[0] = _mm256_fmadd_ps(w, x0, a[0]);
            a[1] = _mm256_fmadd_ps(w, x1, a[1]);
        }
    }
    for (r, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(dst.add(r * dst_rs), a[0]);
        _mm256_storeu_ps(dst.add(r * dst_rs + 8), a[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u64) -> Vec<f32> {
        (0..len as u64)
            .map(|i| ((i * 2_654_435_761 + seed * 40_503) % 1999) as f32 / 999.5 - 1.0)
            .collect()
    }

    /// Against f64 sums, for row counts around the kernel's 6 (tails of 1–5 rows), columns
    /// around its 16 and its blocks (a scalar tail), a transposed lhs, rows of rhs and dst
    /// apart by more than n (rhs's copied or read in place), with and without accumulating,
    /// on one thread and on all.
    #[test]
    fn products_match_f64_sums() {
        if !std::arch::is_x86_feature_detected!("avx2")
            || !std::arch::is_x86_feature_detected!("fma")
        {
            return;
        }
        for (m, n, k) in [
            (1, 16, 1),
            (5, 40, 7),
            (6, 256, 64),
            (13, 600, 33),
            (16, 1000, 144),
        ] {
            for (transposed, accumulate, parallel) in [(false, false, false), (true, true, true)] {
                // rhs's rows 4 KiB apart (copied) or not: read in place, but for the deepest
                // case, whose 144 rows span more pages than the TLB holds (copied).
                let ld = if transposed {
                    (n + 3usize).next_multiple_of(ALIASING)
                } else {
                    n + 3
                };
                let dst_rs = n + 5;
                let w = values(m * k, 1);
                let x = values(k * ld, 2);
                let mut dst = values(m * dst_rs, 3);
                let before = dst.clone();
                let lhs = if transposed {
                    View::rows(&w, m).t() // w holds lhsᵀ: lhs[i][c] = w[c·m + i]
                } else {
                    View::rows(&w, k)
                };
                let rhs = View::rows(&x, ld);
                assert!(suits(m, n, k, &rhs));
                // SAFETY: dst holds m rows of dst_rs ≥ n elements.
                unsafe {
                    product(
                        m,
                        n,
                        k,
                        dst.as_mut_ptr(),
                        dst_rs,
                        lhs,
                        rhs,
                        accumulate,
                        parallel,
                    )
                };
                for i in 0..m {
                    for j in 0..dst_rs {
                        let got = dst[i * dst_rs + j] as f64;
                        if j >= n {
                            assert_eq!(got, before[i * dst_rs + j] as f64, "wrote past n");
                            continue;
                        }
                        let mut want = if accumulate {
                            before[i * dst_rs + j] as f64
                        } else {
                            0.0
                        };
                        for c in 0..k {
                            let l = lhs.data[i * lhs.rs + c * lhs.cs] as f64;
                            want += l * x[c * ld + j] as f64;
                        }
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{m}×{n}×{k} [{i}][{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
