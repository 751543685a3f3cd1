// delay.cu: keep the GPU busy for a given number of SM clock cycles (the bench's timing guard).
//
// Computes nothing. One thread spins on clock64() until at least `cycles` cycles
// of its SM clock have passed, then writes the cycles it counted to spun[0].
// Kernels enqueued after it on the same stream start only when it ends.
//
// Why: cupykv.bench.timing.CudaEventTimer enqueues this after the L2 flush and
// before the start event, so the GPU is still busy while the host runs the timed
// call's Python prologue and enqueues its kernels. Without it the GPU can reach
// the start event, go idle, and the event window then counts host time.
//
// Time: cycles / SM clock. The host converts seconds to cycles with the device's
// maximum clock rate; a lower actual clock only makes the delay longer.
// On the emulator clock64() reads the CPU's time-stamp counter, which also counts
// up, so the spin ends there too (after `cycles` TSC ticks).
// Launch geometry: grid (1), block (1). Device-resident argument: spun [1] int64
// (written). Bytes moved: 8. Registers: a handful; no shared memory.
__global__ void __launch_bounds__(1) cupykv_delay(long long* __restrict__ spun, long long cycles) {
    const long long start = clock64();
    long long elapsed = 0;
    while (elapsed < cycles) elapsed = clock64() - start;
    spun[0] = elapsed;
}
