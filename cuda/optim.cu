/*
 * optim.cu: the optimizer update, and the check for non-finite gradients that dynamic loss
 * scaling makes before it.
 *
 *   sgd_f32(float* w, const float* grad, float* buf, GemsSgdStep s)
 *             one SGD-with-momentum step of w from grad and the momentum buffer, PyTorch's
 *             formula (see GemsSgdStep in gems_kernels.h). With dampening = 0 and
 *             first_step = 0 it is the CPU backend's update (src/backend/cpu/elementwise.rs)
 *             operation for operation, and gives the same bits: the hyper-parameters are
 *             rounded to float first (as T::of does), and every multiply and add is an
 *             explicitly rounded intrinsic (__fmul_rn, __fadd_rn), because NVRTC would
 *             otherwise contract a*b + c into an FMA, which Rust never does.
 *
 *             g = grad_scale grad + weight_decay w: grad_scale (1 / the loss scale under
 *             mixed precision, 1 otherwise) is rounded to float and multiplies grad first;
 *             1 * grad is grad exactly, so without loss scaling the bits do not change.
 *             w, grad, buf are the f32 master copies in every precision.
 *   adam_f32(float* w, const float* grad, float* m, float* v, GemsAdamStep s)
 *             one Adam or AdamW step of w from grad and its moments m and v, PyTorch's formula
 *             (see GemsAdamStep in gems_kernels.h), operation for operation the CPU
 *             backend's update, likewise with explicitly rounded intrinsics (the square root
 *             and the divisions too: __fsqrt_rn, __fdiv_rn), so it gives the same bits.
 *   nonfinite_f32(const float* x, int64_t numel, uint32_t* found)
 *             *found = 1 when any x[i] is inf or NaN (the check of the unscaled gradients
 *             before a step under dynamic loss scaling). Never writes 0: the host zeroes
 *             *found first, and may run it over several tensors before reading it once.
 *             One vote per warp (__any_sync), so at most one lane per warp stores, with
 *             atomicOr: the stores all set 1, but plain stores to one word from several blocks
 *             would be a data race in CUDA's memory model (and the emulator's race check
 *             reports them).
 *
 * Launch (all): 1-d grid-stride, blockDim.x = 256,
 * gridDim.x = min(ceil(numel / 256), 32 x SMs); w, grad and buf (and nonfinite's x) are read
 * and written at the same index by consecutive threads (coalesced), as are adam's m and v.
 */
#include "gems_device.h"

extern "C" __global__ void sgd_f32(float* w, const float* grad, float* buf, GemsSgdStep s) {
    const float lr = (float)s.lr, mom = (float)s.momentum, wd = (float)s.weight_decay;
    const float damp = 1.0f - (float)s.dampening, gs = (float)s.grad_scale;
    GEMS_FOR(i, s.numel) {
        float wi = w[i];
        float g = __fadd_rn(__fmul_rn(gs, grad[i]), __fmul_rn(wd, wi));
        float b;
        if (s.first_step) {
            b = g;
        } else {
            /* (1 - 0) * g == g exactly, so dampening 0 changes nothing. */
            b = __fadd_rn(__fmul_rn(mom, buf[i]), __fmul_rn(damp, g));
        }
        buf[i] = b;
        float step = s.nesterov ? __fadd_rn(g, __fmul_rn(mom, b)) : b;
        w[i] = __fsub_rn(wi, __fmul_rn(lr, step));
    }
}

extern "C" __global__ void adam_f32(float* w, const float* grad, float* m, float* v,
                                    GemsAdamStep s) {
    const float gs = (float)s.grad_scale, l2 = (float)s.weight_decay, decay = (float)s.decay;
    const float one_b1 = (float)(1.0 - s.beta1), b2 = (float)s.beta2;
    const float one_b2 = (float)(1.0 - s.beta2), eps = (float)s.eps;
    const float step_size = (float)s.step_size, bc2_sqrt = (float)s.bc2_sqrt;
    GEMS_FOR(i, s.numel) {
        float wi = w[i];
        /* l2 is 0 for AdamW and decay 1 for Adam: both exact no-ops there. */
        float g = __fadd_rn(__fmul_rn(gs, grad[i]), __fmul_rn(l2, wi));
        wi = __fmul_rn(wi, decay);
        float mi = __fadd_rn(m[i], __fmul_rn(one_b1, __fsub_rn(g, m[i])));
        float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(one_b2, g), g));
        float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        m[i] = mi;
        v[i] = vi;
        w[i] = __fsub_rn(wi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
    }
}

extern "C" __global__ void nonfinite_f32(const float* x, int64_t numel, uint32_t* found) {
    bool bad = false;
    /* inf and NaN are the floats whose exponent bits are all ones. */
    GEMS_FOR(i, numel) bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
    /* Every lane reaches the vote (the loop above is the only divergence and it has ended);
     * blockDim.x is a multiple of 32, so the full mask names live lanes. */
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) atomicOr(found, 1u);
}
