// A stand-in for the CUDA driver (libcuda.so.1) that runs cuda/*.cu on the CPU (kernels.cpp
// under emu.h), so that the Rust CUDA backend (cudarc, kernel launches, argument passing, launch
// shapes, copies, pinned memory, events, streams, the memory pool) runs its GPU suite on a
// machine without a GPU. build.rs builds it (feature `cuda-emu`, on in every `cargo test`). It
// implements the part of the driver API the backend reaches.
//
// Streams are real: each is a queue run by a worker thread of its own. Launches, copies,
// memsets, event records and stream-ordered frees return at once; the host sees their results
// only after cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize or a call documented as
// synchronous (a copy to pageable host memory, cuMemFree, ...), and one stream waits for another
// only through cuStreamWaitEvent. The null (legacy) stream runs its work on the calling thread
// once the blocking streams are idle, which is what the legacy stream orders (non-blocking
// streams, the backend's, are not waited for). Device memory starts as NaN (0xff bytes) and is
// poisoned the same way when a free runs in its stream's order, so a queued operation of
// another stream that still reads it sees NaN. Freed blocks are pooled (reused by a later
// allocation of the same size) as the driver's stream-ordered pool does.
//
// GEMS_EMU_CHAOS=<seed>[,<max_us>] delays each queued operation, with probability 1/2, by a
// random time up to max_us (default 300) microseconds drawn from a generator seeded per
// stream, so that orderings the program does not enforce happen. Every load and store of a
// kernel is checked against the live device allocations (racecheck.cpp's memory check; each
// allocation is padded by EMU_REDZONE bytes on both sides, so that an access a little outside
// it touches nothing else before it is reported); GEMS_EMU_RACECHECK=1 adds the race check.
// An error fails the next synchronisation with CUDA_ERROR_LAUNCH_FAILED, whose text is the
// report.
//
// What it cannot show: speed, the hardware's arithmetic (emu.h's is used, tensor cores
// included), and the memory model within a kernel beyond the race check.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "racecheck.h"

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
    NOT_READY = 600,
    LAUNCH_FAILED = 719,
};

namespace {

// The kernels (kernels.cpp), loaded from this library's folder.
struct Kernels {
    void (*init)(DeviceLookup, OrderingCheck, bool race);
    const void* (*find)(const char*);
    const char* (*name)(const void*);
    void* (*bind)(const void*, void**);
    const char* (*run)(const void*, void*, unsigned, unsigned, unsigned, unsigned);
};
bool device_for_race_check(const void* p, bool shadow, RaceDevice* d);
const char* ordering_check(const void* p, unsigned long n, bool write);
const Kernels& kernels() {
    static const Kernels k = [] {
        Dl_info self;
        dladdr(reinterpret_cast<void*>(&kernels), &self);
        std::string dir(self.dli_fname);
        dir = dir.substr(0, dir.rfind('/') + 1);
        const char* race = std::getenv("GEMS_EMU_RACECHECK");
        bool check = race && std::strcmp(race, "0") != 0;
        std::string path = dir + "libgems_emu_kernels.so";
        void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            std::fprintf(stderr, "emulated driver: %s\n", dlerror());
            std::abort();
        }
        Kernels k{reinterpret_cast<decltype(Kernels::init)>(dlsym(h, "gems_emu_init")),
                  reinterpret_cast<decltype(Kernels::find)>(dlsym(h, "gems_emu_kernel")),
                  reinterpret_cast<decltype(Kernels::name)>(dlsym(h, "gems_emu_kernel_name")),
                  reinterpret_cast<decltype(Kernels::bind)>(dlsym(h, "gems_emu_bind")),
                  reinterpret_cast<decltype(Kernels::run)>(dlsym(h, "gems_emu_run"))};
        k.init(device_for_race_check, ordering_check, check);
        if (check) std::fprintf(stderr, "emulated driver: race check on\n");
        return k;
    }();
    return k;
}

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}
int sm_count() {
    const char* s = std::getenv("GEMS_EMU_SMS");
    return s ? std::atoi(s) : 4;
}
bool trace() { return std::getenv("GEMS_EMU_TRACE") != nullptr; }

