// Paged decode attention for CPUs, reading K/V from the paged cache in place
// (pagoda.kernels.cpu_native builds it; the contract is reference.paged_attention_ref's).
//
// Built with AVX-512 and a head size that is a multiple of 16 (64, 128, ...), it runs
// cpu_decode_tiles.h: (sequence, KV head, context part) items, 16 rows at a time, the next
// rows prefetched through the block table. Otherwise this file's portable loops: one work
// item is one decode sequence, all its heads; the query heads that share a KV head read each
// cached row once. Both keep scores for the whole visible context (two passes: scores, then
// the softmax-weighted sum of V), accumulated in float32 whatever the cache dtype (float32 or
// bfloat16). Work items are split across torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "cpu_decode_tiles.h"

namespace {

// A cached row of all KV heads in float32: the row itself for a float32 cache, else widened
// into ``buffer``.
inline const float* widen(const float* row, int64_t, float*) { return row; }

inline const float* widen(const c10::BFloat16* row, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = load(row, i);
  return buffer;
}

// One decode sequence, all its heads. D: the head size when it is one of the common ones
// (the loops over it then unroll into a few vector instructions), 0 for any other.
template <typename T, int D>
void decode_sequence(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                     int64_t window, const float* sinks, T* out, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, std::vector<float>& buffer) {
  const int64_t dim = D > 0 ? D : head_dim;
  const int64_t group = heads / kv_heads;
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  const int64_t row_size = kv_heads * dim;  // one token's K (or V) row: every KV head
  buffer.resize(heads * (n + 2 * dim + 1) + row_size);
  float* scores = buffer.data();       // [heads][n]
  float* qf = scores + heads * n;      // [heads][dim], pre-scaled
  float* acc = qf + heads * dim;       // [heads][dim]
  float* inv_sum = acc + heads * dim;  // [heads]
  float* wide = inv_sum + heads;       // [row_size]
  for (int64_t i = 0; i < heads * dim; ++i) {
    qf[i] = load(q, i) * scale;
    acc[i] = 0.0f;
  }
  // Visible positions [first, len), block by block: body(j, row) with j = p - first.
  auto for_each_row = [&](const T* cache, auto&& body) {
    for (int64_t b = first / block_size, p = first; p < len; ++b) {
      const T* base = cache + static_cast<int64_t>(table[b]) * block_size * row_size;
      const int64_t stop = std::min(len, (b + 1) * block_size);
      for (int64_t t = p - b * block_size; p < stop; ++p, ++t) body(p - first, widen(base + t * row_size, row_size, wide));
    }
  };
  for_each_row(k_cache, [&](int64_t j, const float* k) {  // scores: query head h reads KV head h / group
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = qf + h * dim;
      const float* kh = k + (h / group) * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
      scores[h * n + j] = dot;
    }
  });
  for (int64_t h = 0; h < heads; ++h) {  // softmax numerators and denominators
    const float floor = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
    auto [top, sum] = softmax_numerators(scores + h * n, n, floor);
    if (sinks) sum += exp_approx(sinks[h] - top);
    inv_sum[h] = 1.0f / sum;
  }
  for_each_row(v_cache, [&](int64_t j, const float* v) {  // probabilities times V
    for (int64_t h = 0; h < heads; ++h) {
      const float w = scores[h * n + j];
      const float* vh = v + (h / group) * dim;
      float* a = acc + h * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
    }
  });
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) store(out, h * dim + d, acc[h * dim + d] * inv_sum[h]);
}

template <typename T>
void decode_typed(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& lens, const at::Tensor& rows, const at::Tensor& seqs, double scale, int64_t window,
                  const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  const int64_t batch = rows.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t table_stride = tables.stride(0);
#if defined(__AVX512F__)
  auto tiled = head_dim == 64    ? &decode_tiled<T, 4>
               : head_dim == 128 ? &decode_tiled<T, 8>
               : head_dim == 32  ? &decode_tiled<T, 2>
               : head_dim == 80  ? &decode_tiled<T, 5>
               : head_dim == 96  ? &decode_tiled<T, 6>
               : head_dim == 256 ? &decode_tiled<T, 16>
                                 : nullptr;
  if (tiled) {
    tiled(qp, kp, vp, tp, table_stride, lp, rp, sp, batch, heads, kv_heads, block_size, static_cast<float>(scale),
          window, sink, op);
    return;
  }
#endif
  auto fn = head_dim == 64 ? &decode_sequence<T, 64> : head_dim == 128 ? &decode_sequence<T, 128> : &decode_sequence<T, 0>;
  // Longest contexts first, handed out one at a time: contexts of very different lengths
  // keep every thread busy to the end (a static split would not).
  std::vector<int64_t> order(batch);
  for (int64_t b = 0; b < batch; ++b) order[b] = b;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[sp[a]] > lp[sp[b]]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), batch);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;
    for (int64_t i = next++; i < batch; i = next++) {
      const int64_t b = order[i], s = sp[b];
      fn(qp + rp[b] * heads * head_dim, kp, vp, tp + s * table_stride, lp[s], window, sink, op + rp[b] * heads * head_dim,
         heads, kv_heads, head_dim, block_size, static_cast<float>(scale), buffer);
    }
  });
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& rows, const at::Tensor& seqs,
                      double scale, int64_t window, const c10::optional<at::Tensor>& sinks, at::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "decode_attention: q, out and the caches must share one dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && lens.is_contiguous(),
              "decode_attention: block tables and lengths must be int32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong, "decode_attention: rows/seqs int64");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "decode_attention: heads must be a multiple of KV heads");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
              "decode_attention: sinks must be contiguous float32");
  const at::Tensor table_rows = tables.stride(1) == 1 ? tables : tables.contiguous();  // rows read in place
  if (q.scalar_type() == at::kFloat) {
    decode_typed<float>(q, k_cache, v_cache, table_rows, lens, rows, seqs, scale, window, sinks, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_typed<c10::BFloat16>(q, k_cache, v_cache, table_rows, lens, rows, seqs, scale, window, sinks, out);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, Tensor rows, "
      "Tensor seqs, float scale, int window, Tensor? sinks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
