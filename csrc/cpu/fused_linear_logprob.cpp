// CPU implementation of lopd::fused_linear_logprob_cpu_fwd / _bwd (schemas: csrc/common/schemas.h;
// the op and its maths: lopd_kernels/fused_linear_logprob.py, docs/math.md section 6).
//
// The valid rows (target != ignore_index) are taken chunk_size at a time, the vocabulary
// vocab_block entries at a time; per (chunk, block) one float32 logit block h W_b^T is formed by
// a GEMM through ATen (MKL) into one recycled buffer (cpu/buffer_cache.h) and handed to the
// per-ISA row kernels (csrc/cpu/isa/fused_linear_logprob_kernel.cpp). Forward: online log-sum-exp
// across the blocks of a chunk (and, with a projection, A += e^{z - m} W_b with A's rows
// rescaled as m rises). Backward: the block is recomputed, turned into the logit gradient G in
// place, and dh_c += G W_b, dW_b (+)= G^T h_c, db_b += sum_rows G (float32). bf16 / fp16 inputs
// are converted to float32 a chunk of hidden rows and a block of head rows at a time.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu/buffer_cache.h"
#include "cpu/fused_linear_logprob.h"
#include "cpu/isa_dispatch.h"

namespace lopd::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_args(const at::Tensor& hidden, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& targets,
                double temperature) {
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu() && targets.device().is_cpu(),
              "fused_linear_logprob: backend='cpu' needs CPU tensors");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2,
              "fused_linear_logprob: hidden [N, d] and weight [V, d] must be 2-D, got ",
              hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(hidden.size(1) == weight.size(1), "fused_linear_logprob: hidden ", hidden.sizes(),
              " and weight ", weight.sizes(), " disagree on d");
  TORCH_CHECK(weight.size(0) > 0, "fused_linear_logprob: weight has an empty vocabulary");
  const auto dt = hidden.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "fused_linear_logprob: backend='cpu' takes float32, bfloat16 or float16, got ", dt,
              " (float64: backend='torch', the reference)");
  TORCH_CHECK(weight.scalar_type() == dt, "fused_linear_logprob: hidden and weight dtypes differ");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 &&
                  targets.size(0) == hidden.size(0),
              "fused_linear_logprob: targets must be int64 of shape [N] = [", hidden.size(0),
              "], got ", targets.scalar_type(), " ", targets.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                    bias->scalar_type() == dt && bias->device().is_cpu(),
                "fused_linear_logprob: bias must be a CPU [V] tensor of the weight's dtype");
  }
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0,
              "fused_linear_logprob: temperature must be a finite number > 0, got ", temperature);
}

void check_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index) {
  const int64_t* p = targets.data_ptr<int64_t>();
  for (int64_t n = 0; n < targets.numel(); ++n) {
    // ValueError in Python, the message of the Python implementations' check.
    TORCH_CHECK_VALUE(p[n] == ignore_index || (p[n] >= 0 && p[n] < vocab),
                      "fused_linear_logprob: targets[", n, "] = ", p[n], " is outside [0, V=", vocab,
                      ") and is not ignore_index (", ignore_index, ")");
  }
}

// The valid rows and the block shape.
struct Plan {
  at::Tensor rows;  // [R] int64
  int64_t n_valid, chunk, vb;
};

Plan make_plan(const at::Tensor& targets, int64_t ignore_index, int64_t chunk_size,
               int64_t vocab_block, int64_t vocab) {
  Plan p;
  p.rows = targets.ne(ignore_index).nonzero().squeeze(-1).contiguous();
  p.n_valid = p.rows.numel();
  p.chunk = std::max<int64_t>(1, chunk_size > 0 ? std::min(chunk_size, p.n_valid) : p.n_valid);
  p.vb = vocab_block > 0 ? std::min(vocab_block, vocab) : vocab;
  return p;
}

// A [rows, cols] view of a flat buffer.
at::Tensor block_view(const at::Tensor& buf, int64_t rows, int64_t cols) {
  return buf.narrow(0, 0, rows * cols).view({rows, cols});
}

// Whether a bfloat16 head runs its GEMMs in bfloat16 (oneDNN through at::mm, float32
// accumulation, block results rounded to bfloat16, as torch.matmul gives them): on CPUs with
// AVX512-BF16 these are several times faster than float32 GEMMs of upcast operands (measured on an
// AMD EPYC: 126 vs 10 GFLOP/s, benchmarks/bench_fused_linear_logprob.py). Without AVX512-BF16,
// or with LOPD_CPU_ISA below avx512, the operands are upcast instead: float32 logits of the bf16
// operands.
bool native_bf16(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kBFloat16 || ::lopd::cpu_isa() != ::lopd::CpuIsa::kAvx512) {
    return false;
  }
