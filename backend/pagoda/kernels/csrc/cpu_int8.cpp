// W8A8 int8 matmul of the CPU path (quantization="w8a8", pagoda.models.w8a8; issue 44):
// y = dequant(quant(x) quant(W)^T) + bias, weights int8 per output channel (quantized once at
// load), activations int8 per row (quantized here, on every call: "dynamic per-token").
//
// Quantization of a row x (float32, or bfloat16 widened): scale = max|x| / 127 (1 for a zero
// row), q = round-half-even(x / scale) clamped to [-127, 127]: the float32 division and
// rounding torch's `torch.round(x / scale)` does, so models.w8a8.w8a8_linear_ref (the
// definition) quantizes every row to the same integers.
// Products: int8 x int8 summed in int32, exactly (|sum| <= 127 * 127 * K < 2^31 for K <= 131072),
// so every output element's sum is the exact integer whatever the kernel, the tile or the
// number of rows: a row's result does not depend on its batch, and all kernels agree bit for bit.
// Finish: out = float(sum) * (x_scale[row] * w_scale[col]) + bias, in float32, rounded to the
// output dtype once.
//
// Layout: the [N, K] int8 weight in panels of 16 output columns, each [Kp / 4][16][4] (four k
// per column: an int32 lane of AVX512-VNNI's vpdpbusd, and AMX's B-tile layout as it is), K
// padded with zeros to Kp, a multiple of 64 (AMX's A-tile width).
// Kernels: AMX-INT8 tiles (tdpbssd, signed x signed; cpu_amx.cpp) for calls of kAmxRows+ rows
// where Linux grants AMX; else register tiles of up to 8 rows x 3 panels on vpdpbusd, which
// multiplies unsigned by signed bytes: the row is read as q + 128 (a byte's top bit flipped)
// and 128 * sum_k W[n, k] (`comp`, computed at packing) is taken off the sum; machines without
// AVX512-VNNI run the same sums in plain C++.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_gemm.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kPadK = 64;  // K padded to a multiple of this
constexpr int64_t kMaxRows = 8;  // rows per register tile
constexpr int64_t kMaxPanels = 3;  // panels per register tile
constexpr int64_t kTileCols = kMaxPanels * kPanel;
constexpr int64_t kBlockK = 256;  // k per pass over a row chunk: the weight block (12 KB) stays in L1
constexpr int64_t kChunkBytes = 256 * 1024;  // quantized x rows per task when a call has many
constexpr int64_t kAmxRows = 16;  // calls with this many rows go to AMX where it can serve them
constexpr int64_t kMaxK = 131072;  // int32 sums stay exact below this

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// One row of x to int8 (q, Kp long: zeros past k) and its scale (the header's definition).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {  // bfloat16 bits to the top of float32
  const __m256i half = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <typename T>
void quantize_row(const T* x, int64_t k, int64_t kp, int8_t* q, float* scale) {
  auto mask_at = [k](int64_t i) { return k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1); };
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + i, mask_at(i))));
  const float top = _mm512_reduce_max_ps(amax);
  const float s = top > 0.0f ? top / 127.0f : 1.0f;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int64_t i = 0; i < k; i += 16) {  // the division, then round half to even: torch.round(x / s)
    const __mmask16 m = mask_at(i);
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i, m), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_max_ps(lo, _mm512_min_ps(hi, r));
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  std::fill(q + k, q + kp, int8_t(0));
}
#else
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t kp, int8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(widen(x[i])));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  *scale = s;
  for (int64_t i = 0; i < k; ++i) {  // nearbyint: the current mode, round half to even
    const float r = std::nearbyint(widen(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  std::fill(q + k, q + kp, int8_t(0));
}
#endif

// A tile adds MR rows x NP panels of (q + 128) * w over k in [k0, k1) to the int32 sums c.
#if defined(__AVX512VNNI__)
template <int MR, int NP>
void tile_vnni(const int8_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t k0, int64_t k1, int32_t* c,
               bool first) {
  __m512i acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p)
      acc[m][p] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(c + m * kTileCols + p * kPanel);
  const __m512i flip = _mm512_set1_epi32(static_cast<int32_t>(0x80808080u));  // q -> q + 128, unsigned
  for (int64_t i = k0; i < k1; i += 4) {
    __m512i b[NP];
    if constexpr (MR >= 2)  // weights 128 k (2 KB) ahead: a tile's first pass over a block reads memory
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * ldw + (i + 128) * kPanel), _MM_HINT_T0);
    for (int p = 0; p < NP; ++p) b[p] = _mm512_loadu_si512(w + p * ldw + i * kPanel);
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, x + m * ldx + i, 4);
      const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(four), flip);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbusd_epi32(acc[m][p], a, b[p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_si512(c + m * kTileCols + p * kPanel, acc[m][p]);
}
#endif

template <int MR, int NP>
void tile_plain(const int8_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t k0, int64_t k1, int32_t* c,
                bool first) {
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(c + m * kTileCols, c + m * kTileCols + NP * kPanel, 0);
  for (int64_t i = k0; i < k1; i += 4)
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NP; ++p)
        for (int64_t col = 0; col < kPanel; ++col) {
          int32_t& sum = c[m * kTileCols + p * kPanel + col];
          for (int64_t j = 0; j < 4; ++j)
            sum += (int32_t(x[m * ldx + i + j]) + 128) * int32_t(w[p * ldw + i * kPanel + col * 4 + j]);
        }
}

