// Linear layers for a few rows (decode), reading each weight once at memory speed.
//
//   skinny_pack(w) -> packed                      w [N, K] -> [ceil(N/4), ceil(K/W), 4, W]
//   skinny_linear(x, packed, bias, N) -> out      out = x @ w^T (+ bias); x [..., K], out [..., N]
//
// At batch 1 a decode step is one pass over every weight, so its floor is the weights' bytes
// over the memory bandwidth. oneDNN's packed GEMM (cluster/model/layers/cpu_gemm.py) streamed
// SmolLM2's 120 layer GEMMs at ~19 GB/s of this EPYC's ~33 (a sum reads 34). What it costs is the
// access pattern, not the arithmetic: on this machine one thread reading four rows of a
// row-major weight at once got 23 GB/s, reading one sequential stream 32. So `skinny_pack`
// interleaves each block of four output features vector by vector, and a task reads its blocks
// front to back as a single stream: 32.6 GB/s at M = 1, 30 at 2, 27 at 4 (K = 576, two threads);
// past ~4 rows the fp32 FMAs, not the bytes, bound it and oneDNN's bf16 dot products win.
// One stream a thread is still short of the memory's speed: a core keeps only so many line
// fills in flight, and the hardware prefetcher stops at 4 KB pages. So each step of the loop
// also prefetches the lines kPrefetchBytes ahead in the thread's range (the next blocks, the
// next task item: a thread's items are contiguous). On a 2-core Xeon (AVX512-BF16, no AMX),
// SmolLM2's 120 layer weights and LM head from DRAM, two threads: 22 GB/s without, 30 with it
// at 3-6 KB ahead (a plain sum reads 35).
//
// Math: per block of four features and each row of x, one fp32 accumulator per vector lane;
// weights widened exactly (bf16 -> fp32 is a 16-bit shift), products and sums in fp32, one
// rounding into out. x is widened to fp32 once per call (M x K floats, in L1). bf16 weights
// times bf16 x on a CPU with AVX512-BF16 take vdpbf16ps instead (`block_dot_pairs`): the same
// exact products summed in fp32 in another order, 32 of them an instruction, where widening
// spends three instructions on 16 (9.0 vs 10.4 ms for SmolLM2's weights on the Xeon above).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "ops.h"

namespace {

using namespace llmc;

constexpr int kBlock = 4;  // output features interleaved per block: 4 x M accumulators
// Rows of x per pass: a float weight keeps 4 x M accumulators, a quantized one twice that
// (a group's partial sums beside the totals); AVX2 has half AVX-512's registers.
constexpr int kMaxRows = W == 8 ? 2 : 4;
constexpr int kMaxRowsQuant = W == 8 ? 1 : 2;
// An fp32 weight's pass (block_dot): with AVX2, 3 rows x 4 features = 12 accumulators, the
// pass's 3 x vectors and one weight vector at a time fill the 16 registers exactly. (A bf16
// weight's widening needs a register more: it keeps kMaxRows, measured no faster at three.)
constexpr int kMaxRowsFp32 = W == 8 ? 3 : 4;
// Blocks per parallel task item: a few KB of weights each, enough items for the threads to
// balance; the threads' contiguous ranges are each one stream.
constexpr int64_t kTaskBytes = 64 * 1024;
constexpr int64_t kWidenMaxRows = 2;  // packed_linear: rows up to which int8 with offsets runs int8_linear
constexpr int64_t kQ4Run = 32;  // 4-bit values per 16 packed bytes (GGUF's block: value i in byte i % 16)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the loads the loop prefetches

// Prefetch the `bytes` (a multiple of 64, or less than a line) kPrefetchBytes past `p`.
inline void prefetch_ahead(const void* p, int64_t bytes) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const char* c = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
#else
  (void)p, (void)bytes;
#endif
}

int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// [N, K] -> [N/4, K/W, 4, W] (zero-padded): vector v of feature r of block b at ((b kv + v) 4 + r) W.
template <typename T>
void pack(T* dst, const T* w, int64_t N, int64_t K) {
  const int64_t kv = padded(K, W) / W;
  at::parallel_for(0, padded(N, kBlock) / kBlock, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t v = 0; v < kv; ++v)
        for (int r = 0; r < kBlock; ++r) {
          T* d = dst + ((b * kv + v) * kBlock + r) * W;
          const int64_t n = b * kBlock + r;
          for (int i = 0; i < W; ++i) {
            const int64_t k = v * W + i;
            d[i] = (n < N && k < K) ? w[n * K + k] : T(0.f);
          }
        }
  });
}

// [N, G] per-group values -> [N/4, G, 4] (zero-padded).
template <typename T>
void pack_groups(T* dst, const T* src, int64_t N, int64_t groups) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < groups; ++g) dst[((n / kBlock) * groups + g) * kBlock + n % kBlock] = src[n * groups + g];
}

// ---- weight formats: vector v (W wide) of feature r of block b, widened to fp32 ------------

template <typename T>
struct DenseWeight {  // skinny_pack's layout
  static constexpr bool kQuantized = false;
  const T* p;
  int64_t kv;
  vf load(int64_t b, int64_t v, int r) const { return vload(p + ((b * kv + v) * kBlock + r) * W); }
  void prefetch(int64_t b, int64_t v) const { prefetch_ahead(p + (b * kv + v) * kBlock * W, kBlock * W * sizeof(T)); }
};

// w = q * scale(group), scale per (feature, group of vpg vectors).
struct Int8Weight {
  static constexpr bool kQuantized = true, kHasMin = false;
  const int8_t* q;
  const float* s;
  int64_t kv, groups, vpg;
  vf load(int64_t b, int64_t v, int r) const { return vload(q + ((b * kv + v) * kBlock + r) * W); }
  void prefetch(int64_t b, int64_t v) const { prefetch_ahead(q + (b * kv + v) * kBlock * W, kBlock * W); }
  float scale(int64_t b, int64_t g, int r) const { return s[(b * groups + g) * kBlock + r]; }
  float min(int64_t, int64_t, int) const { return 0.f; }
};

