// Vectorized CPU kernels of lopd::sparse_teacher_topk_tail_kl_cpu_fwd / _bwd. Compiled once per
// ISA (CPU_CAPABILITY = DEFAULT | AVX2 | AVX512, see csrc/cpu/isa_dispatch.h); the per-bucket
// math is csrc/common/topk_tail_kl_math.h, shared with the dense op.
//
// One row per task (at::parallel_for), float32 math whatever the student dtype.
// Forward: the row's real teacher ids are sorted, and the student's tail log-sum-exp is
// accumulated directly over the contiguous segments between them (never 1 - sum of the top
// masses), in L1-sized blocks each read twice while resident (block max, then the sum of
// exp(x - max) with the fast vector exp of csrc/cpu/vec_exp.h). O(V + M log M), no O(V) scratch.
// The teacher's side is O(M): its tail 1 - exp(max + log1p(rest)) by expm1.
// Backward: one vectorized pass writes the tail formula for every entry, then the target and the
// real slots are rewritten with their own factors (scalar, M + 1 entries).
// GCC 12 reports -Wmaybe-uninitialized false positives inside its own avx512fintrin.h (see
// csrc/cpu/isa/topk_tail_kl_kernel.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/topk_tail_kl_math.h"
#include "cpu/sparse_teacher_topk_tail_kl.h"
#include "cpu/vec_exp.h"
#include "cpu/vec_helpers.h"

namespace lopd::cpu::CPU_CAPABILITY {
namespace {

namespace km = ::lopd::topk_tail_kl;
// Vec, kVF, kStep (one full vector of a 16-bit input type), kNegInf, load2 / store2 / hmax /
// hsum: csrc/cpu/vec_helpers.h.
constexpr int64_t kBlock = 2048;  // elements per L1 block

// Merges the log-sum-exp of x[lo, hi) * inv into st, block by block.
template <typename T>
void segment_lse(const T* x, int64_t lo, int64_t hi, float inv, km::LseState& st) {
  const Vec vinv(inv);
  for (int64_t b = lo; b < hi; b += kBlock) {
    const int64_t e = std::min(hi, b + kBlock);
    Vec vmax(kNegInf);
    int64_t j = b;
    for (; e - j >= kStep; j += kStep) {
      Vec x0, x1;
      load2(x + j, x0, x1);
      vmax = at::vec::maximum(vmax, at::vec::maximum(x0 * vinv, x1 * vinv));
    }
    float mx = hmax(vmax);
    for (int64_t r = j; r < e; ++r) mx = std::max(mx, static_cast<float>(x[r]) * inv);
    if (mx == kNegInf) continue;  // no mass in this block (and x - max would be NaN)
    const Vec vm(mx);
    Vec vsum(0.0f);
    for (j = b; e - j >= kStep; j += kStep) {
      Vec x0, x1;
      load2(x + j, x0, x1);
      vsum = vsum + fast_exp(x0 * vinv - vm) + fast_exp(x1 * vinv - vm);
    }
    float sum = hsum(vsum);
    for (int64_t r = j; r < e; ++r) sum += std::exp(static_cast<float>(x[r]) * inv - mx);
    km::lse_merge(st, mx, sum);
  }
}

// log(1 - sum_i exp(lp_i)) over the real slots, with the log-sum-exp as max + log1p(rest) so
// that a top-M mass near 1 keeps its last digits. A tail below `floor` is rounding noise: raised
// to it for the reverse KL (finite log Q), dropped to 0 for the forward KL (no Q log(Q / 0)).
float teacher_log_tail(const float* lp, int64_t m, float floor, bool reverse) {
  int64_t arg = -1;
  float top = kNegInf;
  for (int64_t i = 0; i < m; ++i) {
    if (lp[i] > top) {
      top = lp[i];
      arg = i;
    }
  }
  if (arg < 0) return 0.0f;  // no real slot: the whole teacher is the tail
  float rest = 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    if (i != arg) rest += std::exp(lp[i] - top);
  }
  const float lse = std::min(top + std::log1p(rest), 0.0f);
  float tail = -std::expm1(lse);
  if (tail < floor) tail = reverse ? floor : 0.0f;
  return tail > 0.0f ? std::log(tail) : kNegInf;
}

template <typename T>
void fwd_impl(const SparseTeacherFwdArgs& a) {
  const int64_t n = a.student.size(0), v = a.student.size(1), m = a.ids.size(1);
  const T* sp = a.student.data_ptr<T>();
  const float* lpp = a.logprobs.data_ptr<float>();
  const int64_t* ip = a.ids.data_ptr<int64_t>();
  const int64_t* tp = a.target.data_ptr<int64_t>();
  float* klp = a.kl.data_ptr<float>();
  float* slpp = a.student_logprob.data_ptr<float>();
  float* lsep = a.lse.data_ptr<float>();
  float* bp = a.bucket_logp.data_ptr<float>();
  const float inv = a.inv_temperature;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> slots;  // (id, slot) of the real slots, by id
    for (int64_t r = begin; r < end; ++r) {
      float* logp = bp + r * 2 * (m + 1);
      float* logq = logp + (m + 1);
      if (tp[r] == a.ignore_index) {
        klp[r] = slpp[r] = lsep[r] = 0.0f;
        std::fill(logp, logp + 2 * (m + 1), 0.0f);
        continue;
      }
      const T* x = sp + r * v;
      const float* lp = lpp + r * m;
      slots.clear();
      for (int64_t i = 0; i < m; ++i) {
        if (lp[i] != kNegInf) slots.emplace_back(ip[r * m + i], i);
      }
      std::sort(slots.begin(), slots.end());
      km::LseState tail = km::lse_empty();
      int64_t lo = 0;
      for (const auto& slot : slots) {
        segment_lse(x, lo, slot.first, inv, tail);
        lo = std::max(lo, slot.first + 1);  // duplicates (validated away) would just be skipped
      }
      segment_lse(x, lo, v, inv, tail);
      km::LseState all = tail;
      for (const auto& slot : slots) km::lse_add(all, static_cast<float>(x[slot.first]) * inv);
      const float lse_s = km::lse_value(all);
      float div = 0.0f;
      for (int64_t i = 0; i < m; ++i) logp[i] = logq[i] = kNegInf;  // padding slots
      for (const auto& slot : slots) {
        const int64_t i = slot.second;
        logp[i] = km::log_normalize(static_cast<float>(x[slot.first]) * inv, lse_s);
        logq[i] = lp[i];
        div += km::bucket_kl_term(logp[i], logq[i], a.reverse);
      }
      logp[m] = km::log_normalize(km::lse_value(tail), lse_s);
      logq[m] = teacher_log_tail(lp, m, a.tail_floor, a.reverse);
      div += km::bucket_kl_term(logp[m], logq[m], a.reverse);
      klp[r] = div;
      lsep[r] = lse_s;
      slpp[r] = km::log_normalize(static_cast<float>(x[tp[r]]) * inv, lse_s);
    }
  });
}

