// CPU implementation of lopd::sparse_teacher_topk_tail_kl_cpu_fwd / _bwd (schemas:
// csrc/common/schemas.h; Python side and conventions: lopd_kernels/sparse_teacher_topk_tail_kl.py).
//
// One row per task (at::parallel_for), float32 math whatever the student dtype. The student's
// tail is a log-sum-exp over the complement of the teacher's ids, accumulated directly: the
// row's real ids are sorted and the vocabulary is streamed in the contiguous segments between
// them (O(V + M log M), no scratch of size V). Scalar code: the per-row work is two passes over
// V, like the dense op's, without its per-ISA vectorization (not measured as a bottleneck yet).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common/topk_tail_kl_math.h"

namespace lopd::cpu {
namespace {

namespace km = ::lopd::topk_tail_kl;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr const char* kOp = "sparse_teacher_topk_tail_kl";

void check_student(const at::Tensor& s) {
  TORCH_CHECK(s.device().is_cpu(), kOp, " (CPU): student_logits must be a CPU tensor, got ",
              s.device());
  TORCH_CHECK(s.dim() == 2 && s.size(1) >= 1, kOp,
              ": student_logits must be 2-D [N, V] with V >= 1, got shape ", s.sizes());
  const auto dt = s.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, kOp,
              " (CPU): student_logits must be float32, bfloat16 or float16, got ", dt,
              " (float64 runs only on backend='torch', the reference)");
}

void check_tensor(const at::Tensor& x, const char* name, at::IntArrayRef shape,
                  at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && x.sizes() == shape && x.scalar_type() == dtype, kOp, ": ",
              name, " must be a CPU ", dtype, " tensor of shape ", shape, ", got ",
              x.scalar_type(), " ", x.sizes(), " on ", x.device());
}

// Targets in [0, V) (or ignore_index), and the real (finite log-prob) slots' ids of kept rows in
// [0, V): the kernels index the student row with both.
void check_indices(const at::Tensor& target, const at::Tensor& ids, const at::Tensor* logprobs,
                   const at::Tensor& bucket_logp, int64_t vocab, int64_t ignore_index) {
  const int64_t n = ids.size(0), m = ids.size(1);
  const int64_t* tp = target.data_ptr<int64_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* lq = logprobs ? logprobs->data_ptr<float>() : bucket_logp.data_ptr<float>();
  const int64_t lq_row = logprobs ? m : 2 * (m + 1);
  const int64_t lq_off = logprobs ? 0 : m + 1;  // bucket_logp[:, 1, :M] = log Q of the slots
  for (int64_t r = 0; r < n; ++r) {
    if (tp[r] == ignore_index) continue;
    TORCH_CHECK(tp[r] >= 0 && tp[r] < vocab, kOp, ": target_ids[", r, "] = ", tp[r],
                " is outside [0, V = ", vocab, ") and is not ignore_index (", ignore_index, ")");
    for (int64_t i = 0; i < m; ++i) {
      const bool real = lq[r * lq_row + lq_off + i] != kNegInf;
      const int64_t id = ip[r * m + i];
      TORCH_CHECK(!real || (id >= 0 && id < vocab), kOp, ": teacher_topk_ids[", r, ", ", i,
                  "] = ", id, " is outside [0, V = ", vocab, ")");
    }
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

// The row's real slots as (id, slot), sorted by id: the segments between consecutive ids are the
// student's tail.
void sorted_real_slots(const int64_t* ids, const float* logq, int64_t m,
                       std::vector<std::pair<int64_t, int64_t>>& out) {
  out.clear();
  for (int64_t i = 0; i < m; ++i) {
    if (logq[i] != kNegInf) out.emplace_back(ids[i], i);
  }
  std::sort(out.begin(), out.end());
}

template <typename T>
km::LseState tail_lse(const T* x, int64_t vocab, float inv_t,
                      const std::vector<std::pair<int64_t, int64_t>>& slots) {
  // Pass 1: the tail's maximum; pass 2: its sum. Segments [lo, hi) skip the real ids.
  float mx = kNegInf;
  auto each_segment = [&](auto&& fn) {
    int64_t lo = 0;
    for (const auto& slot : slots) {
      fn(lo, slot.first);
      lo = std::max(lo, slot.first + 1);
    }
    fn(lo, vocab);
  };
  each_segment([&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) mx = std::max(mx, static_cast<float>(x[j]) * inv_t);
  });
  if (mx == kNegInf) return km::lse_empty();
  float sum = 0.0f;
  each_segment([&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) sum += std::exp(static_cast<float>(x[j]) * inv_t - mx);
  });
  return km::LseState{mx, sum};
}

