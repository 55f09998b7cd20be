// The CPU path's matmul, y = x W^T (+ bias), on weights packed once (pagoda.models.cpu_gemm
// packs a model's weights and picks this or oneDNN by gemm_features(); pagoda.kernels.cpu_native
// builds it).
//
// Layout: the [N, K] weight is cut into panels of 16 output columns. float32 panels are
// [K][16] (one 64-byte vector per k); bfloat16 panels are [K/2][16][2] (a k pair per column:
// the operand layout of AVX512-BF16's vdpbf16ps and of AMX's B tiles), K padded to a
// multiple of 32 with zeros. Packed: [panels, K, 16] or [panels, Kp / 2, 16, 2].
//
// Kernel: a register tile of MR rows x NP panels (up to 8 x 3: 24 zmm accumulators) runs the
// whole K, so every output element is one chain of fused multiply-adds in k order, whatever
// the number of rows in the call: a row's result does not depend on its batch. The tiles
// are split across torch's intra-op threads by panel group (a decode step: every thread
// streams its own part of the weight once) and, for many rows, by row chunk.
// bfloat16: vdpbf16ps adds two products per lane (k pairs), accumulating in float32, and
// the sum is rounded to bfloat16 once at the end (F.linear's rounding).
// Machines without AVX-512 (or without AVX512-BF16 for bf16) get the same loops in plain C++.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "cpu_gemm.h"

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kMaxRows = 8;  // MR: rows per register tile
constexpr int64_t kMaxPanels = 3;  // NP: panels per register tile
constexpr int64_t kTileCols = kMaxPanels * kPanel;  // a tile's float32 sums: [rows][kTileCols]
constexpr int64_t kChunkBytes = 256 * 1024;  // x rows per task when a call has many: about this much
constexpr int64_t kAmxRows = 8;  // bfloat16 calls with this many rows go to AMX where it can serve them
constexpr int64_t kBlockK = 256;  // k per pass over a row chunk: the weight block (48 KB f32, 24 KB bf16) in L1

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A tile kernel adds MR rows x NP panels of products over k in [k0, k1) to the float32 sums c
// (zeroed first when `first`); c is [MR][kTileCols]. Sums in k order, one rounding per product
// added: the k blocks only pause the chain (the sums wait in c, exactly). `fetch`: prefetch the
// weights ahead (the block's first row tile; the next ones find them in L1: prefetching there
// too cost 5-10% at 256-2,048 rows).
#if defined(__AVX512F__)
template <int MR, int NP>
inline void load_sums(__m512 (&acc)[MR][NP], const float* c, bool first) {
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + m * kTileCols + p * kPanel);
}

template <int MR, int NP>
inline void keep_sums(__m512 (&acc)[MR][NP], float* c) {
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + m * kTileCols + p * kPanel, acc[m][p]);
}

template <int MR, int NP>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
              bool first, bool fetch) {
  __m512 acc[MR][NP];
  load_sums<MR, NP>(acc, c, first);
  for (int64_t i = k0; i < k1; ++i) {
    __m512 b[NP];
    if (MR >= 2 && fetch)  // weights 64 k ahead: a block's first row tile reads them from memory
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * ldw + (i + 64) * kPanel), _MM_HINT_T0);
    for (int p = 0; p < NP; ++p) b[p] = _mm512_loadu_ps(w + p * ldw + i * kPanel);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + i]);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(a, b[p], acc[m][p]);
    }
  }
  keep_sums<MR, NP>(acc, c);
}
#endif

