// Interface between the topk_tail_kl op (csrc/cpu/topk_tail_kl.cpp: checks, allocation, ISA
// choice) and its per-ISA kernels (csrc/cpu/isa/topk_tail_kl_kernel.cpp, compiled once per ISA).
#pragma once

#include <ATen/core/Tensor.h>

#include "common/topk_tail_kl_math.h"
#include "cpu/isa_dispatch.h"

namespace lopd::cpu {

// All tensors already checked; outputs preallocated by the op. The logits are [N, V] or
// [B, L, V] with a dense vocabulary axis, rows anywhere (row n at layout.offset(n)); every other
// tensor is contiguous.
struct TopKTailKLFwdArgs {
  at::Tensor student;  // [N, V] | [B, L, V] float32 | bfloat16 | float16
  at::Tensor teacher;  // the same shape; float32 | bfloat16 | float16 (may differ from student)
  int64_t n_rows;      // N (B * L)
  int64_t vocab;       // V
  ::lopd::topk_tail_kl::RowLayout s_layout, t_layout;
  at::Tensor target;   // [N] int64
  int64_t top_m;       // M: 0 (full vocabulary) or in [1, V)
  int64_t width;       // K, the columns of topk_ids: M, 2M for the union, 0 for the full vocabulary
  float inv_temperature;
  ::lopd::topk_tail_kl::DivergenceSpec div;
  ::lopd::topk_tail_kl::Support support;  // teacher when top_m == 0
  int64_t ignore_index;
  at::Tensor kl;               // [N] float32
  at::Tensor student_logprob;  // [N] float32
  at::Tensor teacher_logprob;  // [N] float32
  at::Tensor topk_ids;         // [N, K] int64 (-1: a union's padding slot)
  at::Tensor lse;              // [N, 2] float32
  at::Tensor bucket_logp;      // [N, 2, K + 1] float32
};

struct TopKTailKLBwdArgs {
  at::Tensor grad_kl;               // [N] float32
  at::Tensor grad_student_logprob;  // [N] float32
  at::Tensor grad_teacher_logprob;  // [N] float32 (includes the privilege's upstream gradient)
  at::Tensor student;               // [N, V] | [B, L, V] (rows at s_layout)
  at::Tensor teacher;               // the same shape (rows at t_layout)
  int64_t n_rows;                   // N (B * L)
  int64_t vocab;                    // V
  ::lopd::topk_tail_kl::RowLayout s_layout, t_layout;
  at::Tensor target;                // [N] int64
  at::Tensor topk_ids;              // [N, K] int64 (-1: padding, skipped)
  at::Tensor kl;                    // [N] float32
  at::Tensor lse;                   // [N, 2] float32
  at::Tensor bucket_logp;           // [N, 2, K + 1] float32
  float inv_temperature;
  ::lopd::topk_tail_kl::DivergenceSpec div;
  int64_t ignore_index;
  at::Tensor grad_student;  // dense, student's shape and dtype, or undefined when not required
  at::Tensor grad_teacher;  // dense, teacher's shape and dtype, or undefined when not required
};

}  // namespace lopd::cpu

#define LOPD_TOPK_TAIL_KL_DECLARE(ISA)                                 \
  namespace lopd::cpu::ISA {                                           \
  void topk_tail_kl_fwd_kernel(const ::lopd::cpu::TopKTailKLFwdArgs&); \
  void topk_tail_kl_bwd_kernel(const ::lopd::cpu::TopKTailKLBwdArgs&); \
  }
LOPD_FOR_EACH_CPU_ISA(LOPD_TOPK_TAIL_KL_DECLARE)
#undef LOPD_TOPK_TAIL_KL_DECLARE
