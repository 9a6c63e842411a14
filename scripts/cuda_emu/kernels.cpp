// Every kernel of cuda/*.cu, compiled for the CPU under emu.h (force-included), behind a small C
// interface the emulated driver (driver.cpp) loads: find a kernel by name, bind its arguments,
// run a grid. build.rs compiles it with -fsanitize=thread's instrumentation, answered by
// racecheck.cpp (libgems_emu_kernels.so): every load and store is checked against the device
// allocations, and under GEMS_EMU_RACECHECK for races. A launch with an error returns its
// report; the driver prints it and fails the next synchronisation.
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

// A kernel with its arguments, copied out of cuLaunchKernel's `params`, ready to run on a grid.
struct Bound {
    void (*run)(const Bound*, uint3 grid, unsigned block);
    void (*destroy)(Bound*);
};
template <typename C> struct BoundAs : Bound {
    C closure;
};
// The closure holds the arguments by value (trivially copyable, as emu.h's checked launch
// wants: the kernels' arguments are pointers, numbers and plain structs).
template <typename... A, std::size_t... I>
Bound* unpack(void (*k)(A...), void** p, std::index_sequence<I...>) {
    auto closure = [k, ... a = *static_cast<std::decay_t<A>*>(p[I])] { k(a...); };
    using C = decltype(closure);
    return new BoundAs<C>{{[](const Bound* b, uint3 grid, unsigned block) {
                               launch(grid, block, static_cast<const BoundAs<C>*>(b)->closure);
                           },
                           [](Bound* b) { delete static_cast<BoundAs<C>*>(b); }},
                          closure};
}
struct Kernel {
    std::string name;
    Bound* (*bind)(void**);
};
#define GEMS_KERNEL(name) \
    Kernel{#name, [](void** p) { return unpack(name, p, std::make_index_sequence<kernel_arity(name)>{}); }},
template <typename... A> constexpr std::size_t kernel_arity(void (*)(A...)) { return sizeof...(A); }
const std::vector<Kernel> KERNELS = {
#include "kernels.inc"
};

}  // namespace

extern "C" {

// Once, before any launch: the driver's lookups of device memory and of queued copies, and whether the race check
// runs (the memory check always does).
__attribute__((visibility("default"))) void gems_emu_init(DeviceLookup device, OrderingCheck ordering, bool race) {
    racecheck_init(device, ordering, race);
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
    return static_cast<const Kernel*>(k)->bind(params);
}

// Runs a bound kernel on a grid (one launch at a time: emu.h's state is global) and frees it.
// Returns null, or the report of the first error the checks found.
__attribute__((visibility("default"))) const char* gems_emu_run(const void* k, void* bound, unsigned gx,
                                                                 unsigned gy, unsigned gz, unsigned bx) {
    Bound* b = static_cast<Bound*>(bound);
    racecheck_begin(static_cast<const Kernel*>(k)->name.c_str());
    b->run(b, uint3{gx, gy, gz}, bx);
    b->destroy(b);
    return racecheck_report();
}

}  // extern "C"