// w = q * d(group) + m(group), q in [0, 15] packed two to a byte: in each run of 32 values of a
// feature, value i is byte i % 16's low nibble (i < 16) or high nibble, as in GGUF's Q4 blocks
// (Q4_1; Q4_0 is m = -8 d). d and m fp16 per (feature, group). One 16-byte load and a mask (and
// a shift for the high half) give a vector of 16 values: the widening, not the bytes, is what
// a 4-bit decode step spends its time on.
struct Q4Weight {
  static constexpr bool kQuantized = true, kHasMin = true;
  const uint8_t* q;
  const c10::Half* d;
  const c10::Half* m;
  int64_t runs, groups, vpg;
  vf load(int64_t b, int64_t v, int r) const {
    constexpr int64_t per_run = kQ4Run / W;  // vectors per run
    const uint8_t* run = q + ((b * runs + v / per_run) * kBlock + r) * 16;
#if defined(__AVX512F__)
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
    const __m128i nib = _mm_and_si128((v & 1) ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nib));
#elif defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + (v & 1) * 8));
    const __m128i nib = _mm_and_si128((v & 2) ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nib));
#else
    const int i = static_cast<int>(v % kQ4Run);
    return static_cast<float>(i < 16 ? run[i] & 0x0F : run[i - 16] >> 4);
#endif
  }
  void prefetch(int64_t b, int64_t v) const {  // a run of the block's four features is one line
    constexpr int64_t per_run = kQ4Run / W;
    if (v % per_run == 0) prefetch_ahead(q + (b * runs + v / per_run) * kBlock * 16, kBlock * 16);
  }
  float scale(int64_t b, int64_t g, int r) const { return static_cast<float>(d[(b * groups + g) * kBlock + r]); }
  float min(int64_t b, int64_t g, int r) const { return static_cast<float>(m[(b * groups + g) * kBlock + r]); }
};

// ---- the dot products of one block -----------------------------------------------------------

// Rows 0..MC of x (fp32, kv vectors a row) against a float block, into sums[MC][4].
template <int MC, typename Wt>
inline void block_dot(const Wt& w, int64_t b, const float* x, const float*, int64_t kv, float* sums) {
  vf acc[MC][kBlock];
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = vzero();
  for (int64_t v = 0; v < kv; ++v) {
    w.prefetch(b, v);
    vf xv[MC];  // each weight vector is loaded once and meets every row's x
    for (int c = 0; c < MC; ++c) xv[c] = vload(x + c * kv * W + v * W);
    for (int r = 0; r < kBlock; ++r) {
      const vf wr = w.load(b, v, r);
      for (int c = 0; c < MC; ++c) acc[c][r] = vfma(wr, xv[c], acc[c][r]);
    }
  }
  for (int c = 0; c < MC; ++c) hsum4(acc[c], sums + c * kBlock);
}

// The same for a quantized block, its scales factored out of the sums: per group, the dot of
// the raw q with x, times the group's scale; plus the group's min times x's sum over the group
// (xg [MC][groups]). A per-feature scale (one group) costs one multiply per feature.
template <int MC, typename Wt>
inline void block_dot_quant(const Wt& w, int64_t b, const float* x, const float* xg, int64_t kv, float* sums) {
  vf acc[MC][kBlock];
  float mins[MC][kBlock] = {};
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = vzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    vf part[MC][kBlock];
    for (int c = 0; c < MC; ++c)
      for (int r = 0; r < kBlock; ++r) part[c][r] = vzero();
    const int64_t v1 = std::min(kv, (g + 1) * w.vpg);
    for (int64_t v = g * w.vpg; v < v1; ++v) {
      w.prefetch(b, v);
      const vf w0 = w.load(b, v, 0), w1 = w.load(b, v, 1), w2 = w.load(b, v, 2), w3 = w.load(b, v, 3);
      for (int c = 0; c < MC; ++c) {
        const vf xv = vload(x + c * kv * W + v * W);
        part[c][0] = vfma(w0, xv, part[c][0]);
        part[c][1] = vfma(w1, xv, part[c][1]);
        part[c][2] = vfma(w2, xv, part[c][2]);
        part[c][3] = vfma(w3, xv, part[c][3]);
      }
    }
    for (int r = 0; r < kBlock; ++r) {
      const vf scale = vset(w.scale(b, g, r));
      for (int c = 0; c < MC; ++c) acc[c][r] = vfma(part[c][r], scale, acc[c][r]);
      if (Wt::kHasMin) {
        const float mn = w.min(b, g, r);
        for (int c = 0; c < MC; ++c) mins[c][r] += mn * xg[c * w.groups + g];
      }
    }
  }
  for (int c = 0; c < MC; ++c) {
    hsum4(acc[c], sums + c * kBlock);
    for (int r = 0; r < kBlock; ++r) sums[c * kBlock + r] += mins[c][r];
  }
}

template <typename Wt>
inline void run_block(const Wt& w, int64_t b, int mc, const float* x, const float* xg, int64_t kv, float* sums) {
  if constexpr (Wt::kQuantized) {
    switch (mc) {
      case 1: block_dot_quant<1>(w, b, x, xg, kv, sums); break;
#if !(defined(__AVX2__) && !defined(__AVX512F__))
      case 2: block_dot_quant<2>(w, b, x, xg, kv, sums); break;
#endif
    }
  } else {
    switch (mc) {
      case 1: block_dot<1>(w, b, x, xg, kv, sums); break;
      case 2: block_dot<2>(w, b, x, xg, kv, sums); break;
      case 3: block_dot<3>(w, b, x, xg, kv, sums); break;
#if !(defined(__AVX2__) && !defined(__AVX512F__))
      case 4: block_dot<4>(w, b, x, xg, kv, sums); break;
#endif
    }
  }
}

#if defined(__AVX512F__)
#define LLMC_BF16 __attribute__((target("avx512bf16")))

