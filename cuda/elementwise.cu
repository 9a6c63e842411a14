/*
 * elementwise.cu: element-wise kernels, channel bias and its gradient, channel concatenation,
 * dropout, and the casts between f32 and the 16-bit types.
 *
 * Every kernel here is a grid-stride loop over its elements: launch 1-d, blockDim.x = 256,
 * gridDim.x = min(ceil(numel / 256), 32 x SMs); any grid covers all elements. Consecutive
 * threads touch consecutive elements, so every load and store is coalesced. (channel_sum is
 * the one reduction: one block per channel.)
 *
 * SUF is f32, bf16 or f16: the activation type T (float, gems_bf16, gems_f16). Loads widen
 * to f32, arithmetic is f32, and a store to a 16-bit tensor rounds to nearest even (the only
 * rounding). Biases and their gradients are parameters, f32 in every stamp.
 *
 *   add_SUF                   y = a + b
 *   add_relu_SUF              y = max(a + b, 0) (a residual connection and its ReLU; the
 *                             sum in f32, then the compare, then one rounding to T: the same
 *                             bits as add then relu_forward)
 *   add_assign_SUF            y += x (gradient accumulation)
 *   mul_SUF                   y = x * mask (dropout forward and backward)
 *   fill_SUF                  s = value
 *   add_channel_bias_SUF      y[n, c, :] += bias[c] (T* y, const float* bias)
 *   channel_sum_SUF           db[c] += sum over n and the plane of dy[n, c, :] (const T* dy,
 *                             float* db); one block per channel (gridDim.x = c,
 *                             blockDim.x = 256), a block reduction in double, then one add
 *                             per channel: no atomics, deterministic
 *   copy_channels_SUF         concat (and its backward): channels [src_off, src_off + count)
 *                             of src into [dst_off, dst_off + count) of dst (a bit copy)
 *   dropout_mask_SUF          mask[i] = uniform(seed, j) < p ? 0 : 1 / (1 - p), j element i's
 *                             index in the whole maps' mask (GemsDropout's window), the CPU
 *                             backend's generator, so masks match bit for bit; the mask is in
 *                             T: 1 / (1 - p) is computed as f32 (as T::of does) and then
 *                             rounded to T by the store
 *   cast_f32_bf16, cast_bf16_f32, cast_f32_f16, cast_f16_f32
 *                             (const FROM* x, TO* y, int64_t numel): y = x converted (exact
 *                             widening, or rounding to nearest even)
 */
#include "gems_device.h"

#define STAMP_BINARY(NAME, T, EXPR)                                                         \
    extern "C" __global__ void NAME(const T* a, const T* b, T* y, int64_t numel) {           \
        GEMS_FOR(i, numel) {                                                                  \
            float x0 = ld(a, i), x1 = ld(b, i);                                               \
            st(y, i, EXPR);                                                                   \
        }                                                                                     \
    }

STAMP_BINARY(add_f32, float, x0 + x1)
STAMP_BINARY(add_bf16, gems_bf16, x0 + x1)
STAMP_BINARY(add_f16, gems_f16, x0 + x1)
STAMP_BINARY(add_relu_f32, float, x0 + x1 > 0.0f ? x0 + x1 : 0.0f)
STAMP_BINARY(add_relu_bf16, gems_bf16, x0 + x1 > 0.0f ? x0 + x1 : 0.0f)
STAMP_BINARY(add_relu_f16, gems_f16, x0 + x1 > 0.0f ? x0 + x1 : 0.0f)
STAMP_BINARY(mul_f32, float, x0 * x1)
STAMP_BINARY(mul_bf16, gems_bf16, x0 * x1)
STAMP_BINARY(mul_f16, gems_f16, x0 * x1)

/* The remaining kernels of one activation type T. */
#define STAMP_TYPED(T, SUF)                                                                  \
    extern "C" __global__ void add_assign_##SUF(T* y, const T* x, int64_t numel) {           \
        GEMS_FOR(i, numel) st(y, i, ld(y, i) + ld(x, i));                                     \
    }                                                                                         \
    extern "C" __global__ void fill_##SUF(T* s, float value, int64_t numel) {                 \
        GEMS_FOR(i, numel) st(s, i, value);                                                   \
    }                                                                                         \
    /* One thread per element of the destination slice: consecutive threads read and write   \
     * consecutive elements of a channel run (the run is count x hw contiguous per sample). */ \
    extern "C" __global__ void copy_channels_##SUF(const T* src, T* dst, GemsCopyChannels g) { \
        int64_t run = (int64_t)g.count * g.hw;                                                \
        GEMS_FOR(i, (int64_t)g.n * run) {                                                     \
            int64_t n = i / run, j = i - n * run;                                             \
            dst[(n * g.dst_c + g.dst_off) * (int64_t)g.hw + j] =                              \
                src[(n * g.src_c + g.src_off) * (int64_t)g.hw + j];                           \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void dropout_mask_##SUF(T* mask, GemsDropout d) {                  \
        /* 1 / (1 - p) in double, rounded to f32 as T::of does; st then rounds it to T. */    \
        float keep = (float)(1.0 / (1.0 - d.p));                                              \
        GEMS_FOR(i, d.numel) {                                                                \
            /* The element's index in the whole maps' mask. */                                \
            const int64_t plane = i / (d.win_h * d.win_w), r = i / d.win_w % d.win_h;         \
            const int64_t at = (plane * d.h + d.row + r) * d.w + d.col + i % d.win_w;         \
            st(mask, i, uniform(d.seed, (uint64_t)at) < d.p ? 0.0f : keep);                   \
        }                                                                                     \
    }                                                                                         \
    extern "C" __global__ void add_channel_bias_##SUF(T* y, const float* bias,               \
                                                      GemsChannelGeom g) {                    \
        GEMS_FOR(i, (int64_t)g.n * g.c * g.hw) st(y, i, ld(y, i) + bias[(i / g.hw) % g.c]);   \
    }                                                                                         \
    extern "C" __global__ void channel_sum_##SUF(const T* dy, float* db, GemsChannelGeom g) {  \
        channel_sum(dy, db, g);                                                               \
    }

/* db[c] += the sum of channel c (block c) of dy, accumulated in double. Threads stride each
 * contiguous (n, c) plane: coalesced reads. */
template <typename T>
__device__ void channel_sum(const T* dy, float* db, GemsChannelGeom g) {
    __shared__ double scratch[32];
    int c = blockIdx.x;
    double acc = 0.0;
    for (int n = 0; n < g.n; n++) {
        const T* plane = dy + ((int64_t)n * g.c + c) * g.hw;
        for (int j = threadIdx.x; j < g.hw; j += blockDim.x) acc += ld(plane, j);
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) db[c] += (float)acc;
}

STAMP_TYPED(float, f32)
STAMP_TYPED(gems_bf16, bf16)
STAMP_TYPED(gems_f16, f16)

/* Conversions between an f32 tensor and a 16-bit one (activations entering or leaving the
 * 16-bit graph): grid-stride, blockDim.x = 256, one element per thread per step, coalesced. */
#define STAMP_CAST(NAME, FROM, TO)                                                            \
    extern "C" __global__ void NAME(const FROM* x, TO* y, int64_t numel) {                    \
        GEMS_FOR(i, numel) st(y, i, ld(x, i));                                                \
    }

STAMP_CAST(cast_f32_bf16, float, gems_bf16)
STAMP_CAST(cast_bf16_f32, gems_bf16, float)
STAMP_CAST(cast_f32_f16, float, gems_f16)
STAMP_CAST(cast_f16_f32, gems_f16, float)
