// e^x on 16 float32 lanes (AVX-512), shared by the attention bodies and the streaming argmax.
#pragma once

#include <immintrin.h>

namespace deltaserve_cpu {
namespace avx512 {

// e^x lane-wise for x <= 0; lanes below -87 (and -inf) give exactly 0. Degree-7 Taylor on
// |f| <= ln2/2 after x = k ln2 + f; 2^k applied with scalef. Relative error about 2e-7.
inline __m512 exp512_core(__m512 x);

inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, exp512_core(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))));
}

// e^max(x, -87) for x <= 0 (NaN excluded): lanes below -87, -inf included, give e^-87 ~ 1.6e-38
// instead of 0, which no sum that also holds its max's e^0 = 1 can notice. Drops the compare
// and the mask of exp512 (2 of its 15 vector ops); the argmax's vocabulary-wide sums use it.
inline __m512 exp512_sum_term(__m512 x) {
  return exp512_core(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

inline __m512 exp512_core(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  f = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), f);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

}  // namespace avx512
}  // namespace deltaserve_cpu
