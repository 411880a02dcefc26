// Row kernels of lopd::fused_linear_logprob_cpu_fwd / _bwd, compiled once per ISA (CPU_CAPABILITY
// = DEFAULT | AVX2 | AVX512, csrc/cpu/isa_dispatch.h). The op (csrc/cpu/fused_linear_logprob.cpp)
// forms a float32 logit block with a GEMM; these kernels work on it row by row, one row per task
// (at::parallel_for), reading each row twice while it sits in L2.
//
// Forward, one row of a block: pass 1 adds the bias (written back) and takes the maximum; the
// running maximum m rises to it; the target entry is read (z_a) and set to -inf, so that the sums
// leave it out (1 - p_a is then a sum, never 1 minus a rounded p_a). Pass 2 sums e^{z - m} and,
// for the entropy, e^{z - m} (z - m), in base 2 after one FMA per vector (fast_exp2), lane sums
// flushed to double every kFlush entries; with store_exp it writes e^{z - m} back (the
// projection's GEMM operand). The earlier blocks' sums are rescaled by e^{m_old - m_new}.
// Backward, one row: one pass writes G = -p (u + v (log p + H)) / T (bias added on the way), then
// the target entry is rewritten with (u (1 - p_a) - v p_a (log p_a + H)) / T, 1 - p_a =
// -expm1(log p_a) from the forward's exact log-prob. Maths: docs/math.md, section 6.
// GCC 12 reports -Wmaybe-uninitialized false positives inside its own avx512fintrin.h (the
// `_mm512_undefined_*` placeholders ATen's Vectorized uses); they are not about this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/fused_linear_logprob.h"
#include "cpu/vec_exp.h"
#include "cpu/vec_helpers.h"

