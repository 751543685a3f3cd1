// runtime.cpp: the cupykv CUDA emulator runtime (fibers, scheduler, checks, faults).
//
// Every CUDA thread of a block is a fiber with its own stack. Fibers run one at a
// time on the launching OS thread and switch only at __syncthreads, warp intrinsics
// and exit, with a hand-written x86-64 context switch (no system call). Blocks run
// one after another, in index order or in a seeded random order (schedule.cpp, which
// also orders the warps and lanes each barrier or warp collective releases). The scheduler checks the synchronisation rules:
// every thread reaches the same __syncthreads, warp intrinsics are reached by all lanes
// of their mask at the same call site with the same mask, no lane reads from outside
// the mask. It reports blocks, barriers and warp collectives to the access-event layer
// (access.cpp), whose observers (racecheck.cpp) see every memory access. The tensor-core
// fragment instructions (mma, ldmatrix) are warp collectives of all 32 lanes computed by
// fragments.cpp; asynchronous copies are tracked by async_copy.cpp. Memory faults,
// fiber stack overflows, Ctrl-C and the launch's CPU time limit end the launch with an error
// report; "faults, Ctrl-C and the time limit" below says when that may leave a signal handler,
// and what happens otherwise.
//
// Build: g++ -std=c++17 -O2 -fPIC -shared runtime.cpp access.cpp racecheck.cpp traffic.cpp
// schedule.cpp async_copy.cpp fragments.cpp -I include (done by build.py).
#include <link.h>
#include <pthread.h>
#include <setjmp.h>
#include <stddef.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <string>

#include "cuemu_abi.h"
#include "cuemu_schedule.h"
#include "cuemu_signals.h"
#include "cuemu_trace.h"

#define CUEMU_HIDDEN __attribute__((visibility("hidden")))
#define CUEMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

enum : uint8_t { READY = 0, RUNNING = 1, AT_BARRIER = 2, AT_WARP = 3, EXITED = 4 };

struct Fiber {
  void* sp;
  uint32_t tid;  // linear thread id in the block
  uint8_t state;
  uint8_t op;    // barrier kind or warp op code while waiting
  uint8_t vsize;
  uint3 idx;
  const char* file;
  int line;
  uint32_t mask;
  int32_t arg;
  int32_t width;
  uint64_t value;
  uint64_t result;
  const void* xin;  // fragment instructions: the lane's operands and results (fragments.cpp)
  void* xout;
  const void* ra;   // fragment instructions: the return address of the lane's call
};

struct Warp {
  uint32_t present;  // lanes that exist in this block
  uint32_t exited;
  uint32_t waiting;  // lanes waiting at a warp op
};

struct Stacks {
  char* base = nullptr;
  size_t count = 0;
  size_t size = 0;   // usable bytes per stack
  size_t stride = 0; // guard page + usable bytes
  size_t page = 4096;
};

Stacks g_stacks;
Fiber* g_fibers = nullptr;
uint32_t* g_queue = nullptr;
uint32_t g_capacity = 0;

struct Sched {
  uint32_t n;
  uint32_t qhead, qcount;
  uint32_t alive, exited;
  uint32_t nwarps;
  Warp warps[32];
  uint32_t bar_count, bar_acc;
  const char* bar_file;
  int bar_line;
  int bar_kind;
  bool bar_mismatch;
  void* sched_sp;
  int err;
  uint32_t init_csr[2];    // MXCSR and x87 control word every fiber starts with
  uint32_t host_csr[2];    // the launching thread's, restored when the launch ends
};

Sched S;
Fiber* g_cur = nullptr;
Fiber* g_err_fiber = nullptr;  // the thread an error is about, if any
std::string g_msg;
void (*g_invoke)(void**) = nullptr;
void** g_args = nullptr;

// Fault state (written by the signal handler, read after siglongjmp).
sigjmp_buf g_jb;
thread_local bool t_in_launch = false;
volatile sig_atomic_t g_fault_sig = 0;
uint64_t g_fault_addr = 0;
int g_fault_write = -1;
Fiber* g_fault_fiber = nullptr;
uint32_t g_fault_site = 0;   // the faulting access in the module (cuemu_result.fault_site)
int g_has_fault_site = 0;
struct sigaction g_old_act[4];
const int g_sigs[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
char* g_altstack = nullptr;
const size_t kAltStackSize = 256 * 1024;

// Code a signal handler may leave by siglongjmp ("faults, Ctrl-C and the time limit" below).
struct CodeRange {
  uintptr_t lo = 0, hi = 0;
  bool has(uintptr_t pc) const { return pc - lo < hi - lo; }
};
CodeRange g_module_code;   // the executable segment of the launched kernel's module
CodeRange g_runtime_code;  // this library's
CodeRange g_copy_code;     // cuemu_copy, cuemu_move, cuemu_fill
CodeRange g_kernel_text;   // the module's .text, offsets from its base (cuemu_launch_params.text_lo)
pthread_t g_launch_thread;
volatile sig_atomic_t g_launch_running = 0;  // the launching thread is between sigsetjmp and the end
struct sigaction g_old_sigint;
struct sigaction g_old_time_limit;
timer_t g_time_limit_timer;   // the launching thread's CPU-time timer, while a limited launch runs
double g_time_limit_s = 0;    // the launch's limit (cuemu_launch_params.time_limit_s); 0: none

// The signal of the time limit's timer: a real-time signal that neither Python nor CuPy uses,
// handled by the runtime only while a launch with a limit runs. (glibc's SIGRTMIN is a call.)
int time_limit_signal() { return SIGRTMIN + 2; }

}  // namespace

volatile sig_atomic_t cuemu::interrupt_requested = 0;

extern "C" {
cuemu_ctx_t cuemu_ctx __attribute__((visibility("default")));
CUEMU_HIDDEN void cuemu_switch_ctx(void** save_sp, void* load_sp);
CUEMU_HIDDEN void cuemu_fiber_trampoline();
CUEMU_HIDDEN void cuemu_fiber_main(Fiber* f);
}

// ---- context switch ---------------------------------------------------------------
// Saves the callee-saved registers, MXCSR and the x87 control word on the current
// stack, stores rsp in *save_sp, loads load_sp and restores the same from there.
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl cuemu_switch_ctx
    .hidden cuemu_switch_ctx
    .type cuemu_switch_ctx, @function
cuemu_switch_ctx:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuemu_switch_ctx, .-cuemu_switch_ctx

    .p2align 4
    .globl cuemu_fiber_trampoline
    .hidden cuemu_fiber_trampoline
    .type cuemu_fiber_trampoline, @function
cuemu_fiber_trampoline:
    movq %r12, %rdi
    call cuemu_fiber_main
    ud2
    .size cuemu_fiber_trampoline, .-cuemu_fiber_trampoline
)");

// memcpy, memmove and memset of kernel modules (cuemu_signals.h): leaf string instructions
// between cuemu_copy_code_begin and cuemu_copy_code_end, so that a fault in them is known to
// be in code that holds no state. memmove copies backwards when the destination starts inside
// the source.
asm(R"(
    .text
    .p2align 4
    .globl cuemu_copy_code_begin
    .hidden cuemu_copy_code_begin
cuemu_copy_code_begin:
    .globl cuemu_copy
    .hidden cuemu_copy
    .type cuemu_copy, @function
cuemu_copy:
    movq %rdi, %rax
    movq %rdx, %rcx
    rep movsb
    ret
    .size cuemu_copy, .-cuemu_copy

    .globl cuemu_move
    .hidden cuemu_move
    .type cuemu_move, @function
cuemu_move:
    movq %rdi, %rax
    movq %rdx, %rcx
    movq %rdi, %r8
    subq %rsi, %r8
    cmpq %rdx, %r8
    jae 1f
    leaq -1(%rdi,%rdx), %rdi
    leaq -1(%rsi,%rdx), %rsi
    std
    rep movsb
    cld
    ret
1:
    rep movsb
    ret
    .size cuemu_move, .-cuemu_move

    .globl cuemu_fill
    .hidden cuemu_fill
    .type cuemu_fill, @function
cuemu_fill:
    movq %rdi, %r8
    movl %esi, %eax
    movq %rdx, %rcx
    rep stosb
    movq %r8, %rax
    ret
    .size cuemu_fill, .-cuemu_fill
    .globl cuemu_copy_code_end
    .hidden cuemu_copy_code_end
cuemu_copy_code_end:
)");
extern "C" const char cuemu_copy_code_begin[], cuemu_copy_code_end[];

