/*
 * resize.cu: bilinear resizing of each plane of an NCHW batch from h x w to h_out x w_out,
 * PyTorch's F.interpolate(mode="bilinear") with an output size (GemsResizeGeom). Its own
 * family: interpolation reads a fixed 2 x 2 neighbourhood at a computed place, not a window.
 *
 *   resize_bilinear_forward_SUF(const T* x, T* y, GemsResizeGeom g)
 *                                        one thread per element of the output window, 1-d
 *                                        grid-stride over n c out_h out_w, blockDim.x = 256:
 *                                        the four source pixels and weights of PyTorch's
 *                                        area_pixel_compute_source_index (in float) on the
 *                                        whole maps, read from the input window.
 *   resize_bilinear_backward_SUF(const T* dy, T* dx, GemsResizeGeom g)
 *                                        one thread per element of the input window, 1-d
 *                                        grid-stride over n c in_h in_w, blockDim.x = 256:
 *                                        the input pixel gathers the output window's
 *                                        gradients that read it (no atomics, so the same bits
 *                                        every run) from the output rows and columns whose
 *                                        taps reach it, found by binary search on the whole
 *                                        output (the source index grows with the output
 *                                        index) and cut to the window.
 *
 * SUF in {f32, bf16, f16} is the storage type T (float, gems_bf16, gems_f16); arithmetic is
 * f32 and each result is rounded to T once, when stored. Neighbouring threads take
 * neighbouring columns: loads and stores are coalesced along rows.
 */
#include "gems_device.h"

/* Output index o's two source indices along an axis of `in` (of `out`) and their weights. */
struct ResizeTap {
    int i0, i1;
    float l0, l1;
};

__device__ __forceinline__ ResizeTap resize_source(int o, int in, int out,
                                                   int align_corners) {
    float src;
    if (align_corners) {
        const float scale = out > 1 ? (float)(in - 1) / (float)(out - 1) : 0.0f;
        src = scale * (float)o;
    } else {
        const float scale = (float)in / (float)out;
        src = fmaxf(scale * ((float)o + 0.5f) - 0.5f, 0.0f);
    }
    ResizeTap t;
    t.i0 = (int)src < in - 1 ? (int)src : in - 1;
    t.i1 = t.i0 + 1 < in ? t.i0 + 1 : t.i0;
    t.l1 = src - (float)t.i0;
    t.l0 = 1.0f - t.l1;
    return t;
}

/* The weight output o gives input i along an axis (0 when its taps miss i). */
__device__ __forceinline__ float resize_weight(ResizeTap t, int i) {
    return (t.i0 == i ? t.l0 : 0.0f) + (t.i1 == i ? t.l1 : 0.0f);
}

/* The first output index in [0, out) whose taps reach at or beyond input i (i1 >= i), and
 * the first whose taps start beyond it (i0 > i): the outputs that read i lie between. */
__device__ __forceinline__ int resize_first_reaching(int i, int in, int out, int ac) {
    int lo = 0, hi = out;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (resize_source(mid, in, out, ac).i1 >= i)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

__device__ __forceinline__ int resize_first_past(int i, int in, int out, int ac) {
    int lo = 0, hi = out;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (resize_source(mid, in, out, ac).i0 > i)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

template <typename T>
__device__ void resize_bilinear_forward(const T* x, T* y, GemsResizeGeom g) {
    GEMS_FOR(i, (int64_t)g.n * g.c * g.out_h * g.out_w) {
        const int ow = (int)(i % g.out_w) + g.out_col;
        const int oh = (int)(i / g.out_w % g.out_h) + g.out_row;
        const int64_t plane = i / ((int64_t)g.out_w * g.out_h);
        const T* p = x + plane * g.in_h * g.in_w;
        ResizeTap r = resize_source(oh, g.h, g.h_out, g.align_corners);
        ResizeTap c = resize_source(ow, g.w, g.w_out, g.align_corners);
        /* Rows and columns of the input window. */
        r.i0 -= g.in_row, r.i1 -= g.in_row, c.i0 -= g.in_col, c.i1 -= g.in_col;
        const int64_t row0 = (int64_t)r.i0 * g.in_w, row1 = (int64_t)r.i1 * g.in_w;
        st(y, i,
           r.l0 * (c.l0 * ld(p, row0 + c.i0) + c.l1 * ld(p, row0 + c.i1)) +
               r.l1 * (c.l0 * ld(p, row1 + c.i0) + c.l1 * ld(p, row1 + c.i1)));
    }
}

/* The outputs along an axis that read input i, within the output window [at, at + len). */
__device__ __forceinline__ void resize_readers(int i, int in, int out, int ac, int at, int len,
                                               int* first, int* end) {
    const int first_all = resize_first_reaching(i, in, out, ac);
    const int end_all = resize_first_past(i, in, out, ac);
    *first = first_all > at ? first_all : at;
    *end = end_all < at + len ? end_all : at + len;
}

template <typename T>
__device__ void resize_bilinear_backward(const T* dy, T* dx, GemsResizeGeom g) {
    GEMS_FOR(i, (int64_t)g.n * g.c * g.in_h * g.in_w) {
        const int iw = (int)(i % g.in_w) + g.in_col;
        const int ih = (int)(i / g.in_w % g.in_h) + g.in_row;
        const int64_t plane = i / ((int64_t)g.in_w * g.in_h);
        const T* d = dy + plane * g.out_h * g.out_w;
        int oh0, oh1, ow0, ow1;
        resize_readers(ih, g.h, g.h_out, g.align_corners, g.out_row, g.out_h, &oh0, &oh1);
        resize_readers(iw, g.w, g.w_out, g.align_corners, g.out_col, g.out_w, &ow0, &ow1);
        float sum = 0.0f;
        for (int oh = oh0; oh < oh1; oh++) {
            const ResizeTap r = resize_source(oh, g.h, g.h_out, g.align_corners);
            float row = 0.0f;
            for (int ow = ow0; ow < ow1; ow++) {
                const ResizeTap c = resize_source(ow, g.w, g.w_out, g.align_corners);
                row += resize_weight(c, iw) *
                       ld(d, (int64_t)(oh - g.out_row) * g.out_w + ow - g.out_col);
            }
            sum += resize_weight(r, ih) * row;
        }
        st(dx, i, sum);
    }
}

#define STAMP(T, SUF)                                                                      \
    extern "C" __global__ void resize_bilinear_forward_##SUF(const T* x, T* y,            \
                                                             GemsResizeGeom g) {           \
        resize_bilinear_forward(x, y, g);                                                  \
    }                                                                                      \
    extern "C" __global__ void resize_bilinear_backward_##SUF(const T* dy, T* dx,         \
                                                              GemsResizeGeom g) {          \
        resize_bilinear_backward(dy, dx, g);                                               \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
