// A quantized KV pool (kv_cache_dtype "int8" or "fp8_e4m3", layers/kv_quant.py) in the native step: this step's K/V
// quantized per (token, KV head) and stored at their slots with their scales, by the float32 operations kv_quant.write
// does in torch (the same codes and scales), and a sequence's blocks read back dequantized for the prefill rows' SDPA.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include <c10/util/Float8_e4m3fn.h>

#include "layer_ops.h"
#include "vec_math.h"

namespace {

constexpr float kMinScale = 1e-12f;  // kv_quant.MIN_SCALE: an all-zero head reads back as zeros

// A code of the pool's element type for x / scale: int8 rounds to nearest (ties even) within +-127, float8 e4m3 is
// the nearest of its values (c10's conversion, torch's); kMax is the largest magnitude, what a row's amax maps to.
template <typename Code>
struct Codes;

template <>
struct Codes<int8_t> {
  static constexpr float kMax = 127.0f;
  static int8_t of(float v) {
    const float q = std::nearbyint(v);
    return static_cast<int8_t>(q > kMax ? kMax : (q < -kMax ? -kMax : q));
  }
};

template <>
struct Codes<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
  static c10::Float8_e4m3fn of(float v) { return c10::Float8_e4m3fn(v); }
};

// One token's heads [heads, D] -> codes, a scale per head, and the values as stored (code x scale) in T. Without
// the build's -ffast-math: it would divide by the scale as a multiplication by its reciprocal, and a code a rounding
// away from torch's (kv_quant.quantize) changes what later steps attend to. (No std::max here: a function built with
// other options is not inlined into this one, and the calls cost more than the quantizing.)
template <typename Code, typename T>
__attribute__((optimize("no-fast-math"))) void quantize_token(const T* x, int64_t heads, int64_t D, Code* codes,
                                                              float* scales, T* stored) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * D;
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      const float a = std::fabs(static_cast<float>(xh[d]));
      amax = a > amax ? a : amax;
    }
    const float ratio = amax / Codes<Code>::kMax;
    const float s = ratio > kMinScale ? ratio : kMinScale;
    scales[h] = s;
    for (int64_t d = 0; d < D; ++d) {
      const Code code = Codes<Code>::of(static_cast<float>(xh[d]) / s);
      codes[h * D + d] = code;
      stored[h * D + d] = static_cast<T>(static_cast<float>(code) * s);
    }
  }
}

#ifdef BATCHSERVE_ISA_AVX512
// a / b rounded once, as torch divides: in assembly, which -ffast-math cannot turn into a multiplication by 1 / b
inline __m512 exact_div(__m512 a, __m512 b) {
  __m512 r;
  asm("vdivps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
  return r;
}

// 16 values of x / scale as codes: stored at dst, and returned as the floats the codes stand for
template <typename Code>
struct Codes16;

template <>
struct Codes16<int8_t> {  // nearest (ties even) within +-127
  static __m512 store(__m512 q, int8_t* dst) {
    const __m512 qmax = _mm512_set1_ps(Codes<int8_t>::kMax);
    q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-Codes<int8_t>::kMax)), qmax);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
    return q;
  }
};

template <>
struct Codes16<c10::Float8_e4m3fn> {  // c10's fp8e4m3fn_from_fp32_value (saturating) on 16 lanes: torch's bits
  static __m512 store(__m512 q, c10::Float8_e4m3fn* dst) {
    const __m512i bits = _mm512_castps_si512(q);
    const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i a = _mm512_xor_si512(bits, sign);
    // normal results: the exponent rebased, the mantissa rounded to 3 bits (to nearest, ties even)
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_set1_epi32(static_cast<int>(((uint32_t{7} - 127) << 23) + 0x7FFFFu));
    const __m512i rebased = _mm512_add_epi32(a, bias);
    __m512i code = _mm512_srli_epi32(_mm512_add_epi32(rebased, odd), 20);
    // below 2^-6, e4m3's subnormals: rounded by a float32 addition of 2^14, as c10 does
    const __m512i denorm_mask = _mm512_set1_epi32(141 << 23);
    const __m512i subnormal = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm_mask))), denorm_mask);
    code = _mm512_and_si512(code, _mm512_set1_epi32(0xff));
    // a rounding carried into 0x7f (NaN's pattern), 480 and above, and infinity saturate to 448 (0x7e); NaN stays NaN
    const __m512i nan = _mm512_set1_epi32(0x7f), largest = _mm512_set1_epi32(0x7e);
    code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(code, nan), code, largest);
    code = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)), code, subnormal);
    code = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(1087 << 20)), code, largest);
    code = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)), code, nan);
    code = _mm512_or_si512(code, _mm512_srli_epi32(sign, 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(code));
    return load16(dst);
  }
};

