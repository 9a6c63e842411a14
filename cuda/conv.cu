/*
 * conv.cu: 2-d convolution (NCHW, weights c_out x c_in/groups x kh x kw, any stride, padding,
 * dilation and groups) as a tiled implicit GEMM: the im2col matrix is never built; each tile
 * of it is gathered from the image straight into shared memory.
 *
 * Per group, the three passes are the GEMMs C (M x N) = A (M x K) B (K x N):
 *   forward          y  = W  im2col(x)     M = c_out/G, N = n h_out w_out, K = c_in/G kh kw
 *   backward-data    dx = W^T "col2im"(dy) M = c_in/G,  N = n h w,         K = c_out/G kh kw
 *                    (the gather form: input pixel (h, w) takes dy at (oh, ow) with
 *                    oh stride = h + pad - r dilation, when that divides; no scatter, no atomics)
 *   backward-filter  dw += dy im2col(x)^T  M = c_out/G, N = c_in/G kh kw, K = n h_out w_out
 *
 * Entry points. x, dy, y, dx are activations in the stamp's type T; w (the master weights) and
 * dw (their gradient) are always f32; every product is accumulated in f32. x, w, dy are read;
 * y, dx and dw_partial are overwritten.
 *   conv2d_forward_SUF(const T* x, const float* w, T* y, GemsConvGeom g)
 *   conv2d_backward_data_SUF(const T* dy, const float* w, T* dx, GemsConvGeom g)
 *   conv2d_backward_filter_SUF(const T* x, const T* dy, float* dw_partial, GemsConvGeom g)
 * for SUF (T, math):
 *   f32   (float)      CUDA cores (FMA), no rounding at all
 *   tf32  (float)      TF32 tensor cores (mma.sync m16n8k8, sm_80+): both operands rounded
 *                      to tf32 (cvt.rna) as each fragment is loaded from shared memory
 *   bf16  (gems_bf16)  BF16 tensor cores (mma.sync m16n8k16, sm_80+)
 *   f16   (gems_f16)   F16 tensor cores (mma.sync m16n8k16, sm_80+)
 * What is rounded where, for bf16 and f16: the tiles are staged in shared memory as f32 (a
 * 16-bit activation widens exactly, a weight stays f32); both operands are rounded to T
 * (round to nearest even) when they are packed into mma fragments (pack_bf16, pack_f16), which
 * rounds the f32 weights and is exact for the activations. The mma accumulates in f32; y and
 * dx are rounded to T once, when stored; dw_partial stays f32. For f16 that means the weights
 * must lie within +-65504 and lose precision below 2^-14 (subnormals), as in any f16 conv.
 * The tensor cores are reached by inline PTX (mma_tf32, mma_bf16, mma_f16 in gems_device.h):
 * NVRTC without a CUDA toolkit has no mma.h.
 *
 * Launch (all twelve): blockDim.x = 256 (8 warps), gridDim = (ceil(N / 64), ceil(M / 64), G S).
 * A block computes one 64 x 64 tile of C for group blockIdx.z % G over slice
 * blockIdx.z / G of the K dimension in steps of 16. S (splits of K) must be 1 for forward and
 * backward-data (they overwrite); backward-filter splits its long K (every pixel of the batch)
 * over S blocks, each writing its partial tile to its own slice of a workspace
 * (S x c_out x c_in/G x kh x kw floats), and conv2d_reduce_splits_f32 then adds the S slices
 * to dw in order: no atomics, so the result is the same bits every run.
 *
 *   conv2d_reduce_splits_f32   dw[i] += partial[0][i] + ... + partial[S-1][i]; 1-d grid-stride,
 *                              blockDim.x = 256 (consecutive threads, consecutive i).
 *
 * Memory access: consecutive threads gather consecutive columns of the B tile (consecutive
 * output pixels of a row, for forward and backward-data), and consecutive K of the A tile
 * (contiguous weights), so global loads coalesce; for backward-filter both tiles are loaded
 * with K (the pixel index) fastest, which is contiguous in x and dy. A 16-bit activation
 * gather moves the same elements per warp in half the bytes. Shared tiles are stored K-major
 * as f32 with 8 floats of padding per row, so the tensor-core fragment loads (lanes reading
 * 4 K-rows x 8 columns) fall in 32 different banks. The CUDA-core path gives each thread a
 * 4 x 4 micro-tile strided by 16, so a warp's output stores are 16 consecutive elements.
 */