// Lays out a frame that cuemu_switch_ctx "returns" from into the trampoline.
static void* init_frame(char* top, Fiber* f) {
  uint64_t* sp = reinterpret_cast<uint64_t*>(top) - 10;  // top is 16-aligned
  // ldmxcsr/fldcw read sp[0], six pops, ret to sp[7]: then rsp = top - 16, aligned as
  // before a call, so the trampoline can call cuemu_fiber_main.
  sp[0] = (uint64_t)S.init_csr[0] | ((uint64_t)S.init_csr[1] << 32);  // mxcsr | fpcw
  sp[1] = 0;                                  // r15
  sp[2] = 0;                                  // r14
  sp[3] = 0;                                  // r13
  sp[4] = reinterpret_cast<uint64_t>(f);     // r12 -> fiber
  sp[5] = 0;                                  // rbx
  sp[6] = 0;                                  // rbp
  sp[7] = reinterpret_cast<uint64_t>(&cuemu_fiber_trampoline);
  sp[8] = 0;
  sp[9] = 0;
  return sp;
}
// CuPy compiles every kernel with -ftz=true, so on the GPU fp32 subnormal inputs and results
// of arithmetic flush to sign-preserving zero. Fibers run with MXCSR's flush-to-zero and
// denormals-are-zero bits set to do the same. (SSE applies them to double too, where the GPU
// keeps subnormals; cupykv uses double only for rope angles, far from that range.) The 16-bit
// conversions are integer code in cuda_fp16.h / cuda_bf16.h and keep subnormals, like the
// GPU's cvt instructions without .ftz.
constexpr uint32_t kMxcsrFlushToZero = 1u << 15, kMxcsrDenormalsAreZero = 1u << 6;

static void capture_csr() {
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  S.host_csr[0] = mxcsr;
  S.host_csr[1] = fpcw;
  S.init_csr[0] = mxcsr | kMxcsrFlushToZero | kMxcsrDenormalsAreZero;
  S.init_csr[1] = fpcw;
}

// A fault leaves the launching thread by siglongjmp with a fiber's control words loaded.
static void restore_host_csr() {
  const uint16_t fpcw = (uint16_t)S.host_csr[1];
  asm volatile("ldmxcsr %0" : : "m"(S.host_csr[0]));
  asm volatile("fldcw %0" : : "m"(fpcw));
}
#else
#error "the cupykv emulator runtime supports x86-64 only"
#endif

// ---- stacks and fibers ------------------------------------------------------------
// `need` fibers with stacks of `stack_kib` KiB each (rounded up to pages): the stacks are remapped
// when more fibers are needed or the size changed since the last launch.
static bool ensure_fibers(uint32_t need, uint32_t stack_kib) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t size = ((size_t)stack_kib * 1024 + page - 1) / page * page;
  if (need <= g_capacity && size == g_stacks.size) return true;
  uint32_t n = 64;  // grow in powers of two: each growth remaps every stack
  while (n < need) n *= 2;
  if (g_stacks.base) munmap(g_stacks.base, g_stacks.count * g_stacks.stride);
  free(g_fibers);
  free(g_queue);
  g_stacks = Stacks();
  g_capacity = 0;
  size_t stride = size + page;
  void* base = mmap(nullptr, stride * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return false;
  for (uint32_t i = 0; i < n; ++i) mprotect((char*)base + i * stride, page, PROT_NONE);
  g_stacks.base = (char*)base;
  g_stacks.count = n;
  g_stacks.size = size;
  g_stacks.stride = stride;
  g_stacks.page = page;
  g_fibers = (Fiber*)calloc(n, sizeof(Fiber));
  g_queue = (uint32_t*)calloc(n, sizeof(uint32_t));
  if (!g_fibers || !g_queue) return false;
  g_capacity = n;
  return true;
}
static inline char* stack_top(uint32_t i) { return g_stacks.base + (size_t)(i + 1) * g_stacks.stride; }

static inline void push_ready(Fiber* f) {
  f->state = READY;
  uint32_t slot = S.qhead + S.qcount;
  if (slot >= S.n) slot -= S.n;
  g_queue[slot] = f->tid;
  ++S.qcount;
}
static inline Fiber* pop_ready() {
  if (!S.qcount) return nullptr;
  Fiber* f = &g_fibers[g_queue[S.qhead]];
  S.qhead = (S.qhead + 1 == S.n) ? 0 : S.qhead + 1;
  --S.qcount;
  return f;
}
static inline void enter(Fiber* f) {
  g_cur = f;
  f->state = RUNNING;
  cuemu_ctx.thread_idx = f->idx;
  cuemu::trace_set_thread(f->tid);
}

// The current fiber stops running (its state says why) and the next ready fiber, or
// the scheduler, takes over. Returns when some fiber makes this one ready again.
static void yield_blocked(Fiber* me) {
  Fiber* next = pop_ready();
  if (next) {
    enter(next);
    cuemu_switch_ctx(&me->sp, next->sp);
  } else {
    g_cur = nullptr;
    cuemu_switch_ctx(&me->sp, S.sched_sp);
  }
}

// Readies the lanes of `lanes` in the warp at `base`: in lane order, leaving out `me`, or,
// under a shuffled schedule, all of them in a seeded order (the caller then yields).
static void push_lanes(uint32_t base, uint32_t lanes, const Fiber* me) {
  const uint8_t* order = cuemu::schedule_lane_order();
  for (uint32_t k = 0; k < 32; ++k) {
    const uint32_t l = order ? order[k] : k;
    Fiber* f = &g_fibers[base + l];
    if ((lanes >> l & 1) && (order || f != me)) push_ready(f);
  }
}

// Readies every fiber of the block (at its start, or when a barrier completes): in thread
// order, leaving out `me`, or warps in a seeded order, each in a seeded lane order.
static void push_block(const Fiber* me) {
  uint32_t warps[32];
  for (uint32_t w = 0; w < S.nwarps; ++w) warps[w] = w;
  if (cuemu::schedule_shuffled()) cuemu::schedule_shuffle(warps, S.nwarps);
  for (uint32_t k = 0; k < S.nwarps; ++k) push_lanes(warps[k] * 32u, S.warps[warps[k]].present, me);
}

// Under a shuffled schedule the fiber that released others was queued among them: it runs
// when its turn comes.
static void yield_if_shuffled(Fiber* me) {
  if (!cuemu::schedule_shuffled()) return;
  Fiber* next = pop_ready();
  if (next == me) {
    enter(me);
    return;
  }
  enter(next);
  cuemu_switch_ctx(&me->sp, next->sp);
}

