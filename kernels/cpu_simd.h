// Shared pieces of the host kernels (CPU paged attention, fused RMSNorm, the verification
// twin's vectorised draw).
#pragma once
#include <cstdint>
#include <cstring>

// Host code built for several instruction sets where the compiler can (GCC on x86-64), the
// best one chosen when the library loads: one build runs on any x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define BS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BS_CLONES
#endif

namespace bs {

// exp(x) for x <= 0 (scores minus their running maximum, and the like): Cody-Waite reduction
// to 2^n * e^r, |r| <= ln2/2, and a degree-6 polynomial for e^r (relative error ~2e-7, about
// one float ulp). Branch-free (a select, which the build's -fno-trapping-math lets the
// compiler vectorise), so a loop of it vectorises where std::exp would not.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // below this e^x underflows; 2^n stays a normal float
  // round to nearest by the 1.5 * 2^23 trick (plain adds, which vectorise everywhere)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = uint32_t(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace bs
