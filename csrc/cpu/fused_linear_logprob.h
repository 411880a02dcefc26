// Interface between the fused_linear_logprob CPU op (csrc/cpu/fused_linear_logprob.cpp: checks,
// blocks, GEMMs) and its per-ISA row kernels (csrc/cpu/isa/fused_linear_logprob_kernel.cpp,
// compiled once per ISA). The op forms one float32 logit block [rows, cols] of a token chunk and
// a vocabulary block with a GEMM; the kernels read (and rewrite) it row by row.
#pragma once

#include <cstdint>

#include "cpu/isa_dispatch.h"

namespace lopd::cpu {

// One logit block and what the kernels need to know about its rows.
struct LogprobBlock {
  float* logits;            // [rows, ld] float32, raw GEMM output h W_b^T (no bias, no 1/T)
  int64_t ld;               // row stride of `logits`
  int64_t rows;             // token rows of the chunk
  int64_t cols;             // vocabulary entries of this block
  int64_t v0;               // vocabulary id of column 0
  const float* bias;        // [cols] float32 bias of the block, or nullptr
  const int64_t* targets;   // [rows] the rows' target ids (global, all in [0, V))
  float inv_temperature;
};

// Forward state per row, carried across the vocabulary blocks of a chunk (all relative to the
// running maximum m of the tempered logits z = (x + b) / T): s_ex = sum e^{z - m} and
// s2_ex = sum e^{z - m} (z - m), both over the entries seen so far except the target, whose
// tempered logit is z_a. `scale` receives e^{m_old - m_new} of the block just merged (the factor
// the projection accumulator's row is rescaled by).
struct LogprobRowState {
  float* m;        // [rows], -inf before the first block
  double* s_ex;    // [rows]
  double* s2_ex;   // [rows]
  float* z_a;      // [rows]
  float* scale;    // [rows]
};

// Backward per-row inputs. With u = grad_logprob, v = grad_entropy (nullptr: none), the block is
// overwritten by the logit gradient G = (u (1[j = a] - p_j) - v p_j (log p_j + H)) / T.
struct LogprobRowGrad {
  const float* lse;      // [rows] log-sum-exp of the tempered logits
  const float* logprob;  // [rows] log p_a (forward output)
  const float* grad_logprob;  // [rows]
  const float* grad_entropy;  // [rows] or nullptr
  const float* entropy;       // [rows] or nullptr (with grad_entropy)
};

}  // namespace lopd::cpu

// fwd: folds the block into the row states (the bias added into the block in place). With
// `store_exp` the block is overwritten by e^{z - m_new} with the target entry 0 (the projection's
// GEMM operand). bwd: overwrites the block with G (bias included).
#define LOPD_FUSED_LINEAR_LOGPROB_DECLARE(ISA)                                                 \
  namespace lopd::cpu::ISA {                                                                   \
  void fused_linear_logprob_fwd_block(const ::lopd::cpu::LogprobBlock&,                        \
                                      const ::lopd::cpu::LogprobRowState&, bool with_entropy, \
                                      bool store_exp);                                         \
  void fused_linear_logprob_bwd_block(const ::lopd::cpu::LogprobBlock&,                        \
                                      const ::lopd::cpu::LogprobRowGrad&);                     \
  }
LOPD_FOR_EACH_CPU_ISA(LOPD_FUSED_LINEAR_LOGPROB_DECLARE)
#undef LOPD_FUSED_LINEAR_LOGPROB_DECLARE
