// Run-time choice among the per-ISA copies of the kernels in csrc/cpu/isa/.
//
// Every file in csrc/cpu/isa/ is compiled three times (CMakeLists.txt) with
// CPU_CAPABILITY=DEFAULT|AVX2|AVX512, which selects the width of ATen's at::vec::Vectorized, and
// puts its entry points in the namespace lopd::cpu::<CPU_CAPABILITY>. An op's dispatcher (a file
// in csrc/cpu/, compiled once, generic x86-64) declares the three copies with
// LOPD_FOR_EACH_CPU_ISA and calls the one cpu_isa() names. Nothing is built with -march=native, so
// one binary runs on any x86-64 CPU and uses the widest vectors it has.
#pragma once

#include <cstdlib>
#include <cstring>

namespace lopd {

enum class CpuIsa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The widest ISA both compiled in and supported by this CPU. The environment variable
// LOPD_CPU_ISA=default|avx2|avx512 caps it (read at every call, so tests can run all three copies
// in one process); a request above what the CPU supports falls back to the best supported.
inline CpuIsa cpu_isa() {
  CpuIsa best = CpuIsa::kDefault;
#if defined(__x86_64__) || defined(__i386__)
  // The AVX2 copy is compiled with -mavx2 -mfma -mf16c, the AVX-512 copy additionally with the
  // F/BW/VL/DQ subsets (ATen's CPU_CAPABILITY_AVX512 requirements).
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                               __builtin_cpu_supports("f16c");
  static const bool has_avx512 =
      has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (has_avx512) {
    best = CpuIsa::kAvx512;
  } else if (has_avx2) {
    best = CpuIsa::kAvx2;
  }
#endif
  const char* req = std::getenv("LOPD_CPU_ISA");
  if (req == nullptr) return best;
  CpuIsa want = best;
  if (std::strcmp(req, "default") == 0) {
    want = CpuIsa::kDefault;
  } else if (std::strcmp(req, "avx2") == 0) {
    want = CpuIsa::kAvx2;
  }
  return static_cast<int>(want) < static_cast<int>(best) ? want : best;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

}  // namespace lopd

// Expands MACRO(DEFAULT) MACRO(AVX2) MACRO(AVX512): declare each copy's entry points with it.
#define LOPD_FOR_EACH_CPU_ISA(MACRO) MACRO(DEFAULT) MACRO(AVX2) MACRO(AVX512)

// Calls lopd::cpu::<isa>::FN(args...) for the ISA cpu_isa() picks.
#define LOPD_CPU_ISA_CALL(FN, ...)                      \
  do {                                                  \
    switch (::lopd::cpu_isa()) {                        \
      case ::lopd::CpuIsa::kAvx512:                     \
        ::lopd::cpu::AVX512::FN(__VA_ARGS__);           \
        break;                                          \
      case ::lopd::CpuIsa::kAvx2:                       \
        ::lopd::cpu::AVX2::FN(__VA_ARGS__);             \
        break;                                          \
      default:                                          \
        ::lopd::cpu::DEFAULT::FN(__VA_ARGS__);          \
        break;                                          \
    }                                                   \
  } while (0)
