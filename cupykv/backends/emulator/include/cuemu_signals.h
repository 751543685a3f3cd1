// cuemu_signals.h: runtime-internal: a launch stopped from outside (Ctrl-C, the launch's time
// limit), and the copy routines a fault may be left from (runtime.cpp, "faults, Ctrl-C and the
// time limit", explains both).
#pragma once
#include <signal.h>
#include <stddef.h>

namespace cuemu {

// Why a launch must stop (bits of interrupt_requested): Ctrl-C, or the launch ran past its CPU
// time limit (cuemu_launch_params.time_limit_s).
enum { STOP_SIGINT = 1, STOP_TIME_LIMIT = 2 };

// Set by the SIGINT and time-limit handlers when the signal arrives while the launching thread
// runs code that cannot be left at once (the runtime itself, a library); the runtime polls it
// where a fiber may stop (access hooks, barriers, warp operations, thread exit) and between
// fibers.
extern volatile sig_atomic_t interrupt_requested;
// Ends the launch from the running fiber (never returns) when a stop was requested. `ra`: the
// kernel's return address into the runtime at the poll, which the time limit's report names;
// null where there is none.
void stop_for_interrupt(const void* ra);
inline void poll_interrupt(const void* ra = nullptr) {
  if (__builtin_expect(interrupt_requested != 0, 0)) stop_for_interrupt(ra);
}

}  // namespace cuemu

// The kernels' memcpy, memmove and memset (access.cpp's wrappers) run these leaf routines of
// the runtime, so that an out-of-bounds copy faults in code a launch can be left from.
extern "C" {
void* cuemu_copy(void* dst, const void* src, size_t n);
void* cuemu_move(void* dst, const void* src, size_t n);
void* cuemu_fill(void* dst, int value, size_t n);
}
