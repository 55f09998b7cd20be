// Prefill attention for CPUs: one prompt chunk's queries against its sequence's paged cache,
// read in place (pagoda.kernels.cpu_native builds it; reference.paged_attention_ref is the
// contract). The torch path gathers the context into a copy and runs SDPA with a mask
// instead; this streams the cache once per block of queries and skips what the mask hides.
//
// Query i of the chunk sits at position s_len - q_len + i and sees keys [lo, i's position]
// (lo: 0, or the sliding window's start). One work item is one (KV head, block of 64-256 query
// positions, more the longer the context: query_block): the block's rows of every query head
// of that KV head (grouped-query attention reads each K/V tile once for them all) run a
// flash-attention loop over 48-key tiles: the tile's K transposed to [D][48] so a row's 48
// scores are three vectors (each query element broadcast against a K^T row; 8 rows at a time,
// 24 accumulators), an online softmax per row (running max and a vector of partial sums), then
// P V into the row's accumulator, 4 rows at a time (2 at D = 128): each V vector loaded into a
// register once for them, each row's probability broadcast from memory. Every accumulation is
// float32 whatever the cache dtype (float32 or bfloat16). Tiles past every row's last key are
// never read; only the diagonal tiles (and the window's edge) are masked. Items go to torch's
// threads longest first (the last blocks of a causal chunk see the most keys).
//
// AVX-512 only (head sizes a multiple of 16); cpu_native.native_prefill says when to use it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kVecs = 3;                // score vectors per row and tile
constexpr int64_t kKeys = 16 * kVecs;  // keys per tile

inline __m512 exp16(__m512 x) {  // exp_approx on 16 lanes (cpu_common.h's polynomial)
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// One work item's state: `rows` query rows (group heads x block positions), each with its
// position, scaled query, running max, partial sums and output accumulator.
template <int C>
struct Rows {
  static constexpr int D = C * 16;
  int64_t count = 0;
  std::vector<float> q, acc, top, sums, probs;  // [rows][D], [rows][D], [rows], [rows][16], [rows][kKeys]
  std::vector<int64_t> pos;                     // each row's position
  void reset(int64_t n) {
    count = n;
    q.resize(n * D), acc.assign(n * D, 0.0f), top.assign(n, -std::numeric_limits<float>::infinity());
    sums.assign(n * 16, 0.0f), probs.resize(n * kKeys), pos.resize(n);
  }
};

// Scores of rows [r0, r0 + R) against a tile (kt: [D][kKeys]), masked to each row's keys
// [lo, pos] (first: the tile's first key), folded into the rows' online softmax: probs get
// exp(score - new max), the accumulator and partial sums are rescaled.
template <int C, int R>
inline void score_rows(Rows<C>& rows, int64_t r0, const float* kt, int64_t first, int64_t keys, int64_t window,
                       bool masked) {
  constexpr int D = C * 16;
  float scores[R * kKeys];  // kept in registers over d, stored once (an indexed array would be spilled every d)
  {
    __m512 s[R][kVecs];
    const float* q = rows.q.data() + r0 * D;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      __m512 k[kVecs];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) k[v] = _mm512_loadu_ps(kt + d * kKeys + v * 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 qd = _mm512_set1_ps(q[r * D + d]);
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_fmadd_ps(qd, k[v], s[r][v]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(scores + r * kKeys + v * 16, s[r][v]);
  }
  const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 valid[kVecs];  // the tile's keys that exist (a last tile may be short)
  for (int v = 0; v < kVecs; ++v) {
    const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, keys - 16 * v));
    valid[v] = static_cast<__mmask16>((1u << n) - 1);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    __mmask16 visible[kVecs];
    bool any = false;
    for (int v = 0; v < kVecs; ++v) {
      visible[v] = valid[v];
      if (masked) {
        const int64_t p = rows.pos[row], lo = window > 0 ? p - window + 1 : 0;
        const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first + 16 * v)), step);
        visible[v] &= _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(p)));
        visible[v] &= _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(lo)));
      }
      any = any || visible[v];
    }
    float* probs = rows.probs.data() + row * kKeys;
    if (!any) {  // nothing this row may see here
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(probs + v * 16, _mm512_setzero_ps());
      continue;
    }
    __m512 score[kVecs], most = neg;
    for (int v = 0; v < kVecs; ++v) {
      score[v] = _mm512_mask_mov_ps(neg, visible[v], _mm512_loadu_ps(scores + r * kKeys + v * 16));
      most = _mm512_max_ps(most, score[v]);
    }
    const float top = std::max(rows.top[row], _mm512_reduce_max_ps(most));
    const float shrink = top > rows.top[row] ? exp_approx(rows.top[row] - top) : 1.0f;  // ~0 on a first tile
    rows.top[row] = top;
    float* sums = rows.sums.data() + row * 16;
    __m512 total = _mm512_mul_ps(_mm512_loadu_ps(sums), _mm512_set1_ps(shrink));
    for (int v = 0; v < kVecs; ++v) {
      const __m512 p = _mm512_maskz_mov_ps(visible[v], exp16(_mm512_sub_ps(score[v], _mm512_set1_ps(top))));
      _mm512_storeu_ps(probs + v * 16, p);
      total = _mm512_add_ps(total, p);
    }
    _mm512_storeu_ps(sums, total);
    if (shrink != 1.0f) {
      float* a = rows.acc.data() + row * D;
      const __m512 factor = _mm512_set1_ps(shrink);
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(a + c * 16, _mm512_mul_ps(_mm512_loadu_ps(a + c * 16), factor));
    }
  }
}

