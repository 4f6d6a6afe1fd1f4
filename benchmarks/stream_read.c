// The host's streaming read rate, the yardstick of a batch-1 decode step: each thread sums its share of a buffer
// with 64-byte AVX-512 loads (four independent accumulators, so the loads are not serialised behind the adds),
// optionally asking for the line `ahead` bytes on into L2 as the W8A8 kernel does. Compiled and loaded by
// stream_read.py; times are each thread's CPU clock, so a shared host's other work is not counted.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double thread_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

char* stream_buffer(size_t bytes, int huge) {
  void* p = NULL;
  if (posix_memalign(&p, 2 << 20, bytes) != 0) return NULL;
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  memset(p, 1, bytes);  // fault every page in before timing
  return p;
}

void stream_free(char* p) { free(p); }

struct Share {
  const char* p;
  size_t bytes;
  int passes;
  size_t ahead;
  double seconds;
  long long sink;
};

static void* read_share(void* arg) {
  struct Share* s = arg;
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  const double t0 = thread_seconds();
  for (int pass = 0; pass < s->passes; ++pass) {
    for (const char* q = s->p; q < s->p + s->bytes; q += 256) {
      if (s->ahead) {
        for (int line = 0; line < 4; ++line) _mm_prefetch(q + s->ahead + 64 * line, _MM_HINT_T1);
      }
      a0 = _mm512_add_epi32(a0, _mm512_load_si512(q));
      a1 = _mm512_add_epi32(a1, _mm512_load_si512(q + 64));
      a2 = _mm512_add_epi32(a2, _mm512_load_si512(q + 128));
      a3 = _mm512_add_epi32(a3, _mm512_load_si512(q + 192));
    }
  }
  s->seconds = thread_seconds() - t0;
  s->sink = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
  return NULL;
}

// GB/s of CPU time summed over `threads` threads, each reading its contiguous share `passes` times
double stream_read(const char* p, size_t bytes, int threads, int passes, size_t ahead) {
  pthread_t ids[16];
  struct Share shares[16];
  const size_t share = bytes / threads / 256 * 256;
  for (int t = 0; t < threads; ++t) {
    shares[t] = (struct Share){p + t * share, share, passes, ahead, 0.0, 0};
    pthread_create(&ids[t], NULL, read_share, &shares[t]);
  }
  double rate = 0.0;
  for (int t = 0; t < threads; ++t) {
    pthread_join(ids[t], NULL);
    rate += (double)share * passes / shares[t].seconds / 1e9;
  }
  return rate;
}

// GB/s of CPU time (this thread's clock) reading `n` runs of memory in order, run i at address addrs[i], `bytes[i]`
// long (a multiple of 64), with the same loads as read_share; with `ahead` set, run i + 1's lines are asked for into
// L2 when run i starts. The access pattern of a decode attention kernel over scattered KV blocks, without its maths.
double runs_read(const int64_t* addrs, const int64_t* bytes, int64_t n, int ahead) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0;
  double total = 0.0;
  const double t0 = thread_seconds();
  for (int64_t i = 0; i < n; ++i) {
    const char* q = (const char*)addrs[i];
    if (ahead && i + 1 < n)
      for (int64_t b = 0; b < bytes[i + 1]; b += 64) _mm_prefetch((const char*)addrs[i + 1] + b, _MM_HINT_T1);
    for (int64_t b = 0; b + 128 <= bytes[i]; b += 128) {
      a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(q + b));
      a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(q + b + 64));
    }
    total += bytes[i];
  }
  const double seconds = thread_seconds() - t0;
  volatile int sink = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
  (void)sink;
  return total / seconds / 1e9;
}
