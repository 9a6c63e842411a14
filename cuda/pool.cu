/*
 * pool.cu: max, average, adaptive-average and global-average pooling over NCHW, with the CPU
 * backend's semantics (src/backend/cpu/pool.rs): windows clipped to the image; max routes the
 * gradient to the first maximum of its window; average counts padding and divides by the
 * window clipped to the padded input (PyTorch's count_include_pad = True, ceil mode);
 * adaptive windows are [floor(i in / out), ceil((i + 1) in / out)).
 *
 * Every kernel is stamped for SUF in {f32, bf16, f16}: x, y, dy, dx in T (float, gems_bf16,
 * gems_f16), widened to f32 as loaded; sums and the max compare are f32, and y and dx are
 * rounded to T once, when stored (max pooling's y is an x, so it rounds nothing).
 *
 *   max_pool_forward_SUF            one thread per output element
 *   max_pool_backward_SUF           one thread per INPUT element: it visits the outputs whose
 *                                   windows cover it and adds dy where it is their argmax.
 *                                   A gather, not a scatter: no atomics, deterministic, and
 *                                   dx needs no zeroing (every element is written once).
 *   avg_pool_forward_SUF            one thread per output element
 *   avg_pool_backward_SUF           one thread per input element (gather, as max)
 *   adaptive_avg_pool_forward_SUF   one thread per output element
 *   adaptive_avg_pool_backward_SUF  one thread per input element (gather)
 *   global_avg_pool_forward_SUF     one block per (n, c) plane (gridDim.x = n c,
 *                                   blockDim.x = 256): a block reduction over the
 *                                   contiguous plane, coalesced
 *   global_avg_pool_backward_SUF    dx = dy[plane] / hw, one thread per input element
 *
 * Per-element kernels are 1-d grid-stride loops, blockDim.x = 256; consecutive threads take
 * consecutive ow (or iw) of a row, so the plane is read along rows.
 */
#include "gems_device.h"

/* First and one-past-last input row (or column) of window o, clipped to [0, n). */
__device__ __forceinline__ void clip(int o, int s, int k, int p, int n, int* a, int* b) {
    int start = o * s - p;
    *a = start > 0 ? start : 0;
    int end = start + k < n ? start + k : n;
    *b = end > 0 ? end : 0;
}

/* The first maximum of window (oh, ow) of plane x, as a flat index into the plane (-1 when
 * the window is empty). */
template <typename T>
__device__ int argmax(const T* x, const GemsPoolGeom& g, int oh, int ow) {
    int h0, h1, w0, w1;
    clip(oh, g.stride_h, g.kh, g.pad_h, g.h, &h0, &h1);
    clip(ow, g.stride_w, g.kw, g.pad_w, g.w, &w0, &w1);
    int best = -1;
    float bv = 0.0f;
    for (int ih = h0; ih < h1; ih++)
        for (int iw = w0; iw < w1; iw++) {
            float v = ld(x, ih * g.w + iw);
            if (best < 0 || v > bv) {
                bv = v;
                best = ih * g.w + iw;
            }
        }
    return best;
}

/* The divisor of window (oh, ow): its size clipped to the padded input. */
__device__ __forceinline__ float area(const GemsPoolGeom& g, int oh, int ow) {
    int sh = oh * g.stride_h, sw = ow * g.stride_w;
    int eh = sh + g.kh < g.h + 2 * g.pad_h ? sh + g.kh : g.h + 2 * g.pad_h;
    int ew = sw + g.kw < g.w + 2 * g.pad_w ? sw + g.kw : g.w + 2 * g.pad_w;
    return (float)((eh - sh) * (ew - sw));
}

/* Outputs o whose window [o s - p, o s - p + k) covers input i: o in [lo, hi). */
__device__ __forceinline__ void covering(int i, int s, int k, int p, int n_out, int* lo,
                                         int* hi) {
    int a = i + p - k + 1; /* o s >= a */
    *lo = a > 0 ? (a + s - 1) / s : 0;
    int b = (i + p) / s + 1; /* o s <= i + p */
    *hi = b < n_out ? b : n_out;
}