bool has_bf16_pairs() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Rows 0..MC of x (bf16, zero-padded to kv vectors a row) against block b of skinny_pack's bf16
// layout. Vectors v and v + 1 of a feature (16 values each) become one register of 32, matched
// by 32 consecutive values of x, and vdpbf16ps adds the products of each pair to a lane.
template <int MC>
LLMC_BF16 void block_dot_pairs(const bf16* p, int64_t kv, int64_t b, const bf16* x, float* sums) {
  __m512 acc[MC][kBlock];
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = _mm512_setzero_ps();
  const bf16* block = p + b * kv * kBlock * W;
  auto half = [&](int64_t v, int r) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (v * kBlock + r) * W));
  };
  for (int64_t v = 0; v < kv; v += 2) {
    const bool pair = v + 1 < kv;  // else K's last vector, alone: the upper half is zero
    prefetch_ahead(block + v * kBlock * W, (pair ? 2 : 1) * kBlock * W * sizeof(bf16));
    __m512i w[kBlock];
    for (int r = 0; r < kBlock; ++r)
      w[r] = pair ? _mm512_inserti64x4(_mm512_castsi256_si512(half(v, r)), half(v + 1, r), 1)
                  : _mm512_zextsi256_si512(half(v, r));
    for (int c = 0; c < MC; ++c) {
      const bf16* xc = x + (c * kv + v) * W;
      const __m512i xv = pair ? _mm512_loadu_si512(xc)
                              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)));
      for (int r = 0; r < kBlock; ++r)
        acc[c][r] = _mm512_dpbf16_ps(acc[c][r], reinterpret_cast<__m512bh&>(w[r]), reinterpret_cast<const __m512bh&>(xv));
    }
  }
  for (int c = 0; c < MC; ++c) hsum4(acc[c], sums + c * kBlock);
}

void run_block_pairs(const bf16* p, int64_t kv, int64_t b, int mc, const bf16* x, float* sums) {
  switch (mc) {
    case 1: block_dot_pairs<1>(p, kv, b, x, sums); break;
    case 2: block_dot_pairs<2>(p, kv, b, x, sums); break;
    case 3: block_dot_pairs<3>(p, kv, b, x, sums); break;
    case 4: block_dot_pairs<4>(p, kv, b, x, sums); break;
  }
}
#else
bool has_bf16_pairs() { return false; }
void run_block_pairs(const bf16*, int64_t, int64_t, int, const bf16*, float*) {}
#endif

// ---- 4-bit weights times int8 activations (AVX512-VNNI) ---------------------------------------
//
// Widening 4-bit values to fp32 costs four instructions per 16 and one FMA each: a Q4 decode step
// was compute-bound, slower than Q8_0's with half the bytes. On a CPU with AVX512-VNNI, x is
// instead quantized per row and run of 32 inputs (the weight's runs), as llama.cpp's Q4 dot
// products quantize it (Q8_1): s = absmax / 127, xq = round(x * 127 / absmax) to nearest even
// (an all-zero run: s = 1, xq = 0), and each run's sum of q * xq is exact in int32 (vpdpbusd:
// the weight's unsigned nibbles times xq's signed bytes, 64 products an instruction). Then
// out = sum over runs of d * s * (q . xq) + m * (x's exact fp32 sum over the run), in fp32, one
// rounding. A run of the block's four features is one 64-byte line: its low nibbles are values
// 0-15 of each feature, its high nibbles 16-31; features 0-1 and 2-3 each fill one register,
// matched by xq laid out [0-15, 0-15, 16-31, 16-31].

// x [M, K] -> per row and run j: 64 bytes of xq as above, s and the fp32 sum of the run.
struct Int8Runs {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

#if defined(__AVX512F__)
template <typename T>
Int8Runs quantize_runs(const T* x, int64_t M, int64_t K) {
  const int64_t runs = K / kQ4Run;
  Int8Runs r{std::vector<int8_t>(M * runs * 64), std::vector<float>(M * runs), std::vector<float>(M * runs)};
  for (int64_t i = 0; i < M * runs; ++i) {  // run i % runs of row i / runs: x's elements i*32..
    const vf a = vload(x + i * kQ4Run), b = vload(x + i * kQ4Run + W);
    const float amax = _mm512_reduce_max_ps(vmax(vabs(a), vabs(b)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    r.scale[i] = amax > 0.f ? amax / 127.f : 1.f;
    r.sum[i] = hsum(vadd(a, b));
    const __m128i qa = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(vmul(a, vset(inv))));
    const __m128i qb = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(vmul(b, vset(inv))));
    _mm512_storeu_si512(r.q.data() + i * 64, _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(qa, qa)), _mm256_set_m128i(qb, qb), 1));
  }
  return r;
}