#include "gems_device.h"

#define BM 64
#define BN 64
#define BK 16
#define PAD 8
#define THREADS 256

enum { FWD = 0, BWD_DATA = 1, BWD_FILTER = 2 };
enum { SIMT = 0, TF32 = 1, BF16 = 2, F16 = 3 };

struct Dims {
    int m;
    int64_t n, k;
};

template <int MODE>
__device__ __forceinline__ Dims dims(const GemsConvGeom& g) {
    const int mg = g.c_out / g.groups, cg = g.c_in / g.groups, rs = g.kh * g.kw;
    const int64_t out = (int64_t)g.n * g.h_out * g.w_out;
    if (MODE == FWD) return Dims{mg, out, (int64_t)cg * rs};
    if (MODE == BWD_DATA) return Dims{cg, (int64_t)g.n * g.h * g.w, (int64_t)mg * rs};
    return Dims{mg, (int64_t)cg * rs, out};
}

/* Element (crs, p) of group grp's im2col matrix of x: input channel c at kernel tap (r, s)
 * for output pixel p = (n, oh, ow); zero in the padding. */
template <typename T>
__device__ __forceinline__ float im2col(const T* x, const GemsConvGeom& g, int grp, int64_t crs,
                                        int64_t p) {
    const int rs = g.kh * g.kw;
    const int c = (int)(crs / rs), t = (int)(crs % rs), r = t / g.kw, s = t % g.kw;
    const int64_t hw_out = (int64_t)g.h_out * g.w_out;
    const int64_t n = p / hw_out;
    const int q = (int)(p % hw_out), oh = q / g.w_out, ow = q % g.w_out;
    const int ih = oh * g.stride_h - g.pad_h + r * g.dilation_h;
    const int iw = ow * g.stride_w - g.pad_w + s * g.dilation_w;
    if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) return 0.0f;
    const int cg = g.c_in / g.groups;
    return ld(x, ((n * g.c_in + grp * cg + c) * g.h + ih) * (int64_t)g.w + iw);
}

/* A (m, k): the weights (forward, backward-data) or dy (backward-filter). */
template <int MODE, typename T>
__device__ __forceinline__ float load_a(const T* a, const GemsConvGeom& g, int grp, int m,
                                        int64_t k) {
    const int mg = g.c_out / g.groups, cg = g.c_in / g.groups, rs = g.kh * g.kw;
    if (MODE == FWD) return ld(a, ((int64_t)grp * mg + m) * cg * rs + k);
    if (MODE == BWD_DATA) {
        const int ko = (int)(k / rs), t = (int)(k % rs);
        return ld(a, (((int64_t)grp * mg + ko) * cg + m) * rs + t);
    }
    const int64_t hw_out = (int64_t)g.h_out * g.w_out;
    const int64_t n = k / hw_out, q = k % hw_out;
    return ld(a, (n * g.c_out + grp * mg + m) * hw_out + q);
}

/* B (k, j): im2col(x) (forward), dy gathered for input pixel j (backward-data), or
 * im2col(x)^T (backward-filter). */
template <int MODE, typename T>
__device__ __forceinline__ float load_b(const T* b, const GemsConvGeom& g, int grp, int64_t k,
                                        int64_t j) {
    if (MODE == FWD) return im2col(b, g, grp, k, j);
    if (MODE == BWD_FILTER) return im2col(b, g, grp, j, k);
    const int mg = g.c_out / g.groups, rs = g.kh * g.kw;
    const int ko = (int)(k / rs), t = (int)(k % rs), r = t / g.kw, s = t % g.kw;
    const int64_t hw = (int64_t)g.h * g.w;
    const int64_t n = j / hw;
    const int q = (int)(j % hw), h = q / g.w, w = q % g.w;
    const int th = h + g.pad_h - r * g.dilation_h, tw = w + g.pad_w - s * g.dilation_w;
    if (th < 0 || tw < 0 || th % g.stride_h != 0 || tw % g.stride_w != 0) return 0.0f;
    const int oh = th / g.stride_h, ow = tw / g.stride_w;
    if (oh >= g.h_out || ow >= g.w_out) return 0.0f;
    return ld(b, ((n * g.c_out + grp * mg + ko) * g.h_out + oh) * (int64_t)g.w_out + ow);
}

