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
// The tile operations sit behind a backend (amx_tiles.h): AmxTiles issues them, EmulatedTiles runs the same ones in
// scalar code, so the packing, blocking, row tails and output rounding are tested on any CPU
// (BATCHSERVE_GEMM_PATH=amx_emulated).
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"

void silu_and_mul_bf16_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n);  // fused_ops.cpp

namespace {

using namespace amx;

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
