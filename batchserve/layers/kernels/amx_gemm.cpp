// x [M, K] @ W -> [M, N] in bfloat16 on AMX tiles (float32 accumulation); CpuLinear's GEMM for bf16 models on a CPU
// with `amx_bf16`, from decode-sized M up to a few hundred rows (mixed steps).
//
// Why not oneDNN's packed GEMM at these M: its time is the weight's streaming plus its compute, one after the other,
// while this kernel pulls the next weight panel toward L2 during the current one's tile products and keeps the panel
// in L1 while the rows pass over it (the figures: docs/cpu-kernels.md). Large M (prefill chunks of 1024 rows
// and more) stays on oneDNN, which blocks rows for cache as this kernel does not.
//
// Layout: W is packed once into panels of 32 output columns, each [K / 32][2 tiles][16][32]: one K block of a
// panel is two B tiles (columns 0-15 and 16-31), row kk of a tile holding k = 2kk and 2kk + 1 of each column, the
// pairs tdpbf16ps takes. x is read in place as A tiles (16 rows x 32 k); a row block is 32 rows (two A tiles), so the
// four C tiles hold a 32 x 32 output block over all of K. Threads split the panels.
//
// SwiGLU fused (swiglu=True): the gate/up projection packed with each panel's two tiles holding 16 gate and the same
// 16 up columns (amx_gemm_pack of swiglu_interleaved's order), so a panel's epilogue writes silu(gate) * up for 16
// columns: [M, N / 2], without writing and re-reading the unfused [M, N] or another parallel region a layer. With
// AVX-512 (every AMX CPU) it is bit for bit silu_and_mul of the unfused output: one vector body runs both.
//
// The tile operations sit behind a backend: AmxTiles issues them, EmulatedTiles runs the same ones in scalar code,
// so the packing, blocking, row tails and output rounding are tested on any CPU (BATCHSERVE_GEMM_PATH=amx_emulated).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "vec_math.h"

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define BATCHSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")))
#endif

void silu_and_mul_bf16_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);  // fused_ops.cpp

namespace {

constexpr int64_t kPanel = 32;              // output columns per panel: two B tiles
constexpr int64_t kDepth = 32;              // k per tile row (64 bytes of bf16)
constexpr int64_t kBlockRows = 32;          // rows per block: two A tiles
constexpr int64_t kKBlockBytes = 2 * 1024;  // one K block of a panel: two 16 x 64-byte B tiles

// As the tiles and vcvtne2ps2bf16 do: subnormal inputs count as zero, a subnormal result is flushed to zero, and the
// rest rounds to nearest even (a NaN stays a NaN).
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = (v & 0x7f80u) ? static_cast<uint32_t>(v) << 16 : static_cast<uint32_t>(v & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// The tile backend the same kernel body runs on. Tiles 0-3 accumulate C, 4-5 hold A, 6-7 hold B.
struct EmulatedTiles {
  alignas(64) static inline thread_local uint8_t reg[8][16][64];

  static void configure() {}
  static void release() {}
  static void zero_c() { std::memset(reg, 0, 4 * sizeof reg[0]); }
  template <bool Stream>
  static void load_a(const uint16_t* rows, int64_t stride) {  // A tiles 4, 5: rows 0-15 and 16-31 of a block
    for (int t = 0; t < 2; ++t) load(4 + t, reinterpret_cast<const char*>(rows) + 16 * t * stride, stride);
  }
  static void load_b(const char* k_block) {  // B tiles 6, 7: columns 0-15 and 16-31
    for (int t = 0; t < 2; ++t) load(6 + t, k_block + 1024 * t, 64);
  }
  static void dot_all() {  // C tile 2i + j += A tile 4 + i times B tile 6 + j
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) dot(2 * i + j, 4 + i, 6 + j);
  }
  static void store_c(float (*c)[16][16]) { std::memcpy(c, reg, 4 * sizeof reg[0]); }
  static void load(int t, const char* src, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(reg[t][r], src + r * stride, 64);
  }
  static void dot(int ct, int at, int bt) {  // C[m][n] += sum over kk, j of A[m][2kk + j] * B[kk][2n + j]
    auto* c = reinterpret_cast<float(*)[16]>(reg[ct]);
    auto* a = reinterpret_cast<const uint16_t(*)[32]>(reg[at]);
    auto* b = reinterpret_cast<const uint16_t(*)[32]>(reg[bt]);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float acc = c[m][n];
        for (int kk = 0; kk < 16; ++kk)
          acc += bf16_to_float(a[m][2 * kk]) * bf16_to_float(b[kk][2 * n]) +
                 bf16_to_float(a[m][2 * kk + 1]) * bf16_to_float(b[kk][2 * n + 1]);
        c[m][n] = acc;
      }
  }
  static void prefetch(const char*) {}
  // 32 output columns of one row: c0 and c1 (16 floats each) plus bias, rounded to bf16.
  static void write_row(const float* c0, const float* c1, const float* bias, uint16_t* out) {
    for (int n = 0; n < 16; ++n) {
      out[n] = float_to_bf16(c0[n] + (bias ? bias[n] : 0.0f));
      out[16 + n] = float_to_bf16(c1[n] + (bias ? bias[16 + n] : 0.0f));
    }
  }
};