// --- streams and events -------------------------------------------------------------------
// One lock and one condition for every queue and event: simple, and the work dwarfs it. Never
// destroyed: workers may still wait on them when the process exits.
std::mutex& g_m = *new std::mutex;
std::condition_variable& g_cv = *new std::condition_variable;
// The first failure of queued work (a race report), returned by the next synchronisation.
CUresult g_sticky = OK;
std::string& g_sticky_text = *new std::string;

struct Chaos {
    bool on = false;
    unsigned long long seed = 0;
    unsigned max_us = 300;
};
const Chaos& chaos() {
    static const Chaos c = [] {
        Chaos c;
        if (const char* s = std::getenv("GEMS_EMU_CHAOS")) {
            c.on = true;
            c.seed = std::strtoull(s, nullptr, 10);
            if (const char* comma = std::strchr(s, ',')) c.max_us = unsigned(std::atoi(comma + 1));
            std::fprintf(stderr, "emulated driver: chaos seed %llu, delays up to %u us\n", c.seed, c.max_us);
        }
        return c;
    }();
    return c;
}

struct Stream {
    bool blocking;                            // ordered with the null stream (flag 0)
    std::deque<std::function<void()>> queue;  // the front one runs; it leaves when done
    bool stop = false;
    std::mt19937_64 rng;
    std::thread worker;
    void run();
};
std::set<Stream*>& g_streams = *new std::set<Stream*>;  // never destroyed, as g_m
unsigned long long g_stream_count = 0;

