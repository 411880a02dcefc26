// The Python module lopd_kernels._C (pybind11): what this build contains, for
// `python -m lopd_kernels.info` (lopd_kernels/info.py). Importing it also loads the library, and
// with it the TORCH_LIBRARY registrations of every torch.ops.lopd.* op (csrc/ops.cpp,
// csrc/cpu/, csrc/cuda/): the kernels themselves are reached only through those custom ops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/headeronly/version.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/buffer_cache.h"
#include "cpu/isa_dispatch.h"
#include "cpu/vec_exp_probe.h"

#ifndef LOPD_CUDA_ARCHS_STR
#define LOPD_CUDA_ARCHS_STR ""
#endif

namespace {

#define LOPD_STR2(x) #x
#define LOPD_STR(x) LOPD_STR2(x)

pybind11::dict build_info() {
  pybind11::dict d;
  d["torch_version"] = LOPD_STR(TORCH_VERSION_MAJOR) "." LOPD_STR(TORCH_VERSION_MINOR) "." LOPD_STR(
      TORCH_VERSION_PATCH);
#if defined(__clang__)
  d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = std::string("gcc ") + __VERSION__;
#else
  d["compiler"] = "unknown";
#endif
  d["cxx_standard"] = static_cast<long>(__cplusplus);
#ifdef _OPENMP
  d["openmp"] = static_cast<long>(_OPENMP);
#else
  d["openmp"] = pybind11::none();
#endif
#ifdef LOPD_WITH_CUDA
  d["with_cuda"] = true;
  d["cuda_archs"] = std::string(LOPD_CUDA_ARCHS_STR);
#else
  d["with_cuda"] = false;
  d["cuda_archs"] = std::string();
#endif
  std::vector<std::string> isas;
#define LOPD_ISA_NAME(ISA) isas.emplace_back(#ISA);
  LOPD_FOR_EACH_CPU_ISA(LOPD_ISA_NAME)
#undef LOPD_ISA_NAME
  for (auto& s : isas) {
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  d["cpu_isas_compiled"] = isas;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "lopd_kernels' compiled extension. The kernels are torch.ops.lopd.* custom ops; this "
      "module only reports how it was built (python -m lopd_kernels.info).";
  m.def("build_info", &build_info,
        "dict: torch_version (built against), compiler, cxx_standard, openmp, with_cuda, "
        "cuda_archs, cpu_isas_compiled");
  m.def(
      "cpu_isa", [] { return std::string(lopd::cpu_isa_name(lopd::cpu_isa())); },
      "The CPU kernels' instruction set on this machine: the widest compiled in and supported "
      "by the CPU, capped by the LOPD_CPU_ISA environment variable (default|avx2|avx512)");
  m.def(
      "cpu_buffer_cache_stats",
      [] {
        const auto s = lopd::cpu::cpu_buffer_cache_stats();
        pybind11::dict d;
        d["enabled"] = s.enabled;
        d["cached_blocks"] = s.cached_blocks;
        d["cached_bytes"] = s.cached_bytes;
        d["hits"] = s.hits;
        d["misses"] = s.misses;
        return d;
      },
      "dict: the recycled CPU output buffers (csrc/cpu/buffer_cache.h): enabled, cached_blocks, "
      "cached_bytes, hits, misses");
  m.def("release_cpu_buffer_cache", &lopd::cpu::release_cpu_buffer_cache,
        "Returns the cached (unused) CPU output buffers to the OS");
  m.def(
      "_cpu_exp",
      [](const std::vector<float>& x) {
        std::vector<float> y(x.size());
        LOPD_CPU_ISA_CALL(fast_exp_array, x.data(), y.data(), static_cast<int64_t>(x.size()));
        return y;
      },
      "Test hook: the CPU kernels' vectorized exp (csrc/cpu/vec_exp.h) of a list of floats, on "
      "the ISA cpu_isa() names");
  m.def(
      "_cpu_exp2",
      [](const std::vector<float>& x) {
        std::vector<float> y(x.size());
        LOPD_CPU_ISA_CALL(fast_exp2_array, x.data(), y.data(), static_cast<int64_t>(x.size()));
        return y;
      },
      "Test hook: the CPU kernels' vectorized 2^x (csrc/cpu/vec_exp.h) of a list of floats, on "
      "the ISA cpu_isa() names");
}