#ifdef BATCHSERVE_AMX
struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct AmxTiles {
  AMX_TARGET static void configure() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of cfg, which lets it drop the stores above
    // (ldtilecfg then faults on a zeroed config): the barrier makes all 64 bytes reach memory first
    asm volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  AMX_TARGET static void release() { _tile_release(); }
  AMX_TARGET static void zero_c() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  template <bool Stream>  // tileloaddt1: the rows are not kept in L1, where the B panel they pass over stays
  AMX_TARGET static void load_a(const uint16_t* rows, int64_t stride) {
    if constexpr (Stream) {
      _tile_stream_loadd(4, rows, stride);
      _tile_stream_loadd(5, reinterpret_cast<const char*>(rows) + 16 * stride, stride);
    } else {
      _tile_loadd(4, rows, stride);
      _tile_loadd(5, reinterpret_cast<const char*>(rows) + 16 * stride, stride);
    }
  }
  AMX_TARGET static void load_b(const char* k_block) {
    _tile_loadd(6, k_block, 64);
    _tile_loadd(7, k_block + 1024, 64);
  }
  AMX_TARGET static void dot_all() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  AMX_TARGET static void store_c(float (*c)[16][16]) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  AMX_TARGET static void prefetch(const char* p) { prefetch_line<_MM_HINT_T1>(p); }
  AMX_TARGET static void write_row(const float* c0, const float* c1, const float* bias, uint16_t* out) {
    __m512 v0 = _mm512_loadu_ps(c0), v1 = _mm512_loadu_ps(c1);
    if (bias) {
      v0 = _mm512_add_ps(v0, _mm512_loadu_ps(bias));
      v1 = _mm512_add_ps(v1, _mm512_loadu_ps(bias + 16));
    }
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
  }
};

bool amx_permitted() {  // Linux hands out AMX's tile state only to a process that asks for it
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

struct GemmArgs {
  const uint16_t* x;     // [M, K], rows K apart
  const uint16_t* tail;  // the last M % 32 rows copied into a zeroed [32, K] block, or null
  const char* packed;    // [N / 32] panels of K / 32 blocks
  const float* bias;     // [N] or null
  uint16_t* out;         // [M, N], or [M, N / 2] with swiglu
  int64_t K, N, full_blocks, tail_rows;
  bool swiglu;           // each panel is 16 gate and 16 up columns: out = silu(gate) * up
};

// A finished output block (one panel x one row block) whose rows are still to be written: its C tiles sit in a
// buffer, and its rows are rounded (and SwiGLU'd) a few at a time in the tile steps of the next block, where the
// vector units are otherwise idle while the tiles multiply.
struct PendingRows {
  int64_t panel = 0, block = 0, rows = 0, done = 0;
};

// Rows [pend.done, upto) of a pending block out of its C tiles c.
template <class Tiles>
__attribute__((always_inline)) inline void write_rows(const GemmArgs& g, const float (*c)[16][16], PendingRows& pend,
                                                      int64_t upto) {
  const float* bias = g.bias ? g.bias + pend.panel * kPanel : nullptr;
  for (; pend.done < upto; ++pend.done) {
    const int64_t r = pend.done, row = pend.block * kBlockRows + r;
    const int t = static_cast<int>(r / 16) * 2;
    if (g.swiglu) {  // rounded to bf16 first, as the unfused GEMM's output is
      alignas(64) uint16_t gate_up[kPanel];
      Tiles::write_row(c[t][r % 16], c[t + 1][r % 16], nullptr, gate_up);
      silu_and_mul_bf16_row(gate_up, gate_up + 16, g.out + row * (g.N / 2) + pend.panel * 16, 16);
    } else {
      Tiles::write_row(c[t][r % 16], c[t + 1][r % 16], bias, g.out + row * g.N + pend.panel * kPanel);
    }
  }
}

// Panels [p0, p1) of the output, all rows. While a panel's blocks run, the next panel's bytes are prefetched, spread
// over its (blocks x K blocks) tile steps: only the first row block reads a panel from memory. StreamA: x passes
// through L1 once per panel without evicting the panel (more than one row block; with one, x stays in L1 instead).
// Each block's output rows are written during the next block's tile steps (PendingRows): written after its own
// steps instead, the rows (the SwiGLU epilogue most of all) took a large share of the GEMMs' time at mixed-step M.
template <class Tiles, bool StreamA>
__attribute__((always_inline)) inline void gemm_panels(const GemmArgs& g, int64_t p0, int64_t p1) {
  Tiles::configure();
  alignas(64) float c[4][16][16];
  const int64_t kblocks = g.K / kDepth, panel_bytes = kblocks * kKBlockBytes;
  const int64_t blocks = g.full_blocks + (g.tail_rows > 0), lines = panel_bytes / 64;
  const int64_t lines_per_step = (lines + blocks * kblocks - 1) / (blocks * kblocks);
  const int64_t rows_per_step = (kBlockRows + kblocks - 1) / kblocks;
  PendingRows pend;
  for (int64_t p = p0; p < p1; ++p) {
    const char* panel = g.packed + p * panel_bytes;
    const char* next = p + 1 < p1 ? panel + panel_bytes : nullptr;
    int64_t line = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* a = b < g.full_blocks ? g.x + b * kBlockRows * g.K : g.tail;
      Tiles::zero_c();
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        for (int64_t i = 0; next && i < lines_per_step && line < lines; ++i, ++line) Tiles::prefetch(next + line * 64);
        Tiles::template load_a<StreamA>(a + kb * kDepth, g.K * 2);
        Tiles::load_b(panel + kb * kKBlockBytes);
        Tiles::dot_all();
        write_rows<Tiles>(g, c, pend, std::min(pend.rows, pend.done + rows_per_step));
      }
      write_rows<Tiles>(g, c, pend, pend.rows);
      Tiles::store_c(c);
      pend = PendingRows{p, b, b < g.full_blocks ? kBlockRows : g.tail_rows, 0};
    }
  }
  write_rows<Tiles>(g, c, pend, pend.rows);
  Tiles::release();
}

