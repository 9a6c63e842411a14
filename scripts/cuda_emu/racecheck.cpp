// The memory check and the race check. The kernels are compiled with GCC's -fsanitize=thread,
// which calls __tsan_read*/__tsan_write* before every load and store, and linked with this file
// (compiled without it) instead of ThreadSanitizer's runtime. While a thread of a block runs,
// an access
//   - to its own fiber stack is private (emu.h copies the launch's closure, the kernel's
//     arguments, there);
//   - to the kernels' library (its static data, where emu.h makes __shared__ arrays
//     function-local statics, and its constants) is not device memory; under the race check,
//     writable data is __shared__ memory: two threads of a block touching one 4-byte word
//     between two barriers, at least one of them writing, is a race, as compute-sanitizer's
//     racecheck reports it;
//   - to anything else must lie within a device allocation (the memory check, always on): an
//     access that does not (past an allocation's end, before its start, into freed memory) is
//     reported with the kernel, the block, the thread, the address and the nearest allocation;
//     and an access to bytes that a copy or memset of another stream, queued before the launch,
//     has not yet written (or read, for a write) is reported (the ordering check: nothing
//     orders the two, as an event wait would);
//     Under the race check, in units of 2 bytes (the smallest element a kernel stores): two
//     blocks of one launch writing the same bytes, one block reading what another writes in
//     the launch, or two threads of a block writing the same bytes between two barriers, is a
//     race (emu.h's atomics are not instrumented, so they are exempt).
// An access of n bytes checks every word (unit) it covers. emu.h's own machinery is not
// instrumented (EMU_INTERNAL), and only __syncthreads orders memory within a block here:
// warp-level syncs (shuffles, mma) do not.
//
// It runs on every load and store of the kernels, so its bookkeeping is flat arrays and no lock:
// a launch runs on one OS thread at a time (the driver's launch lock), accesses from any other
// thread are ignored, and the shadows carry epochs (barriers, launches) instead of being cleared.
#include <link.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "racecheck.h"