/* Writes C (m, j): y and dx are overwritten, dw is accumulated. */
template <int MODE, typename TO>
__device__ __forceinline__ void store_c(TO* out, const GemsConvGeom& g, int grp, const Dims& d,
                                        int m, int64_t j, float v) {
    if (m >= d.m || j >= d.n) return;
    if (MODE == FWD) {
        const int64_t hw_out = (int64_t)g.h_out * g.w_out, n = j / hw_out, q = j % hw_out;
        st(out, (n * g.c_out + (int64_t)grp * d.m + m) * hw_out + q, v);
    } else if (MODE == BWD_DATA) {
        const int64_t hw = (int64_t)g.h * g.w, n = j / hw, q = j % hw;
        st(out, (n * g.c_in + (int64_t)grp * d.m + m) * hw + q, v);
    } else {
        st(out, ((int64_t)grp * d.m + m) * d.n + j, v);
    }
}

/* A 16-bit tensor-core operand register: two values rounded to MATH's type (BF16 or F16). */
template <int MATH>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) {
    return MATH == BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
}

template <int MATH>
__device__ __forceinline__ void mma16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                      uint32_t a3, uint32_t b0, uint32_t b1) {
    if (MATH == BF16)
        mma_bf16(c, a0, a1, a2, a3, b0, b1);
    else
        mma_f16(c, a0, a1, a2, a3, b0, b1);
}

/* C = A B for one tile. A and B may differ in element type (forward and backward-data: A is
 * the f32 weights, B the activations x or dy; backward-filter: both are activations); out is
 * y or dx (an activation) or the f32 partial dw. */
