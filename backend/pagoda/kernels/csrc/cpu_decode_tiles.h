// Decode attention's AVX-512 path (cpu_attention.cpp dispatches to it when the build has
// AVX-512 and the head size is a multiple of 16).
//
// One work item is one part of one decode sequence's visible context, every head: each
// query head is scored against those rows (query head h reads KV head h / group, so the heads
// of a group read a cached row once from memory), then the softmax-weighted sum of V is taken,
// and the item leaves, per query head, its scores' max, the sum of their exponentials and the
// unnormalised sum of V rows; the parts of a sequence are merged after (log-sum-exp), the
// attention sinks with them. Long contexts are cut into parts (of 256 positions or more) when
// the batch has fewer sequences than four per thread, so one long sequence keeps every thread
// busy. An item reads whole rows (all KV heads of a position: a block's rows are contiguous);
// on the 2-core EPYC VM that streamed 1.3x faster than items of one KV head.
//
// Rows are read 16 at a time: the 16 dot products of a query head are kept as 16 vectors of
// partial sums and reduced together (one transpose-and-add, not 16 horizontal sums), and the
// weighted sum of V keeps its accumulator in registers across the 16 rows. Rows of a paged
// cache are scattered in blocks, so the rows two tiles ahead are prefetched through the block
// table (the hardware prefetcher cannot see where the next block is).
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 -> float32: the 16 bits on top
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lane i of the result is the sum of v[i]'s 16 lanes: pairs of vectors are interleaved and
// added until each 128-bit lane holds four sums, then the 128-bit lanes are regrouped.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// One sequence's rows (every KV head of a position) in a paged cache: row(p) is position p's.
template <typename T>
struct PagedRows {
  const T* cache;
  const int32_t* table;
  int64_t block_size, row_size;
  const T* row(int64_t p) const {
    return cache + (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * row_size;
  }
  void prefetch(int64_t begin, int64_t end) const {  // rows [begin, end)
    const int64_t bytes = row_size * sizeof(T);
    for (int64_t p = begin; p < end; ++p) {
      const char* r = reinterpret_cast<const char*>(row(p));
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
      _mm_prefetch(r + bytes - 1, _MM_HINT_T0);
    }
  }
};

constexpr int64_t kTile = 16;
constexpr int64_t kAhead = 2 * kTile;  // rows prefetched ahead of the tile being read

// Positions [begin, end) of one sequence for its `heads` query heads, query head h reading KV
// head h / group (qf: [heads][C * 16], scaled). scores: [heads][end - begin] scratch; result:
// [heads][2 + C * 16] = max, sum of exp, sum of exp-weighted V rows.
template <typename T, int C>
void decode_part(const float* qf, const PagedRows<T>& k, const PagedRows<T>& v, int64_t begin, int64_t end,
                 int64_t heads, int64_t group, float* scores, float* result) {
  constexpr int D = C * 16;
  const int64_t n = end - begin;
  const T* rows[kTile];
  k.prefetch(begin, std::min(end, begin + kAhead));
  for (int64_t p = begin; p < end; p += kTile) {
    k.prefetch(std::min(end, p + kAhead), std::min(end, p + kAhead + kTile));
    const int64_t count = std::min(kTile, end - p);
    for (int64_t t = 0; t < count; ++t) rows[t] = k.row(p + t);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < heads; ++h) {
      __m512 q[C], partial[kTile];
      const int64_t off = (h / group) * D;
      for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qf + h * D + c * 16);
      for (int64_t t = 0; t < kTile; ++t) {
        if (t >= count) {
          partial[t] = _mm512_setzero_ps();
          continue;
        }
        __m512 s = _mm512_mul_ps(q[0], load16(rows[t] + off));
        for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[c], load16(rows[t] + off + c * 16), s);
        partial[t] = s;
      }
      _mm512_mask_storeu_ps(scores + h * n + (p - begin), mask, sum_lanes16(partial));
    }
  }
  for (int64_t h = 0; h < heads; ++h) {  // softmax numerators, their max and sum
    const auto [top, sum] = softmax_numerators(scores + h * n, n, -std::numeric_limits<float>::infinity());
    float* r = result + h * (D + 2);
    r[0] = top, r[1] = sum;
    for (int64_t d = 0; d < D; ++d) r[2 + d] = 0.0f;
  }
  v.prefetch(begin, std::min(end, begin + kAhead));
  for (int64_t p = begin; p < end; p += kTile) {  // weights times V
    v.prefetch(std::min(end, p + kAhead), std::min(end, p + kAhead + kTile));
    const int64_t count = std::min(kTile, end - p);
    for (int64_t t = 0; t < count; ++t) rows[t] = v.row(p + t);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t off = (h / group) * D;
      float* a = result + h * (D + 2) + 2;
      const float* w = scores + h * n + (p - begin);
      __m512 acc[C];
      for (int c = 0; c < C; ++c) acc[c] = _mm512_loadu_ps(a + c * 16);
      for (int64_t t = 0; t < count; ++t) {
        const __m512 wt = _mm512_set1_ps(w[t]);
        for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(wt, load16(rows[t] + off + c * 16), acc[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + c * 16, acc[c]);
    }
  }
}

