/*
 * batchnorm.cu: batch normalization over (N, H, W) per channel, training and eval, and the
 * fused BN+ReLU.
 *
 * Every kernel but the last is stamped batchnorm_*_SUF for SUF in {f32, bf16, f16}: x, y, dy,
 * dx are activations in T (float, gems_bf16, gems_f16); gamma, beta, mean, var, dgamma,
 * dbeta, sums and the running statistics are always f32 (parameters and statistics stay
 * f32 under mixed precision). Elements are widened to f32 as they are loaded, all arithmetic
 * is f32 (the reductions f64), and y and dx are rounded to T once, when stored.
 *
 *   batchnorm_stats_SUF             mean[c] and biased var[c] in a single pass: each thread
 *                                   accumulates sum and sum of squares in double (so
 *                                   E[x^2] - E[x]^2 does not cancel catastrophically for f32
 *                                   data), then a block reduction. One block per channel
 *                                   (gridDim.x = c, blockDim.x = 512); threads stride each
 *                                   (n, c) plane, which is contiguous: coalesced reads
 *                                   (16-bit planes: the same pattern, half the bytes).
 *   batchnorm_apply_SUF             y = x scale[c] + shift[c], scale = gamma / sqrt(var + eps),
 *                                   shift = beta - mean scale: the training forward (after
 *                                   stats) and the eval forward (running statistics).
 *   batchnorm_apply_relu_SUF        the same, then max(., 0): the fused BN+ReLU forward.
 *   batchnorm_backward_reduce_SUF   per channel sdy = sum dy and sdyx = sum dy xhat (double
 *                                   accumulation, one block per channel as stats); adds them
 *                                   to dbeta[c] and dgamma[c] and keeps them in sums[2c],
 *                                   sums[2c + 1] for the dx pass.
 *   batchnorm_backward_reduce_relu_SUF   the same with dy masked where the fused output is
 *                                   not positive, the mask recomputed from x exactly as
 *                                   apply computed it (bn_affine): the fused op keeps x
 *                                   only, and the ReLU's gradient never goes to memory.
 *   batchnorm_backward_dx_SUF       dx = gamma invstd / M (M dy - sdy - xhat sdyx),
 *                                   M = n hw, as the CPU backend (src/backend/cpu/norm.rs).
 *   batchnorm_backward_dx_relu_SUF  the same with dy masked likewise.
 *   batchnorm_update_running_f32    running = (1 - momentum) running + momentum batch, the
 *                                   variance unbiased by count / (count - 1); one thread per
 *                                   channel. One stamp only: it touches only f32 statistics.
 *
 * The element-wise passes (apply, dx) are 1-d grid-stride loops, blockDim.x = 256,
 * gridDim.x = min(ceil(n c hw / 256), 32 x SMs); the channel of element i is (i / hw) % c.
 */
#include "gems_device.h"

/* The channel's batch mean and biased variance, in one pass accumulated in double. */
template <typename T>
__device__ void stats(const T* x, float* mean, float* var, GemsBatchNorm bn) {
    __shared__ double scratch[32];
    const GemsChannelGeom g = bn.geom;
    const int c = blockIdx.x;
    double s = 0.0, ss = 0.0;
    for (int n = 0; n < g.n; n++) {
        const T* plane = x + ((int64_t)n * g.c + c) * g.hw;
        for (int j = threadIdx.x; j < g.hw; j += blockDim.x) {
            double v = ld(plane, j);
            s += v;
            ss += v * v;
        }
    }
    s = block_sum(s, scratch);
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) {
        double m = (double)g.n * g.hw;
        double mu = s / m;
        double v = ss / m - mu * mu;
        mean[c] = (float)mu;
        var[c] = (float)(v > 0.0 ? v : 0.0);
    }
}

/* The normalized element before any ReLU: x scale + shift, scale = gamma / sqrt(var + eps),
 * shift = beta - mean scale. The fused backward recomputes it for the ReLU's mask, so apply
 * and the backward must compute it the same way: one function, one explicit fma. */
__device__ __forceinline__ float bn_affine(float x, int c, const float* gamma, const float* beta,
                                           const float* mean, const float* var, float eps) {
    const float scale = gamma[c] / sqrtf(var[c] + eps);
    return fmaf(x, scale, beta[c] - mean[c] * scale);
}

template <bool RELU, typename T>
__device__ void apply(const T* x, const float* gamma, const float* beta, const float* mean,
                      const float* var, T* y, GemsBatchNorm bn) {
    const GemsChannelGeom g = bn.geom;
    const float eps = (float)bn.eps;
    GEMS_FOR(i, (int64_t)g.n * g.c * g.hw) {
        int c = (int)((i / g.hw) % g.c);
        float v = bn_affine(ld(x, i), c, gamma, beta, mean, var, eps);
        st(y, i, RELU ? fmaxf(v, 0.0f) : v);
    }
}

/* gamma and beta are read only when RELU: dy is masked where the fused output,
 * max(bn_affine(x), 0), is not positive (NaN included), as relu_backward masks. */
