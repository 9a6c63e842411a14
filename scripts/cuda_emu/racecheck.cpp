// The race check. The kernels are compiled with GCC's -fsanitize=thread, which calls
// __tsan_read*/__tsan_write* around every load and store, and linked with this file (compiled
// without it) instead of ThreadSanitizer's runtime. While a thread of a block runs, an access
//   - to its own fiber stack is private;
//   - to the static data of the kernels' library (where emu.h makes __shared__ arrays
//     function-local statics) is __shared__ memory: two threads of a block touching one 4-byte
//     word between two barriers, at least one of them writing, is a race, as compute-sanitizer's
//     racecheck reports it;
//   - to device memory, when a write: two blocks of one launch writing the same bytes (in units
//     of 2, the smallest element a kernel stores) is a race (emu.h's atomicAdd is not
//     instrumented, so atomics are exempt).
// An access of n bytes checks every word (unit) it covers. emu.h's own machinery is not
// instrumented (EMU_INTERNAL), and only __syncthreads orders __shared__ memory here: warp-level
// syncs (shuffles, mma) do not.
//
// It runs on every load and store of the kernels, so its bookkeeping is flat arrays and no lock:
// a launch runs on one OS thread at a time (the driver's launch lock), accesses from any other
// thread are ignored, and the shadows carry epochs (barriers, launches) instead of being cleared.
#include <link.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "racecheck.h"

namespace {

bool (*g_device)(const void*, RaceDevice*);
const char* g_kernel = "";
// Never destroyed: a stream's queued launch may still run while the process exits.
std::string& g_report = *new std::string;
std::uintptr_t g_data_lo, g_data_size;  // the writable segment holding the __shared__ arrays

// Who last wrote a 4-byte word of __shared__ memory and who read it (two readers are kept:
// enough to name a thread other than the writer), and in which epoch: g_epoch - g_epoch_base,
// which fits 32 bits (the shadow is cleared and the base moved before it would not).
struct Word {
    std::uint32_t write_epoch = 0, read_epoch = 0;
    std::uint16_t writer = 0, readers[2] = {0, 0};
};
std::vector<Word>& g_shadow = *new std::vector<Word>;  // one per word of that segment
unsigned long g_epoch_base = 0;

// Device memory: each 2-byte unit's shadow holds the launch that first wrote it (high 32 bits)
// and the writer as block * blockDim.x + thread (low 32 bits); launches count from 1.
std::uint32_t g_launch = 0;
std::vector<RaceDevice>& g_devices = *new std::vector<RaceDevice>;  // written this launch, latest first

__attribute__((noinline, cold)) void shared_race(unsigned other, const char* first, const char* then, std::uintptr_t word) {
    if (!g_report.empty()) return;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "race check: %s: block (%u, %u, %u): thread %u %s and thread %u %s the __shared__ "
                  "word %#lx between two barriers",
                  g_kernel, blockIdx.x, blockIdx.y, blockIdx.z, other, first, threadIdx.x, then,
                  (unsigned long)word);
    g_report = buf;
}

// Word `i` of the segment, touched by the running thread.
inline void shared_word(std::uintptr_t i, bool write) {
    Word& w = g_shadow[i];
    auto t = static_cast<std::uint16_t>(threadIdx.x);
    auto e = static_cast<std::uint32_t>(g_epoch - g_epoch_base);
    std::uintptr_t at = g_data_lo + 4 * i;
    if (w.write_epoch == e && w.writer != t) [[unlikely]]
        shared_race(w.writer, "writes", write ? "writes" : "reads", at);
    if (write) {
        if (w.read_epoch == e)
            for (unsigned r : w.readers)
                if (r != t) [[unlikely]]
                    shared_race(r, "reads", "writes", at);
        w.write_epoch = e;
        w.writer = t;
    } else if (w.read_epoch != e) {
        w.read_epoch = e;
        w.readers[0] = w.readers[1] = t;
    } else if (w.readers[0] != t) {
        w.readers[1] = t;
    }
}

// Bytes [off, off + n) of the segment: every word they touch.
__attribute__((noinline)) void shared_words(std::uintptr_t off, unsigned long n, bool write) {
    std::uintptr_t end = std::min(off + n, g_data_size);
    for (std::uintptr_t i = off / 4; i < (end + 3) / 4; i++) shared_word(i, write);
}

// The allocation holding `a` among those this launch wrote, else from the driver (null when
// `a` is not device memory).
const RaceDevice* device_of(std::uintptr_t a) {
    for (std::size_t i = 0; i < g_devices.size(); i++)
        if (a - g_devices[i].lo < g_devices[i].hi - g_devices[i].lo) {
            if (i) std::swap(g_devices[i], g_devices[0]);
            return &g_devices[0];
        }
    RaceDevice d;
    if (!g_device(reinterpret_cast<void*>(a), &d)) return nullptr;
    g_devices.insert(g_devices.begin(), d);
    return &g_devices[0];
}