template <typename T>
__device__ void max_pool_forward(const T* x, T* y, GemsPoolGeom g) {
    const int64_t out = (int64_t)g.h_out * g.w_out;
    GEMS_FOR(i, (int64_t)g.n * g.c * out) {
        int64_t plane = i / out;
        int r = (int)(i - plane * out), oh = r / g.w_out, ow = r % g.w_out;
        const T* xp = x + plane * g.h * g.w;
        int a = argmax(xp, g, oh, ow);
        st(y, i, a >= 0 ? ld(xp, a) : -__int_as_float(0x7f800000));
    }
}

template <typename T>
__device__ void max_pool_backward(const T* x, const T* dy, T* dx, GemsPoolGeom g) {
    const int64_t in = (int64_t)g.h * g.w;
    GEMS_FOR(i, (int64_t)g.n * g.c * in) {
        int64_t plane = i / in;
        int r = (int)(i - plane * in), ih = r / g.w, iw = r % g.w;
        const T* xp = x + plane * in;
        const T* dyp = dy + plane * g.h_out * g.w_out;
        int oh0, oh1, ow0, ow1;
        covering(ih, g.stride_h, g.kh, g.pad_h, g.h_out, &oh0, &oh1);
        covering(iw, g.stride_w, g.kw, g.pad_w, g.w_out, &ow0, &ow1);
        float acc = 0.0f;
        for (int oh = oh0; oh < oh1; oh++)
            for (int ow = ow0; ow < ow1; ow++)
                if (argmax(xp, g, oh, ow) == r) acc += ld(dyp, oh * g.w_out + ow);
        st(dx, i, acc);
    }
}

template <typename T>
__device__ void avg_pool_forward(const T* x, T* y, GemsPoolGeom g) {
    const int64_t out = (int64_t)g.h_out * g.w_out;
    GEMS_FOR(i, (int64_t)g.n * g.c * out) {
        int64_t plane = i / out;
        int r = (int)(i - plane * out), oh = r / g.w_out, ow = r % g.w_out;
        const T* xp = x + plane * g.h * g.w;
        int h0, h1, w0, w1;
        clip(oh, g.stride_h, g.kh, g.pad_h, g.h, &h0, &h1);
        clip(ow, g.stride_w, g.kw, g.pad_w, g.w, &w0, &w1);
        float s = 0.0f;
        for (int ih = h0; ih < h1; ih++)
            for (int iw = w0; iw < w1; iw++) s += ld(xp, ih * g.w + iw);
        st(y, i, s / area(g, oh, ow));
    }
}

template <typename T>
__device__ void avg_pool_backward(const T* dy, T* dx, GemsPoolGeom g) {
    const int64_t in = (int64_t)g.h * g.w;
    GEMS_FOR(i, (int64_t)g.n * g.c * in) {
        int64_t plane = i / in;
        int r = (int)(i - plane * in), ih = r / g.w, iw = r % g.w;
        const T* dyp = dy + plane * g.h_out * g.w_out;
        int oh0, oh1, ow0, ow1;
        covering(ih, g.stride_h, g.kh, g.pad_h, g.h_out, &oh0, &oh1);
        covering(iw, g.stride_w, g.kw, g.pad_w, g.w_out, &ow0, &ow1);
        float acc = 0.0f;
        for (int oh = oh0; oh < oh1; oh++)
            for (int ow = ow0; ow < ow1; ow++)
                acc += ld(dyp, oh * g.w_out + ow) / area(g, oh, ow);
        st(dx, i, acc);
    }
}

/* Adaptive window of output o over n inputs mapped to out outputs. */
__device__ __forceinline__ void adaptive(int o, int n, int out, int* a, int* b) {
    *a = (int)((int64_t)o * n / out);
    *b = (int)(((int64_t)(o + 1) * n + out - 1) / out);
}

template <typename T>
__device__ void adaptive_avg_pool_forward(const T* x, T* y, GemsPoolGeom g) {
    const int64_t out = (int64_t)g.h_out * g.w_out;
    GEMS_FOR(i, (int64_t)g.n * g.c * out) {
        int64_t plane = i / out;
        int r = (int)(i - plane * out), oh = r / g.w_out, ow = r % g.w_out;
        const T* xp = x + plane * g.h * g.w;
        int h0, h1, w0, w1;
        adaptive(oh, g.h, g.h_out, &h0, &h1);
        adaptive(ow, g.w, g.w_out, &w0, &w1);
        float s = 0.0f;
        for (int ih = h0; ih < h1; ih++)
            for (int iw = w0; iw < w1; iw++) s += ld(xp, ih * g.w + iw);
        st(y, i, s / (float)((h1 - h0) * (w1 - w0)));
    }
}

