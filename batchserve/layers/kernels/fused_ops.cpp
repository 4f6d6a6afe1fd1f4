// Fused elementwise CPU ops for float32 and bfloat16 activations: each is one pass over memory instead of the 3-6
// torch ops (and as many temporaries) it replaces. At prefill sizes those torch ops took a large share of a step, at
// decode sizes their per-op overhead adds up over the layers. Same math as the torch references in batchserve/layers/ (norm.py, mlp.py,
// rotary.py).
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"
#include "kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

// Rows per parallel chunk so that a chunk holds at least ~16k elements: small (decode) inputs stay on one thread,
// where waking the pool would cost more than the work.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D with contiguous rows expected");
}

// Elements are read as float and written back rounded to their own type: a bfloat16 model computes each fused op
// in float32 and rounds once, where its torch reference rounds after every op.
inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// Calls f with a value of the element type (float or c10::BFloat16) that `dtype` names; the checks let no other in.
template <typename F>
void dispatch_float_or_bf16(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    f(float{});
  }
}

// sum of src[i]^2 in one order whatever the row's address: 16 lanes (lane j takes i = j mod 16) in unaligned loads,
// then the lanes, then the tail. A `#pragma omp simd reduction` may peel iterations to align its loads, and a row's
// alignment follows the batch's tensor, so the last bit of a norm changed with the rows around it (deterministic
// mode, docs/determinism.md).
inline float sum_of_squares(const float* src, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef BATCHSERVE_ISA_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(src + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += src[i] * src[i];
  return sum;
}

inline float sum_of_squares(const c10::BFloat16* src, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef BATCHSERVE_ISA_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
  return sum;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, and with a residual: residual[r] += x[r] first, normalizing
// the sum (the residual stream of the next layer).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, T* out,
                   int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* src = const_cast<T*>(xr);
      if (residual != nullptr) {
        T* rr = residual + r * res_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) rr[i] = from_float<T>(as_float(rr[i]) + as_float(xr[i]));
        src = rr;
      }
      const float sum = sum_of_squares(src, hidden);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_float<T>(as_float(src[i]) * inv * as_float(weight[i]));
    }
  });
}

// out[i] = silu(gate[i]) * up[i] for i < n: one row of silu_and_mul, and the epilogue of the AMX GEMM fused with it
// (amx_gemm.cpp), whose results must be these bit for bit; not inlined, so that both run the same instructions.
template <typename T>
__attribute__((noinline)) void silu_and_mul_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#ifdef BATCHSERVE_ISA_AVX512
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = load16(g + i);
    const __m512 d = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    // 1 / d as rcp14 and one Newton step (relative error ~2^-28, below float32's rounding): a vdivps costs as
    // much as the whole exp, and this loop was bound by it
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));
    store16(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, r), load16(u + i)));
  }
#endif
  for (; i < n; ++i) {
    // exp's argument clamped as in exp512: -ffast-math assumes no inf, and exp(200) / inf gave NaN
    const float gi = as_float(g[i]);
    const float e = std::exp(std::min(88.f, std::max(-87.f, -gi)));
    o[i] = from_float<T>(gi / (1.f + e) * as_float(u[i]));
  }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]
template <typename T>
void silu_and_mul_rows(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * stride;
      silu_and_mul_row(g, g + inter, out + r * inter, inter);
    }
  });
}

// In place on x [T, heads, D] (rows of any stride, heads contiguous): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin
// for the two halves of each head (HF rotate_half); cos/sin [T, D/2].
template <typename T>
void rope_rows(T* x, int64_t token_stride, int64_t heads, int64_t head_dim, const T* cos, const T* sin,
               int64_t tokens) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_dim;
        T* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = as_float(x1[i]), b = as_float(x2[i]), ci = as_float(c[i]), si = as_float(s[i]);
          x1[i] = from_float<T>(a * ci - b * si);
          x2[i] = from_float<T>(b * ci + a * si);
        }
      }
    }
  });
}

// Index of the largest of n values, the first on ties, a NaN counting as larger than any number (torch.argmax's
// rules). Two passes: the maximum (vectorized), then the first index holding it (the row is in L2 by then). NaN is
// tested on the bits: -ffast-math lets the compiler assume there is none.
inline bool is_nan_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

