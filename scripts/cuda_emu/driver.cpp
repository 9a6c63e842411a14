// A stand-in for the CUDA driver (libcuda.so.1) that runs cuda/*.cu on the CPU under emu.h, so
// that the Rust CUDA backend (cudarc, kernel launches, argument passing, launch shapes, copies,
// pinned memory, events, the memory pool) runs its GPU suite on a machine without a GPU
// (scripts/cuda_emu/suite.sh). It implements the part of the driver API the backend reaches.
//
// What it checks and what it cannot: it runs the real Rust host code and the real kernel
// sources, with device memory that starts as NaN (0xff bytes) so that unwritten outputs show.
// Work runs when it is issued, one launch at a time, so it cannot find a missing
// synchronisation between streams, and the kernels' arithmetic is emu.h's, not the
// hardware's (tensor cores included).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../../cuda/activation.cu"
#undef STAMP
#include "../../cuda/batchnorm.cu"
#undef STAMP
#include "../../cuda/conv.cu"
#undef STAMP
#include "../../cuda/elementwise.cu"
#undef STAMP
#include "../../cuda/loss.cu"
#undef STAMP
#include "../../cuda/optim.cu"
#undef STAMP
#include "../../cuda/pool.cu"
#undef STAMP
EMU_F16_IMPL

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
enum : CUresult {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    NOT_FOUND = 500,
};

namespace {

// A kernel, from its signature: copies the arguments out of cuLaunchKernel's `params` and
// returns the body one thread runs.
using Bound = std::function<void()>;
template <typename... A, std::size_t... I>
Bound unpack(void (*k)(A...), void** p, std::index_sequence<I...>) {
    auto args = std::make_tuple(*static_cast<std::decay_t<A>*>(p[I])...);
    return [k, args] { std::apply(k, args); };
}
struct Kernel {
    std::string name;
    std::function<Bound(void**)> bind;
};
template <typename... A> Kernel kernel(const char* name, void (*k)(A...)) {
    return {name, [k](void** p) { return unpack(k, p, std::index_sequence_for<A...>{}); }};
}
#define GEMS_KERNEL(name) kernel(#name, name),
const std::vector<Kernel> KERNELS = {
#include "kernels.inc"
};

// The emulated device: memory is the host's, counted against a capacity.
const std::size_t TOTAL = std::size_t(8) << 30;
std::mutex mem_mutex;
std::map<CUdeviceptr, std::size_t> allocations;
std::size_t used = 0;
std::mutex launch_mutex;  // emu.h's block state is global: one launch at a time
int sm_count() {
    const char* s = std::getenv("GEMS_EMU_SMS");
    return s ? std::atoi(s) : 4;
}
bool trace() { return std::getenv("GEMS_EMU_TRACE") != nullptr; }

CUresult alloc(CUdeviceptr* p, std::size_t bytes) {
    std::lock_guard<std::mutex> g(mem_mutex);
    if (used + bytes > TOTAL) return OUT_OF_MEMORY;
    void* m = std::malloc(bytes ? bytes : 1);
    if (!m) return OUT_OF_MEMORY;
    std::memset(m, 0xff, bytes);  // NaN in f32, bf16 and f16: unwritten outputs show
    *p = reinterpret_cast<CUdeviceptr>(m);
    allocations[*p] = bytes;
    used += bytes;
    return OK;
}
CUresult release(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocations.find(p);
    if (it == allocations.end()) return INVALID_VALUE;
    used -= it->second;
    allocations.erase(it);
    std::free(reinterpret_cast<void*>(p));
    return OK;
}
// The bytes [p, p + n) lie in one allocation.
bool inside(CUdeviceptr p, std::size_t n) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}
CUresult copy(void* dst, const void* src, std::size_t n, CUdeviceptr dev_a, CUdeviceptr dev_b) {
    if ((dev_a && !inside(dev_a, n)) || (dev_b && !inside(dev_b, n))) {
        std::fprintf(stderr, "emulated driver: a copy of %zu bytes outside an allocation\n", n);
        return INVALID_VALUE;
    }
    std::memcpy(dst, src, n);
    return OK;
}
double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
int dummy;  // handles that need only be distinct and non-null point here

