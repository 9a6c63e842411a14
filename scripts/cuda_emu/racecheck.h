// The race check (racecheck.cpp), for kernels compiled with GCC's -fsanitize=thread.
#pragma once

// Once, with the test for device memory (the driver's allocations).
void racecheck_init(bool (*is_device)(const void*));
// Before a launch of kernel `name`.
void racecheck_begin(const char* name);
// The launch's first race, or null.
const char* racecheck_report();
