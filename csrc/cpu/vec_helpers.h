// Vector helpers of the streaming per-ISA CPU kernels (include from csrc/cpu/isa/ only: it uses
// CPU_CAPABILITY): a logit row is read two float vectors at a time (one full vector of a 16-bit
// input type, widened to fp32 in registers), written back the same way, and reduced across lanes.
// Shared by csrc/cpu/isa/topk_tail_kl_kernel.cpp and
// csrc/cpu/isa/sparse_teacher_topk_tail_kl_kernel.cpp.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace lopd::cpu::CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

// Floats per vector, and elements per step of load2 / store2 (two float vectors).
inline constexpr int64_t kVF = Vec::size();
inline constexpr int64_t kStep = 2 * kVF;
inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// p[0, kStep) as two fp32 vectors.
template <typename T>
inline void load2(const T* p, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + kVF);
  } else {
    // bf16 / fp16 are widened to fp32 in registers.
    at::vec::load_to_float<T>(p, a, b);
  }
}

// Two fp32 vectors into p[0, kStep), rounded to T.
template <typename T>
inline void store2(T* p, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + kVF);
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// Largest lane / sum of the lanes.
inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v);
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

}  // namespace lopd::cpu::CPU_CAPABILITY
