// Interface between the sparse_teacher_topk_tail_kl op (csrc/cpu/sparse_teacher_topk_tail_kl.cpp:
// checks, allocation, ISA choice) and its per-ISA kernels
// (csrc/cpu/isa/sparse_teacher_topk_tail_kl_kernel.cpp, compiled once per ISA).
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu/isa_dispatch.h"

namespace lopd::cpu {

// All tensors contiguous and already checked (ids of the real slots of kept rows in [0, V));
// outputs preallocated by the op.
struct SparseTeacherFwdArgs {
  at::Tensor student;   // [N, V] float32 | bfloat16 | float16
  at::Tensor logprobs;  // [N, M] float32, -inf: padding slot
  at::Tensor ids;       // [N, M] int64
  at::Tensor target;    // [N] int64
  float inv_temperature;
  bool reverse;
  int64_t ignore_index;
  float tail_floor;
  at::Tensor kl;               // [N] float32
  at::Tensor student_logprob;  // [N] float32
  at::Tensor lse;              // [N] float32
  at::Tensor bucket_logp;      // [N, 2, M + 1] float32
};

struct SparseTeacherBwdArgs {
  at::Tensor grad_kl;               // [N] float32
  at::Tensor grad_student_logprob;  // [N] float32
  at::Tensor student;               // [N, V]
  at::Tensor ids;                   // [N, M] int64
  at::Tensor target;                // [N] int64
  at::Tensor kl;                    // [N] float32
  at::Tensor lse;                   // [N] float32
  at::Tensor bucket_logp;           // [N, 2, M + 1] float32
  float inv_temperature;
  bool reverse;
  int64_t ignore_index;
  at::Tensor grad_student;  // [N, V] in the student's dtype
};

}  // namespace lopd::cpu

#define LOPD_SPARSE_TEACHER_DECLARE(ISA)                                          \
  namespace lopd::cpu::ISA {                                                      \
  void sparse_teacher_fwd_kernel(const ::lopd::cpu::SparseTeacherFwdArgs&);       \
  void sparse_teacher_bwd_kernel(const ::lopd::cpu::SparseTeacherBwdArgs&);       \
  }
LOPD_FOR_EACH_CPU_ISA(LOPD_SPARSE_TEACHER_DECLARE)
#undef LOPD_SPARSE_TEACHER_DECLARE
