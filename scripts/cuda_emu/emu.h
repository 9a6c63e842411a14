// A CPU emulation of the CUDA subset cuda/*.cu uses, to check the kernels' indexing on a machine
// without a GPU (scripts/cuda_emu/run.sh). Tensor-core mma is emulated from the fragment
// layouts written in include/gems_device.h, so it checks the kernels against those layouts,
// not against the hardware.
// CPU emulation of the CUDA subset the kernels use: a block's threads are fibers on the
// launching OS thread (made with ucontext, switched with _setjmp/_longjmp, which save no
// signal mask and so make no system call), switched at barriers; blocks run one after another
// (so __shared__ can be static). A barrier that some thread never reaches is reported and
// aborts, where a GPU would hang or misbehave.
#pragma once
#define GEMS_CPU_EMULATION 1
#include <setjmp.h>
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>
using std::uint32_t;
struct uint3 { unsigned x = 0, y = 0, z = 0; };
inline uint3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
// emu.h's own machinery, which the race check (racecheck.cpp) must not see: not instrumented.
#define EMU_INTERNAL __attribute__((no_sanitize_thread))

// The fibers of a launch (one a thread of the block, each running every block in turn), and
// barriers over the block and over each warp.
constexpr std::size_t EMU_STACK = 256 << 10;  // bytes of a fiber's stack
struct Fiber { jmp_buf jb; ucontext_t start; std::unique_ptr<char[]> stack; bool started = false, done = false; };
inline jmp_buf g_sched;
// Never destroyed: a stream's queued launch may still run while the process exits.
inline std::vector<Fiber>& g_fibers = *new std::vector<Fiber>;
inline unsigned g_current;
inline char* g_stack;    // the running fiber's stack (for the race check, which skips it)
inline bool g_in_fiber;  // a thread of the block is running (not the scheduler)
inline bool g_progress;  // something happened this round (else the block is stuck)
// The launch's body: a thunk and the closure it runs (see launch).
inline void (*g_body)(const void*);
inline const void* g_body_closure;
struct Barrier { unsigned expected = 0, arrived = 0, gen = 0; };
inline Barrier g_bar, g_block_end, g_wbar[32];
// Counts the block's barriers (and block starts): two accesses in one epoch are unordered.
inline unsigned long g_epoch = 1;
EMU_INTERNAL inline void fiber_yield() {
    if (!_setjmp(g_fibers[g_current].jb)) _longjmp(g_sched, 1);
}
// Returns true to the thread whose arrival completed the barrier.
EMU_INTERNAL inline bool fiber_wait(Barrier& b) {
    g_progress = true;
    unsigned my = b.gen;
    if (++b.arrived == b.expected) { b.arrived = 0; b.gen++; return true; }
    while (b.gen == my) fiber_yield();
    return false;
}
EMU_INTERNAL inline void warp_sync() { fiber_wait(g_wbar[threadIdx.x / 32]); }
inline double g_wbuf[32][32];
inline uint32_t g_wfrag[32][32][6];
EMU_INTERNAL inline void __syncthreads() { if (fiber_wait(g_bar)) g_epoch++; }
template <typename T> EMU_INTERNAL T __shfl_xor_sync(unsigned, T v, int o) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_wbuf[w][l] = (double)v;
    warp_sync();
    T r = (T)g_wbuf[w][l ^ o];
    warp_sync();
    return r;
}
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
// Not a plain write for the race check.
EMU_INTERNAL inline float atomicAdd(float* p, float v) { static std::mutex m; std::lock_guard<std::mutex> g(m); float o = *p; *p = o + v; return o; }
EMU_INTERNAL inline uint32_t atomicOr(uint32_t* p, uint32_t v) { static std::mutex m; std::lock_guard<std::mutex> g(m); uint32_t o = *p; *p = o | v; return o; }
inline uint32_t to_tf32(float f) { uint32_t u = __float_as_uint(f); u += 0x1000u; return u & ~0x1fffu; }
inline float bf(uint32_t v, int hi) { return __uint_as_float((hi ? (v >> 16) : (v & 0xffff)) << 16); }
inline float hf(uint32_t v, int hi) { uint16_t b = hi ? (v >> 16) : (v & 0xffff); _Float16 h; memcpy(&h, &b, 2); return (float)h; }
EMU_INTERNAL inline bool __any_sync(unsigned, bool v) {
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_wbuf[w][l] = v ? 1.0 : 0.0;
    warp_sync();
    bool r = false; for (int i = 0; i < 32; i++) r = r || g_wbuf[w][i] != 0.0;
    warp_sync();
    return r;
}
// fragments: regs 0..3 = a0..a3, 4..5 = b0, b1
EMU_INTERNAL inline void mma_generic(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1, int kind) { /* 0 tf32, 1 bf16, 2 f16 */
    bool is_bf16 = kind != 0; auto half = kind == 1 ? bf : hf;
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    uint32_t r[6] = {a0, a1, a2, a3, b0, b1};
    memcpy(g_wfrag[w][l], r, sizeof r);
    warp_sync();
    int gid = l >> 2, tig = l & 3;
    int K = is_bf16 ? 16 : 8;
    // The lambdas too: a function's attribute does not reach the lambdas in it.
    auto A = [&](int row, int k) EMU_INTERNAL -> float {
        if (!is_bf16) { int lane = (row % 8) * 4 + (k % 4); int reg = (row >= 8) + 2 * (k >= 4); return __uint_as_float(g_wfrag[w][lane][reg]); }
        int lane = (row % 8) * 4 + (k % 8) / 2; int reg = (row >= 8) + 2 * (k >= 8); return half(g_wfrag[w][lane][reg], k % 2);
    };
    auto B = [&](int k, int n) EMU_INTERNAL -> float {
        if (!is_bf16) { int lane = n * 4 + (k % 4); int reg = 4 + (k >= 4); return __uint_as_float(g_wfrag[w][lane][reg]); }
        int lane = n * 4 + (k % 8) / 2; int reg = 4 + (k >= 8); return half(g_wfrag[w][lane][reg], k % 2);
    };
    int rows[4] = {gid, gid, gid + 8, gid + 8}, cols[4] = {2 * tig, 2 * tig + 1, 2 * tig, 2 * tig + 1};
    float out[4];
    for (int i = 0; i < 4; i++) { float s = c[i]; for (int k = 0; k < K; k++) s += A(rows[i], k) * B(k, cols[i]); out[i] = s; }
    warp_sync();
    for (int i = 0; i < 4; i++) c[i] = out[i];
}
EMU_INTERNAL inline void mma_tf32(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) { mma_generic(c, a0, a1, a2, a3, b0, b1, 0); }
EMU_INTERNAL inline void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) { mma_generic(c, a0, a1, a2, a3, b0, b1, 1); }
EMU_INTERNAL inline void mma_f16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) { mma_generic(c, a0, a1, a2, a3, b0, b1, 2); }
// f16 conversions (declared in gems_device.h, which defines gems_f16): see EMU_F16_IMPL.
#define EMU_F16_IMPL \
    float f16_to_f32(gems_f16 v) { _Float16 h; memcpy(&h, &v.bits, 2); return (float)h; } \
    gems_f16 f32_to_f16(float f) { _Float16 h = (_Float16)f; gems_f16 r; memcpy(&r.bits, &h, 2); return r; }