// quantize_token 16 elements at a time (D a multiple of 16): the same float32 operations, so the same codes, scales
// and stored values (bf16 rounded to nearest even, as torch)
template <typename Code, typename T>
void quantize_token_avx512(const T* x, int64_t heads, int64_t D, Code* codes, float* scales, T* stored) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * D;
    __m512 mx = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(xh + d)));
    const __m512 qmax = _mm512_set1_ps(Codes<Code>::kMax);
    const float ratio = _mm512_cvtss_f32(exact_div(_mm512_set1_ps(_mm512_reduce_max_ps(mx)), qmax));
    const float s = ratio > kMinScale ? ratio : kMinScale;
    const __m512 sv = _mm512_set1_ps(s);
    scales[h] = s;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 value = Codes16<Code>::store(exact_div(load16(xh + d), sv), codes + h * D + d);
      store16(stored + h * D + d, _mm512_mul_ps(value, sv));
    }
  }
}
#endif

// x [T, Hkv, D] (heads contiguous within a token) into the pool's slots -> x as stored [T, Hkv, D], contiguous
template <typename Code, typename T>
at::Tensor store(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales, const int64_t* slots) {
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2);
  auto stored = at::empty({tokens, heads, D}, x.options());
  const T* src = x.data_ptr<T>();
  Code* codes = static_cast<Code*>(cache.data_ptr());
  float* scale = scales.data_ptr<float>();
  T* out = stored.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    Code* token_codes = codes + slots[t] * heads * D;
#ifdef BATCHSERVE_ISA_AVX512
    if (D % 16 == 0) {
      quantize_token_avx512(src + t * x.stride(0), heads, D, token_codes, scale + slots[t] * heads,
                            out + t * heads * D);
      continue;
    }
#endif
    quantize_token(src + t * x.stride(0), heads, D, token_codes, scale + slots[t] * heads, out + t * heads * D);
  }
  return stored;
}

template <typename Code>
std::tuple<at::Tensor, at::Tensor> store_both(const at::Tensor& k, const at::Tensor& v, const QuantizedPool& pool,
                                              const int64_t* slots) {
  if (k.scalar_type() == at::kBFloat16)
    return {store<Code, c10::BFloat16>(k, pool.key, pool.key_scale, slots),
            store<Code, c10::BFloat16>(v, pool.value, pool.value_scale, slots)};
  return {store<Code, float>(k, pool.key, pool.key_scale, slots),
          store<Code, float>(v, pool.value, pool.value_scale, slots)};
}

}  // namespace

bool is_quantized_pool_type(at::ScalarType type) { return type == at::kChar || type == at::kFloat8_e4m3fn; }

std::tuple<at::Tensor, at::Tensor> write_kv_quantized_(const at::Tensor& k, const at::Tensor& v,
                                                       const QuantizedPool& pool, const at::Tensor& slot_mapping) {
  const auto dtype = k.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && v.scalar_type() == dtype,
              "write_kv_quantized_: key and value both float32 or both bfloat16");
  TORCH_CHECK(is_quantized_pool_type(pool.key.scalar_type()) && pool.value.scalar_type() == pool.key.scalar_type() &&
                  pool.key.is_contiguous() && pool.value.is_contiguous() && pool.value.sizes() == pool.key.sizes(),
              "quantized pool: contiguous int8 or float8_e4m3fn K and V of one shape and type");
  TORCH_CHECK(pool.key_scale.scalar_type() == at::kFloat && pool.value_scale.scalar_type() == at::kFloat &&
                  pool.key_scale.is_contiguous() && pool.value_scale.is_contiguous() &&
                  pool.key_scale.sizes() == pool.key.sizes().slice(0, 3) &&
                  pool.value_scale.sizes() == pool.key.sizes().slice(0, 3),
              "quantized pool: contiguous float32 scales [N, block_size, Hkv]");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == pool.key.size(2) &&
                  k.size(2) == pool.key.size(3) && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2),
              "key/value: [T, Hkv, D] of the pool's heads, heads contiguous within a token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0),
              "slots: contiguous int64, one a token");
  const int64_t num_slots = pool.key.size(0) * pool.key.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the pool");
  if (pool.key.scalar_type() == at::kChar) return store_both<int8_t>(k, v, pool, slots);
  return store_both<c10::Float8_e4m3fn>(k, v, pool, slots);
}

at::Tensor dequantized_blocks(const at::Tensor& cache, const at::Tensor& scales, const at::Tensor& blocks,
                              at::ScalarType dtype) {
  // kv_quant.read_blocks: (codes as float32 x scale) in dtype
  return (cache.index_select(0, blocks).to(at::kFloat) * scales.index_select(0, blocks).unsqueeze(-1)).to(dtype);
}