template <typename T>
__device__ void adaptive_avg_pool_backward(const T* dy, T* dx, GemsPoolGeom g) {
    const int64_t in = (int64_t)g.h * g.w;
    GEMS_FOR(i, (int64_t)g.n * g.c * in) {
        int64_t plane = i / in;
        int r = (int)(i - plane * in), ih = r / g.w, iw = r % g.w;
        const T* dyp = dy + plane * g.h_out * g.w_out;
        /* The outputs whose adaptive windows cover ih are contiguous and start at
         * floor(ih out / n): scan from there until a window starts past ih. */
        float acc = 0.0f;
        for (int oh = (int)((int64_t)ih * g.h_out / g.h); oh < g.h_out; oh++) {
            int h0, h1;
            adaptive(oh, g.h, g.h_out, &h0, &h1);
            if (h0 > ih) break;
            if (ih >= h1) continue;
            for (int ow = (int)((int64_t)iw * g.w_out / g.w); ow < g.w_out; ow++) {
                int w0, w1;
                adaptive(ow, g.w, g.w_out, &w0, &w1);
                if (w0 > iw) break;
                if (iw >= w1) continue;
                acc += ld(dyp, oh * g.w_out + ow) / (float)((h1 - h0) * (w1 - w0));
            }
        }
        st(dx, i, acc);
    }
}

template <typename T>
__device__ void global_avg_pool_forward(const T* x, T* y, GemsPoolGeom g) {
    __shared__ float scratch[32];
    const int64_t hw = (int64_t)g.h * g.w;
    const T* xp = x + blockIdx.x * hw;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < hw; j += blockDim.x) s += ld(xp, j);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) st(y, blockIdx.x, s / (float)hw);
}

template <typename T>
__device__ void global_avg_pool_backward(const T* dy, T* dx, GemsPoolGeom g) {
    const int64_t hw = (int64_t)g.h * g.w;
    GEMS_FOR(i, (int64_t)g.n * g.c * hw) st(dx, i, ld(dy, i / hw) / (float)hw);
}

/* The eight entry points of one activation type T. */
#define STAMP(T, SUF)                                                                         \
    extern "C" __global__ void max_pool_forward_##SUF(const T* x, T* y, GemsPoolGeom g) {     \
        max_pool_forward(x, y, g);                                                            \
    }                                                                                         \
    extern "C" __global__ void max_pool_backward_##SUF(const T* x, const T* dy, T* dx,        \
                                                       GemsPoolGeom g) {                      \
        max_pool_backward(x, dy, dx, g);                                                      \
    }                                                                                         \
    extern "C" __global__ void avg_pool_forward_##SUF(const T* x, T* y, GemsPoolGeom g) {     \
        avg_pool_forward(x, y, g);                                                            \
    }                                                                                         \
    extern "C" __global__ void avg_pool_backward_##SUF(const T* dy, T* dx, GemsPoolGeom g) {  \
        avg_pool_backward(dy, dx, g);                                                         \
    }                                                                                         \
    extern "C" __global__ void adaptive_avg_pool_forward_##SUF(const T* x, T* y,              \
                                                               GemsPoolGeom g) {              \
        adaptive_avg_pool_forward(x, y, g);                                                   \
    }                                                                                         \
    extern "C" __global__ void adaptive_avg_pool_backward_##SUF(const T* dy, T* dx,           \
                                                                GemsPoolGeom g) {             \
        adaptive_avg_pool_backward(dy, dx, g);                                                \
    }                                                                                         \
    extern "C" __global__ void global_avg_pool_forward_##SUF(const T* x, T* y,                \
                                                             GemsPoolGeom g) {                \
        global_avg_pool_forward(x, y, g);                                                     \
    }                                                                                         \
    extern "C" __global__ void global_avg_pool_backward_##SUF(const T* dy, T* dx,             \
                                                              GemsPoolGeom g) {               \
        global_avg_pool_backward(dy, dx, g);                                                  \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