// ---- messages ---------------------------------------------------------------------
static void msgf(std::string& out, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  out += buf;
}
static const char* op_name(int op) {
  switch (op) {
    case CUEMU_SHFL_IDX: return "__shfl_sync";
    case CUEMU_SHFL_UP: return "__shfl_up_sync";
    case CUEMU_SHFL_DOWN: return "__shfl_down_sync";
    case CUEMU_SHFL_XOR: return "__shfl_xor_sync";
    case CUEMU_BALLOT: return "__ballot_sync";
    case CUEMU_ALL: return "__all_sync";
    case CUEMU_ANY: return "__any_sync";
    case CUEMU_SYNCWARP: return "__syncwarp";
    case CUEMU_ACTIVEMASK: return "__activemask";
    case CUEMU_MATCH_ANY: return "__match_any_sync";
    case CUEMU_REDUCE_ADD: return "__reduce_add_sync";
    case CUEMU_REDUCE_MIN: case CUEMU_REDUCE_UMIN: return "__reduce_min_sync";
    case CUEMU_REDUCE_MAX: case CUEMU_REDUCE_UMAX: return "__reduce_max_sync";
    case CUEMU_REDUCE_AND: return "__reduce_and_sync";
    case CUEMU_REDUCE_OR: return "__reduce_or_sync";
    case CUEMU_REDUCE_XOR: return "__reduce_xor_sync";
    case CUEMU_MMA_F16: return "mma.sync.m16n8k16 (f16)";
    case CUEMU_MMA_BF16: return "mma.sync.m16n8k16 (bf16)";
    case CUEMU_LDMATRIX: return "ldmatrix.sync.m8n8";
  }
  return "warp operation";
}
static const char* bar_name(int kind) {
  switch (kind) {
    case CUEMU_BAR_COUNT: return "__syncthreads_count";
    case CUEMU_BAR_AND: return "__syncthreads_and";
    case CUEMU_BAR_OR: return "__syncthreads_or";
  }
  return "__syncthreads";
}
static std::string lane_list(uint32_t lanes, uint32_t warp) {
  std::string s;
  for (int l = 0; l < 32;) {
    if (!(lanes >> l & 1)) { ++l; continue; }
    int e = l;
    while (e + 1 < 32 && (lanes >> (e + 1) & 1)) ++e;
    if (!s.empty()) s += ", ";
    if (e == l) msgf(s, "%d (thread %u)", l, warp * 32 + l);
    else msgf(s, "%d-%d (threads %u-%u)", l, e, warp * 32 + l, warp * 32 + e);
    l = e + 1;
  }
  return s;
}
static bool same_site(const char* f1, int l1, const char* f2, int l2) {
  return l1 == l2 && (f1 == f2 || strcmp(f1, f2) == 0);
}

// Stops the launch from inside a fiber (`who` is the thread to blame); never returns.
[[noreturn]] static void fail(int kind, Fiber* who) {
  S.err = kind;
  g_err_fiber = who;
  Fiber* me = g_cur;
  g_cur = nullptr;
  void* dummy;
  cuemu_switch_ctx(me ? &me->sp : &dummy, S.sched_sp);
  __builtin_unreachable();
}

// ---- barriers ---------------------------------------------------------------------
CUEMU_EXPORT int cuemu_barrier(int kind, int pred, const char* file, int line) {
  cuemu::poll_interrupt(__builtin_return_address(0));
  Fiber* me = g_cur;
  cuemu::trace_sync_point();
  if (S.bar_count == 0) {
    S.bar_file = file;
    S.bar_line = line;
    S.bar_kind = kind;
    S.bar_acc = 0;
    S.bar_mismatch = false;
  } else if (kind != S.bar_kind || !same_site(file, line, S.bar_file, S.bar_line)) {
    S.bar_mismatch = true;
  }
  S.bar_acc += pred != 0;
  ++S.bar_count;
  me->file = file;
  me->line = line;
  me->op = (uint8_t)kind;
  if (S.bar_count == S.n && !S.bar_mismatch) {  // everybody is here, nobody exited
    int res = 0;
    switch (kind) {
      case CUEMU_BAR_COUNT: res = (int)S.bar_acc; break;
      case CUEMU_BAR_AND: res = S.bar_acc == S.n; break;
      case CUEMU_BAR_OR: res = S.bar_acc != 0; break;
    }
    S.bar_count = 0;
    cuemu::trace_barrier();
    for (uint32_t i = 0; i < S.n; ++i) g_fibers[i].result = (uint64_t)(int64_t)res;
    push_block(me);
    yield_if_shuffled(me);
    return res;
  }
  me->state = AT_BARRIER;
  yield_blocked(me);
  return (int)(int64_t)me->result;
}

// ---- warp operations --------------------------------------------------------------
static inline bool is_fragment(int op) { return op >= CUEMU_MMA_F16; }

[[noreturn]] static void warp_fail(Fiber* who, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_msg.clear();
  if (is_fragment(who->op))  // the header's line is every call's: name the kernel's call site
    msgf(g_msg, "%s at " CUEMU_SITE_TOKEN " in warp %u: %s", op_name(who->op), cuemu::trace_site(who->ra),
         who->tid / 32, buf);
  else
    msgf(g_msg, "%s at %s:%d (mask 0x%08x) in warp %u: %s", op_name(who->op), who->file, who->line,
         who->mask, who->tid / 32, buf);
  fail(CUEMU_ERR_SYNC, who);
}

static inline bool is_shfl(int op) { return op <= CUEMU_SHFL_XOR; }

// A complete warp at a fragment instruction: every lane's results (fragments.cpp).
static void release_fragment(Warp& W, uint32_t base, Fiber* me) {
  Fiber* F = &g_fibers[base];
  cuemu::FragmentLane lanes[32];
  for (uint32_t l = 0; l < 32; ++l) lanes[l] = cuemu::FragmentLane{F[l].xin, F[l].xout, F[l].ra};
  std::string why;
  const int blame = cuemu::fragment_release(me->op, me->arg, base, lanes, &why);
  if (blame >= 0) {
    g_msg.clear();
    msgf(g_msg, "%s at " CUEMU_SITE_TOKEN " in warp %u: %s", op_name(me->op), cuemu::trace_site(F[blame].ra),
         base / 32, why.c_str());
    fail(CUEMU_ERR_FRAGMENT, &F[blame]);
  }
  if (me->op != CUEMU_LDMATRIX) {   // counted per warp in traffic launches
    const uint3 bi = cuemu_ctx.block_idx, gd = cuemu_ctx.grid_dim;
    cuemu::count_warp_mma(bi.x + (uint64_t)gd.x * (bi.y + (uint64_t)gd.y * bi.z), base / 32);
  }
  // No trace_warp_sync: mma.sync and ldmatrix order no memory accesses between the lanes.
  W.waiting = 0;
  push_lanes(base, 0xffffffffu, me);
}

// Computes the result of every lane of a complete group and makes them ready.
static void release_group(Warp& W, uint32_t base, uint32_t mask, int op, Fiber* me) {
  Fiber* F = &g_fibers[base];
  uint64_t acc = 0;
  switch (op) {
    case CUEMU_BALLOT:
      for (uint32_t l = 0; l < 32; ++l)
        if ((mask >> l & 1) && F[l].value) acc |= 1u << l;
      break;
    case CUEMU_ALL:
      acc = 1;
      for (uint32_t l = 0; l < 32; ++l)
        if ((mask >> l & 1) && !F[l].value) acc = 0;
      break;
    case CUEMU_ANY:
      for (uint32_t l = 0; l < 32; ++l)
        if ((mask >> l & 1) && F[l].value) acc = 1;
      break;
    case CUEMU_REDUCE_ADD: case CUEMU_REDUCE_MIN: case CUEMU_REDUCE_MAX: case CUEMU_REDUCE_UMIN:
    case CUEMU_REDUCE_UMAX: case CUEMU_REDUCE_AND: case CUEMU_REDUCE_OR: case CUEMU_REDUCE_XOR: {
      bool first = true;
      uint32_t a = 0;
      for (uint32_t l = 0; l < 32; ++l) {
        if (!(mask >> l & 1)) continue;
        uint32_t v = (uint32_t)F[l].value;
        if (first) { a = v; first = false; continue; }
        switch (op) {
          case CUEMU_REDUCE_ADD: a += v; break;
          case CUEMU_REDUCE_MIN: a = (int32_t)v < (int32_t)a ? v : a; break;
          case CUEMU_REDUCE_MAX: a = (int32_t)v > (int32_t)a ? v : a; break;
          case CUEMU_REDUCE_UMIN: a = v < a ? v : a; break;
          case CUEMU_REDUCE_UMAX: a = v > a ? v : a; break;
          case CUEMU_REDUCE_AND: a &= v; break;
          case CUEMU_REDUCE_OR: a |= v; break;
          case CUEMU_REDUCE_XOR: a ^= v; break;
        }
      }
      acc = a;
      break;
    }
    default: break;
  }
  if (op != CUEMU_ACTIVEMASK) cuemu::trace_warp_sync(base / 32u, mask);  // orders the lanes
  for (uint32_t l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    Fiber& f = F[l];
    if (is_shfl(op)) {
      // PTX shfl.sync: c = ((32 - width) << 8) | clamp; segmask = 32 - width.
      const uint32_t seg = 32u - (uint32_t)f.width;
      const uint32_t b = (uint32_t)f.arg & 31u;
      const uint32_t min_lane = l & seg;
      const uint32_t max_lane = op == CUEMU_SHFL_UP ? min_lane : (min_lane | (31u & ~seg));
      int32_t j;
      bool ok;
      switch (op) {
        case CUEMU_SHFL_UP: j = (int32_t)l - (int32_t)b; ok = j >= (int32_t)max_lane; break;
        case CUEMU_SHFL_DOWN: j = (int32_t)(l + b); ok = j <= (int32_t)max_lane; break;
        case CUEMU_SHFL_XOR: j = (int32_t)(l ^ b); ok = j <= (int32_t)max_lane; break;
        default: j = (int32_t)(min_lane | (b & ~seg)); ok = j <= (int32_t)max_lane; break;
      }
      if (!ok) j = (int32_t)l;
      if (!(mask >> j & 1))
        warp_fail(&f, "lane %u (thread %u) reads lane %d (thread %u), which is not in the mask",
                  l, base + l, j, base + (uint32_t)j);
      f.result = F[j].value;
    } else if (op == CUEMU_MATCH_ANY) {
      uint32_t m = 0;
      for (uint32_t k = 0; k < 32; ++k)
        if ((mask >> k & 1) && F[k].value == f.value) m |= 1u << k;
      f.result = m;
    } else if (op == CUEMU_ACTIVEMASK) {
      f.result = mask;
    } else {
      f.result = acc;
    }
  }
  W.waiting &= ~mask;
  push_lanes(base, mask, me);
}

