// AMX's tile operations behind one interface, shared by the bf16 GEMM (amx_gemm.cpp) and the quantized weights'
// AMX GEMM (quant_amx.cpp): AmxTiles issues them, EmulatedTiles runs the same ones in scalar code, so a kernel's
// packing, blocking, row tails and output rounding are tested on any CPU (the "amx_emulated" path).
// Tiles 0-3 accumulate C (a 32 x 32 output block), 4-5 hold A (32 rows x 32 k of bf16), 6-7 hold B (a K block of a
// 32-column panel: [2 tiles][16 kk][16 n][2 j], row kk holding k = 2kk and 2kk + 1 of each column).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec_math.h"

// The AMX kernels are compiled where the build's CPU has AMX (-march=native then targets amx-tile and amx-bf16): the
// build is keyed by this CPU's flags and never runs on another, so elsewhere they would be code no call reaches (the
// emulated tiles below are compiled everywhere, for the tests).
#if defined(__x86_64__) && defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BATCHSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512bw,avx512vl")))
#endif

namespace amx {

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
  // C tiles from / into a 32 x 32 float block of rows `stride` bytes apart: tile 2i + j its rows 16i.., columns 16j..
  static void load_c(const float* c, int64_t stride) {
    for (int t = 0; t < 4; ++t)
      load(t, reinterpret_cast<const char*>(c + 16 * (t % 2)) + 16 * (t / 2) * stride, stride);
  }
  static void store_c(float* c, int64_t stride) {
    for (int t = 0; t < 4; ++t)
      for (int r = 0; r < 16; ++r)
        std::memcpy(reinterpret_cast<char*>(c + 16 * (t % 2)) + (16 * (t / 2) + r) * stride, reg[t][r], 64);
  }
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
  AMX_TARGET static void load_c(const float* c, int64_t stride) {
    const char* rows = reinterpret_cast<const char*>(c);
    _tile_loadd(0, rows, stride);
    _tile_loadd(1, rows + 64, stride);
    _tile_loadd(2, rows + 16 * stride, stride);
    _tile_loadd(3, rows + 16 * stride + 64, stride);
  }
  AMX_TARGET static void store_c(float* c, int64_t stride) {
    char* rows = reinterpret_cast<char*>(c);
    _tile_stored(0, rows, stride);
    _tile_stored(1, rows + 64, stride);
    _tile_stored(2, rows + 16 * stride, stride);
    _tile_stored(3, rows + 16 * stride + 64, stride);
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

inline bool amx_permitted() {  // Linux hands out AMX's tile state only to a process that asks for it
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
#endif

}  // namespace amx
