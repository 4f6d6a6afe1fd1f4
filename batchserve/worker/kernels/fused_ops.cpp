// Fused elementwise CPU ops for float32 activations: each is one pass over memory instead of the 3-6 torch ops (and
// as many temporaries) it replaces. At prefill sizes those torch ops took ~20% of a step, at decode sizes their
// per-op overhead adds up over 30 layers. Same math as the torch reference in batchserve/models/llama.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec_math.h"

namespace {

// Rows per parallel chunk so that a chunk holds at least ~16k elements: small (decode) inputs stay on one thread,
// where waking the pool would cost more than the work.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, ": float32 expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D with contiguous rows expected");
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, and with a residual: residual[r] += x[r] first, normalizing
// the sum (the residual stream of the next layer).
void rms_norm_rows(const float* x, int64_t x_stride, float* residual, int64_t res_stride, const float* weight,
                   float* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * x_stride;
      float* src = const_cast<float*>(xr);
      if (residual != nullptr) {
        float* rr = residual + r * res_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) rr[i] += xr[i];
        src = rr;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += src[i] * src[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      float* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = src[i] * inv * weight[i];
    }
  });
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]
void silu_and_mul_rows(const float* gate_up, int64_t stride, float* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up + r * stride;
      const float* u = g + inter;
      float* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= inter; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
      }
#endif
      for (; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

// In place on x [T, heads, D] (rows of any stride, heads contiguous): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
// for the two halves of each head (HF rotate_half); cos/sin [T, D/2].
void rope_rows(float* x, int64_t token_stride, int64_t heads, int64_t head_dim, const float* cos, const float* sin,
               int64_t tokens) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = x + t * token_stride + h * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

}  // namespace

// x [T, H] -> normalized [T, H]; with residual (same shape): residual += x in place, the sum normalized.
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat32, "weight: contiguous float32");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  float* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must have x's shape");
    res = residual->data_ptr<float>();
    res_stride = residual->stride(0);
  }
  rms_norm_rows(x.data_ptr<float>(), x.stride(0), res, res_stride, weight.data_ptr<float>(), out.data_ptr<float>(),
                x.size(0), x.size(1), static_cast<float>(eps));
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  silu_and_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), gate_up.size(0), inter);
  return out;
}

// x [T, heads, D] float32 with contiguous heads (any token stride), cos/sin [T, D/2] contiguous: rotated in place.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3, "x: [T, heads, D] float32");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x: heads must be contiguous within a token");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32, "cos/sin");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2), "cos/sin: [T, D/2]");
  rope_rows(x.data_ptr<float>(), x.stride(0), x.size(1), x.size(2), cos.data_ptr<float>(), sin.data_ptr<float>(),
            x.size(0));
}
