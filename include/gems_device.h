/*
 * gems_device.h: device-side helpers shared by the kernel files in cuda/ (not part of the
 * Rust interface, so not run through bindgen). NVRTC has no CUDA toolkit headers here (no
 * cuda_bf16.h, no mma.h), so bf16 is carried as its 16 bits and converted by hand, and the
 * tensor cores are reached through inline PTX.
 */
#ifndef GEMS_DEVICE_H
#define GEMS_DEVICE_H

#include "gems_kernels.h"

/* bfloat16 as its bit pattern: the high half of an IEEE float. */
typedef unsigned short gems_bf16;

__device__ __forceinline__ float bf16_to_f32(gems_bf16 v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

/* Round to nearest, ties to even; NaN stays a (quiet) NaN. */
__device__ __forceinline__ gems_bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (gems_bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (gems_bf16)(u >> 16);
}

/* Loads and stores that let one kernel body serve f32 and bf16 storage; arithmetic is f32. */
__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const gems_bf16* p, int64_t i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(gems_bf16* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

/* Grid-stride loop over [0, n) in 64-bit indices. */
#define GEMS_FOR(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)blockDim.x * gridDim.x)

/* splitmix64 and uniform(seed, i), bit for bit the CPU backend's
 * (src/backend/cpu/elementwise.rs), so dropout masks match across devices. */
__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double uniform(uint64_t seed, uint64_t i) {
    /* (x >> 11) < 2^53 converts to double exactly; dividing by 2^53 is exact too. */
    return (double)(splitmix64(seed ^ splitmix64(i)) >> 11) / 9007199254740992.0;
}

/* Two floats that hold bf16 values, packed as bf16x2 (the lower K index in the low half). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo) | ((uint32_t)f32_to_bf16(hi) << 16);
}

/* Warp-wide D = A B + C on the tensor cores (sm_80+), C and D in c[0..4], fragments in the
 * PTX ISA's layouts (gid = lane / 4, tig = lane % 4):
 *   m16n8k8 tf32:  a0 (gid, tig), a1 (gid + 8, tig), a2 (gid, tig + 4), a3 (gid + 8, tig + 4);
 *                  b0 (k tig, n gid), b1 (k tig + 4, n gid)
 *   m16n8k16 bf16: a0 (gid, 2 tig ..+1), a1 (gid + 8, 2 tig ..+1), a2 (gid, 2 tig + 8 ..+9),
 *                  a3 (gid + 8, 2 tig + 8 ..+9); b0 (k 2 tig ..+1, n gid), b1 (k 2 tig + 8 ..+9)
 *   c0 (gid, 2 tig), c1 (gid, 2 tig + 1), c2 (gid + 8, 2 tig), c3 (gid + 8, 2 tig + 1). */
#ifndef GEMS_CPU_EMULATION
/* f32 -> tf32 (round to nearest, ties away), as the tensor cores take it. */
__device__ __forceinline__ uint32_t to_tf32(float f) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ void mma_tf32(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#else
/* A CPU emulation of the kernels (for host-side checks of their indexing) supplies these. */
__device__ uint32_t to_tf32(float f);
__device__ void mma_tf32(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                         uint32_t b1);
__device__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                         uint32_t b1);
#endif

/* Sum over a block of up to 1024 threads (blockDim.x a multiple of 32); every thread gets
 * the total. `scratch` holds 32 values. */
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int warps = blockDim.x >> 5;
    v = lane < warps ? scratch[lane] : (T)0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#endif /* GEMS_DEVICE_H */
