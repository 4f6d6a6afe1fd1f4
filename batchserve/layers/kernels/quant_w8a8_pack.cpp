// W8A8's weight repacked once, at load (quant_w8a8.h's layout): codes moved to vpdpbusd's operand order, scales and
// minimums per pair of 16-column blocks, in float16 where every value is one.
#include "aten_pch.h"  // first: the precompiled torch headers (build.py)

#include "quant_w8a8.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifdef __linux__
#include <sys/mman.h>
#endif

using namespace w8a8;

namespace {

// A packed weight from this size up lies in memory the kernel may back with 2 MiB pages (transparent huge pages,
// asked for with madvise): a batch-1 step streams every byte of it once, and on 4 KiB pages the reads pay a TLB miss
// every 4 KiB (a Q4_0 weight read about a quarter faster on huge pages on the AMX host, docs/quantization.md). Below
// it, a weight would hold a whole 2 MiB page for a few bytes.
constexpr int64_t kHugePageMinBytes = int64_t{8} << 20;
constexpr size_t kHugePage = size_t{2} << 20;

// The knob batchserve/env.py documents (BATCHSERVE_HUGE_PAGES, default on), read the same way: "0" turns it off.
bool huge_pages_wanted() {
  const char* knob = std::getenv("BATCHSERVE_HUGE_PAGES");
  return knob == nullptr || std::strcmp(knob, "0") != 0;
}

// `bytes` zeroed bytes as a tensor of `sizes` and `dtype`: on Linux from `kHugePageMinBytes` an anonymous mapping
// aligned to 2 MiB with the huge page hint (zeroed by the kernel, unmapped with the tensor), else at::zeros.
at::Tensor zeroed(at::IntArrayRef sizes, at::ScalarType dtype) {
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
#ifdef __linux__
  if (bytes >= kHugePageMinBytes && huge_pages_wanted()) {
    const size_t size = (static_cast<size_t>(bytes) + kHugePage - 1) / kHugePage * kHugePage;
    void* raw = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      char* base = static_cast<char*>(raw);
      char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1));
      if (aligned > base) munmap(base, aligned - base);  // the mapping trimmed to the aligned `size` bytes
      if (base + size + kHugePage > aligned + size) munmap(aligned + size, base + size + kHugePage - (aligned + size));
      madvise(aligned, size, MADV_HUGEPAGE);  // a hint: where THP is off the pages stay 4 KiB ones
      return at::from_blob(aligned, sizes, [size](void* p) { munmap(p, size); }, at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return at::zeros(sizes, dtype);
}

// `values` copied into zeroed()'s memory (where large, huge pages)
at::Tensor in_stream_memory(const at::Tensor& values) {
  auto out = zeroed(values.sizes(), values.scalar_type());
  out.copy_(values);
  return out;
}

// [N, G] float32 -> [N / 32][G][2 blocks][16] (zero-padded columns) of float32, or float16
at::Tensor pack_columns(const at::Tensor& per_group, at::ScalarType dtype) {
  const int64_t N = per_group.size(0), G = per_group.size(1), pairs = column_pairs(N);
  auto padded = at::zeros({pairs * kPairCols, G}, at::kFloat);
  padded.narrow(0, 0, N).copy_(per_group);
  return in_stream_memory(padded.view({pairs, kPairCols, G}).transpose(1, 2).to(dtype));
}

bool all_float16(const at::Tensor& values) { return at::equal(values.to(at::kHalf).to(at::kFloat), values); }

// code k of a row plus its offset, unsigned (4 bits: the stored nibble, code + 8; GGUF Q4_0's order, byte j of a
// subblock holds k = j low, k = j + 16 high)
uint8_t unsigned_code_at(const uint8_t* row, int64_t k, int64_t bits) {
  if (bits == 8) return static_cast<uint8_t>(row[k] ^ 0x80);
  const int64_t sub = k / 32, j = k % 32;
  const uint8_t byte = row[sub * 16 + (j & 15)];
  return j < 16 ? (byte & 15) : (byte >> 4);
}

// column c (0..31) of a pair: its codes into their places in the packed pair
void pack_column(const uint8_t* row, int64_t K, int64_t bits, int64_t c, uint8_t* pair) {
  const int64_t lane = (c / kCols) * kVector + (c % kCols) * 4;  // its block's vector, its 4 bytes there
  for (int64_t k = 0; k < K; ++k) {
    const uint8_t code = unsigned_code_at(row, k, bits);
    if (bits == 8) {
      pair[(k / 4) * kBlocks * kVector + lane + k % 4] = code;
    } else {
      const int64_t sub = k / 32, j = k % 32, p = (j % 16) / 4, i = j % 4;
      pair[(sub * 4 + p) * kBlocks * kVector + lane + i] |= static_cast<uint8_t>(code << (j < 16 ? 0 : 4));
    }
  }
}

}  // namespace

bool w8a8_supported(const QuantWeight& w) { return w.group % 32 == 0 && w.in_features % 32 == 0; }

void w8a8_pack(QuantWeight& w) {
  const int64_t N = w.out_features, K = w.in_features, pairs = column_pairs(N);
  spans_of(w);  // an activation block that does not fit the weight is refused here, at load
  auto packed = zeroed({pairs * pair_bytes(K, w.bits)}, at::kByte);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const auto* codes = static_cast<const uint8_t*>(w.codes.data_ptr());
  const int64_t row_bytes = w.bits == 8 ? K : K / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPairCols && p * kPairCols + c < N; ++c)
        pack_column(codes + (p * kPairCols + c) * row_bytes, K, w.bits, c, dst + p * pair_bytes(K, w.bits));
  });
  w.w8a8_codes = packed;
  at::Tensor mins = w.mins;
  if (w.bits == 4 && mins.defined()) {
    const at::Tensor at_eight = mins - 8 * w.scales;  // the minimum at the stored nibble 0 (Q4_1's m)
    w.w8a8_add_eight_scales = all_float16(at_eight) && at::equal(at_eight + 8 * w.scales, mins);
    if (w.w8a8_add_eight_scales) mins = at_eight;
  }
  const bool grouped = K / w.group > 1 || mins.defined();
  const bool float16 = grouped && all_float16(w.scales) && (!mins.defined() || all_float16(mins));
  const at::ScalarType dtype = float16 ? at::kHalf : at::kFloat;
  w.w8a8_scales = pack_columns(w.scales, dtype);
  w.w8a8_mins = mins.defined() ? pack_columns(mins, dtype) : at::Tensor();
}

