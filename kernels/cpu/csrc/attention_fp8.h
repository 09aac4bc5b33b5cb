// fp8 KV caches (--kv-cache-dtype fp8 / fp8_e5m2 / fp8_e4m3, worker_service/runner/kv_dtype.py):
// one byte per cached value, widened to float32 as it is read, scale 1.0.
//
//   e5m2  s eeeee mm   = float16's high byte: half bits = byte << 8 (exact, inf / NaN too)
//   e4m3  s eeee mmm   (bias 7, no inf; 0x7f / 0xff NaN): half bits = sign << 8 | rest << 7
//                      is the value x 2^-8 (float16's bias is 15; subnormals map to float16
//                      subnormals, which the conversion widens exactly), so x 256 after.
//                      The NaN bytes widen to +-480 here (torch: NaN); only a NaN key or value
//                      writes one (write_kv_cache saturates finite values at 448).
//
// Scalar conversions for the portable loops (to_float), vector ones (AVX-512: 16 values from
// 16 bytes; AVX2: 8 from 8, both through F16C's half -> float) for the vector bodies' as_f32.
// Writing the cache (rounding to fp8) is torch's (kernels/attention/torch_ref.py).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

#include "simd.h"

namespace deltaserve_cpu {
namespace paged {

inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }

}  // namespace paged

#if defined(DELTASERVE_SIMD)
namespace simd {

#if DELTASERVE_SIMD == 512
// kLanes float16 bit patterns of kLanes fp8 bytes
inline __m256i fp8_halves(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
}
inline __m256i fp8_halves(const c10::Float8_e4m3fn* p) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
  return _mm256_or_si256(sign, rest);
}
inline vf fp8_load(const c10::Float8_e5m2* p) { return _mm512_cvtph_ps(fp8_halves(p)); }
inline vf fp8_load(const c10::Float8_e4m3fn* p) {
  return _mm512_mul_ps(_mm512_cvtph_ps(fp8_halves(p)), _mm512_set1_ps(256.f));
}
#else
inline __m128i fp8_halves(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
}
inline __m128i fp8_halves(const c10::Float8_e4m3fn* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
  return _mm_or_si128(sign, rest);
}
inline vf fp8_load(const c10::Float8_e5m2* p) { return _mm256_cvtph_ps(fp8_halves(p)); }
inline vf fp8_load(const c10::Float8_e4m3fn* p) {
  return _mm256_mul_ps(_mm256_cvtph_ps(fp8_halves(p)), _mm256_set1_ps(256.f));
}
#endif

// A cached row of D fp8 values as float32 in buf: the vector bodies' as_f32 (attention_simd.h)
// for fp8 caches.
template <int D, typename F8>
inline const float* fp8_row_f32(const F8* src, float* buf) {
  for (int c = 0; c < D / kLanes; ++c) storeu(buf + kLanes * c, fp8_load(src + kLanes * c));
  return buf;
}
template <int D>
inline const float* as_f32(const c10::Float8_e5m2* src, float* buf) {
  return fp8_row_f32<D>(src, buf);
}
template <int D>
inline const float* as_f32(const c10::Float8_e4m3fn* src, float* buf) {
  return fp8_row_f32<D>(src, buf);
}

}  // namespace simd
#endif  // DELTASERVE_SIMD

}  // namespace deltaserve_cpu
