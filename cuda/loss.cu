/*
 * loss.cu: softmax cross-entropy.
 *
 *   softmax_cross_entropy_f32            one block per row (gridDim.x = n, blockDim.x = 256):
 *                                        the row's max and sum of exp by block reductions,
 *                                        probs = exp(x - max) / sum, and
 *                                        row_loss[i] = log(sum) - (x[label] - max). The host
 *                                        adds row_loss in f64 and divides by n, as the CPU
 *                                        backend does. Threads stride the row: coalesced.
 *   softmax_cross_entropy_backward_f32   dlogits = scale (probs - onehot(label)); 1-d
 *                                        grid-stride over n x k, blockDim.x = 256.
 *
 * labels are u32 class indices, one per row, already on the device.
 */
#include "gems_device.h"

extern "C" __global__ void softmax_cross_entropy_f32(const float* logits, const uint32_t* labels,
                                                     float* probs, float* row_loss, GemsLoss l) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    const float* x = logits + row * l.k;
    float* p = probs + row * l.k;

    float m = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) m = fmaxf(m, x[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, scratch[w]);

    float s = 0.0f;
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) {
        float e = expf(x[j] - m);
        p[j] = e;
        s += e;
    }
    s = block_sum(s, scratch);
    const float inv = 1.0f / s;
    for (int j = threadIdx.x; j < l.k; j += blockDim.x) p[j] = p[j] * inv;
    if (threadIdx.x == 0) row_loss[row] = logf(s) - (x[labels[row]] - m);
}

extern "C" __global__ void softmax_cross_entropy_backward_f32(const float* probs,
                                                              const uint32_t* labels,
                                                              float* dlogits, GemsLoss l) {
    const float scale = (float)l.scale;
    GEMS_FOR(i, (int64_t)l.n * l.k) {
        int64_t row = i / l.k;
        int j = (int)(i - row * l.k);
        float onehot = labels[row] == (uint32_t)j ? 1.0f : 0.0f;
        dlogits[i] = scale * (probs[i] - onehot);
    }
}
