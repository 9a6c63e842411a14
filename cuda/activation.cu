/*
 * activation.cu: ReLU. (The fused BN+ReLU lives with batch normalization in batchnorm.cu,
 * where the statistics it needs are.)
 *
 *   relu_forward_{f32,bf16,f16}    y = max(x, 0)
 *   relu_backward_{f32,bf16,f16}   dx = y > 0 ? dy : 0 (from the output, so x need not be
 *                                  kept)
 * x, y, dy, dx are in the stamp's type (float, gems_bf16, gems_f16); the compare is done in
 * f32 after an exact widening, and a 16-bit store rounds nothing (max(x, 0) and dy are
 * already representable).
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