#if defined(__x86_64__)
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  return has_bf16;
#else
  return false;
#endif
}

// The GEMMs of one call: float32 operands (a float32 head as is; a half-precision one upcast a
// chunk of hidden rows and a block of head rows at a time), or bfloat16 ones (native_bf16).
class BlockGemm {
 public:
  BlockGemm(const at::Tensor& weight, int64_t chunk, int64_t vb)
      : weight_(weight), native_(native_bf16(weight)) {
    const auto opts = weight.options();
    if (native_) {
      half_ = empty_recycled({chunk * vb}, opts);
    } else if (weight.scalar_type() != at::kFloat) {
      wbuf_ = at::empty({vb, weight.size(1)}, opts.dtype(at::kFloat));
    }
  }

  // Rows r of the hidden states, contiguous, in the GEMM dtype.
  at::Tensor hidden_rows(const at::Tensor& hidden, const at::Tensor& r) const {
    at::Tensor h = hidden.index_select(0, r);
    return (native_ ? h : h.to(at::kFloat)).contiguous();
  }

  // Head rows [v0, v0 + n) in the GEMM dtype.
  at::Tensor head_block(int64_t v0, int64_t n) {
    at::Tensor blk = weight_.narrow(0, v0, n);
    if (native_ || weight_.scalar_type() == at::kFloat) return blk;
    at::Tensor out = wbuf_.narrow(0, 0, n);
    out.copy_(blk);
    return out;
  }

  // out (float32 [R, n]) = h wb^T.
  void logits(at::Tensor& out, const at::Tensor& h, const at::Tensor& wb) {
    if (!native_) {
      at::mm_out(out, h, wb.t());
      return;
    }
    at::Tensor lh = block_view(half_, out.size(0), out.size(1));
    at::mm_out(lh, h, wb.t());
    out.copy_(lh);
  }

  // A float32 [R, n] block as the left operand of the gradient GEMMs (rounded to bf16 once).
  at::Tensor operand(const at::Tensor& g) {
    if (!native_) return g;
    at::Tensor gh = block_view(half_, g.size(0), g.size(1));
    gh.copy_(g);
    return gh;
  }