// A vector loaded into a register by an instruction of its own: used by several FMAs, GCC
// would fold the load into each of them (one load per use: the load ports become the limit).
inline __m512 load_once(const float* p) {
  __m512 x;
  asm("vmovups %1, %0" : "=v"(x) : "m"(*reinterpret_cast<const __m512_u*>(p)));
  return x;
}

// acc += probs V for rows [r0, r0 + R) (vt: the tile's V rows, [kKeys][D]): each V vector
// loaded once for the R rows, a row's probability for key j broadcast from memory (a lane
// permute of the row's probability vector instead was 1.3x slower: permutes and the FMAs'
// folded V loads took the ports the FMAs need).
template <int C, int R>
inline void add_values(Rows<C>& rows, int64_t r0, const float* vt, int64_t keys) {
  constexpr int D = C * 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_loadu_ps(rows.acc.data() + (r0 + r) * D + c * 16);
  const float* p = rows.probs.data() + r0 * kKeys;
  for (int64_t j = 0; j < keys; ++j) {
    __m512 x[C];
    for (int c = 0; c < C; ++c) x[c] = load_once(vt + j * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * kKeys + j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(w, x[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(rows.acc.data() + (r0 + r) * D + c * 16, a[r][c]);
}

// Query positions per work item. An item transposes every K tile its rows see, so a long
// context wants many rows per item (after 30,000 positions of context, 64 -> 256 positions
// took a 2,048-token chunk from 449 to 373 ms at 2 threads); but never fewer than 2 items a
// thread (causal items differ in length).
inline int64_t query_block(int64_t q_len, int64_t s_len, int64_t kv_heads) {
  int64_t block = s_len >= 4096 ? 256 : s_len >= 2048 ? 128 : 64;
  while (block > 16 && kv_heads * ((q_len + block - 1) / block) < 2 * at::get_num_threads()) block /= 2;
  return block;
}

template <typename T, int C>
void prefill_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
                   int64_t s_len, double scale, int64_t window, const c10::optional<at::Tensor>& sinks,
                   at::Tensor& out) {
  constexpr int D = C * 16;
  const int64_t q_len = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const int64_t group = heads / kv_heads, row_size = kv_heads * D, start = s_len - q_len;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t block = query_block(q_len, s_len, kv_heads);
  const int64_t blocks = (q_len + block - 1) / block, items = kv_heads * blocks;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return a % blocks > b % blocks; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    Rows<C> rows;
    std::vector<float> kt(D * kKeys), vt(kKeys * D);
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t g = order[i] / blocks, b0 = order[i] % blocks * block, b1 = std::min(q_len, b0 + block);
      const int64_t n = b1 - b0;
      rows.reset(group * n);  // row = h * n + (i - b0)
      for (int64_t h = 0; h < group; ++h)
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = h * n + t;
          rows.pos[row] = start + b0 + t;
          const T* src = qp + ((b0 + t) * heads + g * group + h) * D;
          for (int d = 0; d < D; ++d) rows.q[row * D + d] = load(src, d) * static_cast<float>(scale);
        }
      const int64_t last = start + b1 - 1;  // the block's last position: its keys end there
      const int64_t lo_all = window > 0 ? std::max<int64_t>(0, start + b0 - window + 1) : 0;
      const int64_t lo_any = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int64_t first = lo_all / kKeys * kKeys; first <= last; first += kKeys) {
        const int64_t keys = std::min(kKeys, last + 1 - first);
        for (int64_t j = 0; j < keys; ++j) {  // the tile: K transposed, V as rows, in float32
          const int64_t p = first + j;
          const int64_t slot = static_cast<int64_t>(tp[p / block_size]) * block_size + p % block_size;
          const int64_t at = slot * row_size + g * D;
          for (int d = 0; d < D; ++d) kt[d * kKeys + j] = load(kp + at, d), vt[j * D + d] = load(vp + at, d);
        }
        for (int64_t j = keys; j < kKeys; ++j)
          for (int d = 0; d < D; ++d) kt[d * kKeys + j] = 0.0f;
        const bool masked = first + kKeys - 1 > start + b0 || first < lo_any;  // some row sees part of it
        constexpr int kValueRows = C >= 8 ? 2 : 4;  // accumulators: rows x C vectors
        int64_t r = 0;
        for (; r + 8 <= rows.count; r += 8) {
          score_rows<C, 8>(rows, r, kt.data(), first, keys, window, masked);
          for (int64_t v = r; v < r + 8; v += kValueRows) add_values<C, kValueRows>(rows, v, vt.data(), keys);
        }
        for (; r < rows.count; ++r) {
          score_rows<C, 1>(rows, r, kt.data(), first, keys, window, masked);
          add_values<C, 1>(rows, r, vt.data(), keys);
        }
      }
      for (int64_t h = 0; h < group; ++h)
        for (int64_t t = 0; t < n; ++t) {
          const int64_t row = h * n + t, head = g * group + h;
          float top = rows.top[row], sum = _mm512_reduce_add_ps(_mm512_loadu_ps(rows.sums.data() + row * 16));
          float shrink = 1.0f;
          if (sink) {  // the sink's logit joins the softmax's denominator
            const float both = std::max(top, sink[head]);
            shrink = exp_approx(top - both);
            sum = sum * shrink + exp_approx(sink[head] - both);
          }
          T* dst = op + ((b0 + t) * heads + head) * D;
          for (int d = 0; d < D; ++d) store(dst, d, rows.acc[row * D + d] * shrink / sum);
        }
    }
  });
}

