// Per-row math of the top-M + tail-bucket KL (lopd::topk_tail_kl_*), shared by the C++ CPU kernel
// and the CUDA kernel so both evaluate exactly the same float32 arithmetic. Derivations and
// notation: docs/math.md (sections 1 and 2).
//
// Everything here is scalar float32 and free of dynamic allocation. `-inf` logits (masked or padded
// vocabulary entries) are legal input: every function below maps a zero-mass bucket to a zero
// contribution instead of producing `0 * inf = NaN`.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define LOPD_HOST_DEVICE __host__ __device__
#else
#define LOPD_HOST_DEVICE
#endif

namespace lopd::topk_tail_kl {

#define LOPD_NEG_INF (-INFINITY)

// The divergence a kernel computes (docs/math.md, sections 1 and 1b): KL(P || Q) (reverse),
// KL(Q || P) (forward), or TRL's generalized JSD beta KL(Q || M) + (1 - beta) KL(P || M) with
// M = (1 - beta) P + beta Q, 0 < beta < 1 (the ends are the forward / reverse KL: parsed so).
enum DivergenceKind : int { kReverse = 0, kForward = 1, kJsd = 2 };
struct DivergenceSpec {
  DivergenceKind kind;
  float beta;  // the JSD's (1 for reverse, 0 for forward)
};

// Whose top-M ids get their own bucket: the teacher's, the student's, or both (up to 2M ids).
enum Support : int { kSupportTeacher = 0, kSupportStudent = 1, kSupportUnion = 2 };

// Where row r of the logits starts, in elements: [N, V] logits with any row stride (one item
// of N rows), or [B, L, V] with any item and position strides (logits[:, :-1] of a causal LM,
// which no [N, V] view covers), read in place. The vocabulary axis is always dense.
struct RowLayout {
  int64_t per_item;     // rows per item (L; N for [N, V])
  int64_t item_stride;  // 0 for [N, V]
  int64_t row_stride;
  LOPD_HOST_DEVICE int64_t offset(int64_t row) const {
    return (row / per_item) * item_stride + (row % per_item) * row_stride;
  }
};

// ---------------------------------------------------------------------------------------------
// Online log-sum-exp. A state (max, sum) represents max + log(sum); an empty set is (-inf, 0).
// `sum` is always relative to `max`, so no term ever overflows, and a state whose max is -inf
// holds exactly zero mass whatever `sum` says.
// ---------------------------------------------------------------------------------------------
struct LseState {
  float max;
  float sum;
};

LOPD_HOST_DEVICE inline LseState lse_empty() { return LseState{LOPD_NEG_INF, 0.0f}; }

// Adds exp(x). x == -inf adds nothing (and must not reach `x - max`, which would be NaN when the
// state is still empty).
LOPD_HOST_DEVICE inline void lse_add(LseState& st, float x) {
  if (x == LOPD_NEG_INF) return;
  if (x > st.max) {
    // exp(-inf - x) == 0 when the state was empty: the old (zero) sum stays zero.
    st.sum = st.sum * expf(st.max - x) + 1.0f;
    st.max = x;
  } else {
    st.sum += expf(x - st.max);
  }
}

// Merges a partial state (other_max, other_sum), e.g. one L1 block's masked max and its sum of
// exp(x - other_max). Either side may be empty.
LOPD_HOST_DEVICE inline void lse_merge(LseState& st, float other_max, float other_sum) {
  if (other_max == LOPD_NEG_INF) return;
  if (st.max == LOPD_NEG_INF) {
    st.max = other_max;
    st.sum = other_sum;
    return;
  }
  if (other_max > st.max) {
    st.sum = st.sum * expf(st.max - other_max) + other_sum;
    st.max = other_max;
  } else {
    st.sum += other_sum * expf(other_max - st.max);
  }
}

LOPD_HOST_DEVICE inline float lse_value(const LseState& st) {
  return st.max == LOPD_NEG_INF ? LOPD_NEG_INF : st.max + logf(st.sum);
}

// x - lse with -inf safety: a row (or set) of zero total mass gives -inf log-probabilities, never
// NaN from (-inf) - (-inf).
LOPD_HOST_DEVICE inline float log_normalize(float x, float lse) {
  return lse == LOPD_NEG_INF ? LOPD_NEG_INF : x - lse;
}

// ---------------------------------------------------------------------------------------------
// Buckets. logp = log P_b (student), logq = log Q_b (teacher).
// ---------------------------------------------------------------------------------------------

// One bucket's contribution to the divergence. Reverse: P_b (log P_b - log Q_b); forward:
// Q_b (log Q_b - log P_b). The weighting bucket with zero mass contributes exactly 0; one with
// mass against a zero-mass bucket contributes +inf, also when its own mass underflows float32
// (a finite log-mass below -104: exp gives 0, and 0 * inf would be NaN).
LOPD_HOST_DEVICE inline float bucket_kl_term(float logp, float logq, bool reverse) {
  const float log_w = reverse ? logp : logq;  // the weighting side
  const float log_o = reverse ? logq : logp;
  if (log_w == LOPD_NEG_INF) return 0.0f;
  if (log_o == LOPD_NEG_INF) return INFINITY;
  return expf(log_w) * (log_w - log_o);
}

// Per-bucket gradient factors. For vocabulary entry j in bucket b, on either side x (student s
// or teacher t), with w_j = exp(x_j / T - lse_b(x)) the entry's share of its bucket's mass on that
// side (1 for a top-M entry, X_j / X_tail for a tail entry):
//   d(u_kl KL + u_ls student_logprob + u_lt teacher_logprob) / dx_j
//       = (w_j * k_x + u_lx * 1[j = a]) / T.
// From math.md with S_j = w_j P_b and T_j = w_j Q_b:
//   reverse: k_s = P_b (u_kl (g_b - KL) - u_ls),      k_t = Q_b (u_kl - u_lt) - u_kl P_b
//   forward: k_s = P_b (u_kl - u_ls) - u_kl Q_b,      k_t = Q_b (u_kl (h_b - F) - u_lt)
// The ratios Q_b / P_b and P_b / Q_b of math.md only ever appear multiplied by P_b (Q_b) here, so
// every factor is a bucket mass in [0, 1] times a finite number: no overflow however lopsided
// the two distributions are (a bucket one side gives e^-100 of the other's mass). A zero-mass
// bucket's log-ratio term is dropped (0, not 0 * inf).
LOPD_HOST_DEVICE inline void bucket_grad_factors(float logp, float logq, float kl, bool reverse,
                                                 float u_kl, float u_ls, float u_lt, float* k_s,
                                                 float* k_t) {
  const float p = expf(logp);  // exactly 0 for -inf
  const float q = expf(logq);
  if (reverse) {
    *k_s = logp == LOPD_NEG_INF ? 0.0f : p * (u_kl * ((logp - logq) - kl) - u_ls);
    *k_t = q * (u_kl - u_lt) - u_kl * p;
  } else {
    *k_s = p * (u_kl - u_ls) - u_kl * q;
    *k_t = logq == LOPD_NEG_INF ? 0.0f : q * (u_kl * ((logq - logp) - kl) - u_lt);
  }
}

// log of a bucket's own mass on one side, lse_b = lse + log_mass, for the shares w_j. A bucket
// without mass gives +inf, so that every share exp(x_j / T - lse_b) is 0 rather than NaN.
LOPD_HOST_DEVICE inline float bucket_lse(float lse, float log_mass) {
  return (log_mass == LOPD_NEG_INF || lse == LOPD_NEG_INF) ? INFINITY : lse + log_mass;
}

// One entry's gradient: (share * k + u_lp * 1[j = a]) / temperature.
LOPD_HOST_DEVICE inline float entry_grad(float share, float k, float u_lp, bool is_target,
                                         float inv_temperature) {
  return (share * k + (is_target ? u_lp : 0.0f)) * inv_temperature;
}

// Finishes a top-M row. Inputs: the selected entries' scaled logits s_top[i], t_top[i]
// (i < m) and the running tail states over the complement of the selection. Writes
// logp[0..m] and logq[0..m] (index m is the tail bucket), the full log-sum-exps, and returns
// the divergence. lse_s = logaddexp(lse(s_top), tail_s) is a sum of non-negative masses: the
// tail is never recovered as `1 - sum(top)`.
LOPD_HOST_DEVICE inline float topk_row_finalize(const float* s_top, const float* t_top,
                                                int64_t m, const LseState& tail_s,
                                                const LseState& tail_t, bool reverse,
                                                float* logp, float* logq, float* lse_s_out,
                                                float* lse_t_out) {
  LseState all_s = tail_s;
  LseState all_t = tail_t;
  for (int64_t i = 0; i < m; ++i) {
    lse_add(all_s, s_top[i]);
    lse_add(all_t, t_top[i]);
  }
  const float lse_s = lse_value(all_s);
  const float lse_t = lse_value(all_t);
  float kl = 0.0f;
  for (int64_t i = 0; i < m; ++i) {
    logp[i] = log_normalize(s_top[i], lse_s);
    logq[i] = log_normalize(t_top[i], lse_t);
    kl += bucket_kl_term(logp[i], logq[i], reverse);
  }
  logp[m] = log_normalize(lse_value(tail_s), lse_s);
  logq[m] = log_normalize(lse_value(tail_t), lse_t);
  kl += bucket_kl_term(logp[m], logq[m], reverse);
  *lse_s_out = lse_s;
  *lse_t_out = lse_t;
  return kl;
}

// ---------------------------------------------------------------------------------------------
// Generalized JSD (docs/math.md, section 1b): M_b = (1 - beta) P_b + beta Q_b,
// JSD = beta KL(Q || M) + (1 - beta) KL(P || M), 0 < beta < 1. Every term is a mass times a
// bounded log-ratio (log P_b - log M_b <= -log(1 - beta)): finite for any buckets.
// ---------------------------------------------------------------------------------------------

// log M_b from the two log-masses; -inf when both are -inf.
LOPD_HOST_DEVICE inline float jsd_log_mixture(float logp, float logq, float beta) {
  const float a = logp == LOPD_NEG_INF ? LOPD_NEG_INF : logp + log1pf(-beta);
  const float b = logq == LOPD_NEG_INF ? LOPD_NEG_INF : logq + logf(beta);
  const float hi = fmaxf(a, b);
  if (hi == LOPD_NEG_INF) return LOPD_NEG_INF;
  return hi + log1pf(expf(fminf(a, b) - hi));
}

// X_b (log X_b - log M_b): one bucket's share of KL(X || M); 0 when X_b = 0.
LOPD_HOST_DEVICE inline float kl_to_mixture_term(float logx, float logm) {
  return logx == LOPD_NEG_INF ? 0.0f : expf(logx) * (logx - logm);
}

// One bucket's JSD term: beta Q_b (log Q_b - log M_b) + (1 - beta) P_b (log P_b - log M_b).
LOPD_HOST_DEVICE inline float bucket_jsd_term(float logp, float logq, float beta) {
  const float logm = jsd_log_mixture(logp, logq, beta);
  return beta * kl_to_mixture_term(logq, logm) + (1.0f - beta) * kl_to_mixture_term(logp, logm);
}

// One bucket's contribution to the divergence of `div` (the KLs: bucket_kl_term, unchanged).
LOPD_HOST_DEVICE inline float bucket_divergence_term(float logp, float logq,
                                                     const DivergenceSpec& div) {
  if (div.kind == kJsd) return bucket_jsd_term(logp, logq, div.beta);
  return bucket_kl_term(logp, logq, div.kind == kReverse);
}

// K_P = KL(P || M) and K_Q = KL(Q || M) over nb buckets (what the JSD backward needs besides the
// bucket masses; the forward's JSD is beta K_Q + (1 - beta) K_P).
LOPD_HOST_DEVICE inline void jsd_mixture_kls(const float* logp, const float* logq, int64_t nb,
                                             float beta, float* k_p, float* k_q) {
  float kp = 0.0f, kq = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const float logm = jsd_log_mixture(logp[b], logq[b], beta);
    kp += kl_to_mixture_term(logp[b], logm);
    kq += kl_to_mixture_term(logq[b], logm);
  }
  *k_p = kp;
  *k_q = kq;
}

