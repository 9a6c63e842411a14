/*
 * optim.cu: the optimizer update.
 *
 *   sgd_f32   one SGD-with-momentum step of w from grad and the momentum buffer, PyTorch's
 *             formula (see GemsSgdStep in gems_kernels.h). With dampening = 0 and
 *             first_step = 0 it is the CPU backend's update (src/backend/cpu/elementwise.rs)
 *             operation for operation, and gives the same bits: the hyper-parameters are
 *             rounded to float first (as T::of does), and every multiply and add is an
 *             explicitly rounded intrinsic (__fmul_rn, __fadd_rn), because NVRTC would
 *             otherwise contract a*b + c into an FMA, which Rust never does.
 *
 * Launch: 1-d grid-stride, blockDim.x = 256, gridDim.x = min(ceil(numel / 256), 32 x SMs);
 * w, grad and buf are read and written at the same index by consecutive threads (coalesced).
 */
#include "gems_device.h"

extern "C" __global__ void sgd_f32(float* w, const float* grad, float* buf, GemsSgdStep s) {
    const float lr = (float)s.lr, mom = (float)s.momentum, wd = (float)s.weight_decay;
    const float damp = 1.0f - (float)s.dampening;
    GEMS_FOR(i, s.numel) {
        float wi = w[i];
        float g = __fadd_rn(grad[i], __fmul_rn(wd, wi));
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