#if defined(__AVX512BF16__)
template <int MR, int NP>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
               bool first, bool fetch) {
  __m512 acc[MR][NP];
  load_sums<MR, NP>(acc, c, first);
  auto step = [&](int64_t i, auto&& pair_of) {  // products of k = i, i + 1 (i even: blocks are kBlockK long)
    __m512bh b[NP];
    if (MR >= 2 && fetch)  // weights 64 k ahead, as in tile_f32
      for (int p = 0; p < NP; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(w + p * ldw + (i + 64) * kPanel), _MM_HINT_T0);
    for (int p = 0; p < NP; ++p) b[p] = (__m512bh)_mm512_loadu_si512(w + p * ldw + i * kPanel);
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair_of(x + m * ldx + i));
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], a, b[p]);
    }
  };
  const int64_t even_end = k0 + ((k1 - k0) & ~int64_t(1));
  for (int64_t i = k0; i < even_end; i += 2)
    step(i, [](const uint16_t* at) {
      int32_t two;
      std::memcpy(&two, at, 4);
      return two;
    });
  if (even_end < k1)  // the last k of an odd K: its partner in the packing is zero, x's is never read
    step(even_end, [](const uint16_t* at) { return static_cast<int32_t>(*at); });
  keep_sums<MR, NP>(acc, c);
}
#endif

// The plain C++ tile (no AVX-512, or bfloat16 without AVX512-BF16): the same sums in the same
// order, one fused multiply-add per product. vdpbf16ps adds a pair's second product first
// (Intel's definition), and so does this loop; bfloat16 products are exact in float32.
inline float widen(float x) { return x; }
inline float widen(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

template <int MR, int NP, typename E>
void tile_plain(const E* x, int64_t ldx, const E* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
                bool first, bool /*fetch: nothing to prefetch*/) {
  constexpr int64_t pair = sizeof(E) == 2 ? 2 : 1;  // bfloat16 panels hold k pairs
  if (first)
    for (int m = 0; m < MR; ++m) std::fill(c + m * kTileCols, c + m * kTileCols + NP * kPanel, 0.0f);
  for (int64_t i0 = k0; i0 < k1; i0 += pair)
    for (int64_t j = pair - 1; j >= 0; --j) {
      const int64_t i = i0 + j;
      if (i >= k1) continue;  // past an odd K: the packing's zero
      for (int m = 0; m < MR; ++m) {
        const float a = widen(x[m * ldx + i]);
        for (int p = 0; p < NP; ++p)
          for (int64_t col = 0; col < kPanel; ++col) {
            float& sum = c[m * kTileCols + p * kPanel + col];
            sum = std::fma(a, widen(w[p * ldw + i0 * kPanel + col * pair + j]), sum);
          }
      }
    }
}

#if !defined(__AVX512F__)
template <int MR, int NP>
void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
              bool first, bool fetch) {
  tile_plain<MR, NP, float>(x, ldx, w, ldw, k0, k1, c, first, fetch);
}
#endif
#if !defined(__AVX512BF16__)
template <int MR, int NP>
void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
               bool first, bool fetch) {
  tile_plain<MR, NP, uint16_t>(x, ldx, w, ldw, k0, k1, c, first, fetch);
}
#endif

template <typename E>
using TileFn = void (*)(const E*, int64_t, const E*, int64_t, int64_t, int64_t, float*, bool, bool);

template <typename E, bool plain>
struct Tile {
  template <int MR, int NP>
  static void fn(const E* x, int64_t ldx, const E* w, int64_t ldw, int64_t k0, int64_t k1, float* c,
                 bool first, bool fetch) {
    if constexpr (plain) {
      tile_plain<MR, NP, E>(x, ldx, w, ldw, k0, k1, c, first, fetch);
    } else if constexpr (sizeof(E) == 4) {
      tile_f32<MR, NP>(x, ldx, w, ldw, k0, k1, c, first, fetch);
    } else {
      tile_bf16<MR, NP>(x, ldx, w, ldw, k0, k1, c, first, fetch);
    }
  }
};

}  // namespace

namespace pagoda_gemm {

void store_sums(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  for (int64_t col = 0; col < cols; col += kPanel) {
    const __mmask16 mask = cols - col >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << (cols - col)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 sum = _mm512_maskz_loadu_ps(mask, c + m * ldc + col);
      _mm512_mask_storeu_ps(out + m * ldo + col, mask, bias ? _mm512_add_ps(sum, b) : sum);
    }
  }
#else
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t col = 0; col < cols; ++col) out[m * ldo + col] = bias ? c[m * ldc + col] + bias[col] : c[m * ldc + col];
#endif
}