// Rows 0..MC (xq, s, sums of `runs` runs each) against block b of q4_pack's layout -> sums[MC][4].
template <int MC>
LLMC_VNNI void block_dot_q4_vnni(const Q4Weight& w, int64_t b, const int8_t* xq, const float* xs, const float* xsum,
                                 int64_t runs, float* sums) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  // A feature's d in the lanes its products land in: 0-3 and 8-11 (feature 0 or 2), 4-7 and 12-15.
  const __m512i pick01 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  const __m512i pick23 = _mm512_add_epi32(pick01, _mm512_set1_epi32(2));
  vf acc01[MC], acc23[MC];
  __m128 mins[MC];
  for (int c = 0; c < MC; ++c) acc01[c] = acc23[c] = vzero(), mins[c] = _mm_setzero_ps();
  const int64_t runs_per_group = runs / w.groups;
  for (int64_t j = 0; j < runs; ++j) {
    const uint8_t* line = w.q + (b * runs + j) * kBlock * 16;
    prefetch_ahead(line, 64);
    const __m512i bytes = _mm512_loadu_si512(line);
    const __m512i lo = _mm512_and_si512(bytes, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    const __m512i w01 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));  // f0 lo, f1 lo, f0 hi, f1 hi
    const __m512i w23 = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
    const int64_t g = (b * w.groups + j / runs_per_group) * kBlock;
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.d + g)));
    const __m128 m = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.m + g)));
    const vf d01 = _mm512_permutexvar_ps(pick01, _mm512_castps128_ps512(d));
    const vf d23 = _mm512_permutexvar_ps(pick23, _mm512_castps128_ps512(d));
    for (int c = 0; c < MC; ++c) {
      const __m512i xv = _mm512_loadu_si512(xq + (c * runs + j) * 64);
      const vf s = vset(xs[c * runs + j]);
      const __m512i p01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, xv);
      const __m512i p23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, xv);
      acc01[c] = vfma(vmul(_mm512_cvtepi32_ps(p01), d01), s, acc01[c]);
      acc23[c] = vfma(vmul(_mm512_cvtepi32_ps(p23), d23), s, acc23[c]);
      mins[c] = _mm_fmadd_ps(m, _mm_set1_ps(xsum[c * runs + j]), mins[c]);
    }
  }
  for (int c = 0; c < MC; ++c) {
    alignas(64) float lanes[2][W];
    float mn[kBlock];
    vstore(lanes[0], acc01[c]), vstore(lanes[1], acc23[c]);
    _mm_storeu_ps(mn, mins[c]);
    for (int r = 0; r < kBlock; ++r) {
      const float* l = lanes[r / 2] + (r % 2) * 4;
      sums[c * kBlock + r] = (l[0] + l[1] + l[2] + l[3]) + (l[8] + l[9] + l[10] + l[11]) + mn[r];
    }
  }
}

void run_block_q4_vnni(const Q4Weight& w, int64_t b, int mc, const int8_t* xq, const float* xs, const float* xsum,
                       int64_t runs, float* sums) {
  switch (mc) {
    case 1: block_dot_q4_vnni<1>(w, b, xq, xs, xsum, runs, sums); break;
    case 2: block_dot_q4_vnni<2>(w, b, xq, xs, xsum, runs, sums); break;
    case 3: block_dot_q4_vnni<3>(w, b, xq, xs, xsum, runs, sums); break;
    case 4: block_dot_q4_vnni<4>(w, b, xq, xs, xsum, runs, sums); break;
  }
}
#endif

#if defined(__AVX2__)
// The same W4A8 product without VNNI (the AVX2 build; the AVX-512 build on a CPU without it), as
// llama.cpp's AVX2 Q4 dot products: features 0-1 (and 2-3) of a run are 32 bytes, their low
// nibbles values 0-15 and high nibbles 16-31 of each; vpmaddubsw multiplies them by xq's
// [0-15, 0-15] and [16-31, 16-31] halves and sums adjacent pairs (at most 2 x 15 x 127 each,
// twice: no int16 saturation), vpmaddwd by ones widens to int32: lanes 0-3 feature 0 (or 2),
// lanes 4-7 feature 1 (or 3). Exact integers per run, then d s in fp32 as above.
#define LLMC_AVX2_Q4 __attribute__((target("avx2,fma,f16c")))

// kQ4Halves: each run's 32 bytes as [0-15, 0-15, 16-31, 16-31] (64 bytes, block_dot_q4_avx2's
// layout), else as they are (32 bytes, block_dot_int8_avx2's).
template <bool kQ4Halves = true, typename T>
Int8Runs quantize_runs_plain(const T* x, int64_t M, int64_t K) {
  const int64_t runs = K / kQ4Run, bytes = kQ4Halves ? 64 : kQ4Run;
  Int8Runs r{std::vector<int8_t>(M * runs * bytes), std::vector<float>(M * runs), std::vector<float>(M * runs)};
  for (int64_t i = 0; i < M * runs; ++i) {
    const T* run = x + i * kQ4Run;
    float amax = 0.f, sum = 0.f;
    for (int k = 0; k < kQ4Run; ++k) amax = std::max(amax, std::fabs(to_float(run[k]))), sum += to_float(run[k]);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    r.scale[i] = amax > 0.f ? amax / 127.f : 1.f;
    r.sum[i] = sum;
    int8_t* q = r.q.data() + i * bytes;
    for (int k = 0; k < kQ4Run; ++k) {  // half to even, as vcvtps2dq rounds
      const int8_t v = static_cast<int8_t>(std::nearbyint(to_float(run[k]) * inv));
      if (kQ4Halves) {
        q[(k / 16) * 32 + k % 16] = q[(k / 16) * 32 + 16 + k % 16] = v;
      } else {
        q[k] = v;
      }
    }
  }
  return r;
}

template <int MC>
LLMC_AVX2_Q4 void block_dot_q4_avx2(const Q4Weight& w, int64_t b, const int8_t* xq, const float* xs, const float* xsum,
                                    int64_t runs, float* sums) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc01[MC], acc23[MC];
  __m128 mins[MC];
  for (int c = 0; c < MC; ++c) acc01[c] = acc23[c] = _mm256_setzero_ps(), mins[c] = _mm_setzero_ps();
  const int64_t runs_per_group = runs / w.groups;
  for (int64_t j = 0; j < runs; ++j) {
    const uint8_t* line = w.q + (b * runs + j) * kBlock * 16;
    prefetch_ahead(line, 64);
    const __m256i b01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
    const __m256i b23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
    const __m256i lo01 = _mm256_and_si256(b01, nibble), hi01 = _mm256_and_si256(_mm256_srli_epi16(b01, 4), nibble);
    const __m256i lo23 = _mm256_and_si256(b23, nibble), hi23 = _mm256_and_si256(_mm256_srli_epi16(b23, 4), nibble);
    const int64_t g = (b * w.groups + j / runs_per_group) * kBlock;
    const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.d + g)));
    const __m128 m = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.m + g)));
    const __m256 d01 = _mm256_set_m128(_mm_permute_ps(d, 0x55), _mm_permute_ps(d, 0x00));
    const __m256 d23 = _mm256_set_m128(_mm_permute_ps(d, 0xFF), _mm_permute_ps(d, 0xAA));
    for (int c = 0; c < MC; ++c) {
      const int8_t* x = xq + (c * runs + j) * 64;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256i p01 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo01, xlo), _mm256_maddubs_epi16(hi01, xhi)), ones);
      const __m256i p23 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo23, xlo), _mm256_maddubs_epi16(hi23, xhi)), ones);
      const __m256 s = _mm256_set1_ps(xs[c * runs + j]);
      acc01[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p01), d01), s, acc01[c]);
      acc23[c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(p23), d23), s, acc23[c]);
      mins[c] = _mm_fmadd_ps(m, _mm_set1_ps(xsum[c * runs + j]), mins[c]);
    }
  }
  for (int c = 0; c < MC; ++c) {
    alignas(32) float lanes[2][8];
    float mn[kBlock];
    _mm256_store_ps(lanes[0], acc01[c]), _mm256_store_ps(lanes[1], acc23[c]);
    _mm_storeu_ps(mn, mins[c]);
    for (int r = 0; r < kBlock; ++r) {
      const float* l = lanes[r / 2] + (r % 2) * 4;
      sums[c * kBlock + r] = (l[0] + l[1]) + (l[2] + l[3]) + mn[r];
    }
  }
}

