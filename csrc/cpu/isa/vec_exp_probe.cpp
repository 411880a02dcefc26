// fast_exp (csrc/cpu/vec_exp.h) over an array, per ISA: lopd_kernels._C._cpu_exp exposes it so
// tests/test_topk_tail_kl.py can bound its error against float64 on every instruction set.
#include <cstdint>

#include "cpu/vec_exp.h"
#include "cpu/vec_exp_probe.h"

namespace lopd::cpu::CPU_CAPABILITY {

void fast_exp_array(const float* in, float* out, int64_t n) {
  using Vec = at::vec::Vectorized<float>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) fast_exp(Vec::loadu(in + i)).store(out + i);
  if (i < n) {
    const int rest = static_cast<int>(n - i);
    fast_exp(Vec::loadu(in + i, rest)).store(out + i, rest);
  }
}

}  // namespace lopd::cpu::CPU_CAPABILITY