// The JSD's per-bucket gradient factors, in the form of bucket_grad_factors (per entry
// (w_j k + u 1[j = a]) / T, w_j the entry's share of its bucket on that side):
//   k_s = P_b (u_kl (1 - beta) (log P_b - log M_b - K_P) - u_ls)
//   k_t = Q_b (u_kl beta (log Q_b - log M_b - K_Q) - u_lt)
// A side without mass in the bucket gets 0 (not 0 * -inf).
LOPD_HOST_DEVICE inline void bucket_grad_factors_jsd(float logp, float logq, float beta,
                                                     float k_p, float k_q, float u_kl, float u_ls,
                                                     float u_lt, float* k_s, float* k_t) {
  const float logm = jsd_log_mixture(logp, logq, beta);
  *k_s = logp == LOPD_NEG_INF
             ? 0.0f
             : expf(logp) * (u_kl * (1.0f - beta) * ((logp - logm) - k_p) - u_ls);
  *k_t = logq == LOPD_NEG_INF ? 0.0f
                              : expf(logq) * (u_kl * beta * ((logq - logm) - k_q) - u_lt);
}

// bucket_grad_factors for any divergence; k_p, k_q: jsd_mixture_kls of the row (JSD only).
LOPD_HOST_DEVICE inline void bucket_grad_factors_div(float logp, float logq, float kl,
                                                     const DivergenceSpec& div, float k_p,
                                                     float k_q, float u_kl, float u_ls,
                                                     float u_lt, float* k_s, float* k_t) {
  if (div.kind == kJsd) {
    bucket_grad_factors_jsd(logp, logq, div.beta, k_p, k_q, u_kl, u_ls, u_lt, k_s, k_t);
  } else {
    bucket_grad_factors(logp, logq, kl, div.kind == kReverse, u_kl, u_ls, u_lt, k_s, k_t);
  }
}