#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
// int8 weights times int8 activations without VNNI, on int8_pack's layout of the AVX2 build
// ([N/4, K/8, 4, 8]: a 32-byte load is features 0-3's eight values of one vector). Widening int8
// weights to fp32 costs more than the FMAs that use them, and AVX2 has registers for one row a
// pass (block_dot_quant): a Q8_0 step of 16 rows dequantized its weights into a float GEMM. Here
// x is quantized per row and run of 32 inputs as for Q4 (quantize_runs_plain), and each vector's
// products are exact in int32 as llama.cpp's AVX2 Q8_0 dot products take them: vpmaddubsw needs
// one unsigned operand, so |w| times xq with w's sign (vpsignb; |w| <= 128 and |xq| <= 127: a
// pair sums to at most 32,512, no int16 saturation, and a -128 in a file's Q8_0 block stays
// exact), vpmaddwd by ones widens the pairs: lanes 2r and 2r + 1 are feature r's. Per run, the
// sum times the weight's scale (per feature or per Q8_0 block) and x's, in fp32.
constexpr int kInt8Rows = 4;  // rows a pass: four accumulators beside a run's 4 + 4 weight registers

template <int MC>
LLMC_AVX2_Q4 void block_dot_int8_avx2(const Int8Weight& w, int64_t b, const int8_t* xq, const float* xs, int64_t runs,
                                      float* sums) {
  static_assert(W == 8, "int8_pack's AVX2 layout");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MC];
  for (int c = 0; c < MC; ++c) acc[c] = _mm256_setzero_ps();
  const int64_t runs_per_group = runs / w.groups, vectors = kQ4Run / W;
  for (int64_t j = 0; j < runs; ++j) {
    const int8_t* line = w.q + (b * w.kv + j * vectors) * kBlock * W;  // 128 bytes: the run's 4 vectors
    prefetch_ahead(line, vectors * kBlock * W);
    __m256i wv[vectors], aw[vectors];
    for (int v = 0; v < vectors; ++v)
      wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + v * kBlock * W)), aw[v] = _mm256_abs_epi8(wv[v]);
    const __m128 s4 = _mm_loadu_ps(w.s + (b * w.groups + j / runs_per_group) * kBlock);
    const __m256 ws = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));  // lanes 2r, 2r + 1: r's
    for (int c = 0; c < MC; ++c) {
      const int8_t* x = xq + (c * runs + j) * kQ4Run;
      __m256i dot = _mm256_setzero_si256();
      for (int v = 0; v < vectors; ++v) {
        int64_t eight;
        std::memcpy(&eight, x + v * W, sizeof(eight));
        const __m256i xv = _mm256_set1_epi64x(eight);  // the vector's 8 values for each feature
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], _mm256_sign_epi8(xv, wv[v])), ones));
      }
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(xs[c * runs + j])), acc[c]);
    }
  }
  for (int c = 0; c < MC; ++c) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[c]);
    for (int r = 0; r < kBlock; ++r) sums[c * kBlock + r] = lanes[2 * r] + lanes[2 * r + 1];
  }
}

bool int8_runs_fit(int64_t K, int64_t groups) { return K % kQ4Run == 0 && (K / groups) % kQ4Run == 0; }
#else
constexpr int kInt8Rows = 1;
#endif

// out [M, N] from blocks of four features: dot(b, m0, mc, sums) puts rows m0..m0+mc of x times
// block b into sums [mc][4]; up to `rows` rows a pass. Each task item is a run of blocks, the
// threads' ranges contiguous (one stream each); the block stays in L1 across passes.
template <typename T, typename Dot>
void over_blocks(T* out, const T* bias, int64_t M, int64_t N, int rows, int64_t block_bytes, const Dot& dot) {
  const int64_t blocks = padded(N, kBlock) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, block_bytes));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float sums[std::max({kMaxRows, kMaxRowsFp32, kInt8Rows}) * kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int nr = static_cast<int>(std::min<int64_t>(kBlock, N - b * kBlock));
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int mc = static_cast<int>(std::min<int64_t>(rows, M - m0));
        dot(b, m0, mc, sums);
        for (int c = 0; c < mc; ++c)
          for (int r = 0; r < nr; ++r) {
            const int64_t n = b * kBlock + r;
            out[(m0 + c) * N + n] = static_cast<T>(sums[c * kBlock + r] + (bias ? to_float(bias[n]) : 0.f));
          }
      }
    }
  });
}