// True when every lane of `mask` waits at the same operation as `me`.
static bool group_complete(const Warp& W, uint32_t base, uint32_t mask, const Fiber* me) {
  if ((W.waiting & mask) != mask) return false;
  for (uint32_t l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    const Fiber& f = g_fibers[base + l];
    if (f.op != me->op || f.mask != mask) return false;
    if (is_fragment(me->op)) {  // one call site of the kernel: header lines are shared, return addresses not
      if (f.ra != me->ra || f.arg != me->arg) return false;
      continue;
    }
    if (me->op != CUEMU_SYNCWARP && !same_site(f.file, f.line, me->file, me->line)) return false;
    // A shuffle's width is each lane's own (PTX's c operand is per thread; release_group applies
    // it lane by lane), but a 4-byte and an 8-byte shuffle are different intrinsics.
    if (is_shfl(me->op) && f.vsize != me->vsize) return false;
  }
  return true;
}

// The start of every warp collective: poll for a stop (`ra`: the kernel's call), mark a sync point,
// record the call on the fiber.
static Fiber* enter_warp_call(int op, unsigned mask, int arg, int width, const char* file, int line,
                              const void* ra) {
  cuemu::poll_interrupt(ra);
  Fiber* me = g_cur;
  cuemu::trace_sync_point();
  me->op = (uint8_t)op;
  me->file = file;
  me->line = line;
  me->mask = mask;
  me->arg = arg;
  me->width = width;
  return me;
}

CUEMU_EXPORT unsigned long long cuemu_warp_op(int op, unsigned mask, unsigned long long value,
                                              int size, int arg, int width, const char* file,
                                              int line) {
  Fiber* me = enter_warp_call(op, mask, arg, width, file, line, __builtin_return_address(0));
  const uint32_t lane = me->tid & 31u, w = me->tid >> 5, base = w * 32u;
  Warp& W = S.warps[w];
  me->value = value;
  me->vsize = (uint8_t)size;
  if (op == CUEMU_ACTIVEMASK) {
    me->mask = 0;
    W.waiting |= 1u << lane;
    uint32_t live = W.present & ~W.exited, same = 0;
    for (uint32_t l = 0; l < 32; ++l) {
      const Fiber& f = g_fibers[base + l];
      if ((W.waiting >> l & 1) && f.op == CUEMU_ACTIVEMASK && same_site(f.file, f.line, file, line))
        same |= 1u << l;
    }
    if (same == live) {
      for (uint32_t l = 0; l < 32; ++l)
        if (same >> l & 1) g_fibers[base + l].mask = same;
      me->mask = same;
      release_group(W, base, same, op, me);
      yield_if_shuffled(me);
      return me->result;
    }
  } else {
    if (!(mask >> lane & 1))
      warp_fail(me, "the calling lane %u (thread %u) is not in the mask", lane, me->tid);
    if (mask & ~W.present)
      warp_fail(me, "the mask names lanes %s that do not exist (the block has %u threads)",
                lane_list(mask & ~W.present, w).c_str(), S.n);
    if (mask & W.exited)
      warp_fail(me, "the mask names lanes %s that have exited",
                lane_list(mask & W.exited, w).c_str());
    if (is_shfl(op) && (width < 1 || width > 32 || (width & (width - 1))))
      warp_fail(me, "width %d is not a power of two in 1..32", width);
    W.waiting |= 1u << lane;
    if (group_complete(W, base, mask, me)) {
      release_group(W, base, mask, op, me);
      yield_if_shuffled(me);
      return me->result;
    }
  }
  me->state = AT_WARP;
  yield_blocked(me);
  return me->result;
}

// mma.sync / ldmatrix (.sync.aligned): every lane of the warp, at one call site, none exited.
CUEMU_EXPORT void cuemu_warp_fragment(int op, int arg, const void* in, void* out, const char* file,
                                      int line) {
  const void* ra = __builtin_return_address(0);   // this call's site, before any helper call
  Fiber* me = enter_warp_call(op, 0xffffffffu, arg, 32, file, line, ra);
  const uint32_t lane = me->tid & 31u, w = me->tid >> 5, base = w * 32u;
  Warp& W = S.warps[w];
  me->vsize = 4;
  me->xin = in;
  me->xout = out;
  me->ra = ra;
  if (W.present != 0xffffffffu)
    warp_fail(me, "needs all 32 lanes of the warp (.sync.aligned), but warp %u of this %u-thread "
              "block has only lanes %s", w, S.n, lane_list(W.present, w).c_str());
  if (W.exited)
    warp_fail(me, "lanes %s have exited; every lane of the warp must execute it (.sync.aligned)",
              lane_list(W.exited, w).c_str());
  if (op == CUEMU_LDMATRIX) {
    const int matrices = arg & 7;
    if (matrices != 1 && matrices != 2 && matrices != 4)
      warp_fail(me, "%d matrices (ldmatrix loads 1, 2 or 4)", matrices);
  }
  W.waiting |= 1u << lane;
  if (group_complete(W, base, 0xffffffffu, me)) {
    release_fragment(W, base, me);
    yield_if_shuffled(me);
    return;
  }
  me->state = AT_WARP;
  yield_blocked(me);
}

// Releases __activemask() callers that no other lane can join any more: each group of
// lanes waiting at the same __activemask() site gets the mask of that group.
static bool release_activemasks() {
  bool any = false;
  for (uint32_t w = 0; w < S.nwarps; ++w) {
    Warp& W = S.warps[w];
    const uint32_t base = w * 32u;
    for (uint32_t l = 0; l < 32; ++l) {
      Fiber& f = g_fibers[base + l];
      if (!(W.waiting >> l & 1) || f.op != CUEMU_ACTIVEMASK) continue;
      uint32_t same = 0;
      for (uint32_t k = l; k < 32; ++k) {
        const Fiber& g = g_fibers[base + k];
        if ((W.waiting >> k & 1) && g.op == CUEMU_ACTIVEMASK && same_site(g.file, g.line, f.file, f.line))
          same |= 1u << k;
      }
      for (uint32_t k = 0; k < 32; ++k)
        if (same >> k & 1) g_fibers[base + k].mask = same;
      release_group(W, base, same, CUEMU_ACTIVEMASK, nullptr);
      any = true;
    }
  }
  return any;
}