namespace lopd::cpu::CPU_CAPABILITY {
namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr double kLn2 = 0.693147180559945309;
// 2^y for y below this is 0 in float32 (e^-150): clamping there keeps 0 * (-inf) out of the
// entropy terms of -inf logits.
constexpr float kMinExp2 = -216.0f;
// Entries per flush of the fp32 lane sums to double (each lane then sums at most 32 terms).
constexpr int64_t kFlush = 512;

// Bias add (written back) and the row maximum of the raw logits.
float bias_and_max(float* x, const float* b, int64_t cols) {
  Vec vmax(kNegInf);
  int64_t j = 0;
  if (b != nullptr) {
    for (; j + kVF <= cols; j += kVF) {
      const Vec v = Vec::loadu(x + j) + Vec::loadu(b + j);
      v.store(x + j);
      vmax = at::vec::maximum(vmax, v);
    }
  } else {
    for (; j + kVF <= cols; j += kVF) vmax = at::vec::maximum(vmax, Vec::loadu(x + j));
  }
  float mx = hmax(vmax);
  for (; j < cols; ++j) {
    if (b != nullptr) x[j] += b[j];
    mx = std::max(mx, x[j]);
  }
  return mx;
}

struct Sums {
  double s = 0.0;   // sum 2^y
  double s2 = 0.0;  // sum 2^y y (log2 units)
};

// Pass 2 of the forward: y = x log2(e) / T - m log2(e), 2^y summed (and 2^y y with the entropy).
template <bool kEntropy, bool kStore>
Sums exp_sums(float* x, int64_t cols, float c2, float m2) {
  const Vec vc2(c2), vm2(m2), vmin(kMinExp2);
  Sums out;
  int64_t j = 0;
  while (j + kVF <= cols) {
    const int64_t stop = std::min(cols - cols % kVF, j + kFlush);
    Vec sum(0.0f), sum2(0.0f);
    for (; j < stop; j += kVF) {
      const Vec y = at::vec::fmsub(Vec::loadu(x + j), vc2, vm2);
      const Vec e = fast_exp2(y);
      sum = sum + e;
      if constexpr (kEntropy) sum2 = at::vec::fmadd(e, at::vec::maximum(y, vmin), sum2);
      if constexpr (kStore) e.store(x + j);
    }
    out.s += hsum(sum);
    if constexpr (kEntropy) out.s2 += hsum(sum2);
  }
  for (; j < cols; ++j) {
    const float y = x[j] * c2 - m2;
    const float e = std::exp2(y);
    out.s += e;
    if constexpr (kEntropy) out.s2 += static_cast<double>(e) * std::max(y, kMinExp2);
    if constexpr (kStore) x[j] = e;
  }
  return out;
}

void fwd_row(const LogprobBlock& blk, const LogprobRowState& st, int64_t i, bool with_entropy,
             bool store_exp) {
  float* x = blk.logits + i * blk.ld;
  const float inv = blk.inv_temperature;
  const float mx = bias_and_max(x, blk.bias, blk.cols);
  const int64_t col = blk.targets[i] - blk.v0;
  const bool has_target = col >= 0 && col < blk.cols;
  if (has_target) st.z_a[i] = x[col] * inv;
  const float m_old = st.m[i];
  const float m_new = std::max(m_old, mx * inv);  // 1/T > 0: the maximum commutes with it
  if (m_new == kNegInf) {  // nothing but -inf so far: no mass to add
    st.scale[i] = 1.0f;
    if (store_exp) std::memset(x, 0, sizeof(float) * blk.cols);
    return;
  }
  if (has_target) x[col] = kNegInf;
  const float c2 = inv * kLog2e;
  const float m2 = m_new * kLog2e;
  Sums sums;
  if (with_entropy) {
    sums = store_exp ? exp_sums<true, true>(x, blk.cols, c2, m2)
                     : exp_sums<true, false>(x, blk.cols, c2, m2);
  } else {
    sums = store_exp ? exp_sums<false, true>(x, blk.cols, c2, m2)
                     : exp_sums<false, false>(x, blk.cols, c2, m2);
  }
  double c = 0.0, shift = 0.0;
  if (m_old != kNegInf) {
    shift = static_cast<double>(m_old) - static_cast<double>(m_new);
    c = std::exp(shift);
  }
  // Old terms relative to m_new: c e^{z - m_old} ((z - m_old) + (m_old - m_new)).
  st.s2_ex[i] = c * (st.s2_ex[i] + shift * st.s_ex[i]) + kLn2 * sums.s2;
  st.s_ex[i] = c * st.s_ex[i] + sums.s;
  st.m[i] = m_new;
  st.scale[i] = static_cast<float>(c);
}

template <bool kEntropy>
void grad_pass(float* x, const float* b, int64_t cols, float c2, float l2, float coef,
               float coef_log2) {
  // G = -p (coef + coef_log2 * y) with p = 2^y, y = (x + b) log2(e) / T - lse log2(e); without
  // the entropy coef_log2 = 0 and G = -p coef.
  const Vec vc2(c2), vl2(l2), vmin(kMinExp2), vcoef(-coef), vcl(-coef_log2);
  int64_t j = 0;
  for (; j + kVF <= cols; j += kVF) {
    Vec v = Vec::loadu(x + j);
    if (b != nullptr) v = v + Vec::loadu(b + j);
    const Vec y = at::vec::fmsub(v, vc2, vl2);
    const Vec p = fast_exp2(y);
    if constexpr (kEntropy) {
      (p * at::vec::fmadd(vcl, at::vec::maximum(y, vmin), vcoef)).store(x + j);
    } else {
      (p * vcoef).store(x + j);
    }
  }
  for (; j < cols; ++j) {
    const float y = (x[j] + (b != nullptr ? b[j] : 0.0f)) * c2 - l2;
    const float p = std::exp2(y);
    x[j] = kEntropy ? -p * (coef + coef_log2 * std::max(y, kMinExp2)) : -p * coef;
  }
}

void bwd_row(const LogprobBlock& blk, const LogprobRowGrad& rg, int64_t i) {
  float* x = blk.logits + i * blk.ld;
  const float inv = blk.inv_temperature;
  const float u = rg.grad_logprob[i] * inv;
  const float v = rg.grad_entropy != nullptr ? rg.grad_entropy[i] * inv : 0.0f;
  if (u == 0.0f && v == 0.0f) {
    std::memset(x, 0, sizeof(float) * blk.cols);
    return;
  }
  const float c2 = inv * kLog2e;
  const float l2 = rg.lse[i] * kLog2e;
  const float ent = v != 0.0f ? rg.entropy[i] : 0.0f;
  if (v != 0.0f) {
    // -p (u + v (log p + H)), log p = y ln 2.
    grad_pass<true>(x, blk.bias, blk.cols, c2, l2, u + v * ent, v * static_cast<float>(kLn2));
  } else {
    grad_pass<false>(x, blk.bias, blk.cols, c2, l2, u, 0.0f);
  }
  const int64_t col = blk.targets[i] - blk.v0;
  if (col >= 0 && col < blk.cols) {
    const double lp = rg.logprob[i];
    double g = -static_cast<double>(u) * std::expm1(lp);  // u (1 - p_a)
    if (v != 0.0f && lp != -std::numeric_limits<double>::infinity()) {
      g -= static_cast<double>(v) * std::exp(lp) * (lp + ent);
    }
    x[col] = static_cast<float>(g);
  }
}

// Rows per task: a block row is a few thousand entries, so small groups keep both threads busy.
constexpr int64_t kGrain = 4;

}  // namespace

void fused_linear_logprob_fwd_block(const LogprobBlock& blk, const LogprobRowState& st,
                                    bool with_entropy, bool store_exp) {
  at::parallel_for(0, blk.rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fwd_row(blk, st, i, with_entropy, store_exp);
  });
}

void fused_linear_logprob_bwd_block(const LogprobBlock& blk, const LogprobRowGrad& rg) {
  at::parallel_for(0, blk.rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) bwd_row(blk, rg, i);
  });
}

}  // namespace lopd::cpu::CPU_CAPABILITY