using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int64_t, int64_t, int32_t*, bool);

template <bool plain>
struct Tile {
  template <int MR, int NP>
  static void fn(const int8_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t k0, int64_t k1, int32_t* c,
                 bool first) {
#if defined(__AVX512VNNI__)
    if constexpr (!plain) {
      tile_vnni<MR, NP>(x, ldx, w, ldw, k0, k1, c, first);
      return;
    }
#endif
    tile_plain<MR, NP>(x, ldx, w, ldw, k0, k1, c, first);
  }
};

}  // namespace

namespace pagoda_gemm {

#if defined(__AVX512F__)
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
#if defined(__AVX512BF16__)
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {  // vcvtneps2bf16: round to nearest even, as c10
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
#else
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int j = 0; j < 16; ++j)
    if (m >> j & 1) p[j] = c10::BFloat16(tmp[j]);
}
#endif
#endif

// The same operations in the same order as the plain loop below: (float(sum) * (xs * ws)) + bias.
template <typename T>
void finish_int8(const int32_t* c, int64_t ldc, int64_t rows, int64_t cols, const int32_t* comp, const float* xs,
                 const float* ws, const float* bias, T* out, int64_t ldo) {
#if defined(__AVX512F__)
  for (int64_t col = 0; col < cols; col += 16) {
    const __mmask16 m = cols - col >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - col)) - 1);
    const __m512i off = comp ? _mm512_maskz_loadu_epi32(m, comp + col) : _mm512_setzero_si512();
    const __m512 w = _mm512_maskz_loadu_ps(m, ws + col);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i sum = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(m, c + r * ldc + col), off);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(xs[r]), w));
      store16(out + r * ldo + col, m, bias ? _mm512_add_ps(v, b) : v);
    }
  }
#else
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t col = 0; col < cols; ++col) {
      const int32_t sum = c[m * ldc + col] - (comp ? comp[col] : 0);
      const float v = static_cast<float>(sum) * (xs[m] * ws[col]);
      out[m * ldo + col] = T(bias ? v + bias[col] : v);
    }
#endif
}

void finish_int8(const int32_t* c, int64_t ldc, int64_t rows, int64_t cols, const int32_t* comp, const float* xs,
                 const float* ws, const float* bias, float* out, int64_t ldo) {
  finish_int8<float>(c, ldc, rows, cols, comp, xs, ws, bias, out, ldo);
}

void finish_int8(const int32_t* c, int64_t ldc, int64_t rows, int64_t cols, const int32_t* comp, const float* xs,
                 const float* ws, const float* bias, c10::BFloat16* out, int64_t ldo) {
  finish_int8<c10::BFloat16>(c, ldc, rows, cols, comp, xs, ws, bias, out, ldo);
}

}  // namespace pagoda_gemm

namespace {

// out[rows, n] from the quantized rows xq [rows, kp] and their scales, on the vector (or plain) tiles.
template <typename T, bool plain>
void run_tiles(const int8_t* xq, const float* xs, int64_t rows, int64_t kp, const int8_t* packed, int64_t ldw,
               int64_t n, const int32_t* comp, const float* ws, const float* bias, T* out) {
  const int64_t panels = ceil_div(n, kPanel), groups = ceil_div(panels, kMaxPanels);
  // Row chunks of equal size (to a tile), as cpu_gemm.cpp's: the threads' shares of tasks are too.
  const int64_t most_rows = std::max<int64_t>(kMaxRows, kChunkBytes / kp / kMaxRows * kMaxRows);
  const int64_t chunks = ceil_div(rows, most_rows);
  const int64_t chunk_rows = ceil_div(ceil_div(rows, chunks), kMaxRows) * kMaxRows;
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> sums(chunk_rows * kTileCols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t % groups, r0 = (t / groups) * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
      const int64_t p0 = g * kMaxPanels, np = std::min(kMaxPanels, panels - p0);
      const int64_t col0 = p0 * kPanel, cols = std::min(n - col0, np * kPanel);
      for (int64_t k0 = 0; k0 < kp; k0 += kBlockK)
        for (int64_t r = r0; r < r1; r += kMaxRows) {
          const TileFn tile = pagoda_gemm::tile_table<TileFn, Tile<plain>>(std::min(kMaxRows, r1 - r), np);
          tile(xq + r * kp, kp, packed + p0 * ldw, ldw, k0, std::min(kp, k0 + kBlockK),
               sums.data() + (r - r0) * kTileCols, k0 == 0);
        }
      pagoda_gemm::finish_int8(sums.data(), kTileCols, r1 - r0, cols, comp + col0, xs + r0, ws + col0,
                               bias ? bias + col0 : nullptr, out + r0 * n + col0, n);
    }
  });
}