// topk_row_finalize for any divergence and support: s_top[i], t_top[i] (i < k) are the scaled
// logits of the row's bucket ids in topk_ids order, -inf at a union's padding slots (mass 0 on
// both sides: log-mass -inf, no contribution); the KLs take topk_row_finalize itself (their bits
// are unchanged).
LOPD_HOST_DEVICE inline float row_finalize(const float* s_top, const float* t_top, int64_t k,
                                           const LseState& tail_s, const LseState& tail_t,
                                           const DivergenceSpec& div, float* logp, float* logq,
                                           float* lse_s_out, float* lse_t_out) {
  if (div.kind != kJsd) {
    return topk_row_finalize(s_top, t_top, k, tail_s, tail_t, div.kind == kReverse, logp, logq,
                             lse_s_out, lse_t_out);
  }
  // The same buckets (the reverse KL's value is discarded), then the JSD over them.
  topk_row_finalize(s_top, t_top, k, tail_s, tail_t, true, logp, logq, lse_s_out, lse_t_out);
  float jsd = 0.0f;
  for (int64_t i = 0; i <= k; ++i) jsd += bucket_jsd_term(logp[i], logq[i], div.beta);
  return jsd;
}

// ---------------------------------------------------------------------------------------------
// Full-vocabulary mode (top_m == 0): every entry is its own bucket, computed in one pass.
// With w the weighting side (student for reverse KL, teacher for forward) and o the other side,
//   KL = sum_j W_j (log W_j - log O_j) = A / Z_w - log Z_w + log Z_o,
//   A  = sum_j exp(w_j - m_w) ((w_j - m_w) - (o_j - m_o)),  Z = sum_j exp(x_j - m_x).
// A is kept relative to the running maxima, so its terms stay small and merging two partial
// states (a running one and one L1 block's) needs only the shifts of both maxima.
// ---------------------------------------------------------------------------------------------
struct FullKLState {
  float max_w, sum_w;  // online lse of the weighting side
  float max_o, sum_o;  // online lse of the other side
  float a;             // A above, relative to (max_w, max_o)
};

