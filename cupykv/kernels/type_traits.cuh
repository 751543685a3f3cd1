// type_traits.cuh: compile-time type tests shared by the kernel headers (kv_codec.cuh, mma.cuh),
// written here because NVRTC offers no <type_traits> without the CUDA C++ standard library.
//
//   same_type<A, B>::value   true exactly when A and B are one type
#pragma once

namespace cupykv {

template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

}  // namespace cupykv