// The whole decode batch: split into items, run them on torch's threads (longest first,
// handed out one at a time), merge each sequence's parts into its output rows.
template <typename T, int C>
void decode_tiled(const T* q, const T* k_cache, const T* v_cache, const int32_t* tables, int64_t table_stride,
                  const int32_t* lens, const int64_t* out_rows, const int64_t* seqs, int64_t batch, int64_t heads,
                  int64_t kv_heads, int64_t block_size, float scale, int64_t window, const float* sinks, T* out) {
  constexpr int D = C * 16;
  const int64_t group = heads / kv_heads, row_size = kv_heads * D, threads = at::get_num_threads();
  std::vector<int64_t> first(batch), parts(batch), start(batch + 1, 0);
  const int64_t wanted = 4 * threads, min_part = 256;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[seqs[b]];
    first[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t n = len - first[b], most = std::max<int64_t>(1, n / min_part);
    parts[b] = batch >= wanted ? 1 : std::min(most, (wanted + batch - 1) / batch);
    start[b + 1] = start[b] + parts[b];
  }
  const int64_t items = start[batch], stride = heads * (D + 2);
  std::vector<float> results(items * stride);
  auto owner = [&](int64_t i) { return std::upper_bound(start.begin(), start.end(), i) - start.begin() - 1; };
  auto part_of = [&](int64_t b, int64_t part) {  // [begin, end) of a part, in positions
    const int64_t n = lens[seqs[b]] - first[b];
    return std::make_pair(first[b] + n * part / parts[b], first[b] + n * (part + 1) / parts[b]);
  };
  std::vector<int64_t> order(items), length(items);
  for (int64_t i = 0; i < items; ++i) {
    const int64_t b = owner(i);
    const auto [begin, end] = part_of(b, i - start[b]);
    order[i] = i, length[i] = end - begin;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return length[a] > length[b]; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t item = order[i], b = owner(item);
      const auto [begin, end] = part_of(b, item - start[b]);
      scratch.resize(heads * (D + (end - begin)));
      float* qf = scratch.data();
      const T* qh = q + out_rows[b] * heads * D;
      for (int64_t j = 0; j < heads * D; ++j) qf[j] = load(qh, j) * scale;
      const int32_t* table = tables + seqs[b] * table_stride;
      const PagedRows<T> k{k_cache, table, block_size, row_size}, v{v_cache, table, block_size, row_size};
      decode_part<T, C>(qf, k, v, begin, end, heads, group, qf + heads * D, results.data() + item * stride);
    }
  });
  at::parallel_for(0, batch, 1, [&](int64_t lo, int64_t hi) {  // merge the parts, sinks included
    for (int64_t b = lo; b < hi; ++b)
      for (int64_t h = 0; h < heads; ++h) {
        const float* r0 = results.data() + start[b] * stride + h * (D + 2);
        float top = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
        for (int64_t part = 0; part < parts[b]; ++part) top = std::max(top, r0[part * stride]);
        float sum = sinks ? exp_approx(sinks[h] - top) : 0.0f, acc[D] = {};
        for (int64_t part = 0; part < parts[b]; ++part) {
          const float* r = r0 + part * stride;
          const float f = exp_approx(r[0] - top);
          sum += f * r[1];
          for (int d = 0; d < D; ++d) acc[d] += f * r[2 + d];
        }
        T* o = out + (out_rows[b] * heads + h) * D;
        for (int d = 0; d < D; ++d) store(o, d, acc[d] / sum);
      }
  });
}

}  // namespace

#endif  // __AVX512F__
