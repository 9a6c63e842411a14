/*
 * gems_kernels.h: the parameter structs of the handwritten CUDA kernels in the cuda/
 * directory (one .cu file per op family).
 *
 * Kernels take these structs by value. The Rust side (src/backend/cuda/params.rs) is bindgen's
 * output for this header, committed and checked current by tests/cuda_kernels.rs.
 *
 * The geometry structs mirror the CPU backend's (src/backend/mod.rs: ConvGeom, PoolGeom,
 * ChannelGeom, SgdStep) field for field, with tuples split into _h/_w. Dimensions are 32-bit
 * (each one is < 2^31); kernels compute flat offsets in 64 bits, since a batch of 100,000^2
 * images has far more than 2^31 elements. Hyper-parameters are double, as on the CPU side;
 * an f32 kernel rounds them to float first, as the CPU backend's T::of does, so both compute
 * with the same constants.
 *
 * Plain C99, usable from NVRTC, which has no system headers.
 */
#ifndef GEMS_KERNELS_H
#define GEMS_KERNELS_H

#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

/* 2-d convolution over an NCHW batch; weights c_out x (c_in / groups) x kh x kw. */
typedef struct GemsConvGeom {
    int32_t n;
    int32_t c_in;
    int32_t h;
    int32_t w;
    int32_t c_out;
    int32_t kh;
    int32_t kw;
    int32_t stride_h;
    int32_t stride_w;
    int32_t pad_h;
    int32_t pad_w;
    int32_t dilation_h;
    int32_t dilation_w;
    int32_t groups;
    int32_t h_out;
    int32_t w_out;
} GemsConvGeom;

/* 2-d pooling window over an NCHW batch (adaptive pools use only n, c, h, w, h_out, w_out). */
typedef struct GemsPoolGeom {
    int32_t n;
    int32_t c;
    int32_t h;
    int32_t w;
    int32_t kh;
    int32_t kw;
    int32_t stride_h;
    int32_t stride_w;
    int32_t pad_h;
    int32_t pad_w;
    int32_t h_out;
    int32_t w_out;
} GemsPoolGeom;

/* A batch seen per channel: n x c x hw. */
typedef struct GemsChannelGeom {
    int32_t n;
    int32_t c;
    int32_t hw;
} GemsChannelGeom;

/* Batch normalization: geometry and epsilon (added to the biased batch variance). */
typedef struct GemsBatchNorm {
    GemsChannelGeom geom;
    double eps;
} GemsBatchNorm;

/* Running statistics update: running = (1 - momentum) running + momentum batch, with the
 * batch variance unbiased by count / (count - 1) (count = n * hw). */
typedef struct GemsBnRunning {
    int32_t c;
    int64_t count;
    double momentum;
} GemsBnRunning;

/* Group normalization (the backend's GroupGeom): n samples of c channels in `groups` groups
 * of c / groups consecutive channels, hw values per plane; eps is added to each (sample,
 * group)'s biased variance. */
typedef struct GemsGroupNorm {
    int32_t n;
    int32_t c;
    int32_t groups;
    int32_t hw;
    double eps;
} GemsGroupNorm;

/* One SGD step as PyTorch defines it:
 *   g = grad_scale grad + weight_decay w
 *   buf = g                                        on the first step (first_step != 0)
 *   buf = momentum buf + (1 - dampening) g         afterwards
 *   w -= lr (nesterov ? g + momentum buf : buf)
 * The CPU backend has no dampening and starts from a zero buffer, which is this formula with
 * dampening = 0 and first_step = 0. grad_scale unscales a gradient computed from a scaled loss
 * (mixed precision: 1 / the loss scale, a power of two, so exact); it is 1 without loss
 * scaling, and then g is bit for bit grad + weight_decay w. */
typedef struct GemsSgdStep {
    int64_t numel;
    double lr;
    double momentum;
    double weight_decay;
    double grad_scale;
    double dampening;
    int32_t nesterov;
    int32_t first_step;
} GemsSgdStep;

/* One Adam or AdamW step as PyTorch's torch.optim.Adam/AdamW (single-tensor path) computes
 * it, step t counted from 1:
 *   g = grad_scale grad; g += weight_decay w   (Adam's L2 term, when weight_decay != 0)
 *   w *= decay                                (AdamW's decoupled decay, 1 - lr wd; 1 for Adam)
 *   m += (1 - beta1) (g - m)                  (torch's lerp, weight < 0.5)
 *   v = beta2 v + (1 - beta2) g g
 *   w -= step_size (m / (sqrt(v) / bc2_sqrt + eps))
 * with step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) computed on the host
 * in double, as PyTorch does in Python floats: eps is added after the square root of the
 * bias-corrected second moment. */
typedef struct GemsAdamStep {
    int64_t numel;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double decay;
    double step_size;
    double bc2_sqrt;
    double grad_scale;
} GemsAdamStep;

/* Dropout: mask element i = 0 with probability p, else 1 / (1 - p). The mask holds the
 * window of win_h x win_w at (row, col) of each plane of an h x w map (the backend's
 * MaskGeom; the whole map: 0, 0, h, w); element (plane, r, c) of it draws
 * uniform(seed, (plane * h + row + r) * w + col + c), the CPU backend's counter-based
 * splitmix64 generator, so a pixel's draw does not depend on the window. */
typedef struct GemsDropout {
    int64_t numel;
    double p;
    uint64_t seed;
    int64_t h;
    int64_t w;
    int64_t row;
    int64_t col;
    int64_t win_h;
    int64_t win_w;
} GemsDropout;

/* Softmax cross-entropy over n samples of k classes at `positions` places each (the backend's
 * LossGeom); scale multiplies the gradient (the loss weight times the loss scale). */
typedef struct GemsLoss {
    int32_t n;
    int32_t k;
    int32_t positions;
    double scale;
} GemsLoss;

/* Bilinear resizing of each plane from h x w to h_out x w_out (the backend's ResizeGeom);
 * align_corners is 0 or 1. x (dx) holds the in_h x in_w window at (in_row, in_col) of each
 * input plane, y (dy) the out_h x out_w window at (out_row, out_col) of each output plane;
 * the taps follow the whole maps (h, w, h_out, w_out) and the input window holds them. */
typedef struct GemsResizeGeom {
    int32_t n;
    int32_t c;
    int32_t h;
    int32_t w;
    int32_t h_out;
    int32_t w_out;
    int32_t align_corners;
    int32_t in_row;
    int32_t in_col;
    int32_t in_h;
    int32_t in_w;
    int32_t out_row;
    int32_t out_col;
    int32_t out_h;
    int32_t out_w;
} GemsResizeGeom;

/* Channel concatenation (and its backward, the split): copies channels
 * [src_off, src_off + count) of src (n x src_c x hw) into channels
 * [dst_off, dst_off + count) of dst (n x dst_c x hw). */
typedef struct GemsCopyChannels {
    int32_t n;
    int32_t hw;
    int32_t src_c;
    int32_t src_off;
    int32_t dst_c;
    int32_t dst_off;
    int32_t count;
} GemsCopyChannels;

#endif /* GEMS_KERNELS_H */
