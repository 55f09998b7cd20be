// The per-layer small ops of the CPU path, one call each instead of a chain of torch ops
// (pagoda.kernels.cpu_native builds it). Each mirrors its torch reference in
// pagoda/kernels/reference.py (or the model's own expression) step for step, rounding to the
// tensor's dtype where the reference does: RMSNorm (with the residual add), rotary
// embedding and SwiGLU's silu(gate) * up. Rows are split across torch's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "cpu_common.h"

namespace {

// Rows per thread chunk: these ops are a few hundred to a few thousand elements per row.
constexpr int64_t kGrain = 16;

inline float round_to(float, float x) { return x; }
inline float round_to(c10::BFloat16, float x) { return static_cast<float>(c10::BFloat16(x)); }

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, const T* weight, double eps,
                   T* out, T* new_residual, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float* s = sum.data();
      if (residual != nullptr) {  // x + residual in the tensors' dtype, kept as the new residual
        const T* rr = residual + r * r_stride;
        for (int64_t i = 0; i < hidden; ++i) {
          s[i] = round_to(T(), load(xr, i) + load(rr, i));
          store(new_residual + r * hidden, i, s[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) s[i] = load(xr, i);
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += s[i] * s[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
      for (int64_t i = 0; i < hidden; ++i) store(out + r * hidden, i, s[i] * inv * load(weight, i));
    }
  });
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": a [rows, n] tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16, got ", x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "rms_norm: weight must be a contiguous [hidden] tensor of x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor new_residual;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    new_residual = at::empty({rows, hidden}, x.options());
  }
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rms_norm_rows<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                           residual ? residual->stride(0) : 0, weight.data_ptr<float>(), eps, out.data_ptr<float>(),
                           residual ? new_residual.data_ptr<float>() : nullptr, rows, hidden);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), residual ? residual->data_ptr<T>() : nullptr,
                       residual ? residual->stride(0) : 0, weight.data_ptr<T>(), eps, out.data_ptr<T>(),
                       residual ? new_residual.data_ptr<T>() : nullptr, rows, hidden);
    }));
  return {out, new_residual};
}

// silu(gate) * up over [rows, 2 * inter] (gate columns first), as F.silu(gate) * up computes it:
// silu rounded to the dtype, then the product rounded.
template <typename T>
void silu_mul_rows(const T* x, int64_t stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> act(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * stride;
      const T* up = gate + inter;
      float* a = act.data();
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = load(gate, i);
        a[i] = g < -88.0f ? -0.0f : g / (1.0f + exp_approx(-g));  // exp(-g) overflows there: torch's -0
      }
      for (int64_t i = 0; i < inter; ++i) store(out + r * inter, i, round_to(T(), a[i]) * load(up, i));
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: an even number of columns (gate, then up)");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      silu_mul_rows<float>(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), rows, inter);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      silu_mul_rows<T>(gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), rows, inter);
    }));
  return out;
}

// NeoX rotary of one [tokens, heads, dim] tensor (rows and heads strided, dim contiguous)
// into a contiguous one: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) in float32, rounded once.
template <typename T>
void rotate_rows(const T* x, int64_t token_stride, int64_t head_stride, const int64_t* positions,
                 const float* cos_sin, T* out, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_sin + positions[t] * dim;
      const float* s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * token_stride + h * head_stride;
        T* oh = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(xh, i), x2 = load(xh, i + half);
          store(oh, i, x1 * c[i] + x2 * -s[i]);
          store(oh, i + half, x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

at::Tensor rotary_one(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: a [tokens, heads, dim] tensor with contiguous, even head vectors");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rotate_rows<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), positions.data_ptr<int64_t>(),
                         cos_sin.data_ptr<float>(), out.data_ptr<float>(), tokens, heads, dim);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      rotate_rows<T>(x.data_ptr<T>(), x.stride(0), x.stride(1), positions.data_ptr<int64_t>(),
                     cos_sin.data_ptr<float>(), out.data_ptr<T>(), tokens, heads, dim);
    }));
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                          const at::Tensor& cos_sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary: positions must be contiguous int64, one per token");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.size(1) == q.size(2),
              "rotary: the cos/sin table must be contiguous float32 [positions, head_dim]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "rotary: q and k must share tokens, head size and dtype");
  return {rotary_one(q, positions, cos_sin), rotary_one(k, positions, cos_sin)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
}
