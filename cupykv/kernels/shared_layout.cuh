// shared_layout.cuh: a block's dynamic shared memory carved into named arrays.
//
// A kernel whose dynamic shared memory holds several arrays takes them from a SharedLayout, in
// order, instead of adding byte offsets to the extern __shared__ pointer itself:
//
//     extern __shared__ __align__(16) unsigned char smem_bytes[];
//     cupykv::SharedLayout loop_memory(smem_bytes);
//     float* q_tile = loop_memory.take<float>(kRows * kRow, "q_tile");
//     T* stages = loop_memory.take<T>(kStageElements, "stages");
//
// Each array starts where the last one ended, which must suit its element's alignment (a kernel
// that needs more, for 16-byte copies, sizes the arrays before it in multiples of 16 bytes; the
// emulator checks the element's). On a GPU take() is that pointer arithmetic and nothing else: the
// same code as offsets added by hand (`python -m cupykv check` counts the same registers).
//
// In cupykv's emulator each array is placed a gap (CUEMU_SHARED_ARRAY_GAP, a multiple of 128 bytes,
// so every byte keeps its bank) further on than the one before it, and an access by a thread must
// lie inside one array of its layout: an index run past an array's end (which on a GPU lands in
// the next array, and shows at best as a wrong value) fails at once, naming the array, the thread and
// the line. An array that ends past the dynamic shared memory the launch asked for fails when it
// is taken. A kernel that reuses the memory for another phase, after a barrier, begins a second
// SharedLayout over the same bytes; each thread's accesses are checked against its latest layout.
// Every thread of a block must take the same arrays (the emulator checks), and at most
// CUEMU_SHARED_ARRAYS_MAX of them a layout.
#pragma once

#ifdef CUPYKV_EMULATOR
// the emulator launches a module that defines this with room for the gaps (launch.py)
extern "C" __attribute__((visibility("default"), weak)) const int cuemu_module_carves_shared = 1;
#endif

namespace cupykv {

class SharedLayout {
  public:
    __device__ __forceinline__ explicit SharedLayout(unsigned char* dynamic_shared)
        : base_(dynamic_shared), next_(dynamic_shared) {
#ifdef CUPYKV_EMULATOR
        cuemu_shared_layout_begin();
#endif
    }

    // The next `count` elements of type E, named `name` (a string literal) in the emulator's reports.
    template <typename E>
    __device__ __forceinline__ E* take(int count, const char* name) {
        E* const array = reinterpret_cast<E*>(next_);
        next_ = reinterpret_cast<unsigned char*>(array + count);
#ifdef CUPYKV_EMULATOR
        return static_cast<E*>(cuemu_shared_array(base_, (unsigned long long)(reinterpret_cast<unsigned char*>(array) - base_),
                                                  (unsigned long long)count * sizeof(E), (unsigned long long)alignof(E),
                                                  taken_++, name));
#else
        (void)name;
        return array;
#endif
    }

  private:
    unsigned char* base_;
    unsigned char* next_;   // where the next array starts
    unsigned taken_ = 0;    // arrays taken so far (the emulator's gaps before the next)
};

}  // namespace cupykv
