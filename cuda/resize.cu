/*
 * resize.cu: bilinear resizing of each plane of an NCHW batch from h x w to h_out x w_out,
 * PyTorch's F.interpolate(mode="bilinear") with an output size (GemsResizeGeom). Its own
 * family: interpolation reads a fixed 2 x 2 neighbourhood at a computed place, not a window.
 *
 *   resize_bilinear_forward_SUF(const T* x, T* y, GemsResizeGeom g)
 *                                        one thread per output element, 1-d grid-stride over
 *                                        n c h_out w_out, blockDim.x = 256: the four source
 *                                        pixels and weights of PyTorch's
 *                                        area_pixel_compute_source_index (in float).
 *   resize_bilinear_backward_SUF(const T* dy, T* dx, GemsResizeGeom g)
 *                                        one thread per input element, 1-d grid-stride over
 *                                        n c h w, blockDim.x = 256: the input pixel gathers
 *                                        the output gradients that read it (no atomics, so
 *                                        the same bits every run) from the output rows and
 *                                        columns whose taps reach it, found by binary search
 *                                        (the source index grows with the output index).
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
    GEMS_FOR(i, (int64_t)g.n * g.c * g.h_out * g.w_out) {
        const int ow = (int)(i % g.w_out);
        const int oh = (int)(i / g.w_out % g.h_out);
        const int64_t plane = i / ((int64_t)g.w_out * g.h_out);
        const T* p = x + plane * g.h * g.w;
        const ResizeTap r = resize_source(oh, g.h, g.h_out, g.align_corners);
        const ResizeTap c = resize_source(ow, g.w, g.w_out, g.align_corners);
        const int64_t row0 = (int64_t)r.i0 * g.w, row1 = (int64_t)r.i1 * g.w;
        st(y, i,
           r.l0 * (c.l0 * ld(p, row0 + c.i0) + c.l1 * ld(p, row0 + c.i1)) +
               r.l1 * (c.l0 * ld(p, row1 + c.i0) + c.l1 * ld(p, row1 + c.i1)));
    }
}

template <typename T>
__device__ void resize_bilinear_backward(const T* dy, T* dx, GemsResizeGeom g) {
    GEMS_FOR(i, (int64_t)g.n * g.c * g.h * g.w) {
        const int iw = (int)(i % g.w);
        const int ih = (int)(i / g.w % g.h);
        const int64_t plane = i / ((int64_t)g.w * g.h);
        const T* d = dy + plane * g.h_out * g.w_out;
        const int oh0 = resize_first_reaching(ih, g.h, g.h_out, g.align_corners);
        const int oh1 = resize_first_past(ih, g.h, g.h_out, g.align_corners);
        const int ow0 = resize_first_reaching(iw, g.w, g.w_out, g.align_corners);
        const int ow1 = resize_first_past(iw, g.w, g.w_out, g.align_corners);
        float sum = 0.0f;
        for (int oh = oh0; oh < oh1; oh++) {
            const ResizeTap r = resize_source(oh, g.h, g.h_out, g.align_corners);
            float row = 0.0f;
            for (int ow = ow0; ow < ow1; ow++) {
                const ResizeTap c = resize_source(ow, g.w, g.w_out, g.align_corners);
                row += resize_weight(c, iw) * ld(d, (int64_t)oh * g.w_out + ow);
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