namespace {

DeviceLookup g_device;
OrderingCheck g_ordering;
bool g_race;
const char* g_kernel = "";
// Never destroyed: a stream's queued launch may still run while the process exits.
std::string& g_report = *new std::string;
std::uintptr_t g_data_lo, g_data_size;  // the writable segment holding the __shared__ arrays
std::uintptr_t g_lib_lo, g_lib_size;    // every segment of the kernels' library

// Who last wrote a 4-byte word of __shared__ memory and who read it (two readers are kept:
// enough to name a thread other than the writer), and in which epoch: g_epoch - g_epoch_base,
// which fits 32 bits (the shadow is cleared and the base moved before it would not).
struct Word {
    std::uint32_t write_epoch = 0, read_epoch = 0;
    std::uint16_t writer = 0, readers[2] = {0, 0};
};
std::vector<Word>& g_shadow = *new std::vector<Word>;  // one per word of that segment
unsigned long g_epoch_base = 0;

// Device memory: the launch's first epoch (a unit's stamps at or after it are this launch's),
// and the allocations it touched, latest first.
unsigned long g_launch_epoch = 0;
std::vector<RaceDevice>& g_devices = *new std::vector<RaceDevice>;

void report(const char* text) {
    if (g_report.empty()) g_report = text;
}

__attribute__((noinline, cold)) void shared_race(unsigned other, const char* first, const char* then, std::uintptr_t word) {
    if (!g_report.empty()) return;
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "race check: %s: block (%u, %u, %u): thread %u %s and thread %u %s the __shared__ "
                  "word %#lx between two barriers",
                  g_kernel, blockIdx.x, blockIdx.y, blockIdx.z, other, first, threadIdx.x, then,
                  (unsigned long)word);
    report(buf);
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

unsigned long block_index() {
    return (blockIdx.z * (unsigned long)gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}

// The access of n bytes at `a` lies outside every device allocation: the report, and an abort
// (before the access) when it is beyond the padding the driver gives each allocation.
__attribute__((noinline, cold)) void outside(std::uintptr_t a, unsigned long n, bool write, const RaceDevice& near) {
    char buf[640];
    int len = std::snprintf(buf, sizeof buf, "memory check: %s: block (%u, %u, %u) thread %u %s %lu bytes at %p, ",
                            g_kernel, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
                            write ? "writes" : "reads", n, reinterpret_cast<void*>(a));
    char* rest = buf + len;
    std::size_t room = sizeof buf - len;
    bool near_enough = false;
    if (near.hi == 0) {
        std::snprintf(rest, room, "outside every device allocation (there is none)");
    } else if (a >= near.lo) {
        std::snprintf(rest, room,
                      "outside every device allocation: offset %lu of the %lu-byte allocation at %p, "
                      "%lu bytes past its end",
                      (unsigned long)(a - near.lo), (unsigned long)(near.hi - near.lo),
                      reinterpret_cast<void*>(near.lo), (unsigned long)(a + n - near.hi));
        near_enough = a + n - near.hi <= EMU_REDZONE;
    } else {
        std::snprintf(rest, room,
                      "outside every device allocation: %lu bytes before the %lu-byte allocation at %p",
                      (unsigned long)(near.lo - a), (unsigned long)(near.hi - near.lo),
                      reinterpret_cast<void*>(near.lo));
        near_enough = near.lo - a <= EMU_REDZONE;
    }
    if (!near_enough) {
        std::fprintf(stderr, "emulated driver: %s (too far out to let the access happen: aborting)\n", buf);
        std::abort();
    }
    report(buf);
}

__attribute__((noinline, cold)) void ordering(std::uintptr_t a, unsigned long n, bool write) {
    const char* conflict = g_ordering(reinterpret_cast<void*>(a), n, write);
    if (!conflict || !g_report.empty()) return;
    char buf[640];
    std::snprintf(buf, sizeof buf, "ordering check: %s: block (%u, %u, %u) thread %u %s %lu bytes at %p, %s", g_kernel,
                  blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, write ? "writes" : "reads", n,
                  reinterpret_cast<void*>(a), conflict);
    report(buf);
}

__attribute__((noinline, cold)) void device_race(const char* what, std::uintptr_t at) {
    if (!g_report.empty()) return;
    char buf[512];
    std::snprintf(buf, sizeof buf, "race check: %s: %s device address %p in one launch", g_kernel, what,
                  reinterpret_cast<void*>(at));
    report(buf);
}

// The race check on device bytes [a, a + n) of allocation `d`.
__attribute__((noinline)) void device_access(const RaceDevice& d, std::uintptr_t a, unsigned long n, bool write) {
    unsigned long block = block_index();
    unsigned long id = block * blockDim.x + threadIdx.x;
    if (id >> 32 || block >= RACE_MANY) {
        report((std::string("race check: ") + g_kernel + ": more than 2^32 threads, beyond what it can check").c_str());
        return;
    }
    char what[200];
    for (std::uintptr_t u = (a - d.lo) / 2; u < (a + n - d.lo + 1) / 2; u++) {
        RaceUnit& s = d.shadow[u];
        std::uintptr_t at = std::max(a, d.lo + 2 * u);
        bool written = s.write_epoch >= g_launch_epoch;
        unsigned long wb = s.writer / blockDim.x;
        if (write) {
            if (written && wb != block) [[unlikely]] {
                std::snprintf(what, sizeof what, "blocks %lu (thread %u) and %lu (thread %u) both write", wb,
                              unsigned(s.writer % blockDim.x), block, threadIdx.x);
                device_race(what, at);
            } else if (written && s.writer != id && s.write_epoch == g_epoch) [[unlikely]] {
                std::snprintf(what, sizeof what,
                              "block (%u, %u, %u): threads %u and %u both write, between two barriers,", blockIdx.x,
                              blockIdx.y, blockIdx.z, unsigned(s.writer % blockDim.x), threadIdx.x);
                device_race(what, at);
            }
            if (s.read_epoch >= g_launch_epoch && s.reader != block) [[unlikely]] {
                if (s.reader == RACE_MANY)
                    std::snprintf(what, sizeof what, "blocks other than %lu read, and block %lu (thread %u) writes,",
                                  block, block, threadIdx.x);
                else
                    std::snprintf(what, sizeof what, "block %u reads, and block %lu (thread %u) writes,", s.reader,
                                  block, threadIdx.x);
                device_race(what, at);
            }
            s.write_epoch = g_epoch;
            s.writer = std::uint32_t(id);
        } else {
            if (written && wb != block) [[unlikely]] {
                std::snprintf(what, sizeof what, "block %lu (thread %u) writes, and block %lu (thread %u) reads,", wb,
                              unsigned(s.writer % blockDim.x), block, threadIdx.x);
                device_race(what, at);
            }
            if (s.read_epoch < g_launch_epoch) {
                s.read_epoch = g_epoch;
                s.reader = std::uint32_t(block);
            } else if (s.reader != block) {
                s.reader = RACE_MANY;
            }
        }
    }
}

// The device allocation holding `a`: among those this launch touched, else from the driver.
// Null when `a` is in none, with `near` the nearest.
inline const RaceDevice* device_of(std::uintptr_t a, RaceDevice* near) {
    if (!g_devices.empty() && a - g_devices[0].lo < g_devices[0].hi - g_devices[0].lo) [[likely]]
        return &g_devices[0];
    for (std::size_t i = 1; i < g_devices.size(); i++)
        if (a - g_devices[i].lo < g_devices[i].hi - g_devices[i].lo) {
            std::swap(g_devices[i], g_devices[0]);
            return &g_devices[0];
        }
    if (!g_device(reinterpret_cast<void*>(a), g_race, near)) return nullptr;
    g_devices.insert(g_devices.begin(), *near);
    return &g_devices[0];
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
    if (a - g_lib_lo < g_lib_size) {
        if (!g_race) return;
        if (std::uintptr_t off = a - g_data_lo; off < g_data_size) {
            if ((off & 3) + n <= 4)  // the usual access: within one word
                shared_word(off / 4, write);
            else
                shared_words(off, n, write);
        }
        return;
    }
    RaceDevice near{0, 0, nullptr, false};
    const RaceDevice* d = device_of(a, &near);
    if (!d || a + n > d->hi) [[unlikely]] {
        outside(a, n, write, d ? *d : near);
        return;
    }
    if (d->pending) [[unlikely]]
        ordering(a, n, write);
    if (g_race) device_access(*d, a, n, write);
}

}  // namespace

void racecheck_init(DeviceLookup device, OrderingCheck ordering, bool race) {
    g_device = device;
    g_ordering = ordering;
    g_race = race;
    // The load segments of the object that holds emu.h's state (and so the kernels'), and its
    // writable one.
    dl_iterate_phdr(
        [](dl_phdr_info* info, std::size_t, void*) {
            auto mine = reinterpret_cast<std::uintptr_t>(&g_epoch);
            std::uintptr_t lo = ~std::uintptr_t(0), hi = 0;
            bool found = false;
            for (int i = 0; i < info->dlpi_phnum; i++) {
                const auto& ph = info->dlpi_phdr[i];
                if (ph.p_type != PT_LOAD) continue;
                std::uintptr_t s = info->dlpi_addr + ph.p_vaddr, e = s + ph.p_memsz;
                lo = std::min(lo, s);
                hi = std::max(hi, e);
                if ((ph.p_flags & PF_W) && mine >= s && mine < e) {
                    g_data_lo = s;
                    g_data_size = e - s;
                    found = true;
                }
            }
            if (!found) return 0;
            g_lib_lo = lo;
            g_lib_size = hi - lo;
            return 1;
        },
        nullptr);
    if (race) g_shadow.assign((g_data_size + 3) / 4, Word{});
}

void racecheck_begin(const char* name) {
    g_kernel = name;
    g_report.clear();
    g_devices.clear();  // allocations may have come and gone since the last launch
    g_launch_epoch = g_epoch + 1;  // emu.h's launch moves it on first
    // A launch moves the epoch by far less than 2^31 (its blocks and barriers).
    if (g_race && g_epoch - g_epoch_base >= 1ul << 31) {
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