int64_t argmax_of(const float* x, int64_t n) {
  float best = -INFINITY;
  int64_t i = 0;
#ifdef BATCHSERVE_ISA_AVX512
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask), inf_bits);
    vmax = _mm512_max_ps(vmax, v);
  }
  if (nan) i = 0, vmax = _mm512_set1_ps(-INFINITY);  // let the scalar loop find the first NaN
  best = _mm512_reduce_max_ps(vmax);
#endif
  for (; i < n; ++i) {
    if (is_nan_bits(x[i])) return i;
    best = std::max(best, x[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // every value is -inf
}

}  // namespace

// The AMX GEMM's fused epilogue (amx_gemm.cpp): one row of silu_and_mul on bf16.
void silu_and_mul_bf16_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  silu_and_mul_row(reinterpret_cast<const c10::BFloat16*>(gate), reinterpret_cast<const c10::BFloat16*>(up),
                   reinterpret_cast<c10::BFloat16*>(out), n);
}

// x [T, H] -> normalized [T, H]; with residual (same shape): residual += x in place, the sum normalized. float32
// or bfloat16, all of one type.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight: contiguous, x's dtype");
  TORCH_CHECK(weight.numel() == x.size(1), "weight: one value per hidden unit");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must have x's shape and dtype");
  }
  dispatch_float_or_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    const int64_t res_stride = residual.has_value() ? residual->stride(0) : 0;
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), res, res_stride, weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  dispatch_float_or_bf16(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(),
                                gate_up.size(0), inter);
  });
  return out;
}

at::Tensor silu_and_mul_panels(at::Tensor gate_up) {
  constexpr int64_t kHalf = kSwigluHalfPanel;
  check_rows(gate_up, "gate_up");
  const int64_t inter = gate_up.size(1) / 2, rows = gate_up.size(0);
  TORCH_CHECK(inter % kHalf == 0, "silu_and_mul_panels: whole panels of 16 gate and 16 up columns");
  auto out = at::empty({rows, inter}, gate_up.options());
  dispatch_float_or_bf16(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t p = 0; p < inter / kHalf; ++p)
          silu_and_mul_row(in + r * stride + 2 * kHalf * p, in + r * stride + 2 * kHalf * p + kHalf,
                           o + r * inter + kHalf * p, kHalf);
    });
  });
  return out;
}

// x [T, heads, D] float32 or bfloat16 with contiguous heads (any token stride), cos/sin [T, D/2] contiguous, of
// x's dtype: rotated in place.
void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() == 3,
              "x: [T, heads, D] float32 or bfloat16");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "x: heads must be contiguous within a token");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "cos/sin: contiguous, x's dtype");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2), "cos/sin: [T, D/2]");
  dispatch_float_or_bf16(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.size(1), x.size(2), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), x.size(0));
  });
}

// logits [R, V] float32 with contiguous rows -> [R] int64: torch.argmax(logits, dim=-1), parallel over rows.
at::Tensor argmax_rows(at::Tensor logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "logits: float32 expected");
  TORCH_CHECK(logits.size(1) > 0, "argmax of an empty row");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t stride = logits.stride(0), n = logits.size(1);
  at::parallel_for(0, logits.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = argmax_of(x + r * stride, n);
  });
  return out;
}

// key/value [T, Hkv, D] float32 (heads contiguous, any token stride) -> rows slot_mapping[t] of the caches viewed as
// [num_slots, Hkv, D]: one call per layer instead of two index_copy_.
void write_kv_(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
               at::Tensor slot_mapping) {
  const auto dtype = key.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && value.scalar_type() == dtype &&
                  key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
              "write_kv_: key, value and caches all float32 or all bfloat16");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "key and value caches must match");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key/value: [T, Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots: contiguous int64");
  const int64_t tokens = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(value.sizes() == key.sizes() && slot_mapping.size(0) == tokens, "key/value/slots disagree");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "key/value: heads must be contiguous within a token");
  TORCH_CHECK(key_cache.size(2) * key_cache.size(3) == row, "cache rows must hold one token's heads");
  const int64_t num_slots = key_cache.numel() / row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the pool");
  const int64_t elem = key.element_size(), row_bytes = row * elem;
  const char *k = static_cast<const char*>(key.data_ptr()), *v = static_cast<const char*>(value.data_ptr());
  char *kc = static_cast<char*>(key_cache.data_ptr()), *vc = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kc + slots[t] * row_bytes, k + t * key.stride(0) * elem, row_bytes);
    std::memcpy(vc + slots[t] * row_bytes, v + t * value.stride(0) * elem, row_bytes);
  }
}
