// signals.cu: kernels that never finish (for Ctrl-C and the launch's time limit), that fault
// inside libc, or inside the kernels' memcpy (tests/test_emulator_signals.py). They compile for
// NVRTC too, but for `shift`.

// Spins on a local variable: no access the emulator sees, no barrier, no call.
__global__ void spin(int* out) {
  volatile int go = 1;
  while (go) {
  }
  out[threadIdx.x] = go;
}

// Spends a long stretch inside libm, then spins on a local like `spin`. glibc's jnf runs a
// recurrence as many steps long as the order (0.9 s for 2e8 steps on a CI host; the test measures
// it), so the time limit's first signal lands in the library, where the runtime's handler may
// only set the flag it polls; after the call nothing polls (no access it sees, no barrier), so
// only a later signal of the repeating timer, landing in the spin, stops the thread. Volatile
// locals keep g++ from folding the call and keep the access hook out of the way.
__global__ void spin_after_libm(int* out, int order) {
  volatile int bessel_order = order;
  volatile float x = 1.0f;
  volatile float value = jnf(bessel_order, x);
  volatile int spinning = 1;
  while (spinning) {
  }
  out[threadIdx.x] = spinning + (int)value;
}

// Busy-waits on a flag in global memory that nothing sets: every read of the (watched)
// argument calls the emulator's access hook.
__global__ void wait_for_flag(int* flag) {
  while (((volatile int*)flag)[0] == 0) {
  }
}

// Busy-waits on a flag that nothing sets, the whole block meeting at a barrier every round.
__global__ void wait_at_barriers(int* flag) {
  const volatile int* seen = flag;
  while (seen[0] == 0) {
    __syncthreads();
  }
}

// Thread `who` of the grid hands printf a bad pointer: the fault happens inside libc, not in
// kernel code.
__global__ void print_string(const char* text, int who) {
  if (blockIdx.x * blockDim.x + threadIdx.x == who) printf("[%s]\n", text);
}

// Finishes: the emulator still runs kernels after an interrupted launch.
__global__ void fill(int* out) { out[threadIdx.x] = 7; }

// memmove within one array in both directions (n <= size - 2), and a memset: the runtime's
// copy routines, not libc's, run them. CUDA has no device memmove, but g++ may emit calls to it
// for a kernel's copy loops, so the emulator provides one: this kernel is for the emulator only.
#ifdef CUPYKV_EMULATOR
__global__ void shift(int* a, int n) {
  if (threadIdx.x == 0) {
    memmove(a + 1, a, n * sizeof(int));      // overlapping, destination after the source
    memmove(a, a + 2, n * sizeof(int));      // overlapping, destination before the source
    memset(a + n, 0, 2 * sizeof(int));
  }
}
#endif

// Copies n floats from x into y: one past the end of x when n is its size + 1.
__global__ void copy_floats(float* y, const float* x, int n) {
  if (threadIdx.x == 0) memcpy(y, x, n * sizeof(float));
}
