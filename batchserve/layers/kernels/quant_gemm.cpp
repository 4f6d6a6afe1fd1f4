// x [M, K] float32 @ a weight kept quantized (int8 or packed int4 codes, group-wise scales; quant_gemm.h) -> [M, N].
//
// Decode is bound by the bytes of weight streamed per step: here each weight is read as stored (1 or 0.5 byte) and
// widened to float32 in registers. Small M (decode): threads split the output columns; each column's codes are read
// once per block of up to 4 rows, widened 32 k at a time, multiplied by their group's scale and FMA'd with the rows'
// activations. A row's result is the same whatever M and the row's place in the batch (one order per row). Large M
// (prefill): tiles of the weight (whole, up to 16 MiB of float32) dequantized to float32 and multiplied by the library GEMM, where compute dominates.
//
// One code path per instruction set (AVX-512, AVX2 + FMA, portable), chosen once in Python (kernels.quant_gemm_path)
// and stored with the weight.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "isa.h"
#include "quant_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>

#ifdef BATCHSERVE_ISA_AVX2
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kSub = 32;      // k per subblock: one int4 subblock is 16 bytes
constexpr int kRowBlock = 4;      // rows sharing one widening of the codes
constexpr int64_t kTileFloats = int64_t{1} << 22;  // a dequantized tile (large M): 16 MiB of float32

// The plain loop: any CPU.
struct Portable {
  using Vec = float;
  static constexpr int kWidth = 1, kVecs = 32;
  static Vec load(const float* p) { return *p; }
  static Vec zero() { return 0.0f; }
  static Vec set1(float v) { return v; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
  static float hsum(Vec v) { return v; }
  static void load_int8(const int8_t* p, Vec* w) {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(p[j]);
  }
  static void load_int4(const uint8_t* p, Vec* w) {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>((p[j] & 15) - 8);
      w[j + 16] = static_cast<float>((p[j] >> 4) - 8);
    }
  }
};

#ifdef BATCHSERVE_ISA_AVX2
// 16 int4 codes of a subblock's 16 bytes, centred, as int8: low nibbles (k = j) and high nibbles (k = j + 16)
inline void int4_halves(const uint8_t* p, __m128i* lo, __m128i* hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  *lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), eight);
  *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), eight);
}

struct Avx2 {
  using Vec = __m256;
  static constexpr int kWidth = 8, kVecs = 4;
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float v) { return _mm256_set1_ps(v); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  }
  static Vec widen(__m128i low8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low8)); }
  static void load_int8(const int8_t* p, Vec* w) {
    for (int j = 0; j < 4; ++j) w[j] = widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
  }
  static void load_int4(const uint8_t* p, Vec* w) {
    __m128i lo, hi;
    int4_halves(p, &lo, &hi);
    w[0] = widen(lo);
    w[1] = widen(_mm_srli_si128(lo, 8));
    w[2] = widen(hi);
    w[3] = widen(_mm_srli_si128(hi, 8));
  }
};
#endif

#ifdef BATCHSERVE_ISA_AVX512
struct Avx512 {
  using Vec = __m512;
  static constexpr int kWidth = 16, kVecs = 2;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float v) { return _mm512_set1_ps(v); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
  static Vec widen(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
  static void load_int8(const int8_t* p, Vec* w) {
    w[0] = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[1] = widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  static void load_int4(const uint8_t* p, Vec* w) {
    __m128i lo, hi;
    int4_halves(p, &lo, &hi);
    w[0] = widen(lo);
    w[1] = widen(hi);
  }
};
#endif

// One 32-k subblock of one column for R rows: the codes widened, scaled (s_lo for k < 16 of the subblock, s_hi above:
// equal unless the group is 16) and FMA'd with the rows' activations.
template <class Isa, int Bits, int R>
inline void subblock_rows(const float* x, int64_t K, const uint8_t* codes, int64_t k0, typename Isa::Vec s_lo,
                          typename Isa::Vec s_hi, typename Isa::Vec (*acc)[2]) {
  typename Isa::Vec w[Isa::kVecs];
  if constexpr (Bits == 8) {
    Isa::load_int8(reinterpret_cast<const int8_t*>(codes) + k0, w);
  } else {
    Isa::load_int4(codes + k0 / 2, w);
  }
  for (int j = 0; j < Isa::kVecs; ++j) w[j] = Isa::mul(w[j], j * Isa::kWidth < 16 ? s_lo : s_hi);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < Isa::kVecs; ++j)
      acc[r][j & 1] = Isa::fmadd(Isa::load(x + r * K + k0 + j * Isa::kWidth), w[j], acc[r][j & 1]);
}

// out[r * N] = sum over k of x[r * K + k] * code(k) * scale(k's group) [+ sum over groups g of min(g) * xsums[r][g],
// the per-group minimum term of GGUF's Q4_1 / K-quants: w = code * scale + min], for R rows and one output column.
template <class Isa, int Bits, int R>
void column_rows(const float* x, int64_t K, const uint8_t* codes, const float* scales, int64_t group,
                 const float* mins, const float* xsums, float* out, int64_t N) {
  typename Isa::Vec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Isa::zero();
  const int64_t groups = K / group;
  if (group >= kSub) {
    for (int64_t g = 0; g < groups; ++g) {
      const auto s = Isa::set1(scales[g]);
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kSub) subblock_rows<Isa, Bits, R>(x, K, codes, k0, s, s, acc);
    }
  } else {  // group 16 (GGUF Q6_K's): two scales a subblock
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += kSub, g += 2)
      subblock_rows<Isa, Bits, R>(x, K, codes, k0, Isa::set1(scales[g]), Isa::set1(scales[g + 1]), acc);
  }
  for (int r = 0; r < R; ++r) {
    float v = Isa::hsum(Isa::add(acc[r][0], acc[r][1]));
    if (mins != nullptr) {
      const float* xs = xsums + r * groups;
      for (int64_t g = 0; g < groups; ++g) v += mins[g] * xs[g];
    }
    out[r * N] = v;
  }
}