void Stream::run() {
    std::unique_lock<std::mutex> l(g_m);
    for (;;) {
        g_cv.wait(l, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        std::function<void()> op = queue.front();
        unsigned delay = chaos().on && (rng() & 1) ? unsigned(rng() % (chaos().max_us + 1)) : 0;
        l.unlock();
        if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
        op();
        l.lock();
        queue.pop_front();
        g_cv.notify_all();
    }
}

Stream* new_stream(unsigned flags) {
    Stream* s = new Stream{flags == 0};
    std::lock_guard<std::mutex> g(g_m);
    s->rng.seed(chaos().seed * 1000003 + g_stream_count++);
    g_streams.insert(s);
    s->worker = std::thread([s] { s->run(); });
    return s;
}

// Waits (g_m held) until every stream `pick` selects is idle.
template <typename P> void wait_idle(std::unique_lock<std::mutex>& l, P pick) {
    g_cv.wait(l, [&] {
        for (Stream* s : g_streams)
            if (pick(s) && !s->queue.empty()) return false;
        return true;
    });
}

// Queues `op` on stream `h`; the null stream runs it here once the blocking streams are idle.
void enqueue(void* h, std::function<void()> op) {
    std::unique_lock<std::mutex> l(g_m);
    if (!h) {
        wait_idle(l, [](Stream* s) { return s->blocking; });
        l.unlock();
        op();
        return;
    }
    static_cast<Stream*>(h)->queue.push_back(std::move(op));
    g_cv.notify_all();
}
// Queues `op` and returns once it has run.
CUresult enqueue_and_wait(void* h, std::function<void()> op) {
    auto done = std::make_shared<bool>(false);
    enqueue(h, [op, done] {
        op();
        std::lock_guard<std::mutex> g(g_m);
        *done = true;
        g_cv.notify_all();
    });
    std::unique_lock<std::mutex> l(g_m);
    g_cv.wait(l, [&] { return *done; });
    return g_sticky;
}

// --- the ordering check -----------------------------------------------------------------
// Copies and memsets queued on a stream and not yet done, with their place in the order the
// host queued work. An operation of another stream queued after one of them and touching its
// bytes (one of the two writing) while it is still pending is ordered after it by nothing: a
// wait on an event covers only records queued before the wait, so the pending one would have
// had to finish first. Kernels (racecheck.cpp, through ordering_check) and frees are checked.
struct Pending {
    CUdeviceptr lo, hi;
    void* stream;
    unsigned long long seq;
    bool write;
    const char* what;
};
std::mutex& pending_mutex = *new std::mutex;
std::list<Pending>& pending = *new std::list<Pending>;
unsigned long long g_seq = 0;  // the host's order of queued work (pending_mutex)
// The running launch (one at a time): its stream and place in that order.
void* g_launch_stream = nullptr;
unsigned long long g_launch_seq = 0;

unsigned long long next_seq() {
    std::lock_guard<std::mutex> g(pending_mutex);
    return ++g_seq;
}
// The first pending operation of a stream other than `s`, queued before `seq`, touching
// [lo, hi) with one of the two (it, or the caller when `write`) writing; null when none
// (pending_mutex held).
const Pending* conflict(void* s, unsigned long long seq, CUdeviceptr lo, CUdeviceptr hi, bool write) {
    for (const Pending& p : pending)
        if (p.stream != s && p.seq < seq && p.lo < hi && lo < p.hi && (p.write || write)) return &p;
    return nullptr;
}
// Queues `op` on stream `h`, recording the device bytes it touches until it is done.
void enqueue_tracked(void* h, std::vector<Pending> touches, std::function<void()> op) {
    if (!h) {  // runs now, on this thread
        enqueue(h, std::move(op));
        return;
    }
    std::vector<std::list<Pending>::iterator> ids;
    {
        std::lock_guard<std::mutex> g(pending_mutex);
        unsigned long long seq = ++g_seq;
        for (Pending& t : touches) {
            t.stream = h;
            t.seq = seq;
            ids.push_back(pending.insert(pending.end(), t));
        }
    }
    enqueue(h, [op = std::move(op), ids] {
        op();
        std::lock_guard<std::mutex> g(pending_mutex);
        for (auto it : ids) pending.erase(it);
    });
}
// For the memory check: whether a pending operation conflicts with the running launch's
// accesses anywhere in [lo, hi).
bool pending_for_launch(CUdeviceptr lo, CUdeviceptr hi) {
    std::lock_guard<std::mutex> g(pending_mutex);
    return conflict(g_launch_stream, g_launch_seq, lo, hi, true) != nullptr;
}
const char* ordering_check(const void* p, unsigned long n, bool write) {
    static thread_local char buf[400];
    CUdeviceptr a = reinterpret_cast<CUdeviceptr>(p);
    std::lock_guard<std::mutex> g(pending_mutex);
    const Pending* c = conflict(g_launch_stream, g_launch_seq, a, a + n, write);
    if (!c) return nullptr;
    std::snprintf(buf, sizeof buf,
                  "which %s queued before the launch on another stream %s and has not yet done (no event "
                  "wait orders the launch after it)",
                  c->what, c->write ? "writes" : "reads");
    return buf;
}

// An event: how many records were asked for and how many have run, and when the last ran.
struct EventState {
    unsigned long long recorded = 0, completed = 0;
    double time = 0;
};
using Event = std::shared_ptr<EventState>;

// --- device and pinned memory -------------------------------------------------------------
const std::size_t TOTAL = std::size_t(8) << 30;
// Freed blocks kept for reuse, at most this many bytes (beyond, the oldest go back to the host).
const std::size_t POOL_KEEP = std::size_t(1) << 30;
// Never destroyed, as g_m: a stream's queued free may still run while the process exits.
std::mutex& mem_mutex = *new std::mutex;
std::map<CUdeviceptr, std::size_t>& allocations = *new std::map<CUdeviceptr, std::size_t>;  // live
// Allocations freed whose free has not yet run in its stream: work queued before the free may
// still write them (what a temporary dropped right after its launches is).
std::map<CUdeviceptr, std::size_t>& freeing = *new std::map<CUdeviceptr, std::size_t>;
std::deque<std::pair<CUdeviceptr, std::size_t>>& pool =
    *new std::deque<std::pair<CUdeviceptr, std::size_t>>;  // freed blocks, oldest first
std::size_t used = 0, pooled = 0;
std::map<const char*, std::size_t, std::greater<const char*>>& pinned =
    *new std::map<const char*, std::size_t, std::greater<const char*>>;  // pinned host blocks
// The race check's shadows of device blocks it saw written, freed with the block's memory.
std::map<CUdeviceptr, RaceUnit*>& shadows = *new std::map<CUdeviceptr, RaceUnit*>;

void drop_pooled_front() {
    std::free(reinterpret_cast<void*>(pool.front().first - EMU_REDZONE));
    if (auto it = shadows.find(pool.front().first); it != shadows.end()) {
        std::free(it->second);
        shadows.erase(it);
    }
    pooled -= pool.front().second;
    used -= pool.front().second;
    pool.pop_front();
}

CUresult alloc(CUdeviceptr* p, std::size_t bytes) {
    std::size_t size = bytes ? bytes : 1;
    std::lock_guard<std::mutex> g(mem_mutex);
    for (auto it = pool.begin(); it != pool.end(); ++it)
        if (it->second == size) {  // poisoned when freed
            *p = it->first;
            pooled -= size;
            pool.erase(it);
            allocations[*p] = size;
            return OK;
        }
    while (used + size > TOTAL && !pool.empty()) drop_pooled_front();
    if (used + size > TOTAL) return OUT_OF_MEMORY;
    // Padded on both sides (see the memory check), NaN in f32, bf16 and f16: unwritten outputs
    // show.
    void* m = std::malloc(size + 2 * EMU_REDZONE);
    if (!m) return OUT_OF_MEMORY;
    std::memset(m, 0xff, size + 2 * EMU_REDZONE);
    *p = reinterpret_cast<CUdeviceptr>(m) + EMU_REDZONE;
    allocations[*p] = size;
    used += size;
    return OK;
}
// Takes `p` out of the live allocations (so later work naming it is refused) and returns its
// size, or 0 when it is not one.
std::size_t unlink(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocations.find(p);
    if (it == allocations.end()) return 0;
    std::size_t n = it->second;
    allocations.erase(it);
    freeing[p] = n;
    return n;
}
// The free itself, in stream order: poison, then pool.
void release(CUdeviceptr p, std::size_t n) {
    std::memset(reinterpret_cast<void*>(p), 0xff, n);
    std::lock_guard<std::mutex> g(mem_mutex);
    freeing.erase(p);
    pool.emplace_back(p, n);
    pooled += n;
    while (pooled > POOL_KEEP) drop_pooled_front();
}
// The bytes [p, p + n) lie in one live allocation.
bool inside(CUdeviceptr p, std::size_t n) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}
// The allocation holding `p` (live, or freed with its free still queued: a kernel queued before
// the free accesses it legally), with its race-check shadow when `shadow` (made on first use; a
// pooled block keeps it, as its epochs stay older than any later launch's). Else false, and the
// nearest allocation, live or freeing.
bool device_for_race_check(const void* p, bool shadow, RaceDevice* d) {
    CUdeviceptr a = reinterpret_cast<CUdeviceptr>(p);
    std::lock_guard<std::mutex> g(mem_mutex);
    *d = RaceDevice{0, 0, nullptr, false};
    std::uintptr_t best = ~std::uintptr_t(0);
    auto consider = [&](CUdeviceptr lo, std::size_t n) {
        std::uintptr_t dist = a < lo ? lo - a : a >= lo + n ? a - (lo + n) + 1 : 0;
        if (dist < best) {
            best = dist;
            *d = RaceDevice{lo, lo + n, nullptr, false};
        }
    };
    for (const auto* m : {&allocations, &freeing}) {
        auto it = m->upper_bound(a);
        if (it != m->end()) consider(it->first, it->second);
        if (it != m->begin()) {
            --it;
            consider(it->first, it->second);
        }
    }
    if (best != 0) return false;
    d->pending = pending_for_launch(d->lo, d->hi);
    if (!shadow) return true;
    RaceUnit*& s = shadows[d->lo];
    if (!s) s = static_cast<RaceUnit*>(std::calloc((d->hi - d->lo + 1) / 2, sizeof(RaceUnit)));
    if (!s) {
        std::fprintf(stderr, "emulated driver: no memory for the race check's shadow\n");
        std::abort();
    }
    d->shadow = s;
    return true;
}
bool is_pinned(const void* h, std::size_t n) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = pinned.lower_bound(static_cast<const char*>(h));  // the last block at or before h
    return it != pinned.end() && static_cast<const char*>(h) + n <= it->first + it->second;
}
CUresult check(CUdeviceptr a, CUdeviceptr b, std::size_t n) {
    if ((a && !inside(a, n)) || (b && !inside(b, n))) {
        std::fprintf(stderr, "emulated driver: a copy or memset of %zu bytes outside a live allocation\n", n);
        return INVALID_VALUE;
    }
    return OK;
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
    {NOT_READY, "CUDA_ERROR_NOT_READY", "not ready (emulated device)"},
    {LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", nullptr},  // the text is the report
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
CUresult cuCtxSynchronize() {
    std::unique_lock<std::mutex> l(g_m);
    wait_idle(l, [](Stream*) { return true; });
    return g_sticky;
}

CUresult cuStreamCreate(void** s, unsigned flags) { *s = new_stream(flags); return OK; }
CUresult cuStreamCreateWithPriority(void** s, unsigned flags, int) { return cuStreamCreate(s, flags); }
// Returns at once; the stream's queued work still runs, then its worker ends.
CUresult cuStreamDestroy_v2(void* h) {
    Stream* s = static_cast<Stream*>(h);
    {
        std::unique_lock<std::mutex> l(g_m);
        s->stop = true;
        g_cv.notify_all();
    }
    std::thread([s] {
        s->worker.join();
        std::lock_guard<std::mutex> g(g_m);
        g_streams.erase(s);
        delete s;
        g_cv.notify_all();
    }).detach();
    return OK;
}
CUresult cuStreamSynchronize(void* h) {
    std::unique_lock<std::mutex> l(g_m);
    if (h) {
        // Waits for the work queued so far: a marker behind it.
        Stream* s = static_cast<Stream*>(h);
        auto done = std::make_shared<bool>(false);
        s->queue.push_back([done] {
            std::lock_guard<std::mutex> g(g_m);
            *done = true;
        });
        g_cv.notify_all();
        g_cv.wait(l, [&] { return *done; });
    } else {
        wait_idle(l, [](Stream* s) { return s->blocking; });
    }
    return g_sticky;
}
CUresult cuLaunchHostFunc(void* s, void (*f)(void*), void* data) {
    enqueue(s, [f, data] { f(data); });
    return OK;
}

CUresult cuEventCreate(void** e, unsigned) { *e = new Event(std::make_shared<EventState>()); return OK; }
CUresult cuEventDestroy_v2(void* e) { delete static_cast<Event*>(e); return OK; }
CUresult cuEventRecord(void* h, void* s) {
    Event e = *static_cast<Event*>(h);
    unsigned long long n;
    {
        std::lock_guard<std::mutex> g(g_m);
        n = ++e->recorded;
    }
    enqueue(s, [e, n] {
        std::lock_guard<std::mutex> g(g_m);
        e->completed = std::max(e->completed, n);
        e->time = now_ms();
        g_cv.notify_all();
    });
    return OK;
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
// Work queued on `s` after this call waits for the event's last record (none: no wait).
CUresult cuStreamWaitEvent(void* s, void* h, unsigned) {
    Event e = *static_cast<Event*>(h);
    unsigned long long n;
    {
        std::lock_guard<std::mutex> g(g_m);
        n = e->recorded;
    }
    enqueue(s, [e, n] {
        std::unique_lock<std::mutex> l(g_m);
        g_cv.wait(l, [&] { return e->completed >= n; });
    });
    return OK;
}
CUresult cuEventSynchronize(void* h) {
    Event e = *static_cast<Event*>(h);
    std::unique_lock<std::mutex> l(g_m);
    unsigned long long n = e->recorded;
    g_cv.wait(l, [&] { return e->completed >= n; });
    return g_sticky;
}
CUresult cuEventQuery(void* h) {
    Event e = *static_cast<Event*>(h);
    std::lock_guard<std::mutex> g(g_m);
    return e->completed >= e->recorded ? g_sticky : NOT_READY;
}
CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    Event ea = *static_cast<Event*>(a), eb = *static_cast<Event*>(b);
    std::lock_guard<std::mutex> g(g_m);
    if (ea->completed < ea->recorded || eb->completed < eb->recorded) return NOT_READY;
    *ms = float(eb->time - ea->time);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemAlloc_v2(CUdeviceptr* p, std::size_t n) { return alloc(p, n); }
// The block is usable at once in this model: reuse needs its free to have run already.
CUresult cuMemAllocAsync(CUdeviceptr* p, std::size_t n, void*) { return alloc(p, n); }
// cuMemFree waits for the device, as it does on a GPU.
CUresult cuMemFree_v2(CUdeviceptr p) {
    std::size_t n = unlink(p);
    if (!n) return INVALID_VALUE;
    CUresult r = cuCtxSynchronize();
    release(p, n);
    return r;
}
CUresult cuMemFreeAsync(CUdeviceptr p, void* s) {
    std::size_t n = unlink(p);
    if (!n) return INVALID_VALUE;
    unsigned long long seq = next_seq();
    enqueue(s, [p, n, s, seq] {
        {
            std::lock_guard<std::mutex> g(pending_mutex);
            if (const Pending* c = conflict(s, seq, p, p + n, true)) {
                char buf[400];
                std::snprintf(buf, sizeof buf,
                              "ordering check: the %zu-byte allocation at %#llx is freed while %s queued before the "
                              "free on another stream, which %s it, has not yet done (no event wait orders the "
                              "free after it)",
                              n, p, c->what, c->write ? "writes" : "reads");
                std::fprintf(stderr, "emulated driver: %s\n", buf);
                std::lock_guard<std::mutex> e(g_m);
                if (g_sticky == OK) {
                    g_sticky = LAUNCH_FAILED;
                    g_sticky_text = buf;
                }
            }
        }
        release(p, n);
    });
    return OK;
}
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
    if (!*p) return OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(mem_mutex);
    pinned[static_cast<const char*>(*p)] = n;
    return OK;
}
CUresult cuMemAllocHost_v2(void** p, std::size_t n) { return cuMemHostAlloc(p, n, 0); }
// Waits for the device first, as cuMemFreeHost does on a GPU.
CUresult cuMemFreeHost(void* p) {
    CUresult r = cuCtxSynchronize();
    {
        std::lock_guard<std::mutex> g(mem_mutex);
        pinned.erase(static_cast<const char*>(p));
    }
    std::free(p);
    return r;
}

// Host to device: pinned memory is read when the copy runs; pageable memory is staged first,
// so the caller may reuse it when the call returns (as the driver does).
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, std::size_t n, void* s) {
    if (CUresult r = check(d, 0, n)) return r;
    if (is_pinned(h, n)) {
        enqueue_tracked(s, {{d, d + n, s, 0, true, "a copy to the device"}},
                        [d, h, n] { std::memcpy(reinterpret_cast<void*>(d), h, n); });
    } else {
        auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(h), static_cast<const char*>(h) + n);
        enqueue_tracked(s, {{d, d + n, s, 0, true, "a copy to the device"}},
                        [d, staged] { std::memcpy(reinterpret_cast<void*>(d), staged->data(), staged->size()); });
    }
    return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, std::size_t n) { return cuMemcpyHtoDAsync_v2(d, h, n, nullptr); }