void store_sums(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, c10::BFloat16* out,
                int64_t ldo) {
#if defined(__AVX512BF16__)
  for (int64_t col = 0; col < cols; col += kPanel) {  // vcvtneps2bf16 rounds to nearest even, as c10 does
    const __mmask16 mask = cols - col >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << (cols - col)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 sum = _mm512_maskz_loadu_ps(mask, c + m * ldc + col);
      _mm256_mask_storeu_epi16(out + m * ldo + col, mask, (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(sum, b) : sum));
    }
  }
#else
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t col = 0; col < cols; ++col)
      out[m * ldo + col] = c10::BFloat16(bias ? c[m * ldc + col] + bias[col] : c[m * ldc + col]);
#endif
}

}  // namespace pagoda_gemm

namespace {

using pagoda_gemm::store_sums;

// out[M, N] = x[M, K] W^T + bias, E the element type of x and the panels (float, or the bits
// of bfloat16), T out's.
template <typename E, typename T, bool plain>
void run_linear(const E* x, int64_t ldx, const E* packed, int64_t ldb, int64_t rows, int64_t n, int64_t k,
                const float* bias, T* out) {
  const int64_t panels = ceil_div(n, kPanel), groups = ceil_div(panels, kMaxPanels);
  // A row chunk's x (~kChunkBytes at most) stays in L2 while every panel group's weight passes
  // by; the weight is read once per chunk (a decode step: one chunk, the weight read once).
  // Chunks are of equal size (to a tile), so that the threads' shares of tasks are too.
  const int64_t most_rows = std::max<int64_t>(kMaxRows, kChunkBytes / (k * sizeof(E)) / kMaxRows * kMaxRows);
  const int64_t chunks = ceil_div(rows, most_rows);
  const int64_t chunk_rows = ceil_div(ceil_div(rows, chunks), kMaxRows) * kMaxRows;
  // Tasks in chunk-major order: threads split the chunks, or one chunk's panel groups.
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(chunk_rows * kTileCols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t % groups, r0 = (t / groups) * chunk_rows, r1 = std::min(rows, r0 + chunk_rows);
      const int64_t p0 = g * kMaxPanels, np = std::min(kMaxPanels, panels - p0);
      const int64_t col0 = p0 * kPanel, cols = std::min(n - col0, np * kPanel);
      for (int64_t k0 = 0; k0 < k; k0 += kBlockK)
        for (int64_t r = r0; r < r1; r += kMaxRows) {
          const TileFn<E> tile = pagoda_gemm::tile_table<TileFn<E>, Tile<E, plain>>(std::min(kMaxRows, r1 - r), np);
          tile(x + r * ldx, ldx, packed + p0 * ldb, ldb, k0, std::min(k, k0 + kBlockK),
               sums.data() + (r - r0) * kTileCols, k0 == 0, r == r0);
        }
      store_sums(sums.data(), kTileCols, r1 - r0, cols, bias ? bias + col0 : nullptr, out + r0 * n + col0, n);
    }
  });
}

// Writes the [n, k] weight w (rows ldw apart) as panels of kPanel rows, one pass: panel p is
// [kp / PAIR][kPanel][PAIR] with out[p][kk / PAIR][j][kk % PAIR] = w[p * kPanel + j][kk], zero
// where a row is past n or kk past k. The writes run in order, the reads down the panel's
// kPanel rows side by side; panels are split across the intra-op threads.
template <int64_t PAIR, typename T>
void pack_panels(const T* w, int64_t ldw, int64_t n, int64_t k, int64_t kp, T* out) {
  at::parallel_for(0, ceil_div(n, kPanel), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t rows = std::min(kPanel, n - p * kPanel);
      const T* src = w + p * kPanel * ldw;
      T* dst = out + p * kp * kPanel;
      for (int64_t kk = 0; kk < kp; kk += PAIR)
        for (int64_t j = 0; j < kPanel; ++j)
          for (int64_t t = 0; t < PAIR; ++t)
            *dst++ = j < rows && kk + t < k ? src[j * ldw + kk + t] : T(0);
    }
  });
}