// A fiber: thread threadIdx of every block in order; the last to finish a block moves
// blockIdx on, so no thread starts a block (and its __shared__) before all left the last.
EMU_INTERNAL inline void fiber_main() {
    for (;;) {
        g_body(g_body_closure);
        if (fiber_wait(g_block_end)) {
            g_epoch++;
            uint3& b = blockIdx;
            if (++b.x == gridDim.x) { b.x = 0; if (++b.y == gridDim.y) { b.y = 0; ++b.z; } }
        }
        if (blockIdx.z == gridDim.z) break;
    }
    g_fibers[g_current].done = true;
    g_progress = true;
    _longjmp(g_sched, 1);
}
// Runs f as every thread of every block of the grid. Each thread runs a copy of f made on its
// own fiber stack (by memcpy, which the checks do not see), so that under the memory check
// (racecheck.cpp) the kernel touches nothing but its stack, the library's static data and
// device memory: f must be trivially copyable (capture pointers and values, not references).
// (Only where the checks are compiled in, -fsanitize=thread: elsewhere f runs in place.)
template <typename F> EMU_INTERNAL void run_closure(const void* closure) {
#ifdef __SANITIZE_THREAD__
    alignas(F) unsigned char copy[sizeof(F)];
    std::memcpy(copy, closure, sizeof(F));
    (*reinterpret_cast<const F*>(copy))();
#else
    (*static_cast<const F*>(closure))();
#endif
}
template <typename F> EMU_INTERNAL void launch(uint3 grid, unsigned block, F f) {
#ifdef __SANITIZE_THREAD__
    static_assert(std::is_trivially_copyable_v<F>, "a checked launch's closure is copied byte for byte");
#endif
    gridDim = grid; blockDim = uint3{block, 1, 1}; blockIdx = uint3{};
    g_epoch++;
    g_body = run_closure<F>;
    g_body_closure = &f;
    g_bar = g_block_end = Barrier{block};
    for (unsigned w = 0; w * 32 < block; w++) g_wbar[w] = Barrier{std::min(32u, block - w * 32)};
    if (g_fibers.size() < block) g_fibers.resize(block);
    for (unsigned t = 0; t < block; t++) {
        Fiber& fb = g_fibers[t];
        if (!fb.stack) fb.stack.reset(new char[EMU_STACK]);
        fb.started = fb.done = false;
        getcontext(&fb.start);
        fb.start.uc_stack.ss_sp = fb.stack.get();
        fb.start.uc_stack.ss_size = EMU_STACK;
        fb.start.uc_link = nullptr;
        makecontext(&fb.start, fiber_main, 0);
    }
    for (unsigned live = block; live;) {
        g_progress = false;
        live = 0;
        for (unsigned t = 0; t < block; t++) {
            Fiber& fb = g_fibers[t];
            if (fb.done) continue;
            threadIdx = uint3{t, 0, 0};
            g_current = t;
            g_stack = fb.stack.get();
            g_in_fiber = true;
            if (!_setjmp(g_sched)) {
                if (!fb.started) { fb.started = true; setcontext(&fb.start); }
                _longjmp(fb.jb, 1);
            }
            g_in_fiber = false;
            live += !fb.done;
        }
        if (live && !g_progress) {
            std::fprintf(stderr, "emulation: block (%u, %u, %u) is stuck: %u threads wait at a barrier others never reach\n",
                         blockIdx.x, blockIdx.y, blockIdx.z, live);
            std::abort();
        }
    }
}
