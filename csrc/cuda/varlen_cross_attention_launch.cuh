// Host side of lopd::varlen_cross_attention_cuda_fwd / _bwd (schemas: csrc/common/schemas.h):
// argument checks, output allocation, the dtype / head-dim dispatch, the choice between the
// tensor-core kernels (varlen_cross_attention_kernels_wmma.cuh) and the CUDA-core ones
// (varlen_cross_attention_kernels.cuh), and their launches. Included by
// csrc/cuda/varlen_cross_attention.cu (nvcc) and csrc/emu/varlen_cross_attention_emu.cpp (g++,
// the SIMT emulator).
#pragma once

#include "cuda/varlen_cross_attention_kernels_wmma.cuh"

namespace lopd::cuda::varlen_xattn {
namespace {

#define LOPD_XATTN_CHECK(cond, ...) \
  TORCH_CHECK(cond, "varlen_cross_attention (" LOPD_SIMT_BACKEND "): ", __VA_ARGS__)

// Calls f(T{}, std::integral_constant<int, NPL>{}) for q's dtype and the per-lane dim count bucket
// of D (1, 2, 3, 4 or 8 dims per lane: D <= 32, 64, 96, 128, 256).
template <typename F>
void dispatch(at::ScalarType dtype, int64_t D, F&& f) {
  auto with_npl = [&](auto tag) {
    if (D <= 32) {
      f(tag, std::integral_constant<int, 1>{});
    } else if (D <= 64) {
      f(tag, std::integral_constant<int, 2>{});
    } else if (D <= 96) {
      f(tag, std::integral_constant<int, 3>{});
    } else if (D <= 128) {
      f(tag, std::integral_constant<int, 4>{});
    } else {
      f(tag, std::integral_constant<int, 8>{});
    }
  };
  switch (dtype) {
    case at::kFloat:
      with_npl(float{});
      break;
    case at::kHalf:
      with_npl(__half{});
      break;
    default:
      with_npl(__nv_bfloat16{});
      break;
  }
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  LOPD_XATTN_CHECK(t.device().type() == LOPD_SIMT_DEVICE_TYPE, name, " must be a ",
                   c10::DeviceTypeName(LOPD_SIMT_DEVICE_TYPE), " tensor, got one on ", t.device());
  LOPD_XATTN_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but q is on ",
                   ref.device());
  LOPD_XATTN_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Checks the forward inputs; returns the shape parameters.
Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& cu, double scale, int64_t max_seqlen_k) {
  check_same_device(q, q, "q");
  check_same_device(q, k, "k");
  check_same_device(q, v, "v");
  check_same_device(q, cu, "cu_seqlens_k");
  const auto dt = q.scalar_type();
  LOPD_XATTN_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
                   "q must be float32, float16 or bfloat16, got ", dt);
  LOPD_XATTN_CHECK(k.scalar_type() == dt && v.scalar_type() == dt,
                   "k and v must have q's dtype ", dt, ", got ", k.scalar_type(), " and ",
                   v.scalar_type());
  LOPD_XATTN_CHECK(q.dim() == 4, "q must be [B, Lq, Hq, D], got shape ", q.sizes());
  LOPD_XATTN_CHECK(k.dim() == 3, "k must be packed [total_k, Hkv, D], got shape ", k.sizes());
  LOPD_XATTN_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes(), ", got ",
                   v.sizes());
  const int64_t D = q.size(3);
  LOPD_XATTN_CHECK(k.size(2) == D, "k head dim ", k.size(2), " must equal q head dim ", D);
  LOPD_XATTN_CHECK(D >= 1 && D <= kMaxHeadDim, "head dim D must be in [1, ", kMaxHeadDim,
                   "], got ", D);
  LOPD_XATTN_CHECK(k.size(1) > 0 && q.size(2) % k.size(1) == 0, "q heads (", q.size(2),
                   ") must be a positive multiple of k/v heads (", k.size(1), ")");
  LOPD_XATTN_CHECK(cu.scalar_type() == at::kInt, "cu_seqlens_k must be int32, got ",
                   cu.scalar_type());
  LOPD_XATTN_CHECK(cu.dim() == 1 && cu.size(0) == q.size(0) + 1, "cu_seqlens_k must be [B+1] = [",
                   q.size(0) + 1, "], got shape ", cu.sizes());
  LOPD_XATTN_CHECK(std::isfinite(scale) && scale > 0, "scale must be a positive finite float, got ",
                   scale);
  LOPD_XATTN_CHECK(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  LOPD_XATTN_CHECK(k.size(0) <= INT32_MAX, "total_k must fit int32 (cu_seqlens_k), got ",
                   k.size(0));
  // Grid limits: B on x (2^31 - 1), Hkv on y, row chunks / key tiles on z (65535 each).
  LOPD_XATTN_CHECK(k.size(1) <= 65535, "at most 65535 k/v heads, got ", k.size(1));
  LOPD_XATTN_CHECK((max_seqlen_k + kKeyTile - 1) / kKeyTile <= 65535,
                   "max_seqlen_k must be <= ", int64_t(65535) * kKeyTile, ", got ", max_seqlen_k);
  if (cu.device().is_cpu() && q.size(0) > 0) {
    // The boundaries are free to check on the CPU (the emulated build); on a GPU they would cost
    // a device sync (the Python wrapper checks them where they are free).
    const int* c = cu.data_ptr<int>();
    LOPD_XATTN_CHECK(c[0] == 0 && c[q.size(0)] == k.size(0),
                     "cu_seqlens_k must start at 0 and end at total_k = ", k.size(0));
    for (int64_t i = 0; i < q.size(0); ++i) {
      LOPD_XATTN_CHECK(c[i + 1] >= c[i], "cu_seqlens_k must be non-decreasing");
      LOPD_XATTN_CHECK(c[i + 1] - c[i] <= max_seqlen_k, "max_seqlen_k=", max_seqlen_k,
                       " is below the length ", c[i + 1] - c[i], " of item ", i);
    }
  }
  Shape s{};
  s.batch = q.size(0);
  s.lq = q.size(1);
  s.hq = q.size(2);
  s.hkv = k.size(1);
  s.d = D;
  s.group = s.hq / s.hkv;
  s.rows = s.group * s.lq;
  s.scale = float(scale);
  return s;
}

