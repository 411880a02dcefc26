// exp(x) on a vector of floats for the per-ISA CPU kernels (include from csrc/cpu/isa/ only: it
// uses CPU_CAPABILITY). The streaming kernels evaluate one or two exponentials per element they
// read (topk_tail_kl: four per vocabulary entry over forward and backward), which at ATen's
// Vectorized::exp (SLEEF, 1 ULP, ~30 instructions) makes them compute-bound well below the
// memory bandwidth. This is the textbook reduction, ~14 instructions:
//   n = round(x / ln 2),  r = x - n ln 2 (two-constant Cody-Waite, exact to ~1 ULP of r),
//   exp(r) by a degree-7 polynomial on |r| <= ln(2) / 2 (Cephes' expf coefficients),
//   exp(x) = 2^n exp(r) (AVX-512: vscalefps, which also yields denormals, 0 and inf).
// Error < 1 ULP over the normal range (bounded at 2 against float64 exp by
// tests/kernels/test_topk_tail_kl.py::test_cpu_fast_exp_accuracy); -inf -> 0, +inf and overflow -> inf,
// NaN -> NaN; results below 2^-126 are denormals on AVX-512 and 0 on AVX2. The DEFAULT ISA keeps
// Vectorized::exp.
//
// fast_exp2(y) = 2^y is the cheaper form for a caller that can fold its scaling into one FMA
// (y = x * (log2 e / T) - m log2 e): the reduction to n = round(y), f = y - n is exact in base 2
// (no Cody-Waite constants), and 2^f on |f| <= 1/2 is a degree-6 polynomial (relative error
// 2.0e-9 before float32 rounding, < 1 ULP after). About 11 instructions instead of 16 with the
// scaling; same special values as fast_exp (tests/kernels/test_topk_tail_kl.py::
// test_cpu_fast_exp2_accuracy).
#pragma once

#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace lopd::cpu::CPU_CAPABILITY {

namespace vec_exp_detail {
// Cephes expf: exp(r) ~ 1 + r + r^2 (p0 + r (p1 + r (p2 + r (p3 + r (p4 + r p5))))).
constexpr float kP0 = 5.0000001201e-1f;
constexpr float kP1 = 1.6666665459e-1f;
constexpr float kP2 = 4.1665795894e-2f;
constexpr float kP3 = 8.3334519073e-3f;
constexpr float kP4 = 1.3981999507e-3f;
constexpr float kP5 = 1.9875691500e-4f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
constexpr float kLn2Lo = -2.12194440e-4f;
// 2^f ~ sum_k kE_k f^k on |f| <= 1/2: a near-minimax fit for relative error (Lawson-weighted
// least squares on Chebyshev nodes, kE0 = 1 exactly), |error| <= 2.0e-9.
constexpr float kE1 = 0.6931471824645996f;
constexpr float kE2 = 0.24022647738456726f;
constexpr float kE3 = 0.055503323674201965f;
constexpr float kE4 = 0.00961843691766262f;
constexpr float kE5 = 0.0013398882001638412f;
constexpr float kE6 = 0.00015353501657955348f;

#if defined(CPU_CAPABILITY_AVX2)
// p * 2^n for integral n in [-126, 127] (built from its exponent bits), then 0 where `tiny` and
// inf where `huge` (the lanes whose argument was clamped into that range).
inline __m256 scale_pow2_avx2(__m256 p, __m256 n, __m256 tiny, __m256 huge) {
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  return _mm256_blendv_ps(out, _mm256_set1_ps(__builtin_inff()), huge);
}
#endif
}  // namespace vec_exp_detail

inline at::vec::Vectorized<float> fast_exp(const at::vec::Vectorized<float>& x) {
  namespace d = vec_exp_detail;
#if defined(CPU_CAPABILITY_AVX512)
  // max/min return their second operand when either is NaN: NaN passes through the clamp.
  __m512 v = _mm512_max_ps(_mm512_set1_ps(-104.0f), __m512(x));
  v = _mm512_min_ps(_mm512_set1_ps(89.0f), v);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(d::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(d::kLn2Hi), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(d::kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(d::kP5), r, _mm512_set1_ps(d::kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(d::kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(d::kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(d::kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(d::kP0));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
#elif defined(CPU_CAPABILITY_AVX2)
  // 2^n is built from its exponent bits, valid for n in [-126, 127]: clamp x to that range,
  // flush results below it (exp(x) < 2^-126: denormal) to 0 and those above it to inf.
  const __m256 xv = __m256(x);
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 hi = _mm256_set1_ps(88.37626266f);
  const __m256 tiny = _mm256_cmp_ps(xv, lo, _CMP_LT_OQ);
  const __m256 huge = _mm256_cmp_ps(xv, hi, _CMP_GT_OQ);
  __m256 v = _mm256_max_ps(lo, xv);
  v = _mm256_min_ps(hi, v);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(d::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(d::kLn2Hi), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(d::kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(d::kP5), r, _mm256_set1_ps(d::kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(d::kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(d::kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(d::kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(d::kP0));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  return vec_exp_detail::scale_pow2_avx2(p, n, tiny, huge);
#else
  return x.exp();
#endif
}

inline at::vec::Vectorized<float> fast_exp2(const at::vec::Vectorized<float>& y) {
  namespace d = vec_exp_detail;
#if defined(CPU_CAPABILITY_AVX512)
  // Clamped to [-200, 200]: 2^-200 scales to exactly 0 and 2^200 to inf, and no n is +-inf
  // (inf - inf would be NaN). NaN passes through max/min (second operand) and the polynomial.
  __m512 v = _mm512_max_ps(_mm512_set1_ps(-200.0f), __m512(y));
  v = _mm512_min_ps(_mm512_set1_ps(200.0f), v);
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(d::kE6), f, _mm512_set1_ps(d::kE5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(d::kE4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(d::kE3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(d::kE2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(d::kE1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
#elif defined(CPU_CAPABILITY_AVX2)
  // 2^n from its exponent bits, valid for n in [-126, 127]: flush below (denormal results) to
  // 0 and above to inf, as fast_exp does.
  const __m256 yv = __m256(y);
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 hi = _mm256_set1_ps(127.0f);
  const __m256 tiny = _mm256_cmp_ps(yv, lo, _CMP_LT_OQ);
  const __m256 huge = _mm256_cmp_ps(yv, hi, _CMP_GT_OQ);
  __m256 v = _mm256_max_ps(lo, yv);
  v = _mm256_min_ps(hi, v);
  const __m256 n = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(v, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(d::kE6), f, _mm256_set1_ps(d::kE5));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(d::kE4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(d::kE3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(d::kE2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(d::kE1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return vec_exp_detail::scale_pow2_avx2(p, n, tiny, huge);
#else
  return y.exp2();
#endif
}

}  // namespace lopd::cpu::CPU_CAPABILITY
