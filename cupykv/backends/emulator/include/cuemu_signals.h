// cuemu_signals.h: runtime-internal: Ctrl-C during a launch, and the copy routines a fault may
// be left from (runtime.cpp, "faults and Ctrl-C", explains both).
#pragma once
#include <signal.h>
#include <stddef.h>

namespace cuemu {

// Set by the SIGINT handler when Ctrl-C arrives while the launching thread runs code that
// cannot be left at once (the runtime itself, a library); the runtime polls it where a fiber
// may stop (access hooks, barriers, warp operations, thread exit) and between fibers.
extern volatile sig_atomic_t interrupt_requested;
// Ends the launch from the running fiber (never returns) when Ctrl-C was pressed.
void stop_for_interrupt();
inline void poll_interrupt() {
  if (__builtin_expect(interrupt_requested != 0, 0)) stop_for_interrupt();
}

}  // namespace cuemu

// The kernels' memcpy, memmove and memset (access.cpp's wrappers) run these leaf routines of
// the runtime, so that an out-of-bounds copy faults in code a launch can be left from.
extern "C" {
void* cuemu_copy(void* dst, const void* src, size_t n);
void* cuemu_move(void* dst, const void* src, size_t n);
void* cuemu_fill(void* dst, int value, size_t n);
}
