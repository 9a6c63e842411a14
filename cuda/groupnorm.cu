/*
 * groupnorm.cu: group normalization (PyTorch's nn.GroupNorm; one group is its LayerNorm over
 * each sample's C x H x W). Statistics are per (sample, group): a run of (c / groups) hw
 * contiguous values, since a group is consecutive channels of one sample.
 *
 * Every kernel is stamped groupnorm_*_SUF for SUF in {f32, bf16, f16}: x, y, dy, dx are
 * activations in T (float, gems_bf16, gems_f16); gamma, beta, dgamma, dbeta, mean, var (n x
 * groups) and sums are f32 (parameters and statistics stay f32 under mixed precision).
 * Elements are widened to f32 as they are loaded, sums accumulate in double, and y and dx
 * are rounded to T once, when stored.
 *
 *   groupnorm_stats_SUF          mean and biased var of each (sample, group) in one pass (sum
 *                                and sum of squares in double, as batchnorm_stats). One block
 *                                per (sample, group) (gridDim.x = n groups, blockDim.x = 512);
 *                                threads stride its contiguous run: coalesced reads.
 *   groupnorm_apply_SUF          y = (x - mean) scale + beta[c], scale = gamma[c] /
 *                                sqrt(var + eps). Centred first: a group of few values can
 *                                have a mean far larger than its spread, where x scale + shift
 *                                would cancel (and then differ with FMA contraction).
 *   groupnorm_backward_reduce_SUF  per (sample, group) a = sum dy gamma[c] and
 *                                b = sum dy gamma[c] xhat into sums[2k], sums[2k + 1]; blocks
 *                                as stats.
 *   groupnorm_param_grads_SUF    per channel dbeta[c] += sum dy and dgamma[c] += sum dy xhat
 *                                over its plane in every sample. One block per channel
 *                                (gridDim.x = c, blockDim.x = 512), threads striding each
 *                                contiguous plane.
 *   groupnorm_backward_dx_SUF    dx = invstd / M (M dy gamma[c] - a - xhat b), M = (c / groups)
 *                                hw, as the CPU backend (src/backend/cpu/groupnorm.rs).
 *
 * The element-wise passes (apply, dx) are 1-d grid-stride loops, blockDim.x = 256,
 * gridDim.x = min(ceil(n c hw / 256), 32 x SMs); element i is in channel (i / hw) % c and
 * (sample, group) i / ((c / groups) hw).
 */
#include "gems_device.h"

__device__ __forceinline__ int64_t gn_len(GemsGroupNorm p) {
    return (int64_t)(p.c / p.groups) * p.hw;
}

template <typename T>
__device__ void gn_stats(const T* x, float* mean, float* var, GemsGroupNorm p) {
    __shared__ double scratch[32];
    const int64_t m = gn_len(p);
    const T* run = x + (int64_t)blockIdx.x * m;
    double s = 0.0, ss = 0.0;
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
        double v = ld(run, j);
        s += v;
        ss += v * v;
    }
    s = block_sum(s, scratch);
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) {
        double mu = s / (double)m;
        double v = ss / (double)m - mu * mu;
        mean[blockIdx.x] = (float)mu;
        var[blockIdx.x] = (float)(v > 0.0 ? v : 0.0);
    }
}

template <typename T>
__device__ void gn_apply(const T* x, const float* gamma, const float* beta, const float* mean,
                         const float* var, T* y, GemsGroupNorm p) {
    const int64_t m = gn_len(p);
    const float eps = (float)p.eps;
    GEMS_FOR(i, (int64_t)p.n * p.c * p.hw) {
        const int c = (int)((i / p.hw) % p.c);
        const int64_t k = i / m;
        const float scale = gamma[c] / sqrtf(var[k] + eps);
        st(y, i, fmaf(ld(x, i) - mean[k], scale, beta[c]));
    }
}

