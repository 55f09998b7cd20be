// Helpers shared by pagoda's C++ CPU kernels (pagoda.kernels.cpu_native).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }  // round to nearest even

// exp(x), Cephes' single-precision polynomial (relative error ~1e-7, as torch's vectorised
// exp), written so the compiler vectorises the loops that call it. Inputs are clamped to
// [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38: past those float32 has nothing useful).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// The softmax's numerators in place: s[j] = exp(s[j] - top), top the max of s's n values and
// `floor` (-inf, or an attention sink's logit); returns {top, the sum of the new s[j]}.
inline std::pair<float, float> softmax_numerators(float* s, int64_t n, float floor) {
  float top = floor;
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_approx(s[j] - top);
    sum += s[j];
  }
  return {top, sum};
}

}  // namespace