// The errors this driver returns: cudarc asks for their names and texts.
struct ErrorText { CUresult code; const char* name; const char* text; };
const ErrorText ERRORS[] = {
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument (emulated device; see its message above)"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory (emulated device)"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal (emulated device)"},
    {INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "neither a cubin nor PTX (emulated device)"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "no kernel of that name in cuda/*.cu (emulated device)"},
};
ErrorText error_of(CUresult e) {
    for (const ErrorText& t : ERRORS)
        if (t.code == e) return t;
    return {e, "CUDA_ERROR_UNKNOWN", "error (emulated device)"};
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned) { return OK; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return OK; }
CUresult cuDeviceGet(CUdevice* d, int ordinal) { if (ordinal != 0) return INVALID_DEVICE; *d = 0; return OK; }
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, len, "gems CPU emulation");
    return OK;
}
CUresult cuDeviceTotalMem_v2(std::size_t* b, CUdevice) { *b = TOTAL; return OK; }
CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    switch (attribute) {
        case 16: *v = sm_count(); return OK;        // multiprocessors
        case 75: *v = 9; return OK;                 // compute capability major
        case 76: *v = 0; return OK;                 // minor
        case 115: *v = 1; return OK;                // memory pools supported
        case 41: *v = 1; return OK;                 // unified addressing
        default: *v = 0; return OK;
    }
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice) { *ctx = &dummy; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
CUresult cuCtxSetCurrent(void*) { return OK; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = &dummy; return OK; }
CUresult cuCtxSynchronize() { return OK; }

CUresult cuStreamCreate(void** s, unsigned) { *s = new int(0); return OK; }
CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { *s = new int(0); return OK; }
CUresult cuStreamDestroy_v2(void* s) { delete static_cast<int*>(s); return OK; }
CUresult cuStreamSynchronize(void*) { return OK; }
CUresult cuStreamWaitEvent(void*, void*, unsigned) { return OK; }
CUresult cuLaunchHostFunc(void*, void (*f)(void*), void* data) { f(data); return OK; }

CUresult cuEventCreate(void** e, unsigned) { *e = new double(now_ms()); return OK; }
CUresult cuEventDestroy_v2(void* e) { delete static_cast<double*>(e); return OK; }
CUresult cuEventRecord(void* e, void*) { *static_cast<double*>(e) = now_ms(); return OK; }
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(void*) { return OK; }
CUresult cuEventQuery(void*) { return OK; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = float(*static_cast<double*>(b) - *static_cast<double*>(a));
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t n) { return alloc(p, n); }
CUresult cuMemAllocAsync(CUdeviceptr* p, std::size_t n, void*) { return alloc(p, n); }
CUresult cuMemFree_v2(CUdeviceptr p) { return release(p); }
CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return release(p); }
CUresult cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
    std::lock_guard<std::mutex> g(mem_mutex);
    *free = TOTAL - used;
    *total = TOTAL;
    return OK;
}
CUresult cuDeviceGetDefaultMemPool(void** pool, CUdevice) { *pool = &dummy; return OK; }
CUresult cuMemPoolSetAttribute(void*, int, void*) { return OK; }
CUresult cuMemPoolGetAttribute(void*, int, void* v) { *static_cast<unsigned long long*>(v) = 0; return OK; }
CUresult cuMemPoolTrimTo(void*, std::size_t) { return OK; }
CUresult cuMemHostAlloc(void** p, std::size_t n, unsigned) {
    *p = std::malloc(n ? n : 1);
    return *p ? OK : OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, std::size_t n) { return cuMemHostAlloc(p, n, 0); }
CUresult cuMemFreeHost(void* p) { std::free(p); return OK; }

CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, std::size_t n) { return copy(reinterpret_cast<void*>(d), h, n, d, 0); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, std::size_t n, void*) { return cuMemcpyHtoD_v2(d, h, n); }
CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, std::size_t n) { return copy(h, reinterpret_cast<void*>(d), n, d, 0); }
CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, std::size_t n, void*) { return cuMemcpyDtoH_v2(h, d, n); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr a, CUdeviceptr b, std::size_t n) {
    return copy(reinterpret_cast<void*>(a), reinterpret_cast<void*>(b), n, a, b);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr a, CUdeviceptr b, std::size_t n, void*) { return cuMemcpyDtoD_v2(a, b, n); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, std::size_t n) {
    if (!inside(d, n)) return INVALID_VALUE;
    std::memset(reinterpret_cast<void*>(d), v, n);
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, std::size_t n, void*) { return cuMemsetD8_v2(d, v, n); }

// A module is any cubin or PTX NVRTC made; functions are found by name among the kernels
// compiled into this library.
CUresult cuModuleLoadData(void** module, const void* image) {
    const char* bytes = static_cast<const char*>(image);
    bool elf = std::memcmp(bytes, "\x7f" "ELF", 4) == 0;
    bool ptx = std::strstr(bytes, ".entry") != nullptr;
    if (!elf && !ptx) return INVALID_IMAGE;
    *module = &dummy;
    return OK;
}
CUresult cuModuleUnload(void*) { return OK; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
    for (const Kernel& k : KERNELS)
        if (k.name == name) {
            *f = const_cast<Kernel*>(&k);
            return OK;
        }
    return NOT_FOUND;
}
CUresult cuFuncSetAttribute(void*, int, int) { return OK; }
CUresult cuFuncGetAttribute(int* v, int, void*) { *v = 0; return OK; }

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void*, void** params, void** extra) {
    const Kernel* k = static_cast<const Kernel*>(f);
    // What the hardware refuses, and what emu.h does not model (2-d blocks, dynamic shared
    // memory, partial warps), is an error rather than a silent difference.
    bool legal = gx && gy && gz && gy <= 65535 && gz <= 65535 && bx && bx <= 1024;
    bool modelled = by == 1 && bz == 1 && shared == 0 && bx % 32 == 0 && !extra;
    if (!legal || !modelled) {
        std::fprintf(stderr, "emulated driver: %s launched with grid (%u, %u, %u), block (%u, %u, %u), %u bytes of shared memory\n",
                     k->name.c_str(), gx, gy, gz, bx, by, bz, shared);
        return INVALID_VALUE;
    }
    Bound body = k->bind(params);
    std::lock_guard<std::mutex> g(launch_mutex);
    double start = now_ms();
    launch(uint3{gx, gy, gz}, bx, body);
    if (trace())
        std::fprintf(stderr, "launch %s grid (%u, %u, %u) block %u: %.1f ms\n", k->name.c_str(), gx, gy, gz, bx, now_ms() - start);
    return OK;
}

CUresult cuGetErrorString(CUresult e, const char** s) { *s = error_of(e).text; return OK; }
CUresult cuGetErrorName(CUresult e, const char** s) { *s = error_of(e).name; return OK; }

}  // extern "C"