// out [M, N] = x [M, K] @ w^T (+ bias); block_bytes: the weight bytes of one block (task sizing).
template <typename T, typename Wt>
void skinny(T* out, const T* x_in, const Wt& w, int64_t block_bytes, const T* bias, int64_t M, int64_t N, int64_t K) {
  const int64_t kv = padded(K, W) / W, kp = kv * W;
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<Wt, DenseWeight<bf16>>) {
    if (has_bf16_pairs()) {  // x zero-padded once, in bf16
      std::vector<bf16> x(M * kp, bf16(0.f));
      for (int64_t m = 0; m < M; ++m) std::copy(x_in + m * K, x_in + (m + 1) * K, x.begin() + m * kp);
      return over_blocks(out, bias, M, N, kMaxRows, block_bytes, [&](int64_t b, int64_t m0, int mc, float* sums) {
        run_block_pairs(w.p, kv, b, mc, x.data() + m0 * kp, sums);
      });
    }
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Wt, Q4Weight>) {
    if (LLMC_NAMESPACE::int8_gemm_available()) {  // W4A8 (block_dot_q4_vnni)
      const int64_t runs = K / kQ4Run;
      const Int8Runs xr = quantize_runs(x_in, M, K);
      return over_blocks(out, bias, M, N, kMaxRows, block_bytes, [&](int64_t b, int64_t m0, int mc, float* sums) {
        run_block_q4_vnni(w, b, mc, xr.q.data() + m0 * runs * 64, xr.scale.data() + m0 * runs, xr.sum.data() + m0 * runs,
                          runs, sums);
      });
    }
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_same_v<Wt, Q4Weight>) {  // W4A8 without VNNI (block_dot_q4_avx2)
    const int64_t runs = K / kQ4Run;
    const Int8Runs xr = quantize_runs_plain(x_in, M, K);
    return over_blocks(out, bias, M, N, kMaxRows, block_bytes, [&](int64_t b, int64_t m0, int mc, float* sums) {
      with_rows<kMaxRows>(mc, [&](auto rows) {
        block_dot_q4_avx2<rows()>(w, b, xr.q.data() + m0 * runs * 64, xr.scale.data() + m0 * runs, xr.sum.data() + m0 * runs,
                                  runs, sums);
      });
    });
  }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<Wt, Int8Weight>) {  // W8A8 without VNNI (block_dot_int8_avx2)
    if (int8_runs_fit(K, w.groups)) {
      const int64_t runs = K / kQ4Run;
      const Int8Runs xr = quantize_runs_plain<false>(x_in, M, K);
      return over_blocks(out, bias, M, N, kInt8Rows, block_bytes, [&](int64_t b, int64_t m0, int mc, float* sums) {
        with_rows<kInt8Rows>(mc, [&](auto rows) {
          block_dot_int8_avx2<rows()>(w, b, xr.q.data() + m0 * runs * kQ4Run, xr.scale.data() + m0 * runs, runs, sums);
        });
      });
    }
  }
#endif
  std::vector<float> x(M * kp, 0.f);  // widened and zero-padded once; every block reads it
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * kp + k] = to_float(x_in[m * K + k]);
  std::vector<float> xg;  // x's sum over each scale group, for formats with a min
  if constexpr (Wt::kQuantized) {
    if (Wt::kHasMin) {
      xg.assign(M * w.groups, 0.f);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xg[m * w.groups + k / (w.vpg * W)] += x[m * kp + k];
    }
  }
  const int rows = Wt::kQuantized ? kMaxRowsQuant : std::is_same_v<Wt, DenseWeight<float>> ? kMaxRowsFp32 : kMaxRows;
  over_blocks(out, bias, M, N, rows, block_bytes,
              [&](int64_t b, int64_t m0, int mc, float* sums) {
                run_block(w, b, mc, x.data() + m0 * kp, xg.empty() ? nullptr : xg.data() + m0 * (xg.size() / M), kv, sums);
              });
}

// out [N, K] = the weight, dequantized (the many-rows path hands it to a GEMM).
template <typename T, typename Wt>
void dequant(T* out, const Wt& w, int64_t N, int64_t K) {
  const int64_t kv = padded(K, W) / W;
  at::parallel_for(0, padded(N, kBlock) / kBlock, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int nr = static_cast<int>(std::min<int64_t>(kBlock, N - b * kBlock));
      for (int r = 0; r < nr; ++r) {
        T* row = out + (b * kBlock + r) * K;
        for (int64_t g = 0; g < w.groups; ++g) {
          const vf scale = vset(w.scale(b, g, r)), min = vset(w.min(b, g, r));
          for (int64_t v = g * w.vpg, v1 = std::min(kv, (g + 1) * w.vpg); v < v1; ++v) {
            const vf value = vfma(w.load(b, v, r), scale, min);
            if ((v + 1) * W <= K) {
              vstore(row + v * W, value);
            } else {  // K's tail: through a buffer (the packed tail is zero-padded)
              float tail[W];
              vstore(tail, value);
              for (int64_t k = v * W; k < K; ++k) row[k] = static_cast<T>(tail[k - v * W]);
            }
          }
        }
      }
    }
  });
}

// ---- ops -------------------------------------------------------------------------------------

// Checks shared by the linear ops; returns M (the rows of x) and allocates out [..., N].
int64_t check_x(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t N, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be float32 or bfloat16, got ",
              x.scalar_type());
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type() && bias->is_contiguous(), op,
                        ": bias must be [", N, "] in x's dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  out = x.new_empty(shape);
  return x.numel() / std::max<int64_t>(x.size(-1), 1);
}

// The linear op for any weight format: x [..., K] -> a new [..., N] (one op call per layer).
template <typename Wt>
at::Tensor linear(const char* op, const at::Tensor& x_in, const Wt& w, int64_t block_bytes,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor out;
  const int64_t M = check_x(op, x, bias, N, out), K = x.size(-1);
  if (x.scalar_type() == at::kBFloat16) {
    skinny<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), w, block_bytes, bias ? bias->data_ptr<bf16>() : nullptr, M, N, K);
  } else {
    skinny<float>(out.data_ptr<float>(), x.data_ptr<float>(), w, block_bytes, bias ? bias->data_ptr<float>() : nullptr, M, N, K);
  }
  return out;
}