__attribute__((noinline)) void device_write(std::uintptr_t a, unsigned long n) {
    const RaceDevice* d = device_of(a);
    if (!d) return;
    unsigned long block = (blockIdx.z * (unsigned long)gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    unsigned long id = block * blockDim.x + threadIdx.x;
    if (id >> 32) {
        if (g_report.empty())
            g_report = std::string("race check: ") + g_kernel + ": more than 2^32 threads, beyond what it can check";
        return;
    }
    std::uint64_t me = std::uint64_t(g_launch) << 32 | id;
    std::uintptr_t end = std::min(a + n, d->hi);
    for (std::uintptr_t u = (a - d->lo) / 2; u < (end - d->lo + 1) / 2; u++) {
        std::uint64_t& s = d->shadow[u];
        if (s >> 32 != g_launch) {
            s = me;
            continue;
        }
        unsigned long first = std::uint32_t(s) / blockDim.x;
        if (first != block && g_report.empty()) {
            char buf[512];
            std::snprintf(buf, sizeof buf,
                          "race check: %s: blocks %lu (thread %u) and %lu (thread %u) both write device "
                          "address %p in one launch",
                          g_kernel, first, unsigned(std::uint32_t(s) % blockDim.x), block, threadIdx.x,
                          reinterpret_cast<void*>(std::max(a, d->lo + 2 * u)));
            g_report = buf;
        }
    }
}

__attribute__((always_inline)) inline void access(void* p, unsigned long n, bool write) {
    if (!g_in_fiber) return;
    // Only the thread running the block (it runs on the fiber's stack): meanwhile the host
    // thread may run the library's other instrumented code (binding the next launch's
    // arguments), which is no thread of the block, and must not touch this launch's state.
    auto stack = reinterpret_cast<std::uintptr_t>(g_stack);
    if (reinterpret_cast<std::uintptr_t>(__builtin_frame_address(0)) - stack >= EMU_STACK) return;
    auto a = reinterpret_cast<std::uintptr_t>(p);
    if (a - stack < EMU_STACK) return;
    if (std::uintptr_t off = a - g_data_lo; off < g_data_size) {
        if ((off & 3) + n <= 4)  // the usual access: within one word
            shared_word(off / 4, write);
        else
            shared_words(off, n, write);
    } else if (write)
        device_write(a, n);
}

}  // namespace

void racecheck_init(bool (*device)(const void*, RaceDevice*)) {
    g_device = device;
    // The writable load segment of the object that holds emu.h's state (and so the kernels').
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void*) {
            auto mine = reinterpret_cast<std::uintptr_t>(&g_epoch);
            for (int i = 0; i < info->dlpi_phnum; i++) {
                const auto& ph = info->dlpi_phdr[i];
                std::uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
                if (ph.p_type == PT_LOAD && (ph.p_flags & PF_W) && mine >= lo && mine < hi) {
                    g_data_lo = lo;
                    g_data_size = hi - lo;
                    return 1;
                }
            }
            return 0;
        },
        nullptr);
    g_shadow.assign((g_data_size + 3) / 4, Word{});
}

void racecheck_begin(const char* name) {
    g_kernel = name;
    g_report.clear();
    g_devices.clear();  // allocations may have come and gone since the last launch
    if (++g_launch == 0) {
        std::fprintf(stderr, "race check: 2^32 launches, beyond what it can tell apart\n");
        std::abort();
    }
    // A launch moves the epoch by far less than 2^31 (its blocks and barriers).
    if (g_epoch - g_epoch_base >= 1ul << 31) {
        g_shadow.assign(g_shadow.size(), Word{});
        g_epoch_base = g_epoch;
    }
}

const char* racecheck_report() { return g_report.empty() ? nullptr : g_report.c_str(); }

// The calls -fsanitize=thread puts around every memory access; hidden, so the kernels' calls
// bind here directly rather than through the PLT.
#define HOOK extern "C" __attribute__((visibility("hidden"))) void
#define HOOKS(N)                                                                \
    HOOK __tsan_read##N(void* p) { access(p, N, false); }                       \
    HOOK __tsan_write##N(void* p) { access(p, N, true); }                       \
    HOOK __tsan_unaligned_read##N(void* p) { access(p, N, false); }             \
    HOOK __tsan_unaligned_write##N(void* p) { access(p, N, true); }
HOOKS(1)
HOOKS(2)
HOOKS(4)
HOOKS(8)
HOOKS(16)
HOOK __tsan_read_range(void* p, unsigned long n) { access(p, n, false); }
HOOK __tsan_write_range(void* p, unsigned long n) { access(p, n, true); }
HOOK __tsan_init() {}
HOOK __tsan_func_entry(void*) {}
HOOK __tsan_func_exit() {}