// The activations' sums per row and group [M, K / group] (float32, in k order): what the minimum term multiplies.
at::Tensor group_sums(const float* x, int64_t M, int64_t K, int64_t group) {
  auto sums = at::empty({M, K / group}, at::kFloat);
  float* s = sums.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / group; ++g) {
      float total = 0.0f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) total += x[m * K + k];
      s[m * (K / group) + g] = total;
    }
  return sums;
}

template <class Isa, int Bits>
void small_m(const float* x, int64_t M, int64_t K, const QuantWeight& w, float* out) {
  const int64_t N = w.out_features, row_bytes = Bits == 8 ? K : K / 2, groups = K / w.group;
  const auto* codes = static_cast<const uint8_t*>(w.codes.data_ptr());
  const float* scales = w.scales.data_ptr<float>();
  const bool has_mins = w.mins.defined();
  const at::Tensor xsums = has_mins ? group_sums(x, M, K, w.group) : at::Tensor();  // once per row of x
  const float* mins = has_mins ? w.mins.data_ptr<float>() : nullptr;
  const float* xs = has_mins ? xsums.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = codes + n * row_bytes;
      const float* s = scales + n * groups;
      const float* mn = has_mins ? mins + n * groups : nullptr;
      for (int64_t m = 0; m < M; m += kRowBlock) {
        const float* xr = x + m * K;
        const float* xsr = has_mins ? xs + m * groups : nullptr;
        float* o = out + m * N + n;
        switch (std::min<int64_t>(kRowBlock, M - m)) {
          case 1: column_rows<Isa, Bits, 1>(xr, K, c, s, w.group, mn, xsr, o, N); break;
          case 2: column_rows<Isa, Bits, 2>(xr, K, c, s, w.group, mn, xsr, o, N); break;
          case 3: column_rows<Isa, Bits, 3>(xr, K, c, s, w.group, mn, xsr, o, N); break;
          default: column_rows<Isa, Bits, 4>(xr, K, c, s, w.group, mn, xsr, o, N); break;
        }
      }
    }
  });
}

template <class Isa>
void small_m_of(const float* x, int64_t M, int64_t K, const QuantWeight& w, float* out) {
  if (w.bits == 8) {
    small_m<Isa, 8>(x, M, K, w, out);
  } else {
    small_m<Isa, 4>(x, M, K, w, out);
  }
}

void small_m_on_path(const float* x, int64_t M, int64_t K, const QuantWeight& w, float* out) {
  switch (w.path) {
#ifdef BATCHSERVE_ISA_AVX512
    case QuantPath::kAvx512Vnni:
    case QuantPath::kAvx512: return small_m_of<Avx512>(x, M, K, w, out);
#endif
#ifdef BATCHSERVE_ISA_AVX2
    case QuantPath::kAvx2: return small_m_of<Avx2>(x, M, K, w, out);
#endif
    case QuantPath::kPortable: return small_m_of<Portable>(x, M, K, w, out);
    default: TORCH_CHECK(false, "quant_gemm: this path is not built here");
  }
}

