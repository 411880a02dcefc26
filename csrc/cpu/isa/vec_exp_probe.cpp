// fast_exp and fast_exp2 (csrc/cpu/vec_exp.h) over an array, per ISA: lopd_kernels._C._cpu_exp
// and _cpu_exp2 expose them so tests/kernels/test_topk_tail_kl.py can bound their error against float64
// on every instruction set.
#include <cstdint>

#include "cpu/vec_exp.h"
#include "cpu/vec_exp_probe.h"

namespace lopd::cpu::CPU_CAPABILITY {

namespace {
template <typename F>
void map_array(F f, const float* in, float* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) f(Vec::loadu(in + i)).store(out + i);
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    f(Vec::loadu(in + i, rest)).store(out + i, rest);
  }
}
}  // namespace

void fast_exp_array(const float* in, float* out, int64_t n) {
  map_array([](const auto& x) { return fast_exp(x); }, in, out, n);
}

void fast_exp2_array(const float* in, float* out, int64_t n) {
  map_array([](const auto& x) { return fast_exp2(x); }, in, out, n);
}

}  // namespace lopd::cpu::CPU_CAPABILITY