// ---- thread exit ------------------------------------------------------------------
[[noreturn]] static void fiber_exit(Fiber* me) {
  cuemu::poll_interrupt();
  cuemu::trace_sync_point();
  cuemu::async_thread_exit(me->tid);  // no asynchronous copy may be left in flight
  me->state = EXITED;
  --S.alive;
  ++S.exited;
  const uint32_t lane = me->tid & 31u, w = me->tid >> 5, base = w * 32u;
  Warp& W = S.warps[w];
  W.exited |= 1u << lane;
  for (uint32_t l = 0; l < 32; ++l) {
    Fiber& f = g_fibers[base + l];
    if ((W.waiting >> l & 1) && f.op != CUEMU_ACTIVEMASK && (f.mask >> lane & 1)) {
      warp_fail(&f, "lane %u (thread %u) waits for lane %u (thread %u), which exited", l,
                base + l, lane, me->tid);
    }
  }
  yield_blocked(me);
  __builtin_unreachable();
}

extern "C" CUEMU_HIDDEN void cuemu_fiber_main(Fiber* f) {
  g_invoke(g_args);
  fiber_exit(f);
}

// ---- deadlock report --------------------------------------------------------------
static std::string describe(const Fiber& f) {
  std::string s;
  switch (f.state) {
    case EXITED: return "exited";
    case AT_BARRIER: msgf(s, "waiting at %s() %s:%d", bar_name(f.op), f.file, f.line); return s;
    case AT_WARP:
      if (f.op == CUEMU_ACTIVEMASK) msgf(s, "waiting at __activemask() %s:%d", f.file, f.line);
      else if (is_fragment(f.op)) msgf(s, "waiting at %s " CUEMU_SITE_TOKEN, op_name(f.op), cuemu::trace_site(f.ra));
      else msgf(s, "waiting at %s(mask 0x%08x) %s:%d", op_name(f.op), f.mask, f.file, f.line);
      return s;
    case READY: return "ready";
  }
  return "running";
}

// The first pair of lanes of one warp, both waiting at a warp operation, for which
// `conflict(f, lane_f, g, lane_g)` holds (lanes in order: f's, then g's from lane 0); false when
// there is none. The explanations of a warp that cannot go on search with it.
template <class Conflict>
static bool find_waiting_pair(uint32_t* warp, uint32_t* lane_f, uint32_t* lane_g, Conflict conflict) {
  for (uint32_t w = 0; w < S.nwarps; ++w) {
    const uint32_t base = w * 32u, waiting = S.warps[w].waiting;
    for (uint32_t l = 0; l < 32; ++l) {
      if (!(waiting >> l & 1)) continue;
      for (uint32_t k = 0; k < 32; ++k) {
        if (!(waiting >> k & 1) || !conflict(g_fibers[base + l], l, g_fibers[base + k], k)) continue;
        *warp = w, *lane_f = l, *lane_g = k;
        return true;
      }
    }
  }
  return false;
}

// Two waiting lanes that name each other in their masks, at the same operation (any
// __syncwarp(), else the same call site), with different masks: neither group can ever
// complete. Appends the explanation to `out`; false when there is none.
static bool explain_mask_mismatch(std::string& out) {
  uint32_t w, l, k;
  const bool found = find_waiting_pair(&w, &l, &k, [](const Fiber& f, uint32_t l, const Fiber& g, uint32_t k) {
    if (f.op == CUEMU_ACTIVEMASK || g.op != f.op || g.mask == f.mask) return false;
    if (!(f.mask >> k & 1) || !(g.mask >> l & 1)) return false;
    return f.op == CUEMU_SYNCWARP || same_site(f.file, f.line, g.file, g.line);
  });
  if (!found) return false;
  const uint32_t base = w * 32u;
  const Fiber &f = g_fibers[base + l], &g = g_fibers[base + k];
  msgf(out, "%s at %s:%d in warp %u: lane %u (thread %u) passes mask 0x%08x, but lane %u "
       "(thread %u), which both masks name, waits at %s:%d with mask 0x%08x; lanes that "
       "synchronise together must pass the same mask", op_name(f.op), f.file, f.line, w, l,
       base + l, f.mask, k, base + k, g.file, g.line, g.mask);
  return true;
}

// Two waiting lanes at one shuffle call site with one mask, shuffling values of different sizes
// (one template instantiated for two types): the one case besides different masks in which lanes
// at the same site never complete. Appends the explanation to `out`; false when there is none.
static bool explain_value_size_mismatch(std::string& out) {
  uint32_t w, l, k;
  const bool found = find_waiting_pair(&w, &l, &k, [](const Fiber& f, uint32_t, const Fiber& g, uint32_t k) {
    return is_shfl(f.op) && g.op == f.op && g.mask == f.mask && g.vsize != f.vsize && (f.mask >> k & 1) &&
           same_site(f.file, f.line, g.file, g.line);
  });
  if (!found) return false;
  const uint32_t base = w * 32u;
  const Fiber &f = g_fibers[base + l], &g = g_fibers[base + k];
  msgf(out, "%s at %s:%d (mask 0x%08x) in warp %u: lane %u (thread %u) shuffles a %u-byte value, "
       "but lane %u (thread %u) a %u-byte one; lanes that shuffle together must call the same "
       "intrinsic, with one value type", op_name(f.op), f.file, f.line, f.mask, w, l, base + l,
       (unsigned)f.vsize, k, base + k, (unsigned)g.vsize);
  return true;
}

static void report_stuck() {
  uint32_t at_bar = 0, at_warp = 0;
  for (uint32_t i = 0; i < S.n; ++i) {
    at_bar += g_fibers[i].state == AT_BARRIER;
    at_warp += g_fibers[i].state == AT_WARP;
  }
  g_msg.clear();
  if (at_bar && S.exited && !at_warp)
    msgf(g_msg, "divergent %s(): %u threads wait at a barrier that %u exited threads never reach "
         "(every thread of the block must reach the same barrier)", bar_name(S.bar_kind), at_bar, S.exited);
  else if (at_bar && S.bar_mismatch)
    msgf(g_msg, "divergent barriers: threads wait at different __syncthreads() call sites or kinds of "
         "barrier (every thread of the block must reach the same barrier)");
  else if (at_warp) {
    if (!explain_mask_mismatch(g_msg) && !explain_value_size_mismatch(g_msg))
      msgf(g_msg, "deadlock: warp-synchronous operations cannot complete (lanes of a mask must "
           "reach the same call site with the same mask, and no lane may wait at a barrier "
           "meanwhile)");
  } else
    msgf(g_msg, "deadlock: no thread of the block can make progress");
  g_msg += "; thread states (linear ids):";
  int lines = 0;
  for (uint32_t i = 0; i < S.n;) {
    std::string d = describe(g_fibers[i]);
    uint32_t e = i;
    while (e + 1 < S.n && describe(g_fibers[e + 1]) == d) ++e;
    if (++lines > 24) { g_msg += "\n  ..."; break; }
    const uint3& a = g_fibers[i].idx;
    const uint3& b = g_fibers[e].idx;
    if (e == i) msgf(g_msg, "\n  thread %u (%u,%u,%u): %s", i, a.x, a.y, a.z, d.c_str());
    else msgf(g_msg, "\n  threads %u-%u (%u,%u,%u)..(%u,%u,%u): %s", i, e, a.x, a.y, a.z, b.x, b.y, b.z, d.c_str());
    i = e + 1;
  }
}

// The time limit's report (g_msg): the limit, and the kernel line the running thread was stopped
// at (`site`, an offset in the module) when `has_site`, else `otherwise`.
static void describe_time_limit(bool has_site, uint32_t site, const char* otherwise) {
  g_msg.clear();
  msgf(g_msg, "the launch used more than its %g s of CPU time (CUPYKV_EMULATOR_LAUNCH_TIMEOUT) and "
       "was stopped ", g_time_limit_s);
  if (has_site) msgf(g_msg, "at " CUEMU_SITE_TOKEN, site);
  else msgf(g_msg, "%s", otherwise);
}