template <typename T>
__device__ void gn_backward_reduce(const T* x, const T* dy, const float* gamma,
                                   const float* mean, const float* var, float* sums,
                                   GemsGroupNorm p) {
    __shared__ double scratch[32];
    const int64_t m = gn_len(p), k = blockIdx.x, base = k * m;
    const int first = (int)(k % p.groups) * (p.c / p.groups);
    const float mu = mean[k], invstd = 1.0f / sqrtf(var[k] + (float)p.eps);
    double a = 0.0, b = 0.0;
    for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
        const float d = ld(dy, base + j) * gamma[first + (int)(j / p.hw)];
        a += d;
        b += (double)d * ((ld(x, base + j) - mu) * invstd);
    }
    a = block_sum(a, scratch);
    b = block_sum(b, scratch);
    if (threadIdx.x == 0) {
        sums[2 * k] = (float)a;
        sums[2 * k + 1] = (float)b;
    }
}

template <typename T>
__device__ void gn_param_grads(const T* x, const T* dy, const float* mean, const float* var,
                               float* dgamma, float* dbeta, GemsGroupNorm p) {
    __shared__ double scratch[32];
    const int c = blockIdx.x, group = c / (p.c / p.groups);
    const float eps = (float)p.eps;
    double sdy = 0.0, sdyx = 0.0;
    for (int n = 0; n < p.n; n++) {
        const int64_t k = (int64_t)n * p.groups + group;
        const float mu = mean[k], invstd = 1.0f / sqrtf(var[k] + eps);
        const int64_t base = ((int64_t)n * p.c + c) * p.hw;
        for (int j = threadIdx.x; j < p.hw; j += blockDim.x) {
            const float d = ld(dy, base + j);
            sdy += d;
            sdyx += (double)d * ((ld(x, base + j) - mu) * invstd);
        }
    }
    sdy = block_sum(sdy, scratch);
    sdyx = block_sum(sdyx, scratch);
    if (threadIdx.x == 0) {
        dbeta[c] += (float)sdy;
        dgamma[c] += (float)sdyx;
    }
}

template <typename T>
__device__ void gn_backward_dx(const T* x, const T* dy, const float* gamma, const float* mean,
                               const float* var, const float* sums, T* dx, GemsGroupNorm p) {
    const int64_t len = gn_len(p);
    const float m = (float)len, eps = (float)p.eps;
    GEMS_FOR(i, (int64_t)p.n * p.c * p.hw) {
        const int c = (int)((i / p.hw) % p.c);
        const int64_t k = i / len;
        const float invstd = 1.0f / sqrtf(var[k] + eps);
        const float xhat = (ld(x, i) - mean[k]) * invstd;
        st(dx, i,
           invstd / m * (m * ld(dy, i) * gamma[c] - sums[2 * k] - xhat * sums[2 * k + 1]));
    }
}

/* The five per-type entry points over one activation type T. */
#define STAMP(T, SUF)                                                                         \
    extern "C" __global__ void groupnorm_stats_##SUF(const T* x, float* mean, float* var,     \
                                                     GemsGroupNorm p) {                       \
        gn_stats(x, mean, var, p);                                                            \
    }                                                                                         \
    extern "C" __global__ void groupnorm_apply_##SUF(const T* x, const float* gamma,          \
                                                     const float* beta, const float* mean,    \
                                                     const float* var, T* y,                  \
                                                     GemsGroupNorm p) {                       \
        gn_apply(x, gamma, beta, mean, var, y, p);                                            \
    }                                                                                         \
    extern "C" __global__ void groupnorm_backward_reduce_##SUF(                               \
        const T* x, const T* dy, const float* gamma, const float* mean, const float* var,     \
        float* sums, GemsGroupNorm p) {                                                       \
        gn_backward_reduce(x, dy, gamma, mean, var, sums, p);                                 \
    }                                                                                         \
    extern "C" __global__ void groupnorm_param_grads_##SUF(                                   \
        const T* x, const T* dy, const float* mean, const float* var, float* dgamma,          \
        float* dbeta, GemsGroupNorm p) {                                                      \
        gn_param_grads(x, dy, mean, var, dgamma, dbeta, p);                                   \
    }                                                                                         \
    extern "C" __global__ void groupnorm_backward_dx_##SUF(                                   \
        const T* x, const T* dy, const float* gamma, const float* mean, const float* var,     \
        const float* sums, T* dx, GemsGroupNorm p) {                                          \
        gn_backward_dx(x, dy, gamma, mean, var, sums, dx, p);                                 \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
