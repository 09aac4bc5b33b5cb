// Float32 arithmetic a proof can rely on: a double rounded up (never down) to float, and a
// scope that runs this thread in IEEE mode whatever the caller set. For screened_greedy.cpp,
// whose error bounds assume both.
#pragma once

#include <cmath>
#include <limits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>   // the MXCSR
#endif

namespace deltaserve_cpu {

// v rounded up to float: a bound's coefficient may not shrink in the cast (subnormals, where
// rounding to nearest loses up to half their value). Past float32's range: inf (a row's guard
// then hands it back), not the undefined out-of-range conversion.
inline float up(double v) {
  if (!(v <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::infinity();
  const float f = static_cast<float>(v);
  return static_cast<double>(f) < v ? std::nextafter(f, std::numeric_limits<float>::infinity())
                                    : f;
}

#if defined(__x86_64__) || defined(__i386__)
// IEEE float32 arithmetic on this thread while in scope: round to nearest, no flush-to-zero or
// denormals-are-zero. The bound assumes them; torch.set_flush_denormal(True) after the pack
// made DAZ read a subnormal sw as 0, an estimate of 0 that ruled out the largest logit.
class IeeeMode {
 public:
  IeeeMode() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kNotIeee); }
  ~IeeeMode() { _mm_setcsr(saved_); }
  IeeeMode(const IeeeMode&) = delete;
  IeeeMode& operator=(const IeeeMode&) = delete;

 private:
  static constexpr unsigned kNotIeee = 0x8000u | 0x6000u | 0x0040u;   // FTZ, rounding, DAZ
  unsigned saved_;
};
#endif

}  // namespace deltaserve_cpu