template <int MODE, int MATH, typename TA, typename TB, typename TO>
__device__ void conv_gemm(const TA* asrc, const TB* bsrc, TO* out, const GemsConvGeom& g) {
    __shared__ float As[BK][BM + PAD];
    __shared__ float Bs[BK][BN + PAD];
    const int tid = threadIdx.x;
    const int grp = blockIdx.z % g.groups;
    const int split = blockIdx.z / g.groups, splits = gridDim.z / g.groups;
    const Dims d = dims<MODE>(g);
    const int m0 = blockIdx.y * BM;
    const int64_t n0 = (int64_t)blockIdx.x * BN;
    const int64_t ktiles = (d.k + BK - 1) / BK;
    const int64_t per = (ktiles + splits - 1) / splits;
    const int64_t kt0 = split * per, kt1 = kt0 + per < ktiles ? kt0 + per : ktiles;
    /* Backward-filter: this split's slice of the partial sums. */
    if (MODE == BWD_FILTER) out += (int64_t)split * g.groups * d.m * d.n;

    /* CUDA cores: a 4 x 4 micro-tile per thread at rows ty + 16 i, columns tx + 16 j.
     * Tensor cores: warp (wm, wn) owns rows wm 32 .. + 32 and columns wn 16 .. + 16 as
     * 2 x 2 mma tiles of 16 x 8; acc[mi][ni][0..4] in the mma C-fragment layout. */
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    const int tx = tid % 16, ty = tid / 16;
    const int warp = tid / 32, lane = tid % 32, wm = warp / 4, wn = warp % 4;
    const int gid = lane >> 2, tig = lane & 3;

    for (int64_t kt = kt0; kt < kt1; kt++) {
        const int64_t k0 = kt * BK;
#pragma unroll
        for (int i = 0; i < (BM * BK) / THREADS; i++) {
            const int e = tid + i * THREADS, kk = e % BK, mm = e / BK;
            As[kk][mm] = (m0 + mm < d.m && k0 + kk < d.k)
                             ? load_a<MODE>(asrc, g, grp, m0 + mm, k0 + kk)
                             : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < (BN * BK) / THREADS; i++) {
            const int e = tid + i * THREADS;
            const int kk = MODE == BWD_FILTER ? e % BK : e / BN;
            const int nn = MODE == BWD_FILTER ? e / BK : e % BN;
            Bs[kk][nn] = (n0 + nn < d.n && k0 + kk < d.k)
                             ? load_b<MODE>(bsrc, g, grp, k0 + kk, n0 + nn)
                             : 0.0f;
        }
        __syncthreads();
        if (MATH == SIMT) {
#pragma unroll
            for (int kk = 0; kk < BK; kk++) {
                float a[4], b[4];
#pragma unroll
                for (int i = 0; i < 4; i++) a[i] = As[kk][ty + 16 * i];
#pragma unroll
                for (int j = 0; j < 4; j++) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
            }
        } else if (MATH == TF32) {
#pragma unroll
            for (int ks = 0; ks < BK; ks += 8) {
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const int r = wm * 32 + mi * 16 + gid;
                    const uint32_t a0 = to_tf32(As[ks + tig][r]);
                    const uint32_t a1 = to_tf32(As[ks + tig][r + 8]);
                    const uint32_t a2 = to_tf32(As[ks + tig + 4][r]);
                    const uint32_t a3 = to_tf32(As[ks + tig + 4][r + 8]);
#pragma unroll
                    for (int ni = 0; ni < 2; ni++) {
                        const int c = wn * 16 + ni * 8 + gid;
                        const uint32_t b0 = to_tf32(Bs[ks + tig][c]);
                        const uint32_t b1 = to_tf32(Bs[ks + tig + 4][c]);
                        mma_tf32(acc[mi * 2 + ni], a0, a1, a2, a3, b0, b1);
                    }
                }
            }
        } else {
            /* BF16 or F16: the only place an operand is rounded to 16 bits. */
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int r = wm * 32 + mi * 16 + gid, k = 2 * tig;
                const uint32_t a0 = pack16<MATH>(As[k][r], As[k + 1][r]);
                const uint32_t a1 = pack16<MATH>(As[k][r + 8], As[k + 1][r + 8]);
                const uint32_t a2 = pack16<MATH>(As[k + 8][r], As[k + 9][r]);
                const uint32_t a3 = pack16<MATH>(As[k + 8][r + 8], As[k + 9][r + 8]);
#pragma unroll
                for (int ni = 0; ni < 2; ni++) {
                    const int c = wn * 16 + ni * 8 + gid;
                    const uint32_t b0 = pack16<MATH>(Bs[k][c], Bs[k + 1][c]);
                    const uint32_t b1 = pack16<MATH>(Bs[k + 8][c], Bs[k + 9][c]);
                    mma16<MATH>(acc[mi * 2 + ni], a0, a1, a2, a3, b0, b1);
                }
            }
        }
        __syncthreads();
    }

    if (MATH == SIMT) {
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                store_c<MODE>(out, g, grp, d, m0 + ty + 16 * i, n0 + tx + 16 * j, acc[i][j]);
    } else {
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++) {
                const int r = m0 + wm * 32 + mi * 16 + gid;
                const int64_t c = n0 + wn * 16 + ni * 8 + 2 * tig;
                const float* cf = acc[mi * 2 + ni];
                store_c<MODE>(out, g, grp, d, r, c, cf[0]);
                store_c<MODE>(out, g, grp, d, r, c + 1, cf[1]);
                store_c<MODE>(out, g, grp, d, r + 8, c, cf[2]);
                store_c<MODE>(out, g, grp, d, r + 8, c + 1, cf[3]);
            }
    }
}

/* One body per (suffix, math, activation type T); the weights and dw are f32 in all four. */
#define STAMP(SUF, MATH, T)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS)                                    \
        conv2d_forward_##SUF(const T* x, const float* w, T* y, GemsConvGeom g) {              \
        conv_gemm<FWD, MATH>(w, x, y, g);                                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS)                                    \
        conv2d_backward_data_##SUF(const T* dy, const float* w, T* dx, GemsConvGeom g) {      \
        conv_gemm<BWD_DATA, MATH>(w, dy, dx, g);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) conv2d_backward_filter_##SUF(      \
        const T* x, const T* dy, float* dw_partial, GemsConvGeom g) {                         \
        conv_gemm<BWD_FILTER, MATH>(dy, x, dw_partial, g);                                    \
    }

STAMP(f32, SIMT, float)
STAMP(tf32, TF32, float)
STAMP(bf16, BF16, gems_bf16)
STAMP(f16, F16, gems_f16)

extern "C" __global__ void conv2d_reduce_splits_f32(const float* partial, float* dw,
                                                    int64_t numel, int32_t splits) {
    GEMS_FOR(i, numel) {
        float acc = dw[i];
        for (int s = 0; s < splits; s++) acc += partial[(int64_t)s * numel + i];
        dw[i] = acc;
    }
}