// Device to host: into pinned memory asynchronously; into pageable memory the call returns
// when the copy is done.
CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, std::size_t n, void* s) {
    if (CUresult r = check(d, 0, n)) return r;
    auto op = [h, d, n] { std::memcpy(h, reinterpret_cast<const void*>(d), n); };
    if (is_pinned(h, n)) {
        enqueue_tracked(s, {{d, d + n, s, 0, false, "a copy from the device"}}, op);
        return OK;
    }
    return enqueue_and_wait(s, op);
}
CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, std::size_t n) { return cuMemcpyDtoHAsync_v2(h, d, n, nullptr); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr a, CUdeviceptr b, std::size_t n, void* s) {
    if (CUresult r = check(a, b, n)) return r;
    enqueue_tracked(s, {{a, a + n, s, 0, true, "a device-to-device copy"}, {b, b + n, s, 0, false, "a device-to-device copy"}},
                    [a, b, n] { std::memcpy(reinterpret_cast<void*>(a), reinterpret_cast<const void*>(b), n); });
    return OK;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr a, CUdeviceptr b, std::size_t n) { return cuMemcpyDtoDAsync_v2(a, b, n, nullptr); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, std::size_t n, void* s) {
    if (CUresult r = check(d, 0, n)) return r;
    enqueue_tracked(s, {{d, d + n, s, 0, true, "a memset"}},
                    [d, v, n] { std::memset(reinterpret_cast<void*>(d), v, n); });
    return OK;
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, std::size_t n) { return cuMemsetD8Async(d, v, n, nullptr); }