  // out (float32) = / += a @ b.
  static void into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
    if (a.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat) {
      if (accumulate) {
        out.addmm_(a, b);
      } else {
        at::mm_out(out, a, b);
      }
    } else if (accumulate) {
      out.add_(at::mm(a, b));
    } else if (out.scalar_type() == a.scalar_type()) {
      at::mm_out(out, a, b);
    } else {
      out.copy_(at::mm(a, b));
    }
  }

 private:
  at::Tensor weight_;
  bool native_;
  at::Tensor half_, wbuf_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_logprob_fwd_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& targets_in, double temperature, int64_t ignore_index, bool with_entropy,
    bool projection, int64_t chunk_size, int64_t vocab_block) {
  check_args(hidden, weight, bias, targets_in, temperature);
  const at::Tensor targets = targets_in.contiguous();
  const int64_t n = hidden.size(0), d = hidden.size(1), vocab = weight.size(0);
  check_targets(targets, vocab, ignore_index);
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor logprob = at::zeros({n}, f32);
  at::Tensor entropy = at::zeros({with_entropy ? n : 0}, f32);
  at::Tensor lse = at::zeros({n}, f32);
  at::Tensor proj = projection ? at::zeros_like(hidden, at::MemoryFormat::Contiguous)
                               : at::empty({0}, hidden.options());
  const Plan plan = make_plan(targets, ignore_index, chunk_size, vocab_block, vocab);
  if (plan.n_valid == 0) return {logprob, entropy, lse, proj};

  const float inv = static_cast<float>(1.0 / temperature);
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor buf = empty_recycled({plan.chunk * plan.vb}, f32);
  BlockGemm gemm(weight, plan.chunk, plan.vb);
  at::Tensor m = at::empty({plan.chunk}, f32), z_a = at::empty({plan.chunk}, f32);
  at::Tensor scale = at::empty({plan.chunk}, f32);
  at::Tensor s_ex = at::empty({plan.chunk}, f32.dtype(at::kDouble));
  at::Tensor s2_ex = at::empty_like(s_ex);
  float* lp_out = logprob.data_ptr<float>();
  float* lse_out = lse.data_ptr<float>();
  float* ent_out = with_entropy ? entropy.data_ptr<float>() : nullptr;
  const int64_t* rows_p = plan.rows.data_ptr<int64_t>();

  for (int64_t c0 = 0; c0 < plan.n_valid; c0 += plan.chunk) {
    const int64_t nr = std::min(plan.chunk, plan.n_valid - c0);
    const at::Tensor r = plan.rows.narrow(0, c0, nr);
    const at::Tensor h = gemm.hidden_rows(hidden, r);
    const at::Tensor tgt = targets.index_select(0, r).contiguous();
    m.fill_(kNegInf);
    z_a.fill_(kNegInf);
    s_ex.zero_();
    s2_ex.zero_();
    at::Tensor acc = projection ? at::zeros({nr, d}, f32) : at::Tensor();
    const LogprobRowState st{m.data_ptr<float>(), s_ex.data_ptr<double>(),
                             s2_ex.data_ptr<double>(), z_a.data_ptr<float>(),
                             scale.data_ptr<float>()};
    for (int64_t v0 = 0; v0 < vocab; v0 += plan.vb) {
      const int64_t cols = std::min(plan.vb, vocab - v0);
      const at::Tensor wb = gemm.head_block(v0, cols);
      at::Tensor logits = block_view(buf, nr, cols);
      gemm.logits(logits, h, wb);
      const LogprobBlock blk{logits.data_ptr<float>(), cols, nr, cols, v0,
                             bias_f32.defined() ? bias_f32.data_ptr<float>() + v0 : nullptr,
                             tgt.data_ptr<int64_t>(), inv};
      LOPD_CPU_ISA_CALL(fused_linear_logprob_fwd_block, blk, st, with_entropy, projection);
      if (projection) {
        acc.mul_(scale.narrow(0, 0, nr).unsqueeze(1));
        BlockGemm::into(acc, gemm.operand(logits), wb, true);
      }
    }
    // Per row: lse = m + log S, S = S_ex + e^{z_a - m}; log p_a = -log1p(S_ex e^{m - z_a}).
    at::Tensor coef_a, coef_acc;
    if (projection) {
      coef_a = at::empty({nr}, f32);
      coef_acc = at::empty({nr}, f32);
    }
    for (int64_t i = 0; i < nr; ++i) {
      const double mi = st.m[i], za = st.z_a[i];
      const double d_a = za - mi;
      const double e_a = za == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(d_a);
      const double total = st.s_ex[i] + e_a;
      const double log_total = std::log(total);
      const double lp = d_a > -30.0 ? -std::log1p(st.s_ex[i] * std::exp(-d_a)) : d_a - log_total;
      const int64_t row = rows_p[c0 + i];
      lp_out[row] = static_cast<float>(lp);
      lse_out[row] = static_cast<float>(mi + log_total);
      if (ent_out != nullptr) {
        const double mean = (st.s2_ex[i] + (e_a > 0.0 ? e_a * d_a : 0.0)) / total;
        ent_out[row] = static_cast<float>(log_total - mean);
      }
      if (projection) {  // P = (S_ex W_a - A) / (S T)
        coef_a.data_ptr<float>()[i] = static_cast<float>(st.s_ex[i] / total * inv);
        coef_acc.data_ptr<float>()[i] = static_cast<float>(-inv / total);
      }
    }
    if (projection) {
      at::Tensor p = weight.index_select(0, tgt).to(at::kFloat).mul_(coef_a.unsqueeze(1));
      p.add_(acc.mul_(coef_acc.unsqueeze(1)));
      proj.index_copy_(0, r, p.to(proj.scalar_type()));
    }
  }
  return {logprob, entropy, lse, proj};
}