template <typename Wt>
void dequant_into(const char* op, at::Tensor& out, const Wt& w) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), op, ": out must be a contiguous [N, K] tensor");
  if (out.scalar_type() == at::kBFloat16) {
    dequant<bf16>(out.data_ptr<bf16>(), w, out.size(0), out.size(1));
  } else {
    TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": out must be float32 or bfloat16, got ", out.scalar_type());
    dequant<float>(out.data_ptr<float>(), w, out.size(0), out.size(1));
  }
}

}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

bool q4_int8_activations() {
#if defined(__AVX2__)
  return true;  // VNNI where the CPU has it (and the build), else the AVX2 kernel
#else
  return false;
#endif
}

bool int8_int8_activations() {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return true;  // block_dot_int8_avx2 (the AVX-512 build's W8A8 is int8_gemm, on AVX512-VNNI)
#else
  return false;
#endif
}

at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "skinny_pack: w must be a contiguous [N, K] tensor, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = w.new_empty({padded(N, kBlock) / kBlock, padded(K, W) / W, kBlock, W});
  if (w.scalar_type() == at::kBFloat16) {
    pack<bf16>(packed.data_ptr<bf16>(), w.data_ptr<bf16>(), N, K);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "skinny_pack: float32 or bfloat16, got ", w.scalar_type());
    pack<float>(packed.data_ptr<float>(), w.data_ptr<float>(), N, K);
  }
  return packed;
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t K = x.size(-1), kv = padded(K, W) / W;
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == padded(N, kBlock) / kBlock && packed.size(1) == kv &&
                  packed.size(2) == kBlock && packed.size(3) == W && packed.is_contiguous(),
              "skinny_linear: packed is ", packed.sizes(), ", not skinny_pack of a [", N, ", ", K, "] weight");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(),
              "skinny_linear: x (", x.scalar_type(), ") and packed (", packed.scalar_type(), ") must share a dtype");
  const int64_t block_bytes = kBlock * kv * W * packed.element_size();
  if (x.scalar_type() == at::kBFloat16) return linear("skinny_linear", x, DenseWeight<bf16>{packed.data_ptr<bf16>(), kv}, block_bytes, bias, N);
  return linear("skinny_linear", x, DenseWeight<float>{packed.data_ptr<float>(), kv}, block_bytes, bias, N);
}

// Vectors per scale group: `groups` scales per feature over K (1: one per feature).
int64_t vectors_per_group(const char* op, int64_t K, int64_t groups, int64_t unit) {
  if (groups == 1) return padded(K, W) / W;
  TORCH_CHECK(groups > 0 && K % groups == 0 && (K / groups) % unit == 0 && (K / groups) % W == 0, op, ": ", groups,
              " scale groups over ", K, " inputs: each group must be a whole number of ", std::max<int64_t>(unit, W),
              " inputs (or one group per feature)");
  return K / groups / W;
}

// q [N, K] int8 and scales [N, groups] fp32 (w = q * its group's scale) -> (q, scales) blocked.
std::vector<at::Tensor> int8_pack(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar, "int8_pack: q must be a contiguous [N, K] int8 tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "int8_pack: scales must be a contiguous [", q.size(0), ", groups] float32 tensor, got ", scales.sizes());
  const int64_t N = q.size(0), K = q.size(1), groups = scales.size(1), blocks = padded(N, kBlock) / kBlock;
  vectors_per_group("int8_pack", K, groups, 1);
  at::Tensor qp = q.new_empty({blocks, padded(K, W) / W, kBlock, W});
  pack<int8_t>(qp.data_ptr<int8_t>(), q.data_ptr<int8_t>(), N, K);
  at::Tensor sp = scales.new_zeros({blocks, groups, kBlock});
  pack_groups<float>(sp.data_ptr<float>(), scales.data_ptr<float>(), N, groups);
  return {qp, sp};
}

Int8Weight int8_weight(const char* op, const at::Tensor& qp, const at::Tensor& sp, int64_t N, int64_t K) {
  TORCH_CHECK(qp.dim() == 4 && qp.size(0) == padded(N, kBlock) / kBlock && qp.size(1) == padded(K, W) / W &&
                  qp.size(2) == kBlock && qp.size(3) == W && qp.scalar_type() == at::kChar && qp.is_contiguous() &&
                  sp.dim() == 3 && sp.size(0) == qp.size(0) && sp.size(2) == kBlock && sp.scalar_type() == at::kFloat &&
                  sp.is_contiguous(),
              op, ": (", qp.sizes(), ", ", sp.sizes(), ") is not int8_pack of a [", N, ", ", K, "] weight");
  const int64_t groups = sp.size(1);
  return {qp.data_ptr<int8_t>(), sp.data_ptr<float>(), qp.size(1), groups, vectors_per_group(op, K, groups, 1)};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& sp,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  const Int8Weight w = int8_weight("int8_linear", qp, sp, N, x.size(-1));
  return linear("int8_linear", x, w, kBlock * w.kv * W, bias, N);
}

void int8_dequant_(at::Tensor out, const at::Tensor& qp, const at::Tensor& sp) {
  dequant_into("int8_dequant_", out, int8_weight("int8_dequant_", qp, sp, out.size(0), out.size(1)));
}