template <typename T>
void fwd_rows(const at::Tensor& student, const at::Tensor& logprobs, const at::Tensor& ids,
              const at::Tensor& target, float inv_t, bool reverse, int64_t ignore_index,
              float floor, at::Tensor& kl, at::Tensor& slp, at::Tensor& lse, at::Tensor& bucket) {
  const int64_t n = student.size(0), v = student.size(1), m = ids.size(1);
  const T* sp = student.data_ptr<T>();
  const float* lpp = logprobs.data_ptr<float>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* tp = target.data_ptr<int64_t>();
  float* klp = kl.data_ptr<float>();
  float* slpp = slp.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  float* bp = bucket.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> slots;
    for (int64_t r = begin; r < end; ++r) {
      float* logp = bp + r * 2 * (m + 1);
      float* logq = logp + (m + 1);
      if (tp[r] == ignore_index) {
        klp[r] = slpp[r] = lsep[r] = 0.0f;
        std::fill(logp, logp + 2 * (m + 1), 0.0f);
        continue;
      }
      const T* x = sp + r * v;
      const float* lp = lpp + r * m;
      sorted_real_slots(ip + r * m, lp, m, slots);
      const km::LseState tail = tail_lse(x, v, inv_t, slots);
      km::LseState all = tail;
      for (const auto& slot : slots) km::lse_add(all, static_cast<float>(x[slot.first]) * inv_t);
      const float lse_s = km::lse_value(all);
      float div = 0.0f;
      for (int64_t i = 0; i < m; ++i) logp[i] = logq[i] = kNegInf;  // padding slots
      for (const auto& slot : slots) {
        const int64_t i = slot.second;
        logp[i] = km::log_normalize(static_cast<float>(x[slot.first]) * inv_t, lse_s);
        logq[i] = lp[i];
        div += km::bucket_kl_term(logp[i], logq[i], reverse);
      }
      logp[m] = km::log_normalize(km::lse_value(tail), lse_s);
      logq[m] = teacher_log_tail(lp, m, floor, reverse);
      div += km::bucket_kl_term(logp[m], logq[m], reverse);
      klp[r] = div;
      lsep[r] = lse_s;
      slpp[r] = km::log_normalize(static_cast<float>(x[tp[r]]) * inv_t, lse_s);
    }
  });
}

template <typename T>
void bwd_rows(const at::Tensor& grad_kl, const at::Tensor& grad_slp, const at::Tensor& student,
              const at::Tensor& ids, const at::Tensor& target, const at::Tensor& kl,
              const at::Tensor& lse, const at::Tensor& bucket, float inv_t, bool reverse,
              int64_t ignore_index, at::Tensor& grad) {
  const int64_t n = student.size(0), v = student.size(1), m = ids.size(1);
  const T* sp = student.data_ptr<T>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* tp = target.data_ptr<int64_t>();
  const float* gkl = grad_kl.data_ptr<float>();
  const float* gsl = grad_slp.data_ptr<float>();
  const float* klp = kl.data_ptr<float>();
  const float* lsep = lse.data_ptr<float>();
  const float* bp = bucket.data_ptr<float>();
  T* gp = grad.data_ptr<T>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* g = gp + r * v;
      if (tp[r] == ignore_index) {
        std::fill(g, g + v, static_cast<T>(0.0f));
        continue;
      }
      const T* x = sp + r * v;
      const float* logp = bp + r * 2 * (m + 1);
      const float* logq = logp + (m + 1);
      const float u_kl = gkl[r], u_ls = gsl[r], lse_s = lsep[r];
      float k_tail, unused;
      km::bucket_grad_factors(logp[m], logq[m], klp[r], reverse, u_kl, u_ls, 0.0f, &k_tail,
                              &unused);
      const float lse_tail = km::bucket_lse(lse_s, logp[m]);
      // Every entry gets the tail formula, then the real slots their own bucket's.
      for (int64_t j = 0; j < v; ++j) {
        const float share = std::exp(static_cast<float>(x[j]) * inv_t - lse_tail);
        g[j] = static_cast<T>(km::entry_grad(share, k_tail, u_ls, j == tp[r], inv_t));
      }
      for (int64_t i = 0; i < m; ++i) {
        if (logq[i] == kNegInf) continue;  // padding slot: its id stays in the tail
        float k_s;
        km::bucket_grad_factors(logp[i], logq[i], klp[r], reverse, u_kl, u_ls, 0.0f, &k_s,
                                &unused);
        const int64_t id = ip[r * m + i];
        g[id] = static_cast<T>(km::entry_grad(1.0f, k_s, u_ls, id == tp[r], inv_t));
      }
    }
  });
}