template <typename T>
void bwd_impl(const SparseTeacherBwdArgs& a) {
  const int64_t n = a.student.size(0), v = a.student.size(1), m = a.ids.size(1);
  const T* sp = a.student.data_ptr<T>();
  const int64_t* ip = a.ids.data_ptr<int64_t>();
  const int64_t* tp = a.target.data_ptr<int64_t>();
  const float* gkl = a.grad_kl.data_ptr<float>();
  const float* gsl = a.grad_student_logprob.data_ptr<float>();
  const float* klp = a.kl.data_ptr<float>();
  const float* lsep = a.lse.data_ptr<float>();
  const float* bp = a.bucket_logp.data_ptr<float>();
  T* gp = a.grad_student.data_ptr<T>();
  const float inv = a.inv_temperature;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* g = gp + r * v;
      if (tp[r] == a.ignore_index) {
        std::fill(g, g + v, static_cast<T>(0.0f));
        continue;
      }
      const T* x = sp + r * v;
      const float* logp = bp + r * 2 * (m + 1);
      const float* logq = logp + (m + 1);
      const float u_kl = gkl[r], u_ls = gsl[r];
      float k_tail, unused;
      km::bucket_grad_factors(logp[m], logq[m], klp[r], a.reverse, u_kl, u_ls, 0.0f, &k_tail,
                              &unused);
      // +inf when the tail has no mass: every share is then 0, never NaN.
      const float lse_tail = km::bucket_lse(lsep[r], logp[m]);
      const Vec vinv(inv), vlse(lse_tail), vk(k_tail * inv);
      int64_t j = 0;
      for (; v - j >= kStep; j += kStep) {
        Vec x0, x1;
        load2(x + j, x0, x1);
        // Real slots may exceed lse_tail here (share > 1, even inf): they are rewritten below.
        store2(g + j, fast_exp(x0 * vinv - vlse) * vk, fast_exp(x1 * vinv - vlse) * vk);
      }
      for (; j < v; ++j) {
        g[j] = static_cast<T>(std::exp(static_cast<float>(x[j]) * inv - lse_tail) * k_tail * inv);
      }
      const int64_t tgt = tp[r];
      const float share_t = std::exp(static_cast<float>(x[tgt]) * inv - lse_tail);
      g[tgt] = static_cast<T>(km::entry_grad(share_t, k_tail, u_ls, true, inv));
      for (int64_t i = 0; i < m; ++i) {
        if (logq[i] == kNegInf) continue;  // padding slot: its id stays in the tail
        float k_s;
        km::bucket_grad_factors(logp[i], logq[i], klp[r], a.reverse, u_kl, u_ls, 0.0f, &k_s,
                                &unused);
        const int64_t id = ip[r * m + i];
        g[id] = static_cast<T>(km::entry_grad(1.0f, k_s, u_ls, id == tgt, inv));
      }
    }
  });
}

}  // namespace

// float32 / bfloat16 / float16 students (the op rejects the rest).
template <typename Args, typename Fn>
static void dispatch_student(const Args& args, Fn&& fn) {
  switch (args.student.scalar_type()) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kBFloat16:
      fn(at::BFloat16{});
      break;
    case at::kHalf:
      fn(at::Half{});
      break;
    default:
      TORCH_CHECK(false, "sparse_teacher_topk_tail_kl: unsupported student dtype ",
                  args.student.scalar_type());
  }
}

void sparse_teacher_fwd_kernel(const SparseTeacherFwdArgs& args) {
  dispatch_student(args, [&](auto tag) { fwd_impl<decltype(tag)>(args); });
}

void sparse_teacher_bwd_kernel(const SparseTeacherBwdArgs& args) {
  dispatch_student(args, [&](auto tag) { bwd_impl<decltype(tag)>(args); });
}

}  // namespace lopd::cpu::CPU_CAPABILITY