// q [N, K] uint8 values in [0, 15], d and m [N, groups] fp16 (w = q d + m) -> (q packed two to a
// byte, d, m) blocked. K a multiple of 32, groups whole runs of 32.
std::vector<at::Tensor> q4_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kByte && q.size(1) % kQ4Run == 0,
              "q4_pack: q must be a contiguous [N, K] uint8 tensor with K a multiple of ", kQ4Run, ", got ", q.sizes());
  for (const at::Tensor* t : {&d, &m})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->sizes() == d.sizes() && t->is_contiguous() &&
                    t->scalar_type() == at::kHalf,
                "q4_pack: d and m must be contiguous [", q.size(0), ", groups] float16 tensors");
  const int64_t N = q.size(0), K = q.size(1), groups = d.size(1), blocks = padded(N, kBlock) / kBlock, runs = K / kQ4Run;
  vectors_per_group("q4_pack", K, groups, kQ4Run);
  at::Tensor qp = q.new_zeros({blocks, runs, kBlock, 16});
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = qp.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = k % kQ4Run;
      uint8_t& byte = dst[(((n / kBlock) * runs + k / kQ4Run) * kBlock + n % kBlock) * 16 + i % 16];
      byte |= static_cast<uint8_t>((src[n * K + k] & 0x0F) << (i < 16 ? 0 : 4));
    }
  at::Tensor dp = d.new_zeros({blocks, groups, kBlock}), mp = m.new_zeros({blocks, groups, kBlock});
  pack_groups<c10::Half>(dp.data_ptr<c10::Half>(), d.data_ptr<c10::Half>(), N, groups);
  pack_groups<c10::Half>(mp.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(), N, groups);
  return {qp, dp, mp};
}

Q4Weight q4_weight(const char* op, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp, int64_t N, int64_t K) {
  TORCH_CHECK(K % kQ4Run == 0 && qp.dim() == 4 && qp.size(0) == padded(N, kBlock) / kBlock && qp.size(1) == K / kQ4Run &&
                  qp.size(2) == kBlock && qp.size(3) == 16 && qp.scalar_type() == at::kByte && qp.is_contiguous() &&
                  dp.dim() == 3 && dp.size(0) == qp.size(0) && dp.size(2) == kBlock && dp.scalar_type() == at::kHalf &&
                  dp.is_contiguous() && mp.sizes() == dp.sizes() && mp.scalar_type() == at::kHalf && mp.is_contiguous(),
              op, ": (", qp.sizes(), ", ", dp.sizes(), ", ", mp.sizes(), ") is not q4_pack of a [", N, ", ", K, "] weight");
  const int64_t groups = dp.size(1);
  return {qp.data_ptr<uint8_t>(), dp.data_ptr<c10::Half>(), mp.data_ptr<c10::Half>(), qp.size(1), groups,
          vectors_per_group(op, K, groups, kQ4Run)};
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp,
                     const c10::optional<at::Tensor>& bias, int64_t N) {
  const int64_t K = x.size(-1);
  return linear("q4_linear", x, q4_weight("q4_linear", qp, dp, mp, N, K), kBlock * K / 2, bias, N);
}

void q4_dequant_(at::Tensor out, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp) {
  dequant_into("q4_dequant_", out, q4_weight("q4_dequant_", qp, dp, mp, out.size(0), out.size(1)));
}

// Weights stacked by output features (a merged projection whose parts are GGUF tensors of different
// types): w[0] int64 [P, 2] gives each part's tensor count and out features, its tensors follow.
at::Tensor stacked_linear(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& bias, int64_t N) {
  const at::Tensor& parts = w[0];
  TORCH_CHECK(parts.dim() == 2 && parts.size(1) == 2 && parts.is_contiguous(),
              "packed_linear: a stacked weight starts with its parts' [P, 2] int64 (tensors, out features), got ", parts.sizes());
  const int64_t* p = parts.data_ptr<int64_t>();
  std::vector<at::Tensor> outs;
  int64_t next = 1, row = 0;
  for (int64_t i = 0; i < parts.size(0); ++i) {
    const int64_t count = p[2 * i], n = p[2 * i + 1];
    TORCH_CHECK(count > 0 && next + count <= static_cast<int64_t>(w.size()) && row + n <= N, "packed_linear: stacked part ", i,
                " (", count, " tensors, ", n, " features) runs past the weight's ", w.size() - 1, " tensors or ", N, " features");
    const c10::optional<at::Tensor> part_bias = bias ? c10::optional<at::Tensor>(bias->narrow(0, row, n)) : c10::nullopt;
    outs.push_back(packed_linear(x, w.slice(next, count), part_bias, n));
    next += count;
    row += n;
  }
  TORCH_CHECK(row == N && next == static_cast<int64_t>(w.size()), "packed_linear: the stacked parts give ", row, " of ", N,
              " features and ", next - 1, " of ", w.size() - 1, " tensors");
  std::vector<int64_t> shape = outs[0].sizes().vec();
  shape.back() = N;
  at::Tensor out = outs[0].new_empty(shape);
  row = 0;
  for (const at::Tensor& part : outs) {  // at::cat without its header (ops.h)
    out.narrow(-1, row, part.size(-1)).copy_(part);
    row += part.size(-1);
  }
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(!w.empty(), "packed_linear: a packed weight of no tensors");
  if (w[0].scalar_type() == at::kLong) return stacked_linear(x, w, bias, N);
  switch (w.size()) {
    case 1:
      if (w[0].scalar_type() == at::kByte) return kquant_linear(x, w[0], bias, N);
      return skinny_linear(x, w[0], bias, N);
    case 2: return int8_linear(x, w[0], w[1], bias, N);
    case 3:
      if (w[0].scalar_type() == at::kChar) {
        // int8 with W8A8's offsets. From memory, one or two rows stream the weight faster widened in
        // registers (one sequential stream: 1.7 vs 2.2 ms for 53 MB at 1 row); from 3 rows the int8
        // dot products win (2.7 vs 4.0 ms at 3 rows, 4.8 vs 12.2 at 12).
        const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
        if (rows <= kWidenMaxRows) return int8_linear(x, w[0], w[1], bias, N);
        return int8_gemm(x, w[0], w[1], w[2], bias, N);
      }
      return q4_linear(x, w[0], w[1], w[2], bias, N);
    default:
      TORCH_CHECK(false, "packed_linear: a packed weight is 1 (dense or k-quant), 2 (int8), 3 (int8 W8A8 or 4-bit) tensors, "
                  "or a stacked one, got ", w.size());
  }
}

}  // namespace LLMC_NAMESPACE