template <typename T>
void prefill_dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& table, int64_t s_len, double scale, int64_t window,
                      const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return prefill_typed<T, 4>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
    case 128: return prefill_typed<T, 8>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
    case 32: return prefill_typed<T, 2>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
    case 80: return prefill_typed<T, 5>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
    case 96: return prefill_typed<T, 6>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
    default: TORCH_CHECK(false, "prefill_attention: head size 32, 64, 80, 96 or 128, got ", q.size(2));
  }
}

}  // namespace
#endif  // __AVX512F__

namespace {

void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& table, int64_t s_len, double scale, int64_t window,
                       const c10::optional<at::Tensor>& sinks, at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "prefill_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "prefill_attention: q, out and the caches must share one dtype");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 1 && table.is_contiguous(),
              "prefill_attention: the block table must be one contiguous int32 row");
  TORCH_CHECK(q.size(0) <= s_len && (s_len + k_cache.size(1) - 1) / k_cache.size(1) <= table.size(0),
              "prefill_attention: the chunk must end at s_len inside the block table");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "prefill_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
              "prefill_attention: sinks must be contiguous float32");
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat)
    return prefill_dispatch<float>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
  if (q.scalar_type() == at::kBFloat16)
    return prefill_dispatch<c10::BFloat16>(q, k_cache, v_cache, table, s_len, scale, window, sinks, out);
  TORCH_CHECK(false, "prefill_attention: float32 or bfloat16 only, got ", q.scalar_type());
#else
  TORCH_CHECK(false, "prefill_attention: this build has no AVX-512");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int s_len, float scale, "
      "int window, Tensor? sinks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
