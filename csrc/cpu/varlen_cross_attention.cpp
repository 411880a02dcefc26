// CPU implementation of lopd::varlen_cross_attention_cpu_fwd / _bwd (schemas:
// csrc/common/schemas.h): argument checks, output allocation, and the choice of the per-ISA kernel
// (csrc/cpu/isa/varlen_cross_attention_kernel.cpp). Inputs fp32 / bf16 / fp16 (one dtype for q,
// k, v); the math is fp32. float64 is rejected with a message pointing to backend="torch".
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/isa_dispatch.h"
#include "cpu/varlen_cross_attention.h"

namespace lopd::cpu {
namespace {

#define LOPD_XATTN_CHECK(cond, ...) TORCH_CHECK(cond, "varlen_cross_attention (CPU): ", __VA_ARGS__)

void check_cpu(const at::Tensor& t, const char* name) {
  LOPD_XATTN_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
}

// Checks the forward inputs (shapes, dtypes, and the boundaries, which are free to read here).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cu, double scale) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  check_cpu(v, "v");
  check_cpu(cu, "cu_seqlens_k");
  const auto dt = q.scalar_type();
  LOPD_XATTN_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "q must be float32, float16 or bfloat16, got ", dt,
                   " (float64 runs only on backend='torch', the reference)");
  LOPD_XATTN_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "k and v must have q's dtype ",
                   dt, ", got ", k.scalar_type(), " and ", v.scalar_type());
  LOPD_XATTN_CHECK(q.dim() == 4, "q must be [B, Lq, Hq, D], got shape ", q.sizes());
  LOPD_XATTN_CHECK(k.dim() == 3, "k must be packed [total_k, Hkv, D], got shape ", k.sizes());
  LOPD_XATTN_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ",
                   v.sizes());
  LOPD_XATTN_CHECK(k.size(2) == q.size(3), "k head dim ", k.size(2), " must equal q head dim ",
                   q.size(3));
  LOPD_XATTN_CHECK(k.size(1) > 0 && q.size(2) % k.size(1) == 0, "q heads (", q.size(2),
                   ") must be a positive multiple of k/v heads (", k.size(1), ")");
  LOPD_XATTN_CHECK(cu.scalar_type() == at::kInt, "cu_seqlens_k must be int32, got ",
                   cu.scalar_type());
  LOPD_XATTN_CHECK(cu.dim() == 1 && cu.size(0) == q.size(0) + 1, "cu_seqlens_k must be [B+1] = [",
                   q.size(0) + 1, "], got shape ", cu.sizes());
  LOPD_XATTN_CHECK(std::isfinite(scale) && scale > 0, "scale must be a positive finite float, got ",
                   scale);
  const at::Tensor c = cu.contiguous();
  const int* p = c.data_ptr<int>();
  LOPD_XATTN_CHECK(p[0] == 0 && p[q.size(0)] == k.size(0),
                   "cu_seqlens_k must start at 0 and end at total_k = ", k.size(0));
  for (int64_t i = 0; i < q.size(0); ++i) {
    LOPD_XATTN_CHECK(p[i + 1] >= p[i], "cu_seqlens_k must be non-decreasing");
  }
}

void check_like(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                at::ScalarType dtype) {
  check_cpu(t, name);
  LOPD_XATTN_CHECK(t.sizes() == shape && t.scalar_type() == dtype, name, " must be ", dtype, " ",
                   shape, ", got ", t.scalar_type(), " ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor> varlen_cross_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_k,
    double scale, int64_t /*max_seqlen_k: sizes GPU grids; not needed here*/) {
  check_inputs(q, k, v, cu_seqlens_k, scale);
  VarlenXattnFwdArgs a;
  a.q = q.contiguous();
  a.k = k.contiguous();
  a.v = v.contiguous();
  a.cu = cu_seqlens_k.contiguous();
  a.scale = static_cast<float>(scale);
  // Every element is written by the kernel (empty items: zeros / -inf): no fill here.
  a.out = at::empty_like(a.q);
  a.lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.numel() > 0) {
    LOPD_CPU_ISA_CALL(varlen_cross_attention_fwd_kernel, a);
  }
  return {a.out, a.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_cross_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_k, double scale, int64_t /*max_seqlen_k*/) {
  check_inputs(q, k, v, cu_seqlens_k, scale);
  check_like(grad_out, "grad_out", q.sizes(), q.scalar_type());
  check_like(out, "out", q.sizes(), q.scalar_type());
  const std::vector<int64_t> lse_shape{q.size(0), q.size(2), q.size(1)};
  check_like(lse, "lse", lse_shape, at::kFloat);
  check_like(grad_lse, "grad_lse", lse_shape, at::kFloat);
  VarlenXattnBwdArgs a;
  a.grad_out = grad_out.contiguous();
  a.grad_lse = grad_lse.contiguous();
  a.q = q.contiguous();
  a.k = k.contiguous();
  a.v = v.contiguous();
  a.cu = cu_seqlens_k.contiguous();
  a.out = out.contiguous();
  a.lse = lse.contiguous();
  a.scale = static_cast<float>(scale);
  a.dq = at::empty_like(a.q);
  // Every key row belongs to exactly one item (cu_seqlens_k runs from 0 to total_k) and is
  // written once by the (item, kv head) unit that owns it: no zero-fill of dk, dv.
  a.dk = at::empty_like(a.k);
  a.dv = at::empty_like(a.v);
  if (q.numel() == 0) {
    // No query rows: nothing attends, the keys get no gradient.
    a.dk.zero_();
    a.dv.zero_();
  } else {
    LOPD_CPU_ISA_CALL(varlen_cross_attention_bwd_kernel, a);
  }
  return {a.dq, a.dk, a.dv};
}

#undef LOPD_XATTN_CHECK

}  // namespace
}  // namespace lopd::cpu

TORCH_LIBRARY_IMPL(lopd, CPU, m) {
  m.impl("varlen_cross_attention_cpu_fwd", &lopd::cpu::varlen_cross_attention_fwd_cpu);
  m.impl("varlen_cross_attention_cpu_bwd", &lopd::cpu::varlen_cross_attention_bwd_cpu);
}
