// The memory check and the race check (racecheck.cpp), for kernels compiled with GCC's
// -fsanitize=thread.
#pragma once
#include <cstdint>

// The race check's shadow of one 2-byte unit of device memory: the last write in the launch
// (its epoch, emu.h's g_epoch, and the writer as block * blockDim.x + thread) and the blocks
// that read it (the epoch of the first read in the launch, and its block, or RACE_MANY).
struct RaceUnit {
    std::uint64_t write_epoch, read_epoch;
    std::uint32_t writer, reader;
};
constexpr std::uint32_t RACE_MANY = 0xffffffffu;
// A device allocation [lo, hi) and the race check's shadow of it (one RaceUnit per 2 bytes,
// zero when made, kept by the allocation's owner for as long as the memory lives; null when
// the race check is off).
struct RaceDevice {
    std::uintptr_t lo, hi;
    RaceUnit* shadow;
    // A copy or memset of another stream, queued before the running launch and not yet done,
    // touches it: each access is then checked against it (see OrderingCheck).
    bool pending;
};
// The owner's lookup: fills `d` for the device allocation holding `p` (with its shadow when
// `shadow`) and returns true; else returns false with `d` the nearest allocation (lo = hi = 0
// when there is none).
using DeviceLookup = bool (*)(const void* p, bool shadow, RaceDevice* d);
// The owner's ordering check of an access to an allocation marked `pending`: null, or what
// the access conflicts with (a copy of another stream that nothing orders it after).
using OrderingCheck = const char* (*)(const void* p, unsigned long n, bool write);
// Once: the lookups, and whether the race check runs beside the memory check.
void racecheck_init(DeviceLookup device, OrderingCheck ordering, bool race);
// Before a launch of kernel `name`.
void racecheck_begin(const char* name);
// The launch's first error (an access outside device memory, or a race), or null.
const char* racecheck_report();
// Bytes an access may land past an allocation's end (or before its start) and still be only
// reported: the driver pads each allocation by this much, so that it touches no other memory.
// Farther out, the report is printed and the process aborts before the access.
constexpr std::uintptr_t EMU_REDZONE = 256;