float checked_inv_temperature(double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, kOp,
              ": temperature must be a finite number > 0, got ", temperature);
  return static_cast<float>(1.0 / temperature);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_teacher_fwd_cpu(
    const at::Tensor& student_logits, const at::Tensor& teacher_topk_logprobs,
    const at::Tensor& teacher_topk_ids, const at::Tensor& target_ids, double temperature,
    bool reverse, int64_t ignore_index, double tail_floor) {
  check_student(student_logits);
  const int64_t n = student_logits.size(0), v = student_logits.size(1);
  TORCH_CHECK(teacher_topk_ids.dim() == 2 && teacher_topk_ids.size(1) >= 1, kOp,
              ": teacher_topk_ids must be 2-D [N, M] with M >= 1, got ", teacher_topk_ids.sizes());
  const int64_t m = teacher_topk_ids.size(1);
  check_tensor(teacher_topk_ids, "teacher_topk_ids", {n, m}, at::kLong);
  check_tensor(teacher_topk_logprobs, "teacher_topk_logprobs", {n, m}, at::kFloat);
  check_tensor(target_ids, "target_ids", {n}, at::kLong);
  TORCH_CHECK(tail_floor >= 0.0 && tail_floor < 1.0, kOp, ": tail_floor must be in [0, 1), got ",
              tail_floor);
  const float inv_t = checked_inv_temperature(temperature);
  const at::Tensor s = student_logits.contiguous();
  const at::Tensor lp = teacher_topk_logprobs.contiguous();
  const at::Tensor ids = teacher_topk_ids.contiguous();
  const at::Tensor tgt = target_ids.contiguous();
  check_indices(tgt, ids, &lp, lp, v, ignore_index);
  const auto f32 = s.options().dtype(at::kFloat);
  at::Tensor kl = at::empty({n}, f32), slp = at::empty({n}, f32), lse = at::empty({n}, f32);
  at::Tensor bucket = at::empty({n, 2, m + 1}, f32);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), kOp, [&] {
    fwd_rows<scalar_t>(s, lp, ids, tgt, inv_t, reverse, ignore_index,
                       static_cast<float>(tail_floor), kl, slp, lse, bucket);
  });
  return {kl, slp, lse, bucket};
}

at::Tensor sparse_teacher_bwd_cpu(const at::Tensor& grad_kl, const at::Tensor& grad_student_logprob,
                                  const at::Tensor& student_logits,
                                  const at::Tensor& teacher_topk_ids, const at::Tensor& target_ids,
                                  const at::Tensor& kl, const at::Tensor& lse,
                                  const at::Tensor& bucket_logp, double temperature, bool reverse,
                                  int64_t ignore_index) {
  check_student(student_logits);
  const int64_t n = student_logits.size(0), v = student_logits.size(1);
  TORCH_CHECK(teacher_topk_ids.dim() == 2, kOp, ": teacher_topk_ids must be 2-D [N, M], got ",
              teacher_topk_ids.sizes());
  const int64_t m = teacher_topk_ids.size(1);
  check_tensor(teacher_topk_ids, "teacher_topk_ids", {n, m}, at::kLong);
  check_tensor(target_ids, "target_ids", {n}, at::kLong);
  check_tensor(grad_kl, "grad_kl", {n}, at::kFloat);
  check_tensor(grad_student_logprob, "grad_student_logprob", {n}, at::kFloat);
  check_tensor(kl, "kl", {n}, at::kFloat);
  check_tensor(lse, "lse", {n}, at::kFloat);
  check_tensor(bucket_logp, "bucket_logp", {n, 2, m + 1}, at::kFloat);
  const float inv_t = checked_inv_temperature(temperature);
  const at::Tensor s = student_logits.contiguous();
  const at::Tensor ids = teacher_topk_ids.contiguous();
  const at::Tensor tgt = target_ids.contiguous();
  const at::Tensor bucket = bucket_logp.contiguous();
  check_indices(tgt, ids, nullptr, bucket, v, ignore_index);
  at::Tensor grad = at::empty_like(s);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), kOp, [&] {
    bwd_rows<scalar_t>(grad_kl.contiguous(), grad_student_logprob.contiguous(), s, ids, tgt,
                       kl.contiguous(), lse.contiguous(), bucket, inv_t, reverse, ignore_index,
                       grad);
  });
  return grad;
}

}  // namespace
}  // namespace lopd::cpu

TORCH_LIBRARY_IMPL(lopd, CPU, m) {
  m.impl("sparse_teacher_topk_tail_kl_cpu_fwd", &lopd::cpu::sparse_teacher_fwd_cpu);
  m.impl("sparse_teacher_topk_tail_kl_cpu_bwd", &lopd::cpu::sparse_teacher_bwd_cpu);
}