// What stops the launch when a stop was requested between fibers, in the scheduler.
static int stop_between_fibers() {
  if (cuemu::interrupt_requested & cuemu::STOP_SIGINT) return CUEMU_ERR_INTERRUPTED;
  describe_time_limit(false, 0, "between threads, in the scheduler");
  return CUEMU_ERR_TIME_LIMIT;
}

// ---- running a block --------------------------------------------------------------
static int run_block(const uint32_t bd[3]) {
  const uint32_t n = S.n;
  S.qhead = 0;
  S.qcount = 0;
  S.alive = n;
  S.exited = 0;
  S.bar_count = 0;
  S.bar_mismatch = false;
  S.err = 0;
  for (uint32_t w = 0; w < S.nwarps; ++w) {
    uint32_t lanes = n - w * 32u;
    S.warps[w].present = lanes >= 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    S.warps[w].exited = 0;
    S.warps[w].waiting = 0;
  }
  uint32_t t = 0;
  for (uint32_t z = 0; z < bd[2]; ++z)
    for (uint32_t y = 0; y < bd[1]; ++y)
      for (uint32_t x = 0; x < bd[0]; ++x, ++t) {
        Fiber& f = g_fibers[t];
        f.tid = t;
        f.idx = uint3{x, y, z};
        f.op = 0;
        f.mask = 0;
        f.sp = init_frame(stack_top(t), &f);
      }
  cuemu::async_block_begin();
  push_block(nullptr);
  for (;;) {
    if (cuemu::interrupt_requested) return stop_between_fibers();  // Ctrl-C or the time limit
    Fiber* f = pop_ready();
    if (f) {
      enter(f);
      cuemu_switch_ctx(&S.sched_sp, f->sp);
      if (S.err) return S.err;
      continue;
    }
    if (S.alive == 0) return CUEMU_OK;
    if (release_activemasks()) continue;
    report_stuck();
    return CUEMU_ERR_SYNC;
  }
}

// ---- device assert, traps ---------------------------------------------------------
CUEMU_EXPORT void cuemu_device_assert(const char* expr, const char* file, unsigned line,
                                      const char* func) {
  g_msg.clear();
  msgf(g_msg, "device assertion `%s` failed at %s:%u in %s", expr, file, line, func);
  fail(CUEMU_ERR_ASSERT, g_cur);
}
CUEMU_EXPORT void cuemu_trap(const char* what, const char* file, int line) {
  g_msg.clear();
  msgf(g_msg, "%s at %s:%d", what, file, line);
  fail(CUEMU_ERR_TRAP, g_cur);
}
CUEMU_EXPORT void cuemu_launch_bounds_exceeded(const char* bounds, long long max_threads) {
  const uint3 b = cuemu_ctx.block_dim;
  g_msg.clear();
  msgf(g_msg, "block (%u, %u, %u) has %llu threads, above the kernel's __launch_bounds__(%s), whose first argument "
       "is %lld here", b.x, b.y, b.z, (unsigned long long)b.x * b.y * b.z, bounds, max_threads);
  fail(CUEMU_ERR_LAUNCH_BOUNDS, g_cur);
}
// An access the instrumentation caught in a guard span (alignment padding beside a buffer): ends
// the launch as the fault a guard page would have raised there (on_fault, below).
[[noreturn]] void cuemu::fail_with_fault(uint64_t addr, int is_write, uint32_t site) {
  g_fault_sig = SIGSEGV;
  g_fault_addr = addr;
  g_fault_write = is_write;
  g_fault_fiber = g_cur;
  g_fault_site = site;
  g_has_fault_site = 1;
  siglongjmp(g_jb, 1);
}
[[noreturn]] void cuemu::fail_launch(int kind, const char* msg) {
  g_msg.assign(msg);
  fail(kind, g_cur);
}
CUEMU_EXPORT long long cuemu_clock64(void) { return (long long)__builtin_ia32_rdtsc(); }

// ---- faults, Ctrl-C and the time limit ----------------------------------------------
// A fault in a fiber (SIGSEGV, SIGBUS, SIGFPE, SIGILL), Ctrl-C (SIGINT) and the signal of the
// launch's CPU-time timer (time_limit_signal()) end the launch: the handler siglongjmps back to
// cuemu_launch, which abandons the fibers and reports. Leaving a signal handler that way is only
// well defined when the interrupted instruction belongs to code that holds no lock and leaves
// nothing half-updated that outlives the launch; POSIX makes it undefined after interrupting a
// function that is not async-signal-safe (printf, malloc). So the handler looks at the
// interrupted pc first, and jumps only from:
//   - the launched kernel's module (kernel code and the cuemu.h inlines): it writes its own
//     memory and reads cuemu_ctx, nothing else (a stop signal: its .text only, in_kernel_text);
//   - cuemu_copy/move/fill, the kernels' memcpy/memmove/memset: string instructions, no state;
//   - for a fault, anywhere in this runtime when the address is in the running fiber's stack
//     guard (a stack overflow faults at a call or a push; the runtime takes no lock, and its
//     scheduler and observer state is per launch, rebuilt by the next one).
// Elsewhere (libc, libm, libstdc++; the runtime itself for any other fault, which is a bug):
//   - a fault is reported on stderr (signal, address, block, thread, pc) and the handler that
//     was installed before the launch gets the fault again when the instruction re-executes:
//     by default the process dies of that signal (Python's faulthandler, if enabled, prints
//     the Python stack). The process cannot go on safely, so it does not.
//   - Ctrl-C and the time limit set a bit of cuemu::interrupt_requested, which the runtime polls
//     at its entry points from fibers (access hooks, barriers, warp operations, thread exit) and
//     between fibers; the launch then stops through fail() or the scheduler, in ordinary code.
//     (A kernel that loops inside library calls only, without hooks, may need a second Ctrl-C;
//     the timer repeats by itself.)
// SIGINT is taken only by launches with CUEMU_STOP_ON_SIGINT, and only while they run; before
// and after, Python's own handler gets it. cuemu_launch then returns CUEMU_ERR_INTERRUPTED.
// The time limit's signal is handled only while a launch with a limit runs, and only the
// launching thread's timer sends it; cuemu_launch then returns CUEMU_ERR_TIME_LIMIT, its message
// naming the kernel line the thread was stopped at (an @site token) when there is one.

// Whether `a` lies in the guard page of fiber `f`'s stack, or below it in the stack of the
// fiber before (stack-clash probes stride by one page). Fiber 0 has no fiber before it: below
// its guard lies whatever else is mapped there (a buffer's guard page, for one).
static bool in_stack_guard(const Fiber* f, uint64_t a) {
  if (!f || !g_stacks.base) return false;
  const uint64_t guard = (uint64_t)(g_stacks.base + (size_t)f->tid * g_stacks.stride);
  return a >= guard - (f->tid ? g_stacks.size : 0) && a < guard + g_stacks.page;
}

// The address span of every fiber's stack with its guard page, [*lo, *hi); both 0 before the
// first launch. Tests use it to place a buffer beside the stacks.
CUEMU_EXPORT void cuemu_fiber_stacks(uint64_t* lo, uint64_t* hi) {
  *lo = (uint64_t)g_stacks.base;
  *hi = *lo + (uint64_t)g_stacks.count * g_stacks.stride;
}

static CodeRange code_range_of(const void* code) {
  struct Query {
    uintptr_t pc;
    CodeRange range;
  } q{(uintptr_t)code, CodeRange()};
  dl_iterate_phdr([](dl_phdr_info* info, size_t, void* data) -> int {
    Query* q = static_cast<Query*>(data);
    for (int i = 0; i < info->dlpi_phnum; ++i) {
      const ElfW(Phdr)& ph = info->dlpi_phdr[i];
      if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
      const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
      if (q->pc - lo < ph.p_memsz) {
        q->range = CodeRange{lo, lo + ph.p_memsz};
        return 1;
      }
    }
    return 0;
  }, &q);
  return q.range;
}

