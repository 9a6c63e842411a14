/*
 * activation.cu: ReLU and the smooth activations. (The fused BN+ReLU lives with batch
 * normalization in batchnorm.cu, where the statistics it needs are.)
 *
 *   relu_forward_{f32,bf16,f16}    y = max(x, 0)
 *   relu_backward_{f32,bf16,f16}   dx = y > 0 ? dy : 0 (from the output, so x need not be
 *                                  kept)
 *   silu_forward_SUF               y = x sigmoid(x)
 *   gelu_forward_SUF               y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2 (exact GELU)
 *   gelu_tanh_forward_SUF          y = x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2
 *   sigmoid_forward_SUF            y = 1 / (1 + exp(-x))
 *   {silu,gelu,gelu_tanh,sigmoid}_backward_SUF   dx = f'(x) dy, from the input x, with the
 *                                  derivatives PyTorch's backward uses (as the CPU backend,
 *                                  src/backend/cpu/elementwise.rs)
 * x, y, dy, dx are in the stamp's type (float, gems_bf16, gems_f16); arithmetic is f32 after
 * an exact widening, and a 16-bit store rounds once. ReLU's stores round nothing (max(x, 0)
 * and dy are already representable).
 *
 * Launch: 1-d grid-stride, blockDim.x = 256, gridDim.x = min(ceil(numel / 256), 32 x SMs).
 * Consecutive threads touch consecutive elements: coalesced loads and stores.
 */
#include "gems_device.h"

#define STAMP(T, SUF)                                                                       \
    extern "C" __global__ void relu_forward_##SUF(const T* x, T* y, int64_t numel) {        \
        GEMS_FOR(i, numel) {                                                                 \
            float v = ld(x, i);                                                              \
            st(y, i, v > 0.0f ? v : 0.0f);                                                   \
        }                                                                                    \
    }                                                                                        \
    extern "C" __global__ void relu_backward_##SUF(const T* y, const T* dy, T* dx,          \
                                                   int64_t numel) {                          \
        GEMS_FOR(i, numel) st(dx, i, ld(y, i) > 0.0f ? ld(dy, i) : 0.0f);                    \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
#undef STAMP

/* sqrt(2 / pi) and the cubic coefficient of the tanh GELU; 1 / sqrt(2) and 1 / sqrt(2 pi)
 * of the exact one. */
#define GEMS_SQRT_2_OVER_PI 0.7978845608028654f
#define GEMS_GELU_CUBIC 0.044715f
#define GEMS_FRAC_1_SQRT_2 0.7071067811865476f
#define GEMS_FRAC_1_SQRT_2PI 0.3989422804014327f

/* 0 (not NaN) where exp(-x) overflows. */
__device__ __forceinline__ float sigmoid_of(float x) { return 1.0f / (1.0f + expf(-x)); }

struct Silu {
    static __device__ float f(float x) { return x * sigmoid_of(x); }
    static __device__ float df(float x) {
        const float s = sigmoid_of(x);
        return s * (1.0f + x * (1.0f - s));
    }
};

struct Gelu {
    static __device__ float f(float x) { return 0.5f * x * (1.0f + erff(x * GEMS_FRAC_1_SQRT_2)); }
    /* Phi(x) + x phi(x). */
    static __device__ float df(float x) {
        const float cdf = 0.5f * (1.0f + erff(x * GEMS_FRAC_1_SQRT_2));
        return cdf + x * GEMS_FRAC_1_SQRT_2PI * expf(-0.5f * x * x);
    }
};

struct GeluTanh {
    static __device__ float f(float x) {
        return 0.5f * x * (1.0f + tanhf(GEMS_SQRT_2_OVER_PI * (x + GEMS_GELU_CUBIC * x * x * x)));
    }
    static __device__ float df(float x) {
        const float t = tanhf(GEMS_SQRT_2_OVER_PI * (x + GEMS_GELU_CUBIC * x * x * x));
        const float inner = GEMS_SQRT_2_OVER_PI * (1.0f + 3.0f * GEMS_GELU_CUBIC * x * x);
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * inner;
    }
};

struct Sigmoid {
    static __device__ float f(float x) { return sigmoid_of(x); }
    static __device__ float df(float x) {
        const float s = sigmoid_of(x);
        return s * (1.0f - s);
    }
};

#define STAMP(F, NAME, T, SUF)                                                              \
    extern "C" __global__ void NAME##_forward_##SUF(const T* x, T* y, int64_t numel) {      \
        GEMS_FOR(i, numel) st(y, i, F::f(ld(x, i)));                                         \
    }                                                                                        \
    extern "C" __global__ void NAME##_backward_##SUF(const T* x, const T* dy, T* dx,        \
                                                     int64_t numel) {                        \
        GEMS_FOR(i, numel) st(dx, i, ld(dy, i) * F::df(ld(x, i)));                           \
    }
#define STAMP_TYPES(F, NAME)            \
    STAMP(F, NAME, float, f32)          \
    STAMP(F, NAME, gems_bf16, bf16)     \
    STAMP(F, NAME, gems_f16, f16)

STAMP_TYPES(Silu, silu)
STAMP_TYPES(Gelu, gelu)
STAMP_TYPES(GeluTanh, gelu_tanh)
STAMP_TYPES(Sigmoid, sigmoid)
#undef STAMP_TYPES
