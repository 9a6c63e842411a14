// Every kernel of cuda/*.cu, compiled for the CPU under emu.h (force-included), behind a small C
// interface the emulated driver (driver.cpp) loads: find a kernel by name, bind its arguments,
// run a grid. build.rs compiles it twice: plainly (libgems_emu_kernels.so) and with the race
// check (-fsanitize=thread's instrumentation, answered by racecheck.cpp;
// libgems_emu_kernels_race.so). A launch with a race returns its report;
// the driver prints it and fails the next synchronisation.
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "activation.cu"
#undef STAMP
#include "batchnorm.cu"
#undef STAMP
#include "conv.cu"
#undef STAMP
#include "elementwise.cu"
#undef STAMP
#include "groupnorm.cu"
#undef STAMP
#include "loss.cu"
#undef STAMP
#include "optim.cu"
#undef STAMP
#include "pool.cu"
#undef STAMP
#include "resize.cu"
#undef STAMP
EMU_F16_IMPL
#include "racecheck.h"

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

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void gems_emu_init(bool (*device)(const void*, RaceDevice*)) {
#ifdef GEMS_EMU_RACECHECK
    racecheck_init(device);
#else
    (void)device;
#endif
}

// The kernel called `name`, or null.
__attribute__((visibility("default"))) const void* gems_emu_kernel(const char* name) {
    for (const Kernel& k : KERNELS)
        if (k.name == name) return &k;
    return nullptr;
}

__attribute__((visibility("default"))) const char* gems_emu_kernel_name(const void* k) {
    return static_cast<const Kernel*>(k)->name.c_str();
}

// The kernel's arguments copied out of `params` (freed by gems_emu_run).
__attribute__((visibility("default"))) void* gems_emu_bind(const void* k, void** params) {
    return new Bound(static_cast<const Kernel*>(k)->bind(params));
}

// Runs a bound kernel on a grid (one launch at a time: emu.h's state is global) and frees it.
// Returns null, or the report of the first race the check found.
__attribute__((visibility("default"))) const char* gems_emu_run(const void* k, void* bound, unsigned gx,
                                                                 unsigned gy, unsigned gz, unsigned bx) {
    std::unique_ptr<Bound> body(static_cast<Bound*>(bound));
#ifdef GEMS_EMU_RACECHECK
    racecheck_begin(static_cast<const Kernel*>(k)->name.c_str());
    launch(uint3{gx, gy, gz}, bx, *body);
    return racecheck_report();
#else
    (void)k;
    launch(uint3{gx, gy, gz}, bx, *body);
    return nullptr;
#endif
}

}  // extern "C"