// Async-signal-safe text for the report of a fault the launch cannot survive.
struct Note {
  char buf[768];
  size_t n = 0;
  Note& s(const char* text) {
    while (*text && n + 1 < sizeof buf) buf[n++] = *text++;
    return *this;
  }
  Note& u(uint64_t v, bool hex = false) {
    char digits[24];
    int k = 0;
    do {
      digits[k++] = "0123456789abcdef"[v % (hex ? 16 : 10)];
      v /= hex ? 16 : 10;
    } while (v);
    if (hex) s("0x");
    while (k && n + 1 < sizeof buf) buf[n++] = digits[--k];
    return *this;
  }
  Note& idx(uint3 i) { return s("(").u(i.x).s(",").u(i.y).s(",").u(i.z).s(")"); }
};

static const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
  }
  return "a signal";
}

static void report_unrecoverable(int sig, uint64_t addr, uint64_t pc) {
  Note m;
  m.s("cupykv emulator: ").s(signal_name(sig)).s(" (address ").u(addr, true).s(") in block ")
      .idx(cuemu_ctx.block_idx);
  if (g_cur) m.s(" thread ").idx(g_cur->idx);
  if (g_runtime_code.has(pc))
    m.s(" inside the emulator runtime (pc ").u(pc - g_runtime_code.lo, true)
        .s(" in the runtime library): a bug in cupykv's emulator; please report it");
  else
    m.s(" inside a library function the kernel called (pc ").u(pc, true)
        .s("; printf with a bad pointer, for example)");
  m.s(". That code may hold locks or be halfway through updating its state, so the launch "
      "cannot be abandoned safely: the process stops here.\n");
  ssize_t ignored = write(2, m.buf, m.n);
  (void)ignored;
}

static void on_fault(int sig, siginfo_t* si, void* uc_) {
  ucontext_t* uc = (ucontext_t*)uc_;
  const uint64_t pc = (uint64_t)uc->uc_mcontext.gregs[REG_RIP], addr = (uint64_t)si->si_addr;
  const bool ours = t_in_launch;
  if (ours) {
    const bool leavable = g_module_code.has(pc) || g_copy_code.has(pc) ||
                          (g_runtime_code.has(pc) && in_stack_guard(g_cur, addr));
    if (leavable) {
      g_fault_sig = sig;
      g_fault_addr = addr;
      // An atomic helper's own read or write (cuemu.h, not the kernel's code): the kernel's
      // atomic at its call site, a read-modify-write, so a write.
      const bool in_atomic = g_module_code.has(pc) && cuemu::atomic_site != 0;
      g_fault_write = in_atomic ? 1
                      : sig == SIGSEGV ? ((uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0) : -1;
      g_fault_fiber = g_cur;
      // The faulting instruction itself, written as the return address that would follow it, or
      // the kernel's call of the copy or the atomic it faulted in.
      g_has_fault_site = g_module_code.has(pc) || g_copy_code.has(pc);
      g_fault_site = in_atomic ? cuemu::atomic_site
                     : g_module_code.has(pc) ? cuemu::trace_site((const void*)(pc + 1))
                     : g_copy_code.has(pc) ? cuemu::copy_site : 0;
      cuemu::atomic_site = 0;
      siglongjmp(g_jb, 1);
    }
    report_unrecoverable(sig, addr, pc);
  }
  // Not a fault the launch can report: the previous handler takes it when it re-executes.
  for (int i = 0; i < 4; ++i)
    if (g_sigs[i] == sig) sigaction(sig, &g_old_act[i], nullptr);
}

// Whether `pc` is in the kernels' own code: the module's .text when the launch said where it is.
// (The module's PLT stubs lie outside it: a pc there names no source line, and the hook the stub
// jumps to polls for a stop anyway.)
static bool in_kernel_text(uint64_t pc) {
  if (!g_module_code.has(pc)) return false;
  return !g_kernel_text.hi || g_kernel_text.has(cuemu::trace_site((const void*)pc));
}

// Ctrl-C (SIGINT) and the time limit's signal. Each masks the other, so the bits never race.
static void on_stop_signal(int sig, siginfo_t*, void* uc_) {
  cuemu::interrupt_requested |= sig == SIGINT ? cuemu::STOP_SIGINT : cuemu::STOP_TIME_LIMIT;
  if (!g_launch_running || !pthread_equal(pthread_self(), g_launch_thread)) return;
  const uint64_t pc = (uint64_t)((ucontext_t*)uc_)->uc_mcontext.gregs[REG_RIP];
  if (!g_cur || !(in_kernel_text(pc) || g_copy_code.has(pc))) return;  // polled later
  g_fault_sig = sig;
  g_fault_addr = 0;
  g_fault_write = -1;
  g_fault_fiber = g_cur;
  // where the thread was: the kernel's instruction, or its call of the copy it was in
  g_has_fault_site = 1;
  g_fault_site = g_copy_code.has(pc) ? cuemu::copy_site : cuemu::trace_site((const void*)(pc + 1));
  siglongjmp(g_jb, 1);
}

void cuemu::stop_for_interrupt(const void* ra) {
  if (!interrupt_requested || !g_cur || !g_launch_running) return;
  if (interrupt_requested & STOP_SIGINT) fail(CUEMU_ERR_INTERRUPTED, g_cur);
  const bool named = ra && g_module_code.has((uintptr_t)ra);
  describe_time_limit(named, named ? cuemu::trace_site(ra) : 0, "in the emulator runtime, at no kernel line");
  fail(CUEMU_ERR_TIME_LIMIT, g_cur);
}

// Appends the kernel line of the faulting instruction (an @site token) when the fault has one.
static void name_fault_site() {
  if (g_has_fault_site) msgf(g_msg, " at " CUEMU_SITE_TOKEN, g_fault_site);
}

static void describe_fault(cuemu_result* r) {
  g_msg.clear();
  Fiber* f = g_fault_fiber;
  uint64_t a = g_fault_addr;
  if (g_fault_sig == time_limit_signal()) {
    r->kind = CUEMU_ERR_TIME_LIMIT;
    describe_time_limit(true, g_fault_site, "");
    return;
  }
  if (g_fault_sig == SIGSEGV || g_fault_sig == SIGBUS) {
    if (in_stack_guard(f, a)) {
      r->kind = CUEMU_ERR_STACK;
      msgf(g_msg, "stack overflow: the thread used more than its %zu KiB fiber stack (large "
           "local arrays?)", g_stacks.size / 1024);
      name_fault_site();
      msgf(g_msg, "; set CUPYKV_EMULATOR_STACK_KIB to enlarge it");
      return;
    }
  }
  switch (g_fault_sig) {
    case SIGINT:
      r->kind = CUEMU_ERR_INTERRUPTED;
      msgf(g_msg, "interrupted (Ctrl-C)");
      return;
    case SIGFPE:
      r->kind = CUEMU_ERR_TRAP;
      msgf(g_msg, "arithmetic exception (SIGFPE, e.g. integer division by zero; the GPU would "
           "return an unspecified value instead)");
      name_fault_site();
      return;
    case SIGILL:
      r->kind = CUEMU_ERR_TRAP;
      msgf(g_msg, "illegal instruction (SIGILL, e.g. __builtin_trap or reaching unreachable code)");
      name_fault_site();
      return;
  }
  r->kind = CUEMU_ERR_FAULT;
  msgf(g_msg, "invalid memory access at 0x%llx", (unsigned long long)a);
}

static void install_handlers(bool take_sigint, bool timed) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);  // a fault handler is not interrupted by a stop
  sigaddset(&sa.sa_mask, time_limit_signal());
  for (int i = 0; i < 4; ++i) sigaction(g_sigs[i], &sa, &g_old_act[i]);
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  if (take_sigint) sigaction(SIGINT, &sa, &g_old_sigint);
  if (timed) sigaction(time_limit_signal(), &sa, &g_old_time_limit);
}
static void restore_handlers(bool took_sigint, bool timed) {
  for (int i = 0; i < 4; ++i) sigaction(g_sigs[i], &g_old_act[i], nullptr);
  if (took_sigint) sigaction(SIGINT, &g_old_sigint, nullptr);
  if (timed) sigaction(time_limit_signal(), &g_old_time_limit, nullptr);
}

