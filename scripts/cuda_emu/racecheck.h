// The race check (racecheck.cpp), for kernels compiled with GCC's -fsanitize=thread.
#pragma once
#include <cstdint>

// A live device allocation [lo, hi) and the race check's shadow of it: one 8-byte word per 2
// bytes, zero when made, kept by the allocation's owner for as long as the memory lives.
struct RaceDevice {
    std::uintptr_t lo, hi;
    std::uint64_t* shadow;
};
// Once, with the owner's lookup: fills `d` for the device allocation holding `p` and returns
// true, or returns false when `p` is not device memory.
void racecheck_init(bool (*device)(const void* p, RaceDevice* d));
// Before a launch of kernel `name`.
void racecheck_begin(const char* name);
// The launch's first race, or null.
const char* racecheck_report();