// A module is any cubin or PTX NVRTC made; functions are found by name among the kernels
// compiled into the kernels library.
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
    *f = const_cast<void*>(kernels().find(name));
    return *f ? OK : NOT_FOUND;
}
CUresult cuFuncSetAttribute(void*, int, int) { return OK; }
CUresult cuFuncGetAttribute(int* v, int, void*) { *v = 0; return OK; }

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void* s, void** params, void** extra) {
    const Kernels& k = kernels();
    const char* name = k.name(f);
    // What the hardware refuses, and what emu.h does not model (2-d blocks, dynamic shared
    // memory, partial warps), is an error rather than a silent difference.
    bool legal = gx && gy && gz && gy <= 65535 && gz <= 65535 && bx && bx <= 1024;
    bool modelled = by == 1 && bz == 1 && shared == 0 && bx % 32 == 0 && !extra;
    if (!legal || !modelled) {
        std::fprintf(stderr, "emulated driver: %s launched with grid (%u, %u, %u), block (%u, %u, %u), %u bytes of shared memory\n",
                     name, gx, gy, gz, bx, by, bz, shared);
        return INVALID_VALUE;
    }
    void* bound = k.bind(f, params);  // the arguments are read now, as the driver does
    unsigned long long seq = next_seq();
    enqueue(s, [f, bound, gx, gy, gz, bx, name, s, seq] {
        static std::mutex launch_mutex;  // emu.h's block state is global: one launch at a time
        std::lock_guard<std::mutex> g(launch_mutex);
        g_launch_stream = s;
        g_launch_seq = seq;
        double start = now_ms();
        const char* race = kernels().run(f, bound, gx, gy, gz, bx);
        if (trace())
            std::fprintf(stderr, "launch %s grid (%u, %u, %u) block %u: %.1f ms\n", name, gx, gy, gz, bx, now_ms() - start);
        if (race) {
            std::fprintf(stderr, "emulated driver: %s\n", race);
            std::lock_guard<std::mutex> e(g_m);
            if (g_sticky == OK) {
                g_sticky = LAUNCH_FAILED;
                g_sticky_text = race;
            }
        }
    });
    return OK;
}

// Not a driver call: how many bytes from `p` to the end of its live device allocation (0 when
// `p` is not in one), so that cudnn.cpp can check the buffers it is handed as the driver checks
// copies.
std::size_t gems_emu_device_bytes(const void* p) {
    CUdeviceptr a = reinterpret_cast<CUdeviceptr>(p);
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocations.upper_bound(a);
    if (it == allocations.begin()) return 0;
    --it;
    return a >= it->first && a < it->first + it->second ? it->first + it->second - a : 0;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
    *s = e == LAUNCH_FAILED ? g_sticky_text.c_str() : error_of(e).text;
    return OK;
}
CUresult cuGetErrorName(CUresult e, const char** s) { *s = error_of(e).name; return OK; }

}  // extern "C"