// Calls f(T{}) for a half-precision dtype (the WMMA kernels' inputs).
template <typename F>
void dispatch_half(at::ScalarType dtype, F&& f) {
  if (dtype == at::kHalf) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

// Forward / dQ blocks: enough warps for the rows of one (item, kv head), at most kMaxWarps.
int row_warps(const Shape& s) {
  const int64_t w = (s.rows + kRowsPerWarp - 1) / kRowsPerWarp;
  return int(w < 1 ? 1 : (w > kMaxWarps ? kMaxWarps : w));
}

std::tuple<at::Tensor, at::Tensor> varlen_cross_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_k,
    double scale, int64_t max_seqlen_k) {
  const Shape s = check_inputs(q, k, v, cu_seqlens_k, scale, max_seqlen_k);
  LOPD_DEVICE_GUARD(q.device());
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.batch, s.hq, s.lq}, q.options().dtype(at::kFloat));
  if (s.batch == 0 || s.rows == 0) return {out, lse};
  if (use_wmma(q.scalar_type(), s.d, fwd_wmma_smem(int(s.d)), {&q, &k, &v, &out})) {
    const int64_t tiles = (s.rows + kTcRows - 1) / kTcRows;
    LOPD_XATTN_CHECK(tiles <= 65535, "too many query rows per kv head (", s.rows, ")");
    dispatch_half(q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      auto kernel = fwd_wmma_kernel<T>;
      LOPD_LAUNCH(kernel, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(tiles)),
                  kTcWarps * kWarp, fwd_wmma_smem(int(s.d)),
                  reinterpret_cast<const T*>(q.data_ptr()),
                  reinterpret_cast<const T*>(k.data_ptr()),
                  reinterpret_cast<const T*>(v.data_ptr()), cu_seqlens_k.data_ptr<int>(),
                  reinterpret_cast<T*>(out.data_ptr()), lse.data_ptr<float>(), s);
    });
    return {out, lse};
  }
  const int warps = row_warps(s);
  const int rpb = warps * kRowsPerWarp;
  const int64_t chunks = (s.rows + rpb - 1) / rpb;
  LOPD_XATTN_CHECK(chunks <= 65535, "too many query rows per kv head (", s.rows, ")");
  const size_t smem =
      sizeof(float) * (size_t(rpb) * s.d + 2 * kKeyTile * kv_stride(int(s.d)) + 2 * rpb * kKeyTile);
  const dim3 grid(unsigned(s.batch), unsigned(s.hkv), unsigned(chunks));
  dispatch(q.scalar_type(), s.d, [&](auto tag, auto npl) {
    using T = decltype(tag);
    auto kernel = fwd_kernel<T, decltype(npl)::value>;
    LOPD_LAUNCH(kernel, grid, warps * kWarp, smem, reinterpret_cast<const T*>(q.data_ptr()),
                reinterpret_cast<const T*>(k.data_ptr()), reinterpret_cast<const T*>(v.data_ptr()),
                cu_seqlens_k.data_ptr<int>(), reinterpret_cast<T*>(out.data_ptr()),
                lse.data_ptr<float>(), s);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_cross_attention_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& grad_lse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_k, double scale, int64_t max_seqlen_k) {
  const Shape s = check_inputs(q, k, v, cu_seqlens_k, scale, max_seqlen_k);
  check_same_device(q, grad_out, "grad_out");
  check_same_device(q, out, "out");
  check_same_device(q, grad_lse, "grad_lse");
  check_same_device(q, lse, "lse");
  LOPD_XATTN_CHECK(grad_out.sizes() == q.sizes() && grad_out.scalar_type() == q.scalar_type(),
                   "grad_out must match q (shape ", q.sizes(), ", dtype ", q.scalar_type(),
                   "), got ", grad_out.sizes(), " ", grad_out.scalar_type());
  LOPD_XATTN_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
                   "out must match q (shape ", q.sizes(), ", dtype ", q.scalar_type(), "), got ",
                   out.sizes(), " ", out.scalar_type());
  const std::vector<int64_t> lse_shape{s.batch, s.hq, s.lq};
  LOPD_XATTN_CHECK(lse.sizes() == lse_shape && lse.scalar_type() == at::kFloat,
                   "lse must be float32 [B, Hq, Lq] = ", at::IntArrayRef(lse_shape), ", got ",
                   lse.sizes(), " ", lse.scalar_type());
  LOPD_XATTN_CHECK(grad_lse.sizes() == lse_shape && grad_lse.scalar_type() == at::kFloat,
                   "grad_lse must be float32 [B, Hq, Lq] = ", at::IntArrayRef(lse_shape),
                   ", got ", grad_lse.sizes(), " ", grad_lse.scalar_type());
  LOPD_DEVICE_GUARD(q.device());
  at::Tensor dq = at::empty_like(q);
  // Every key row belongs to exactly one item (cu_seqlens_k runs from 0 to total_k), so the
  // dK/dV kernel overwrites all of dk and dv.
  at::Tensor dk = at::empty_like(k);
  at::Tensor dv = at::empty_like(v);
  if (s.batch == 0 || s.rows == 0) {
    dk.zero_();  // no query rows: the keys get no gradient
    dv.zero_();
    return {dq, dk, dv};
  }
  at::Tensor delta = at::empty({s.batch, s.hq, s.lq}, q.options().dtype(at::kFloat));
  const int64_t n_delta = s.batch * s.hq * s.lq;
  const size_t wmma_smem = std::max(dq_wmma_smem(int(s.d)), dkdv_wmma_smem(int(s.d)));
  if (use_wmma(q.scalar_type(), s.d, wmma_smem, {&q, &k, &v, &grad_out, &out, &dq, &dk, &dv})) {
    const int64_t tiles = (s.rows + kTcRows - 1) / kTcRows;
    LOPD_XATTN_CHECK(tiles <= 65535, "too many query rows per kv head (", s.rows, ")");
    const int64_t key_tiles = (max_seqlen_k + kTcKeys - 1) / kTcKeys;
    dispatch_half(q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* qp = reinterpret_cast<const T*>(q.data_ptr());
      const T* kp = reinterpret_cast<const T*>(k.data_ptr());
      const T* vp = reinterpret_cast<const T*>(v.data_ptr());
      const T* dop = reinterpret_cast<const T*>(grad_out.data_ptr());
      const int* cup = cu_seqlens_k.data_ptr<int>();
      auto delta_ = delta_kernel<T>;
      LOPD_LAUNCH(delta_, unsigned((n_delta + kBwdWarps - 1) / kBwdWarps), kBwdWarps * kWarp, 0,
                  dop, reinterpret_cast<const T*>(out.data_ptr()), grad_lse.data_ptr<float>(),
                  delta.data_ptr<float>(), s);
      auto dq_ = dq_wmma_kernel<T>;
      LOPD_LAUNCH(dq_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(tiles)),
                  kTcWarps * kWarp, dq_wmma_smem(int(s.d)), qp, kp, vp, dop, cup,
                  lse.data_ptr<float>(), delta.data_ptr<float>(),
                  reinterpret_cast<T*>(dq.data_ptr()), s);
      if (key_tiles > 0) {
        auto dkdv_ = dkdv_wmma_kernel<T>;
        LOPD_LAUNCH(dkdv_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(key_tiles)),
                    kTcWarps * kWarp, dkdv_wmma_smem(int(s.d)), qp, kp, vp, dop, cup,
                    lse.data_ptr<float>(), delta.data_ptr<float>(),
                    reinterpret_cast<T*>(dk.data_ptr()), reinterpret_cast<T*>(dv.data_ptr()), s);
      }
    });
    return {dq, dk, dv};
  }
  const int warps = row_warps(s);
  const int rpb = warps * kRowsPerWarp;
  const int64_t chunks = (s.rows + rpb - 1) / rpb;
  LOPD_XATTN_CHECK(chunks <= 65535, "too many query rows per kv head (", s.rows, ")");
  const int stride = kv_stride(int(s.d));
  const size_t dq_smem =
      sizeof(float) * (2 * size_t(rpb) * s.d + 2 * kKeyTile * stride + rpb * kKeyTile);
  const size_t dkdv_smem = sizeof(float) * (2 * kKeyTile * stride + 2 * kRowChunk * s.d +
                                            2 * kRowChunk * kKeyTile + 2 * kRowChunk);
  const int64_t key_tiles = (max_seqlen_k + kKeyTile - 1) / kKeyTile;
  dispatch(q.scalar_type(), s.d, [&](auto tag, auto npl) {
    using T = decltype(tag);
    constexpr int NPL = decltype(npl)::value;
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const T* kp = reinterpret_cast<const T*>(k.data_ptr());
    const T* vp = reinterpret_cast<const T*>(v.data_ptr());
    const T* dop = reinterpret_cast<const T*>(grad_out.data_ptr());
    const int* cup = cu_seqlens_k.data_ptr<int>();
    auto dk_ = delta_kernel<T>;
    LOPD_LAUNCH(dk_, unsigned((n_delta + kBwdWarps - 1) / kBwdWarps), kBwdWarps * kWarp, 0, dop,
                reinterpret_cast<const T*>(out.data_ptr()), grad_lse.data_ptr<float>(),
                delta.data_ptr<float>(), s);
    auto dq_ = dq_kernel<T, NPL>;
    LOPD_LAUNCH(dq_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(chunks)), warps * kWarp,
                dq_smem, qp, kp, vp, dop, cup, lse.data_ptr<float>(), delta.data_ptr<float>(),
                reinterpret_cast<T*>(dq.data_ptr()), s);
    if (key_tiles > 0) {
      auto dkdv_ = dkdv_kernel<T, NPL>;
      LOPD_LAUNCH(dkdv_, dim3(unsigned(s.batch), unsigned(s.hkv), unsigned(key_tiles)),
                  kBwdWarps * kWarp, dkdv_smem, qp, kp, vp, dop, cup, lse.data_ptr<float>(),
                  delta.data_ptr<float>(), reinterpret_cast<T*>(dk.data_ptr()),
                  reinterpret_cast<T*>(dv.data_ptr()), s);
    }
  });
  return {dq, dk, dv};
}

#undef LOPD_XATTN_CHECK

}  // namespace
}  // namespace lopd::cuda::varlen_xattn