// The int8 [N, K] weight packed into panels, and comp = 128 * (each column's sum of weights).
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "pack_int8: an int8 [N, K] weight");
  const int64_t n = qweight.size(0), k = qweight.size(1), panels = ceil_div(n, kPanel), kp = ceil_div(k, kPadK) * kPadK;
  TORCH_CHECK(k <= kMaxK, "pack_int8: K=", k, " is over ", kMaxK, " (int32 sums would overflow)");
  at::Tensor padded = at::zeros({panels * kPanel, kp}, qweight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(qweight);
  at::Tensor packed = padded.view({panels, kPanel, kp / 4, 4}).permute({0, 2, 1, 3}).contiguous();
  at::Tensor comp = qweight.to(at::kInt).sum(1, false, at::kInt).mul_(128).contiguous();
  return {packed, comp};
}

// x [rows, K] float32 or bfloat16 -> (xq [rows, Kp] int8, x_scale [rows] float32).
template <typename T>
void quantize(const at::Tensor& x, int64_t kp, int8_t* xq, float* xs) {
  const T* data = x.data_ptr<T>();
  const int64_t k = x.size(1), ldx = x.stride(0);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(data + r * ldx, k, kp, xq + r * kp, xs + r);
  });
}

// kernel: "auto" (AMX from kAmxRows rows where it serves, else the vector tiles), "vector",
// "plain" (plain C++ whatever the CPU has) or "amx" (an error where AMX cannot serve).
at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp,
                       const at::Tensor& w_scale, int64_t n, const c10::optional<at::Tensor>& bias,
                       c10::string_view kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "vector" || kernel == "plain" || kernel == "amx",
              "linear_w8a8: kernel must be auto, vector, plain or amx");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_w8a8: x must be [rows, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear_w8a8: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) == ceil_div(n, kPanel),
              "linear_w8a8: packed int8 weight of ", n, " columns expected (pack_int8)");
  const int64_t rows = x.size(0), k = x.size(1), kp = packed.size(1) * 4;
  TORCH_CHECK(kp >= k && kp - k < kPadK, "linear_w8a8: weight packed for K=", kp, ", x has K=", k);
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.is_contiguous() && comp.numel() == n,
              "linear_w8a8: comp must be int32 [N] (pack_int8)");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n,
              "linear_w8a8: w_scale must be a contiguous float32 [N] tensor");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "linear_w8a8: bias must be a contiguous float32 [N] tensor");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  at::Tensor xq = at::empty({rows, kp}, x.options().dtype(at::kChar));
  at::Tensor xs = at::empty({rows}, x.options().dtype(at::kFloat));
  int8_t* q = xq.data_ptr<int8_t>();
  float* s = xs.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) quantize<float>(x, kp, q, s); else quantize<c10::BFloat16>(x, kp, q, s);
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* c = comp.data_ptr<int32_t>();
  const float* ws = w_scale.data_ptr<float>();
  const bool amx = kernel == "amx" || (kernel == "auto" && rows >= kAmxRows);
  if (x.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    if (amx && pagoda_gemm::amx_linear_int8(q, s, rows, kp, w, packed.stride(0), n, ws, b, o)) return out;
    TORCH_CHECK(kernel != "amx", "linear_w8a8: AMX-INT8 cannot serve this call (not granted or not built)");
    (kernel == "plain" ? &run_tiles<float, true> : &run_tiles<float, false>)(q, s, rows, kp, w, packed.stride(0), n, c,
                                                                             ws, b, o);
  } else {
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    if (amx && pagoda_gemm::amx_linear_int8(q, s, rows, kp, w, packed.stride(0), n, ws, b, o)) return out;
    TORCH_CHECK(kernel != "amx", "linear_w8a8: AMX-INT8 cannot serve this call (not granted or not built)");
    (kernel == "plain" ? &run_tiles<c10::BFloat16, true> : &run_tiles<c10::BFloat16, false>)(
        q, s, rows, kp, w, packed.stride(0), n, c, ws, b, o);
  }
  return out;
}

// What serves W8A8 calls here: "avx512vnni" (the vector tiles), "amx-int8"; empty: plain C++.
std::string int8_features() {
  std::string features;
#if defined(__AVX512VNNI__)
  features += "avx512vnni,";
#endif
  if (pagoda_gemm::amx_int8_usable()) features += "amx-int8,";
  if (!features.empty()) features.pop_back();
  return features;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_features() -> str", &int8_features);
  m.def("pack_int8(Tensor qweight) -> (Tensor, Tensor)");
  m.def("linear_w8a8(Tensor x, Tensor packed, Tensor comp, Tensor w_scale, int n, Tensor? bias, "
        "str kernel=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("pack_int8", &pack_int8);
  m.impl("linear_w8a8", &linear_w8a8);
}