#ifdef BATCHSERVE_AMX
// Each variant is its own flattened function: both inlined into one ran the single-block case slower.
AMX_TARGET __attribute__((flatten, noinline)) void amx_panels_streaming(const GemmArgs& g, int64_t p0, int64_t p1) {
  gemm_panels<AmxTiles, true>(g, p0, p1);
}
AMX_TARGET __attribute__((flatten, noinline)) void amx_panels_cached(const GemmArgs& g, int64_t p0, int64_t p1) {
  gemm_panels<AmxTiles, false>(g, p0, p1);
}
void amx_panels(const GemmArgs& g, int64_t p0, int64_t p1) {
  if (g.full_blocks + (g.tail_rows > 0) > 1) return amx_panels_streaming(g, p0, p1);
  amx_panels_cached(g, p0, p1);
}
#endif

void emulated_panels(const GemmArgs& g, int64_t p0, int64_t p1) { gemm_panels<EmulatedTiles, false>(g, p0, p1); }

}  // namespace

bool amx_gemm_available() {  // built with AMX, and the kernel lets this process use its tiles (none: no AMX)
#ifdef BATCHSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

bool amx_gemm_takes(int64_t n, int64_t k) { return n > 0 && k > 0 && n % kPanel == 0 && k % kDepth == 0; }

at::Tensor amx_gemm_pack(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: [N, K] bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(amx_gemm_takes(N, K), "amx_gemm needs N a multiple of 32 and K a multiple of 32");
  // [panel][K block][tile][kk][n][j] = W[panel * 32 + tile * 16 + n][K block * 32 + 2kk + j]
  return weight.contiguous()
      .view({N / kPanel, 2, 16, K / kDepth, 16, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({N / kPanel, K / kDepth, 2, 16, 32});
}

at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, bool emulated,
                       bool swiglu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x: [M, K] bfloat16, CPU");
  TORCH_CHECK(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32 &&
                  packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "packed: amx_gemm_pack's [N / 32, K / 32, 2, 16, 32]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kPanel;
  TORCH_CHECK(packed.size(1) * kDepth == K && K > 0, "x and the packed weight disagree on K");
  TORCH_CHECK(packed.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()), "CPU tensors only");
  TORCH_CHECK(emulated || amx_gemm_available(), "amx_gemm needs a CPU with amx_bf16 (or emulated=True)");
  TORCH_CHECK(!swiglu || !bias.has_value(), "amx_gemm: no bias with swiglu");
  x = x.contiguous();
  auto out = at::empty({M, swiglu ? N / 2 : N}, x.options());
  if (M == 0) return out;
  at::Tensor bias32, tail;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias: [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const int64_t full_blocks = M / kBlockRows, tail_rows = M % kBlockRows;
  if (tail_rows) {
    tail = at::zeros({kBlockRows, K}, x.options());
    tail.narrow(0, 0, tail_rows).copy_(x.narrow(0, full_blocks * kBlockRows, tail_rows));
  }
  const GemmArgs g{reinterpret_cast<const uint16_t*>(x.data_ptr()),
                   tail_rows ? reinterpret_cast<const uint16_t*>(tail.data_ptr()) : nullptr,
                   reinterpret_cast<const char*>(packed.data_ptr()),
                   bias.has_value() ? bias32.data_ptr<float>() : nullptr,
                   reinterpret_cast<uint16_t*>(out.data_ptr()),
                   K, N, full_blocks, tail_rows, swiglu};
  at::parallel_for(0, N / kPanel, 0, [&](int64_t p0, int64_t p1) {
#ifdef BATCHSERVE_AMX
    if (!emulated) return amx_panels(g, p0, p1);
#endif
    emulated_panels(g, p0, p1);
  });
  return out;
}
