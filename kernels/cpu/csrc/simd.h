// One float32 vector type and the few operations the kernels' vector bodies use, for the widest
// instruction set the build targets:
//
//   AVX-512          vf = __m512, 16 lanes, 32 registers, masks are __mmask16
//   AVX2 + FMA       vf = __m256,  8 lanes, 16 registers, masks are all-ones lanes of a __m256
//
// DELTASERVE_SIMD is 512 or 256 then; with neither (a generic build) it is undefined and the
// kernels keep their portable loops. bfloat16 is widened by a shift (its bits are float32's
// high half), so no avx512_bf16 is needed.
#pragma once

#if defined(__AVX512F__)
#define DELTASERVE_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define DELTASERVE_SIMD 256
#endif

#if defined(DELTASERVE_SIMD)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace deltaserve_cpu {
namespace simd {

#if DELTASERVE_SIMD == 512
using vf = __m512;
using vi = __m512i;
using mask = __mmask16;
constexpr int kLanes = 16;
constexpr int kRegs = 32;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float v) { return _mm512_set1_ps(v); }
inline vf load(const float* p) { return _mm512_load_ps(p); }       // 64-byte aligned
inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vf v) { _mm512_store_ps(p, v); }
inline void storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf loadu(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::BFloat16* p) {                               // 32-byte aligned
  const __m256i raw = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline mask lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline mask gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline mask ge(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline mask eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline mask is_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline mask mask_or(mask a, mask b) { return a | b; }
inline bool any(mask m) { return m != 0; }
inline vf select(mask m, vf if_false, vf if_true) {
  return _mm512_mask_mov_ps(if_false, m, if_true);
}
inline vf zero_unless(mask m, vf v) { return _mm512_maskz_mov_ps(m, v); }
// lanes l < n (n <= 0: none)
inline mask first(int64_t n) {
  return n >= kLanes ? static_cast<mask>(0xFFFF)
                     : n <= 0 ? static_cast<mask>(0) : static_cast<mask>((1u << n) - 1);
}
// p[0 .. n) in the first lanes, `fill` in the rest (nothing past p + n is read)
inline vf loadu_first(const float* p, int64_t n, vf fill) {
  return _mm512_mask_loadu_ps(fill, first(n), p);
}
inline void storeu_first(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float first_lane(vf v) { return _mm512_cvtss_f32(v); }
inline vi iota() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
inline vi set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline vi add_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi select_i(mask m, vi if_false, vi if_true) {
  return _mm512_mask_mov_epi32(if_false, m, if_true);
}
inline void storeu_i(int32_t* p, vi v) { _mm512_storeu_si512(p, v); }
// round(x) and x * 2^k for integral k
inline vf round(vf x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vf scale_pow2(vf p, vf k) { return _mm512_scalef_ps(p, k); }

#else  // AVX2 + FMA
using vf = __m256;
using vi = __m256i;
using mask = __m256;
constexpr int kLanes = 8;
constexpr int kRegs = 16;

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float v) { return _mm256_set1_ps(v); }
inline vf load(const float* p) { return _mm256_load_ps(p); }       // 32-byte aligned
inline vf loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vf v) { _mm256_store_ps(p, v); }
inline void storeu(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf loadu(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::BFloat16* p) {                               // 16-byte aligned
  const __m128i raw = _mm_load_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline mask lt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline mask gt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline mask ge(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline mask eq(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline mask is_nan(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline mask mask_or(mask a, mask b) { return _mm256_or_ps(a, b); }
inline bool any(mask m) { return _mm256_movemask_ps(m) != 0; }
inline vf select(mask m, vf if_false, vf if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
inline vf zero_unless(mask m, vf v) { return _mm256_and_ps(m, v); }
inline vi iota() { return _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0); }
inline mask first(int64_t n) {
  const int32_t c = n >= kLanes ? kLanes : n <= 0 ? 0 : static_cast<int32_t>(n);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), iota()));
}
inline vf loadu_first(const float* p, int64_t n, vf fill) {
  const mask m = first(n);
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, _mm256_castps_si256(m)), m);
}
inline void storeu_first(float* p, vf v, int64_t n) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(first(n)), v);
}
inline float reduce_max(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float first_lane(vf v) { return _mm256_cvtss_f32(v); }
inline vi set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline vi add_i(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi select_i(mask m, vi if_false, vi if_true) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false),
                                              _mm256_castsi256_ps(if_true), m));
}
inline void storeu_i(int32_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vf round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^k for integral k in [-126, 127]: 2^k built in the exponent bits (exp_core's range)
inline vf scale_pow2(vf p, vf k) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// e^x lane-wise for -87 <= x <= 0: x = k ln2 + f with |f| <= ln2/2, e^f by a degree-5 minimax
// polynomial (relative error 7.5e-8 on the interval, found by Remez exchange), times 2^k.
// Relative error at most 2.2e-7 in float32 (the degree-7 Taylor one it replaced: 1e-7); two
// FMAs fewer made the log-sum-exp pass 8-11% faster on emulated AVX2.
inline vf exp_core(vf x) {
#if DELTASERVE_SIMD == 512
  const vf k = round(mul(x, set1(1.44269504088896341f)));
#else
  // Adding 1.5 * 2^23 rounds x / ln2 to the nearest integer k, which then sits in t's low
  // mantissa bits: two instructions for AVX2's round (two uops) and the float->int conversion.
  const vf magic = set1(12582912.0f);
  const vf t = fmadd(x, set1(1.44269504088896341f), magic);
  const vf k = sub(t, magic);
#endif
  vf f = fnmadd(k, set1(0.693145751953125f), x);
  f = fnmadd(k, set1(1.428606765330187e-06f), f);
  vf p = set1(8.297654800e-03f);
  p = fmadd(p, f, set1(4.191538319e-02f));
  p = fmadd(p, f, set1(1.666757464e-01f));
  p = fmadd(p, f, set1(4.999889433e-01f));
  p = fmadd(p, f, set1(9.999997020e-01f));
  p = fmadd(p, f, set1(1.000000119e+00f));
#if DELTASERVE_SIMD == 512
  return scale_pow2(p, k);
#else
  // (k + 127) << 23 is 2^k; the shift drops the magic number's bits above k's
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(127)), 23);
  return mul(p, _mm256_castsi256_ps(bits));
#endif
}

// e^x for x <= 0; lanes below -87 (and -inf) give exactly 0.
inline vf exp(vf x) {
  const vf lo = set1(-87.0f);
  return zero_unless(ge(x, lo), exp_core(max(x, lo)));
}

// e^max(x, -87) for x <= 0 (NaN excluded): lanes below -87, -inf included, give e^-87 ~ 1.6e-38
// instead of 0, which no sum that also holds its max's e^0 = 1 can notice. Drops exp's compare
// and mask; the argmax's vocabulary-wide sums use it.
inline vf exp_sum_term(vf x) { return exp_core(max(x, set1(-87.0f))); }

}  // namespace simd
}  // namespace deltaserve_cpu
#endif  // DELTASERVE_SIMD
