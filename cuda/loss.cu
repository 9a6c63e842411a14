/*
 * loss.cu: softmax cross-entropy.
 *
 *   softmax_cross_entropy_SUF(const T* logits, const uint32_t* labels, float* probs,
 *                             float* row_loss, GemsLoss l)
 *                                        one block per row (gridDim.x = n, blockDim.x = 256):
 *                                        the row's max and sum of exp by block reductions,
 *                                        probs = exp(x - max) / sum, and
 *                                        row_loss[i] = log(sum) - (x[label] - max). The host
 *                                        adds row_loss in f64 and divides by n, as the CPU
 *                                        backend does. Threads stride the row: coalesced.
 *   softmax_cross_entropy_backward_SUF(const float* probs, const uint32_t* labels,
 *                                      T* dlogits, GemsLoss l)
 *                                        dlogits = scale (probs - onehot(label)); 1-d
 *                                        grid-stride over n x k, blockDim.x = 256.
 *
 * SUF in {f32, bf16, f16} is the type T of the logits and their gradient (float, gems_bf16,
 * gems_f16); probs and row_loss are always f32 (the softmax is computed in f32 from the
 * widened logits and kept at full precision for the backward), and dlogits is rounded to T
 * once, when stored. A loss scale, if any, belongs in l.scale: it multiplies dlogits in f32,
 * before that rounding.
 *
 * labels are u32 class indices, one per row, already on the device.
 */
#include "gems_device.h"

template <typename T>
__device__ void softmax_cross_entropy(const T* logits, const uint32_t* labels, float* probs,
                                      float* row_loss, GemsLoss l) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const T* x = logits + row * l.k;
    float* p = probs + row * l.k;

    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) m = fmaxf(m, ld(x, j));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, scratch[w]);

    float s = 0.0f;
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) {
        float e = expf(ld(x, j) - m);
        p[j] = e;
        s += e;
    }
    s = block_sum(s, scratch);
    const float inv = 1.0f / s;
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) p[j] = p[j] * inv;
    if (threadIdx.x == 0) row_loss[row] = logf(s) - (ld(x, labels[row]) - m);
}

template <typename T>
__device__ void softmax_cross_entropy_backward(const float* probs, const uint32_t* labels,
                                               T* dlogits, GemsLoss l) {
    const float scale = (float)l.scale;
    GEMS_FOR(i, (int64_t)l.n * l.k) {
        int64_t row = i / l.k;
        int j = (int)(i - row * l.k);
        float onehot = labels[row] == (uint32_t)j ? 1.0f : 0.0f;
        st(dlogits, i, scale * (probs[i] - onehot));
    }
}

#define STAMP(T, SUF)                                                                         \
    extern "C" __global__ void softmax_cross_entropy_##SUF(                                   \
        const T* logits, const uint32_t* labels, float* probs, float* row_loss, GemsLoss l) { \
        softmax_cross_entropy(logits, labels, probs, row_loss, l);                            \
    }                                                                                         \
    extern "C" __global__ void softmax_cross_entropy_backward_##SUF(                          \
        const float* probs, const uint32_t* labels, T* dlogits, GemsLoss l) {                 \
        softmax_cross_entropy_backward(probs, labels, dlogits, l);                            \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