LOPD_HOST_DEVICE inline FullKLState full_kl_empty() {
  return FullKLState{LOPD_NEG_INF, 0.0f, LOPD_NEG_INF, 0.0f, 0.0f};
}

// Re-expresses a partial state relative to new maxima (new_max_w >= st.max_w,
// new_max_o >= st.max_o). A part with no weighting mass stays (0, 0).
LOPD_HOST_DEVICE inline void full_kl_rebase(FullKLState& st, float new_max_w, float new_max_o) {
  // Shifts of equal maxima are 0, also when both are -inf (no NaN from -inf - -inf).
  const float d_w = st.max_w == new_max_w ? 0.0f : st.max_w - new_max_w;
  const float d_o = st.max_o == new_max_o ? 0.0f : st.max_o - new_max_o;
  if (st.max_w != LOPD_NEG_INF) {
    const float r = expf(d_w);
    // A' = sum exp(w - M_w) ((w - M_w) - (o - M_o)) = r (A + Z_w ((m_w - M_w) - (m_o - M_o))).
    st.a = r * (st.a + st.sum_w * (d_w - d_o));
    st.sum_w *= r;
  }
  st.sum_o *= expf(d_o);
  st.max_w = new_max_w;
  st.max_o = new_max_o;
}

LOPD_HOST_DEVICE inline void full_kl_merge(FullKLState& st, FullKLState part) {
  const float mw = fmaxf(st.max_w, part.max_w);
  const float mo = fmaxf(st.max_o, part.max_o);
  full_kl_rebase(st, mw, mo);
  full_kl_rebase(part, mw, mo);
  st.sum_w += part.sum_w;
  st.sum_o += part.sum_o;
  st.a += part.a;
}

// Adds one entry (w, o) to a state (scalar remainder loops and the CUDA kernel).
LOPD_HOST_DEVICE inline void full_kl_add(FullKLState& st, float w, float o) {
  FullKLState one = full_kl_empty();
  if (w != LOPD_NEG_INF) {
    one.max_w = w;
    one.sum_w = 1.0f;
    // Relative to its own maxima the entry's difference term is 0; an entry with weighting mass
    // where the other side has none is a true infinite divergence.
    one.a = (o == LOPD_NEG_INF) ? INFINITY : 0.0f;
  }
  if (o != LOPD_NEG_INF) {
    one.max_o = o;
    one.sum_o = 1.0f;
  }
  full_kl_merge(st, one);
}

// Returns the divergence and writes lse_w, lse_o.
LOPD_HOST_DEVICE inline float full_kl_finalize(const FullKLState& st, float* lse_w,
                                               float* lse_o) {
  *lse_w = lse_value(LseState{st.max_w, st.sum_w});
  *lse_o = lse_value(LseState{st.max_o, st.sum_o});
  if (st.max_w == LOPD_NEG_INF) return 0.0f;
  return st.a / st.sum_w - logf(st.sum_w) + logf(st.sum_o);
}

}  // namespace lopd::topk_tail_kl