// rows [n0, n1) of the weight as float32 into dst [(n1 - n0), K]: code * scale (+ min), the products the kernels form
void dequantize_rows(const QuantWeight& w, int64_t n0, int64_t n1, float* dst) {
  const int64_t K = w.in_features, row_bytes = w.bits == 8 ? K : K / 2, groups = K / w.group;
  const int64_t subs_per_group = std::max<int64_t>(1, w.group / kSub), scales_per_sub = w.group < kSub ? 2 : 1;
  const auto* codes = static_cast<const uint8_t*>(w.codes.data_ptr());
  const float* scales = w.scales.data_ptr<float>();
  const float* mins = w.mins.defined() ? w.mins.data_ptr<float>() : nullptr;
  at::parallel_for(n0, n1, 8, [&](int64_t begin, int64_t end) {
    float v[kSub];
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = codes + n * row_bytes;
      float* d = dst + (n - n0) * K;
      // a subblock's scales: its group's (group >= 32) or the next two (group 16), counted, not divided
      for (int64_t k0 = 0, in_group = 0, g = 0; k0 < K; k0 += kSub) {
        if (w.bits == 8) {
          const auto* q = reinterpret_cast<const int8_t*>(c) + k0;
          for (int j = 0; j < 32; ++j) v[j] = static_cast<float>(q[j]);
        } else {
          const uint8_t* q = c + k0 / 2;
          for (int j = 0; j < 16; ++j) {
            v[j] = static_cast<float>((q[j] & 15) - 8);
            v[j + 16] = static_cast<float>((q[j] >> 4) - 8);
          }
        }
        const int64_t row_g = n * groups + g;
        for (int half = 0; half < 2; ++half) {
          const int64_t gi = row_g + (scales_per_sub == 2 ? half : 0);
          const float s = scales[gi];
          if (mins == nullptr) {
            for (int j = 16 * half; j < 16 * half + 16; ++j) d[k0 + j] = v[j] * s;
          } else {
            for (int j = 16 * half; j < 16 * half + 16; ++j) d[k0 + j] = v[j] * s + mins[gi];
          }
        }
        if (scales_per_sub == 2) {
          g += 2;
        } else if (++in_group == subs_per_group) {
          in_group = 0;
          ++g;
        }
      }
    }
  });
}

}  // namespace

std::vector<std::string> quant_gemm_paths() {
  std::vector<std::string> paths;
  if (w8a8_built() && cpu_runs(Isa::kAvx512Vnni)) paths.push_back("avx512_vnni");
#ifdef BATCHSERVE_ISA_AVX512
  if (cpu_runs(Isa::kAvx512)) paths.push_back("avx512");
#endif
#ifdef BATCHSERVE_ISA_AVX2
  if (cpu_runs(Isa::kAvx2)) paths.push_back("avx2");
#endif
  paths.push_back("portable");
  return paths;
}

at::Tensor quant_dequantize(const QuantWeight& w) {
  auto out = at::empty({w.out_features, w.in_features}, at::kFloat);
  dequantize_rows(w, 0, w.out_features, out.data_ptr<float>());
  return out;
}

// the paths other than W8A8: float32 in and out
static at::Tensor quant_gemm_float(const at::Tensor& xc, const QuantWeight& w) {
  const int64_t M = xc.size(0), N = w.out_features, K = w.in_features;
  auto out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  if (M <= w.small_max_m) {
    small_m_on_path(xc.data_ptr<float>(), M, K, w, out.data_ptr<float>());
    return out;
  }
  // as few tiles as fit kTileFloats: each is one parallel region and one library GEMM
  const int64_t tile_rows = std::min(N, std::max<int64_t>(1, kTileFloats / K));
  auto tile = at::empty({tile_rows, K}, at::kFloat);
  // a bf16 model's activations are bf16 already: its GEMM runs on the CPU's bf16 units, float32 accumulation
  const auto lhs = w.bf16_tiles ? xc.to(at::kBFloat16) : xc;
  for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
    const int64_t n1 = std::min(N, n0 + tile_rows);
    dequantize_rows(w, n0, n1, tile.data_ptr<float>());
    const auto rows = tile.narrow(0, 0, n1 - n0);
    out.narrow(1, n0, n1 - n0).copy_(at::mm(lhs, (w.bf16_tiles ? rows.to(at::kBFloat16) : rows).t()));
  }
  return out;
}

at::Tensor quant_gemm(const at::Tensor& x, const QuantWeight& w, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.in_features, "quant_gemm: x [M, in_features]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "quant_gemm: float32 or bf16 out");
  const bool amx = quant_amx_takes(w, x);
  if (amx || (w.path == QuantPath::kAvx512Vnni && w.w8a8_codes.defined() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16))) {
    const auto xc = x.contiguous();
    auto out = at::empty({xc.size(0), w.out_features}, xc.options().dtype(out_dtype));
    if (amx) {
      quant_amx_gemm(xc, w, out);
    } else if (xc.size(0) > 0) {
      w8a8_gemm(xc, w, out);
    }
    return out;
  }
  const auto out = quant_gemm_float(x.to(at::kFloat).contiguous(), w);
  return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
}
