// The race check. The kernels are compiled with GCC's -fsanitize=thread, which calls
// __tsan_read*/__tsan_write* around every load and store, and linked with this file (compiled
// without it) instead of ThreadSanitizer's runtime. While a thread of a block runs, an access
//   - to its own fiber stack is private;
//   - to the static data of the kernels' library (where emu.h makes __shared__ arrays
//     function-local statics) is __shared__ memory: two threads of a block touching one 4-byte
//     word between two barriers, at least one of them writing, is a race, as compute-sanitizer's
//     racecheck reports it;
//   - to device memory, when a write: two blocks of one launch writing the same address is a race
//     (emu.h's atomicAdd is not instrumented, so atomics are exempt).
// emu.h's own machinery is not instrumented (EMU_INTERNAL), and only __syncthreads orders
// __shared__ memory here: warp-level syncs (shuffles, mma) do not.
#include <link.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "racecheck.h"

namespace {

bool (*g_is_device)(const void*);
const char* g_kernel = "";
std::string g_report;
std::uintptr_t g_data_lo, g_data_hi;  // the writable segment holding the __shared__ arrays

// Who last wrote a 4-byte word of __shared__ memory and who read it (two readers are kept:
// enough to name a thread other than the writer), and in which epoch.
struct Word { unsigned long write_epoch = 0, read_epoch = 0; unsigned writer = 0, readers[2] = {0, 0}; };
std::vector<Word> g_shadow;  // one per word of that segment
// Device memory written in this launch: address -> block (linear) and thread.
std::unordered_map<std::uintptr_t, std::pair<unsigned long, unsigned>> g_written;

void shared_race(unsigned other, const char* first, const char* then, std::uintptr_t word) {
    if (!g_report.empty()) return;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "race check: %s: block (%u, %u, %u): thread %u %s and thread %u %s the __shared__ "
                  "word %#lx between two barriers",
                  g_kernel, blockIdx.x, blockIdx.y, blockIdx.z, other, first, threadIdx.x, then,
                  (unsigned long)word);
    g_report = buf;
}

void access(void* p, bool write) {
    if (!g_in_fiber) return;
    auto a = reinterpret_cast<std::uintptr_t>(p);
    auto stack = reinterpret_cast<std::uintptr_t>(g_fibers[g_current].stack.get());
    if (a - stack < EMU_STACK) return;
    if (a >= g_data_lo && a < g_data_hi) {
        Word& w = g_shadow[(a - g_data_lo) / 4];
        unsigned t = threadIdx.x;
        unsigned long e = g_epoch;
        if (w.write_epoch == e && w.writer != t) shared_race(w.writer, "writes", write ? "writes" : "reads", a);
        if (write) {
            if (w.read_epoch == e)
                for (unsigned r : w.readers)
                    if (r != t) shared_race(r, "reads", "writes", a);
            w.write_epoch = e;
            w.writer = t;
        } else if (w.read_epoch != e) {
            w.read_epoch = e;
            w.readers[0] = w.readers[1] = t;
        } else if (w.readers[0] != t) {
            w.readers[1] = t;
        }
        return;
    }
    if (!write || !g_is_device(p)) return;
    unsigned long b = (blockIdx.z * (unsigned long)gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    auto [it, fresh] = g_written.try_emplace(a, b, threadIdx.x);
    if (!fresh && it->second.first != b && g_report.empty()) {
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "race check: %s: blocks %lu (thread %u) and %lu (thread %u) both write device "
                      "address %p in one launch",
                      g_kernel, it->second.first, it->second.second, b, threadIdx.x, p);
        g_report = buf;
    }
}

void range(void* p, unsigned long n, bool write) {
    for (unsigned long i = 0; i < n; i += 4) access(static_cast<char*>(p) + i, write);
}

}  // namespace

void racecheck_init(bool (*is_device)(const void*)) {
    g_is_device = is_device;
    // The writable load segment of the object that holds emu.h's state (and so the kernels').
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void*) {
            auto mine = reinterpret_cast<std::uintptr_t>(&g_epoch);
            for (int i = 0; i < info->dlpi_phnum; i++) {
                const auto& ph = info->dlpi_phdr[i];
                std::uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
                if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W) && mine >= lo && mine < hi) {
                    g_data_lo = lo;
                    g_data_hi = hi;
                    return 1;
                }
            }
            return 0;
        },
        nullptr);
    g_shadow.assign((g_data_hi - g_data_lo + 3) / 4, Word{});
}

void racecheck_begin(const char* name) {
    g_kernel = name;
    g_report.clear();
    g_written.clear();
}

const char* racecheck_report() { return g_report.empty() ? nullptr : g_report.c_str(); }

// The calls -fsanitize=thread puts around every memory access.
#define HOOKS(N)                                                                     \
    extern "C" void __tsan_read##N(void* p) { access(p, false); }                    \
    extern "C" void __tsan_write##N(void* p) { access(p, true); }                    \
    extern "C" void __tsan_unaligned_read##N(void* p) { access(p, false); }          \
    extern "C" void __tsan_unaligned_write##N(void* p) { access(p, true); }
HOOKS(1)
HOOKS(2)
HOOKS(4)
HOOKS(8)
HOOKS(16)
extern "C" void __tsan_read_range(void* p, unsigned long n) { range(p, n, false); }
extern "C" void __tsan_write_range(void* p, unsigned long n) { range(p, n, true); }
extern "C" void __tsan_init() {}
extern "C" void __tsan_func_entry(void*) {}
extern "C" void __tsan_func_exit() {}