template <bool RELU, typename T>
__device__ void backward_reduce(const T* x, const float* gamma, const float* beta, const T* dy,
                                const float* mean, const float* var, float* dgamma,
                                float* dbeta, float* sums, GemsBatchNorm bn) {
    __shared__ double scratch[32];
    const GemsChannelGeom g = bn.geom;
    const int c = blockIdx.x;
    const float mu = mean[c];
    const float eps = (float)bn.eps;
    const float invstd = 1.0f / sqrtf(var[c] + eps);
    double sdy = 0.0, sdyx = 0.0;
    for (int n = 0; n < g.n; n++) {
        const int64_t base = ((int64_t)n * g.c + c) * g.hw;
        for (int j = threadIdx.x; j < g.hw; j += blockDim.x) {
            float d = ld(dy, base + j);
            if (RELU && !(bn_affine(ld(x, base + j), c, gamma, beta, mean, var, eps) > 0.0f))
                d = 0.0f;
            sdy += d;
            sdyx += (double)d * ((ld(x, base + j) - mu) * invstd);
        }
    }
    sdy = block_sum(sdy, scratch);
    sdyx = block_sum(sdyx, scratch);
    if (threadIdx.x == 0) {
        dbeta[c] += (float)sdy;
        dgamma[c] += (float)sdyx;
        sums[2 * c] = (float)sdy;
        sums[2 * c + 1] = (float)sdyx;
    }
}

template <bool RELU, typename T>
__device__ void backward_dx(const T* x, const T* dy, const float* gamma, const float* beta,
                            const float* mean, const float* var, const float* sums, T* dx,
                            GemsBatchNorm bn) {
    const GemsChannelGeom g = bn.geom;
    const float m = (float)((double)g.n * g.hw);
    const float eps = (float)bn.eps;
    GEMS_FOR(i, (int64_t)g.n * g.c * g.hw) {
        int c = (int)((i / g.hw) % g.c);
        float invstd = 1.0f / sqrtf(var[c] + eps);
        const float xi = ld(x, i);
        float d = ld(dy, i);
        if (RELU && !(bn_affine(xi, c, gamma, beta, mean, var, eps) > 0.0f)) d = 0.0f;
        float xhat = (xi - mean[c]) * invstd;
        st(dx, i, gamma[c] * invstd / m * (m * d - sums[2 * c] - xhat * sums[2 * c + 1]));
    }
}

/* The seven per-type entry points over one activation type T. */
#define STAMP(T, SUF)                                                                         \
    extern "C" __global__ void batchnorm_stats_##SUF(const T* x, float* mean, float* var,     \
                                                     GemsBatchNorm bn) {                      \
        stats(x, mean, var, bn);                                                              \
    }                                                                                         \
    extern "C" __global__ void batchnorm_apply_##SUF(const T* x, const float* gamma,          \
                                                     const float* beta, const float* mean,    \
                                                     const float* var, T* y,                  \
                                                     GemsBatchNorm bn) {                      \
        apply<false>(x, gamma, beta, mean, var, y, bn);                                       \
    }                                                                                         \
    extern "C" __global__ void batchnorm_apply_relu_##SUF(                                    \
        const T* x, const float* gamma, const float* beta, const float* mean,                 \
        const float* var, T* y, GemsBatchNorm bn) {                                           \
        apply<true>(x, gamma, beta, mean, var, y, bn);                                        \
    }                                                                                         \
    extern "C" __global__ void batchnorm_backward_reduce_##SUF(                               \
        const T* x, const T* dy, const float* mean, const float* var, float* dgamma,          \
        float* dbeta, float* sums, GemsBatchNorm bn) {                                        \
        backward_reduce<false>(x, nullptr, nullptr, dy, mean, var, dgamma, dbeta, sums, bn);  \
    }                                                                                         \
    extern "C" __global__ void batchnorm_backward_reduce_relu_##SUF(                          \
        const T* x, const float* gamma, const float* beta, const T* dy, const float* mean,    \
        const float* var, float* dgamma, float* dbeta, float* sums, GemsBatchNorm bn) {       \
        backward_reduce<true>(x, gamma, beta, dy, mean, var, dgamma, dbeta, sums, bn);        \
    }                                                                                         \
    extern "C" __global__ void batchnorm_backward_dx_##SUF(                                   \
        const T* x, const T* dy, const float* gamma, const float* mean, const float* var,     \
        const float* sums, T* dx, GemsBatchNorm bn) {                                         \
        backward_dx<false>(x, dy, gamma, nullptr, mean, var, sums, dx, bn);                   \
    }                                                                                         \
    extern "C" __global__ void batchnorm_backward_dx_relu_##SUF(                              \
        const T* x, const float* gamma, const float* beta, const T* dy, const float* mean,    \
        const float* var, const float* sums, T* dx, GemsBatchNorm bn) {                       \
        backward_dx<true>(x, dy, gamma, beta, mean, var, sums, dx, bn);                       \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)

extern "C" __global__ void batchnorm_update_running_f32(float* running_mean, float* running_var,
                                                        const float* mean, const float* var,
                                                        GemsBnRunning r) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= r.c) return;
    const float mo = (float)r.momentum;
    const int64_t count = r.count > 2 ? r.count : 2;
    const float unbias = (float)((double)r.count / (double)(count - 1));
    running_mean[c] = (1.0f - mo) * running_mean[c] + mo * mean[c];
    running_var[c] = (1.0f - mo) * running_var[c] + mo * var[c] * unbias;
}
