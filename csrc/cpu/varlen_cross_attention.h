// Interface between the varlen_cross_attention CPU op (csrc/cpu/varlen_cross_attention.cpp:
// checks, allocation, ISA choice) and its per-ISA kernels
// (csrc/cpu/isa/varlen_cross_attention_kernel.cpp, compiled once per ISA).
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu/isa_dispatch.h"

namespace lopd::cpu {

// All tensors contiguous and already checked; outputs preallocated by the op.
struct VarlenXattnFwdArgs {
  at::Tensor q;   // [B, Lq, Hq, D] float32 | bfloat16 | float16
  at::Tensor k;   // [total_k, Hkv, D], q's dtype
  at::Tensor v;   // [total_k, Hkv, D], q's dtype
  at::Tensor cu;  // [B + 1] int32, 0 = cu[0] <= ... <= cu[B] = total_k
  float scale;
  at::Tensor out;  // [B, Lq, Hq, D], q's dtype
  at::Tensor lse;  // [B, Hq, Lq] float32
};

struct VarlenXattnBwdArgs {
  at::Tensor grad_out;  // [B, Lq, Hq, D], q's dtype
  at::Tensor grad_lse;  // [B, Hq, Lq] float32
  at::Tensor q, k, v, cu;
  at::Tensor out;  // forward output
  at::Tensor lse;  // forward log-sum-exp
  float scale;
  at::Tensor dq;  // [B, Lq, Hq, D]: fully written (zeros for empty items)
  at::Tensor dk;  // [total_k, Hkv, D]: fully written (every key row is in exactly one item)
  at::Tensor dv;  // [total_k, Hkv, D]: idem
};

}  // namespace lopd::cpu

#define LOPD_VARLEN_XATTN_DECLARE(ISA)                                      \
  namespace lopd::cpu::ISA {                                                \
  void varlen_cross_attention_fwd_kernel(const ::lopd::cpu::VarlenXattnFwdArgs&); \
  void varlen_cross_attention_bwd_kernel(const ::lopd::cpu::VarlenXattnBwdArgs&); \
  }
LOPD_FOR_EACH_CPU_ISA(LOPD_VARLEN_XATTN_DECLARE)
#undef LOPD_VARLEN_XATTN_DECLARE
