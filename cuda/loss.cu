/*
 * loss.cu: softmax cross-entropy over n samples of k classes at `positions` places each
 * (1 for a classifier's N x K logits, H W for per-pixel N x K x H x W logits), laid out
 * n x k x positions: place q = s positions + p has its k logits `positions` apart.
 *
 *   softmax_cross_entropy_SUF(const T* logits, const uint32_t* labels, const float* weights,
 *                             float* probs, float* block_loss, GemsLoss l)
 *                                        one thread per place (blockDim.x = 256, gridDim.x =
 *                                        ceil(n positions / 256), no grid stride): the place's
 *                                        max and sum of exp over its k classes, probs =
 *                                        exp(x - max) / sum, and weights[q] (log(sum) -
 *                                        (x[label] - max)), summed over the block into
 *                                        block_loss[blockIdx.x]. The host adds block_loss in
 *                                        f64 in block order: the same bits every run.
 *   softmax_cross_entropy_backward_SUF(const float* probs, const uint32_t* labels,
 *                                      const float* weights, T* dlogits, GemsLoss l)
 *                                        dlogits = scale weights[q] (probs - onehot(label))
 *                                        at every class of place q; one thread per place,
 *                                        1-d grid-stride, blockDim.x = 256.
 *
 * Neighbouring threads take neighbouring places, so each class's loads and stores are
 * coalesced over places (segmentation: k small, positions large). A classifier (positions =
 * 1) has each thread walk its own contiguous row: uncoalesced, but n threads of k classes is
 * a negligible pass beside the network.
 *
 * SUF in {f32, bf16, f16} is the type T of the logits and their gradient (float, gems_bf16,
 * gems_f16); probs are always f32 (the softmax is computed in f32 from the widened logits and
 * kept at full precision for the backward), and dlogits is rounded to T once, when stored. A
 * loss scale, if any, belongs in l.scale: it multiplies dlogits in f32, before that rounding.
 *
 * labels (u32 class indices, all < k) and weights (0 at unlabelled places) hold one value per
 * place and are already on the device.
 */
#include "gems_device.h"

template <typename T>
__device__ void softmax_cross_entropy(const T* logits, const uint32_t* labels,
                                      const float* weights, float* probs, float* block_loss,
                                      GemsLoss l) {
    __shared__ float scratch[32];
    const int64_t q = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float loss = 0.0f;
    if (q < (int64_t)l.n * l.positions) {
        const int64_t s = q / l.positions;
        const int64_t base = s * l.k * l.positions + (q - s * l.positions);
        const T* x = logits + base;
        float* p = probs + base;
        float m = -__int_as_float(0x7f800000);
        for (int j = 0; j < l.k; j++) m = fmaxf(m, ld(x, (int64_t)j * l.positions));
        float sum = 0.0f;
        for (int j = 0; j < l.k; j++) {
            float e = expf(ld(x, (int64_t)j * l.positions) - m);
            p[(int64_t)j * l.positions] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j < l.k; j++) p[(int64_t)j * l.positions] *= inv;
        loss = weights[q] * (logf(sum) - (ld(x, (int64_t)labels[q] * l.positions) - m));
    }
    loss = block_sum(loss, scratch);
    if (threadIdx.x == 0) block_loss[blockIdx.x] = loss;
}

template <typename T>
__device__ void softmax_cross_entropy_backward(const float* probs, const uint32_t* labels,
                                               const float* weights, T* dlogits, GemsLoss l) {
    GEMS_FOR(q, (int64_t)l.n * l.positions) {
        const int64_t s = q / l.positions;
        const int64_t base = s * l.k * l.positions + (q - s * l.positions);
        const float w = (float)l.scale * weights[q];
        for (int j = 0; j < l.k; j++) {
            const int64_t i = base + (int64_t)j * l.positions;
            float onehot = labels[q] == (uint32_t)j ? 1.0f : 0.0f;
            st(dlogits, i, w * (probs[i] - onehot));
        }
    }
}

#define STAMP(T, SUF)                                                                      \
    extern "C" __global__ void softmax_cross_entropy_##SUF(                                \
        const T* logits, const uint32_t* labels, const float* weights, float* probs,      \
        float* block_loss, GemsLoss l) {                                                   \
        softmax_cross_entropy(logits, labels, weights, probs, block_loss, l);              \
    }                                                                                      \
    extern "C" __global__ void softmax_cross_entropy_backward_##SUF(                       \
        const float* probs, const uint32_t* labels, const float* weights, T* dlogits,     \
        GemsLoss l) {                                                                      \
        softmax_cross_entropy_backward(probs, labels, weights, dlogits, l);                \
    }

STAMP(float, f32)
STAMP(gems_bf16, bf16)
STAMP(gems_f16, f16)