at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear: a [N, K] weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = ceil_div(n, kPanel);
  if (w.scalar_type() == at::kFloat) {  // [panels, K, 16]
    at::Tensor packed = at::empty({panels, k, kPanel}, w.options());
    pack_panels<1>(w.data_ptr<float>(), k, n, k, k, packed.data_ptr<float>());
    return packed;
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "pack_linear: float32 or bfloat16, got ", w.scalar_type());
  const int64_t kp = ceil_div(k, 32) * 32;  // [panels, Kp / 2, 16, 2]
  at::Tensor packed = at::empty({panels, kp / 2, kPanel, 2}, w.options());
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  pack_panels<2>(static_cast<const uint16_t*>(bits(w)), k, n, k, kp, bits(packed));
  return packed;
}

// kernel: "auto" (AMX for bfloat16 from kAmxRows rows where it can serve, else the vector
// tiles), "vector", "plain" (the plain C++ tiles whatever the CPU has: tests compare them with
// the vector ones) or "amx" (an error where AMX cannot serve).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                  c10::string_view kernel) {
  TORCH_CHECK(kernel == "auto" || kernel == "vector" || kernel == "plain" || kernel == "amx",
              "linear: kernel must be auto, vector, plain or amx");
  const bool plain = kernel == "plain";
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [rows, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and the packed weight must share one dtype");
  TORCH_CHECK(packed.is_contiguous() && packed.size(0) == ceil_div(n, kPanel), "linear: packed weight of ", n,
              " columns expected (pack_linear)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "linear: bias must be a contiguous float32 [N] tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t ldb = packed.stride(0);
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k, "linear: float32 weight packed for K=", packed.size(1),
                ", x has K=", k);
    TORCH_CHECK(kernel != "amx", "linear: AMX serves bfloat16 only");
    auto run = plain ? &run_linear<float, float, true> : &run_linear<float, float, false>;
    run(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), ldb, rows, n, k, b, out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear: float32 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 >= k && packed.size(1) * 2 - k < 32,
                "linear: bfloat16 weight packed for another K than x's ", k);
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); };
    if ((kernel == "amx" || (kernel == "auto" && rows >= kAmxRows)) &&
        pagoda_gemm::amx_linear_bf16(bits(x), x.stride(0), bits(packed), ldb, rows, n, k, b,
                                     out.data_ptr<c10::BFloat16>()))
      return out;
    TORCH_CHECK(kernel != "amx", "linear: AMX cannot serve this call (no AMX, or K=", k, " not a multiple of 32)");
    auto run = plain ? &run_linear<uint16_t, c10::BFloat16, true> : &run_linear<uint16_t, c10::BFloat16, false>;
    run(bits(x), x.stride(0), bits(packed), ldb, rows, n, k, b, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// What this build's matmul runs on this machine (the build is -march=native, for the CPU it
// runs on): "avx512f" (float32 vector tiles), "avx512bf16" (bfloat16 vector tiles), "amx"
// (AMX tiles, granted by Linux), comma-separated; empty: the plain C++ tiles serve everything.
std::string gemm_features() {
  std::string features;
#if defined(__AVX512F__)
  features += "avx512f,";
#endif
#if defined(__AVX512BF16__)
  features += "avx512bf16,";
#endif
  if (pagoda_gemm::amx_usable()) features += "amx,";
  if (!features.empty()) features.pop_back();
  return features;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("gemm_features() -> str", &gemm_features);  // no tensor argument: a catch-all kernel
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias, str kernel=\"auto\") -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