// A timer on the launching thread's CPU clock that sends it time_limit_signal() once the launch
// has used `seconds`, then every 0.1 s more: a signal taken in the runtime only sets the flag its
// next poll reads, and a kernel looping on registers alone polls nothing, so a later signal must
// land in the kernel's own code. Created (unarmed) before the launch; false when it cannot be.
static bool create_time_limit_timer() {
  struct sigevent ev;
  memset(&ev, 0, sizeof ev);
  ev.sigev_notify = SIGEV_THREAD_ID;
  ev.sigev_signo = time_limit_signal();
  ev._sigev_un._tid = (pid_t)syscall(SYS_gettid);  // glibc names it sigev_notify_thread_id from 2.35
  return timer_create(CLOCK_THREAD_CPUTIME_ID, &ev, &g_time_limit_timer) == 0;
}
static void arm_time_limit_timer(double seconds) {
  struct itimerspec when;
  memset(&when, 0, sizeof when);
  const double whole = seconds < 1e9 ? seconds : 1e9;
  when.it_value.tv_sec = (time_t)whole;
  when.it_value.tv_nsec = (long)((whole - (double)when.it_value.tv_sec) * 1e9);
  if (when.it_value.tv_sec == 0 && when.it_value.tv_nsec == 0) when.it_value.tv_nsec = 1;
  when.it_interval.tv_nsec = 100 * 1000 * 1000;
  timer_settime(g_time_limit_timer, 0, &when, nullptr);
}

// ---- launch -----------------------------------------------------------------------
CUEMU_EXPORT int cuemu_launch(const cuemu_launch_params* p, cuemu_result* r) {
  memset(r, 0, offsetof(cuemu_result, msg));
  r->msg[0] = 0;
  r->is_write = -1;
  const uint32_t n = p->block[0] * p->block[1] * p->block[2];
  if (n == 0 || n > 1024 || !ensure_fibers(n, p->stack_kib)) {
    r->kind = CUEMU_ERR_SETUP;
    snprintf(r->msg, sizeof r->msg, "cannot prepare %u fibers of %u KiB stack each", n, p->stack_kib);
    return r->kind;
  }
  if (!g_altstack) {
    void* m = mmap(nullptr, kAltStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) { r->kind = CUEMU_ERR_SETUP; return r->kind; }
    g_altstack = (char*)m;
  }
  S.n = n;
  S.nwarps = (n + 31) / 32;
  const uint64_t nblocks = (uint64_t)p->grid[0] * p->grid[1] * p->grid[2];
  cuemu::schedule_begin(p->seed, nblocks);
  const bool timed = p->time_limit_s > 0;
  g_time_limit_s = timed ? p->time_limit_s : 0;
  if (timed && !create_time_limit_timer()) {
    r->kind = CUEMU_ERR_SETUP;
    snprintf(r->msg, sizeof r->msg, "cannot create the launch's CPU-time timer (timer_create)");
    return r->kind;
  }
  if (!cuemu::trace_launch_begin(p, n, (uintptr_t)g_stacks.base, g_stacks.count * g_stacks.stride)) {
    if (timed) timer_delete(g_time_limit_timer);
    r->kind = CUEMU_ERR_SETUP;
    snprintf(r->msg, sizeof r->msg, "cannot map the race checker's shadow memory");
    return r->kind;
  }
  capture_csr();
  g_invoke = p->invoke;
  g_args = p->args;
  cuemu_ctx.block_dim = uint3{p->block[0], p->block[1], p->block[2]};
  cuemu_ctx.grid_dim = uint3{p->grid[0], p->grid[1], p->grid[2]};
  cuemu_ctx.dyn_smem = p->dyn_smem;
  g_fault_sig = 0;
  g_fault_fiber = nullptr;
  g_err_fiber = nullptr;
  g_cur = nullptr;
  if (!g_module_code.has((uintptr_t)p->invoke)) g_module_code = code_range_of((const void*)p->invoke);
  g_kernel_text = CodeRange{(uintptr_t)p->text_lo, (uintptr_t)p->text_hi};
  if (!g_runtime_code.hi) {
    g_runtime_code = code_range_of((const void*)&cuemu_launch);
    g_copy_code = CodeRange{(uintptr_t)cuemu_copy_code_begin, (uintptr_t)cuemu_copy_code_end};
  }
  const bool take_sigint = (p->options & CUEMU_STOP_ON_SIGINT) != 0;
  cuemu::interrupt_requested = 0;
  g_launch_thread = pthread_self();

  stack_t ss, old_ss;
  ss.ss_sp = g_altstack;
  ss.ss_size = kAltStackSize;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  install_handlers(take_sigint, timed);
  volatile int rc = CUEMU_OK;  // survives siglongjmp
  if (sigsetjmp(g_jb, 1) == 0) {
    t_in_launch = true;
    g_launch_running = 1;
    if (timed) arm_time_limit_timer(g_time_limit_s);
    const uint64_t gx = p->grid[0], gxy = gx * p->grid[1];
    for (uint64_t k = 0; k < nblocks && rc == CUEMU_OK; ++k) {
      const uint64_t b = cuemu::schedule_block(k);  // linear block index, x fastest
      cuemu_ctx.block_idx = uint3{(uint32_t)(b % gx), (uint32_t)(b % gxy / gx), (uint32_t)(b / gxy)};
      const uint64_t room = p->dyn_smem_room > p->dyn_smem_size ? p->dyn_smem_room : p->dyn_smem_size;
      if (room && p->poison <= 255) memset(p->dyn_smem, (int)p->poison, room);
      cuemu::trace_block_begin(b);
      rc = run_block(p->block);
      cuemu::trace_block_end();
      if (rc != CUEMU_OK) r->kind = rc;
    }
    g_launch_running = 0;
    t_in_launch = false;
  } else {
    g_launch_running = 0;
    t_in_launch = false;
    r->addr = g_fault_addr;
    r->is_write = g_fault_write;
    r->signo = g_fault_sig;
    r->fault_site = g_fault_site;
    r->has_fault_site = g_has_fault_site;
    describe_fault(r);
    rc = r->kind;
    g_err_fiber = g_fault_fiber;
  }
  // Deleted before its handler goes: a signal the timer sent was taken when timer_delete returned.
  if (timed) timer_delete(g_time_limit_timer);
  cuemu::trace_launch_end();
  restore_host_csr();
  restore_handlers(take_sigint, timed);
  if (!(old_ss.ss_flags & SS_DISABLE)) sigaltstack(&old_ss, nullptr);
  else { ss.ss_flags = SS_DISABLE; sigaltstack(&ss, nullptr); }
  const int stops = cuemu::interrupt_requested;
  cuemu::interrupt_requested = 0;
  if (stops & cuemu::STOP_SIGINT) {  // Ctrl-C, taken by the runtime while the launch ran
    if (rc == CUEMU_OK) rc = CUEMU_ERR_INTERRUPTED;  // it came between fibers or blocks
    if (rc != CUEMU_ERR_INTERRUPTED) raise(SIGINT);  // another error is reported: Python's handler gets it
  }
  // (a time limit passed after the last thread of the last block ended: the launch completed)
  if (rc == CUEMU_ERR_INTERRUPTED) {
    r->kind = rc;
    g_msg.assign("interrupted (Ctrl-C)");
  }
  if (rc != CUEMU_OK) {
    snprintf(r->msg, sizeof r->msg, "%s", g_msg.c_str());
    if (g_err_fiber) {
      r->has_thread = 1;
      r->thread_idx[0] = g_err_fiber->idx.x;
      r->thread_idx[1] = g_err_fiber->idx.y;
      r->thread_idx[2] = g_err_fiber->idx.z;
    }
  }
  fflush(stdout);
  r->block_idx[0] = cuemu_ctx.block_idx.x;
  r->block_idx[1] = cuemu_ctx.block_idx.y;
  r->block_idx[2] = cuemu_ctx.block_idx.z;
  return rc;
}
