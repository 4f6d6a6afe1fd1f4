// Paged prefill attention of a bfloat16 pool on AMX tiles: prefill_tiles.h's body with Q.K^T and P.V as tile products
// (float32 accumulation). The tile operations sit behind a backend, as in amx_gemm.cpp: AMX's, or amx_tiles.h's scalar
// emulation (the "amx_emulated" path, which tests run anywhere).
#include "isa.h"

#ifdef BATCHSERVE_ISA_AVX512
#include "prefill_tiles.h"

namespace {

#ifdef BATCHSERVE_AMX
template <int D>
AMX_TARGET __attribute__((flatten, noinline)) void amx_items(const std::vector<WorkItem>& items,
                                                             const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  attend_items<amx::AmxTiles, D>(items, a, queue);
}
#endif

template <int D>
void emulated_items(const std::vector<WorkItem>& items, const PagedArgs<c10::BFloat16>& a, WorkQueue& queue) {
  attend_items<amx::EmulatedTiles, D>(items, a, queue);
}

template <int D>
void attend_on_tiles(const PagedArgs<c10::BFloat16>& a, bool emulated) {
  attend<D>(a, [&](const std::vector<WorkItem>& items, WorkQueue& queue) {
#ifdef BATCHSERVE_AMX
    if (!emulated) return amx_items<D>(items, a, queue);
#endif
    emulated_items<D>(items, a, queue);
  });
}

}  // namespace

bool prefill_attention_amx(const PagedArgs<c10::BFloat16>& a, bool emulated) {
#ifndef BATCHSERVE_AMX
  if (!emulated) return false;
#endif
  if (a.head_dim == 64) return attend_on_tiles<64>(a, emulated), true;
  if (a.head_dim == 128) return attend_on_tiles<128>(a, emulated), true;
  if (a.head_dim == 32) return attend_on_tiles<32>(a, emulated), true;
  return false;
}

#endif  // BATCHSERVE_ISA_AVX512