std::vector<at::Tensor> fused_linear_logprob_bwd_cpu(
    const at::Tensor& grad_logprob, const at::Tensor& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& targets_in,
    const at::Tensor& logprob, const at::Tensor& entropy, const at::Tensor& lse,
    const at::Tensor& proj, double temperature, int64_t ignore_index, int64_t chunk_size,
    int64_t vocab_block, c10::List<bool> needs) {
  TORCH_CHECK(needs.size() == 3, "fused_linear_logprob: needs must have 3 entries");
  const bool need_h = needs.get(0), need_w = needs.get(1), need_b = needs.get(2);
  const auto none = lse.options().dtype(at::kFloat);
  if (proj.numel() > 0) {  // frozen head: d_hidden = grad_logprob * P (0 at ignored rows)
    // Out of place: proj is the forward's saved output (and .to() of a float32 proj is proj).
    at::Tensor dh = need_h ? at::mul(proj.to(at::kFloat), grad_logprob.to(at::kFloat).unsqueeze(1))
                                 .to(proj.scalar_type())
                           : at::empty({0}, none);
    return {dh, at::empty({0}, none), at::empty({0}, none)};
  }
  check_args(hidden, weight, bias, targets_in, temperature);
  const at::Tensor targets = targets_in.contiguous();
  const int64_t d = hidden.size(1), vocab = weight.size(0);
  check_targets(targets, vocab, ignore_index);
  const auto f32 = hidden.options().dtype(at::kFloat);
  const Plan plan = make_plan(targets, ignore_index, chunk_size, vocab_block, vocab);
  const bool w_f32 = weight.scalar_type() == at::kFloat;
  const int64_t n_chunks = (plan.n_valid + plan.chunk - 1) / plan.chunk;
  at::Tensor dh = need_h ? at::zeros({hidden.size(0), d}, f32) : at::Tensor();
  at::Tensor db = need_b ? at::zeros({vocab}, f32) : at::Tensor();
  // The weight gradient: written by the first chunk's GEMMs (beta = 0), accumulated by later
  // ones; a half-precision head with one chunk gets each block written in its dtype.
  at::Tensor dw, dw32;
  if (need_w) {
    if (plan.n_valid == 0) {
      dw32 = at::zeros({vocab, d}, f32);
    } else if (w_f32 || n_chunks > 1) {
      dw32 = at::empty({vocab, d}, f32);
    } else {
      dw = at::empty({vocab, d}, weight.options());
    }
  }
  if (plan.n_valid > 0 && (need_h || need_w || need_b)) {
    const float inv = static_cast<float>(1.0 / temperature);
    const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor buf = empty_recycled({plan.chunk * plan.vb}, f32);
    BlockGemm gemm(weight, plan.chunk, plan.vb);
    const at::Tensor u = grad_logprob.to(at::kFloat).contiguous();
    const bool with_v = grad_entropy.numel() > 0;
    const at::Tensor v = with_v ? grad_entropy.to(at::kFloat).contiguous() : at::Tensor();
    for (int64_t c0 = 0; c0 < plan.n_valid; c0 += plan.chunk) {
      const int64_t nr = std::min(plan.chunk, plan.n_valid - c0);
      const at::Tensor r = plan.rows.narrow(0, c0, nr);
      const at::Tensor h = gemm.hidden_rows(hidden, r);
      const at::Tensor tgt = targets.index_select(0, r).contiguous();
      const at::Tensor u_r = u.index_select(0, r).contiguous();
      const at::Tensor lse_r = lse.index_select(0, r).contiguous();
      const at::Tensor lp_r = logprob.index_select(0, r).contiguous();
      at::Tensor v_r, ent_r;
      if (with_v) {
        v_r = v.index_select(0, r).contiguous();
        ent_r = entropy.index_select(0, r).contiguous();
      }
      const LogprobRowGrad rg{lse_r.data_ptr<float>(), lp_r.data_ptr<float>(),
                              u_r.data_ptr<float>(), with_v ? v_r.data_ptr<float>() : nullptr,
                              with_v ? ent_r.data_ptr<float>() : nullptr};
      at::Tensor dh_c = need_h ? at::empty({nr, d}, f32) : at::Tensor();
      for (int64_t v0 = 0; v0 < vocab; v0 += plan.vb) {
        const int64_t cols = std::min(plan.vb, vocab - v0);
        const at::Tensor wb = gemm.head_block(v0, cols);
        at::Tensor g = block_view(buf, nr, cols);
        gemm.logits(g, h, wb);
        const LogprobBlock blk{g.data_ptr<float>(), cols, nr, cols, v0,
                               bias_f32.defined() ? bias_f32.data_ptr<float>() + v0 : nullptr,
                               tgt.data_ptr<int64_t>(), inv};
        LOPD_CPU_ISA_CALL(fused_linear_logprob_bwd_block, blk, rg);
        const at::Tensor op = gemm.operand(g);
        if (need_h) BlockGemm::into(dh_c, op, wb, v0 > 0);
        if (need_w) {
          at::Tensor dst = dw32.defined() ? dw32.narrow(0, v0, cols) : dw.narrow(0, v0, cols);
          BlockGemm::into(dst, op.t(), h, c0 > 0);
        }
        if (need_b) db.narrow(0, v0, cols).add_(g.sum(0));
      }
      if (need_h) dh.index_copy_(0, r, dh_c);
    }
  }
  if (need_w && !dw.defined()) dw = w_f32 ? dw32 : dw32.to(weight.scalar_type());
  return {need_h ? dh.to(hidden.scalar_type()) : at::empty({0}, none),
          need_w ? dw : at::empty({0}, none),
          need_b ? db.to(weight.scalar_type()) : at::empty({0}, none)};
}

}  // namespace
}  // namespace lopd::cpu

TORCH_LIBRARY_IMPL(lopd, CPU, m) {
  m.impl("fused_linear_logprob_cpu_fwd", &lopd::cpu::fused_linear_logprob_fwd_cpu);
  m.impl("fused_linear_logprob_cpu_bwd", &lopd::cpu::fused_linear_logprob_bwd_cpu);
}
