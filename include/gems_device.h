/*
 * gems_device.h: device-side helpers shared by the kernel files in cuda/ (not part of the
 * Rust interface, so not run through bindgen). NVRTC has no CUDA toolkit headers here (no
 * cuda_bf16.h, cuda_fp16.h or mma.h), so the 16-bit types are carried as their bits and
 * converted by hand (bf16) or by one PTX cvt (f16), and the tensor cores are reached through
 * inline PTX.
 *
 * The two 16-bit types are distinct structs (not one unsigned short), so that ld/st and the
 * kernels' templates pick the conversion by type. Each is 2 bytes, the layout of Rust's
 * half::bf16 and half::f16. They are storage only: every kernel computes in float.
 */
#ifndef GEMS_DEVICE_H
#define GEMS_DEVICE_H

#include "gems_kernels.h"

/* bfloat16 as its bit pattern: the high half of an IEEE float. */
struct gems_bf16 {
    unsigned short bits;
};

/* IEEE binary16 as its bit pattern. */
struct gems_f16 {
    unsigned short bits;
};

__device__ __forceinline__ float bf16_to_f32(gems_bf16 v) {
    return __uint_as_float(((unsigned int)v.bits) << 16);
}

/* Round to nearest, ties to even; NaN stays a (quiet) NaN. (The bits are chosen by one
 * select, which compiles to selp, not to branches.) */
__device__ __forceinline__ gems_bf16 f32_to_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int nan = (u >> 16) | 0x40u;
    const unsigned int rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    gems_bf16 r;
    r.bits = (unsigned short)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
    return r;
}

#ifndef GEMS_CPU_EMULATION
/* f16 <-> f32 by the hardware's cvt: exact widening; narrowing rounds to nearest even
 * (overflow to inf, underflow through the subnormals to 0; NaN stays NaN). PTX's "h"
 * constraint is a 16-bit register. */
__device__ __forceinline__ float f16_to_f32(gems_f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

__device__ __forceinline__ gems_f16 f32_to_f16(float f) {
    gems_f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
    return r;
}
#else
/* The CPU emulation supplies these. */
__device__ float f16_to_f32(gems_f16 v);
__device__ gems_f16 f32_to_f16(float f);
#endif

/* Loads and stores that let one kernel body serve f32, bf16 and f16 storage: ld widens to
 * float (exactly), st rounds a float to the storage type (the only rounding a 16-bit kernel
 * does); arithmetic is f32. */
__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const gems_bf16* p, int64_t i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ float ld(const gems_f16* p, int64_t i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(gems_bf16* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ void st(gems_f16* p, int64_t i, float v) { p[i] = f32_to_f16(v); }

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

/* Two floats rounded to bf16 (to nearest even) and packed as bf16x2, the lower K index in
 * the low half: a tensor-core operand register. Exact for values that already are bf16. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)f32_to_bf16(lo).bits | ((uint32_t)f32_to_bf16(hi).bits << 16);
}

/* The same for f16 (f16x2): rounded to nearest even, so an f32 value (a master weight) is
 * rounded here, once, to the operand type; values beyond +-65504 become +-inf. */
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    return (uint32_t)f32_to_f16(lo).bits | ((uint32_t)f32_to_f16(hi).bits << 16);
}

/* Warp-wide D = A B + C on the tensor cores (sm_80+), C and D in c[0..4], fragments in the
 * PTX ISA's layouts (gid = lane / 4, tig = lane % 4):
 *   m16n8k8 tf32:  a0 (gid, tig), a1 (gid + 8, tig), a2 (gid, tig + 4), a3 (gid + 8, tig + 4);
 *                  b0 (k tig, n gid), b1 (k tig + 4, n gid)
 *   m16n8k16 bf16 and f16 (the same layout):
 *                  a0 (gid, 2 tig ..+1), a1 (gid + 8, 2 tig ..+1), a2 (gid, 2 tig + 8 ..+9),
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

__device__ __forceinline__ void mma_f16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
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
__device__ void mma_f16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
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
