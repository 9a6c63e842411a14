/*
 * elementwise.cu: element-wise kernels, channel concatenation and dropout.
 *
 * Every kernel here is a grid-stride loop over its elements: launch 1-d, blockDim.x = 256,
 * gridDim.x = min(ceil(numel / 256), 32 x SMs); any grid covers all elements. Consecutive
 * threads touch consecutive elements, so every load and store is coalesced.
 *
 *   add_{f32,bf16}            y = a + b
 *   add_assign_{f32,bf16}     y += x (gradient accumulation)
 *   mul_{f32,bf16}            y = x * mask (dropout forward and backward)
 *   fill_{f32,bf16}           s = value
 *   add_channel_bias_f32      y[n, c, :] += bias[c]
 *   channel_sum_f32           db[c] += sum over n and the plane of dy[n, c, :]; one block per
 *                             channel (gridDim.x = c, blockDim.x = 256), a block reduction in
 *                             double, then one add per channel: no atomics, deterministic
 *   copy_channels_{f32,bf16}  concat (and its backward): channels [src_off, src_off + count)
 *                             of src into [dst_off, dst_off + count) of dst
 *   dropout_mask_{f32,bf16}   mask[i] = uniform(seed, i) < p ? 0 : 1 / (1 - p), the CPU
 *                             backend's generator, so masks match bit for bit
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
STAMP_BINARY(mul_f32, float, x0 * x1)
STAMP_BINARY(mul_bf16, gems_bf16, x0 * x1)

#define STAMP_UNARY(T, SUF)                                                                  \
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
        /* 1 / (1 - p) in double, then rounded once to the storage type, as T::of does. */    \
        float keep = (float)(1.0 / (1.0 - d.p));                                              \
        GEMS_FOR(i, d.numel) st(mask, i, uniform(d.seed, (uint64_t)i) < d.p ? 0.0f : keep);   \
    }

STAMP_UNARY(float, f32)
STAMP_UNARY(gems_bf16, bf16)

extern "C" __global__ void add_channel_bias_f32(float* y, const float* bias, GemsChannelGeom g) {
    GEMS_FOR(i, (int64_t)g.n * g.c * g.hw) y[i] += bias[(i / g.hw) % g.c];
}

extern "C" __global__ void channel_sum_f32(const float* dy, float* db, GemsChannelGeom g) {
    __shared__ double scratch[32];
    int c = blockIdx.x;
    double acc = 0.0;
    for (int n = 0; n < g.n; n++) {
        const float* plane = dy + ((int64_t)n * g.c + c) * g.hw;
        for (int j = threadIdx.x; j < g.hw; j += blockDim.x) acc += plane[j];
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) db[c] += (float)acc;
}
