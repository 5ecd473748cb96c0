// GGUF's k-quants (Q4_K, Q5_K, Q6_K) served in their own super-blocks, times int8 activations, for
// any number of rows (decode and prefill):
//
//   kquant_linear(x, packed, bias, N) -> out    out = x @ w^T (+ bias); x [..., K] float32 / bf16
//   kquant_dequant_(out, packed)                 out [N, K] (float32 / bf16) = w, in place
//
// packed: uint8 [ceil(N/4), K/256, 4, B]: the tensor's super-blocks of 256 inputs, bit for bit as
// in the file, those of four consecutive output features side by side (CpuKernels.kquant_pack), so
// a task's blocks are one stream, as in skinny_gemm_cpu.cpp's layouts. B, a block's bytes, names
// the type (llama.cpp's ggml-common.h):
//   Q4_K (144): fp16 d, dmin; 12 bytes of 6-bit scales sc and mins m, one each per run of 32
//               (get_scale_min_k4); 128 bytes of 4-bit q: in pair c of runs, byte l's low nibble is
//               input 64c + l, its high nibble input 64c + 32 + l.   w = d sc q - dmin m
//   Q5_K (176): as Q4_K, with 32 bytes qh before the nibbles: bit i of qh[l] is the fifth bit of
//               input l of run i.                                      w = d sc q - dmin m
//   Q6_K (210): 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per run of
//               16), fp16 d.                                           w = d sc (q - 32), q in [0, 63]
// A padding feature is a zero block (w = 0).
//
// Activations are quantized as llama.cpp's k-quant dot products take them (Q8_K): per row and
// super-block, s = absmax / 127 and xq = round(x * (127 / absmax)) to nearest even (an all-zero
// block: s = 0, xq = 0), with xq's sums over each run of 16 (bsums). A super-block's integer part is
// exact in int32, the rest fp32:
//   Q4_K / Q5_K: A = sum over runs of sc (q . xq), B = sum over runs of m (xq's sum over the run);
//                out += s (d A) - s (dmin B)
//   Q6_K:        A = sum over runs of sc ((q . xq) - 32 (xq's sum over the run));  out += s (d A)
// then one rounding into out. The mins' term uses xq's sums, as llama.cpp's does (Q4_1's kernel in
// skinny_gemm_cpu.cpp uses x's own).
//
// With AVX512-VNNI (the AVX-512 build on a CPU that has it, checked at run time): a block's
// nibbles (and Q5_K's fifth bits, Q6_K's high parts) become four vectors of 64 unsigned values,
// in the order they lie in the file (xq is stored in that order instead: Q4_K / Q5_K's vector c
// holds inputs 128 (c / 2) + 32 (c % 2) + [0, 32) and those 64 further; Q6_K's, inputs 64c +
// [0, 64)). vpdpbusd sums four products per int32 lane, a lane within one run; vpdpwssd multiplies
// each lane by its run's scale and adds (the lanes fit in 16 bits: 4 x 63 x 127). Q6_K's -32
// starts each lane at -32 x its four xq (computed once per row). The mins' term is one vpmaddwd of
// the 8 mins (each twice) by the 16 bsums. fp32 accumulators per feature and row, lanes summed
// once at the end. Up to 7 rows: rows pass in groups of 4 against a block of 4 features (16
// accumulators), each block unpacked again for each group. From 8 rows: the panel kernel below
// decodes 16 features once per block of rows, one feature per 32-bit lane, and passes the rows.
//
// Without VNNI (the AVX2 build; the AVX-512 build on a CPU without it): the AVX2 kernel further
// down, vpmaddubsw as llama.cpp's AVX2 dot products. The scalar build: the same integers in plain
// C++ loops over a decoded block, rows in groups of 64.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace llmc;

constexpr int kBlock = 4;          // features side by side
constexpr int kQK = 256;           // inputs per super-block
constexpr int kRuns16 = kQK / 16;  // bsums per super-block
constexpr int64_t kTaskBytes = 64 * 1024;  // weight bytes per parallel task item (at least one block of 4)
constexpr int kVnniRows = 4;       // rows per pass, VNNI: 4 x 4 fp32 accumulators
constexpr int kScalarRows = 64;    // rows per pass, plain loops (a block decoded once per pass)
constexpr int kAvx2Rows = 16;      // rows per pass, AVX2 (its accumulators live in L1)
constexpr int64_t kPrefetchBytes = 4096;

enum class KType { Q4K, Q5K, Q6K };

constexpr int64_t block_bytes(KType t) { return t == KType::Q4K ? 144 : t == KType::Q5K ? 176 : 210; }

KType ktype_of(const char* op, int64_t bytes) {
  if (bytes == 144) return KType::Q4K;
  if (bytes == 176) return KType::Q5K;
  TORCH_CHECK(bytes == 210, op, ": packed's blocks are ", bytes, " bytes, not a k-quant's (144 Q4_K, 176 Q5_K, 210 Q6_K)");
  return KType::Q6K;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---- a super-block decoded (dequantization, the plain loops) -------------------------------------

// q in input order: [0, 31] for Q4_K / Q5_K, [0, 63] for Q6_K (w = d sc (q - 32)); per run (8 of
// 32, or Q6_K's 16 of 16) its scale, and for Q4_K / Q5_K its min. Aligned: GCC 12 vectorizes the
// loops over q with aligned loads of its own and did not always align the stack slot.
struct alignas(64) Decoded {
  uint8_t q[kQK];
  int32_t sc[16], mn[8];
  float d, dmin;
};

// llama.cpp's get_scale_min_k4: run j's 6-bit scale and min from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, int32_t& sc, int32_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void decode_q45k(const uint8_t* b, bool five, Decoded& o) {
  o.d = half_at(b);
  o.dmin = half_at(b + 2);
  for (int j = 0; j < 8; ++j) scale_min_k4(j, b + 4, o.sc[j], o.mn[j]);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = qs[32 * c + l];
      int lo = byte & 0xF, hi = byte >> 4;
      if (five) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      o.q[64 * c + l] = static_cast<uint8_t>(lo);
      o.q[64 * c + 32 + l] = static_cast<uint8_t>(hi);
    }
}

void decode_q6k(const uint8_t* b, Decoded& o) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  o.d = half_at(b + 208);
  o.dmin = 0.f;
  for (int i = 0; i < 16; ++i) o.sc[i] = sc[i];
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int a = ql[64 * h + l], c = ql[64 * h + 32 + l], bits = qh[32 * h + l];
      uint8_t* q = o.q + 128 * h;
      q[l] = static_cast<uint8_t>((a & 0xF) | ((bits & 3) << 4));
      q[32 + l] = static_cast<uint8_t>((c & 0xF) | (((bits >> 2) & 3) << 4));
      q[64 + l] = static_cast<uint8_t>((a >> 4) | (((bits >> 4) & 3) << 4));
      q[96 + l] = static_cast<uint8_t>((c >> 4) | (((bits >> 6) & 3) << 4));
    }
}

template <KType T>
inline void decode(const uint8_t* b, Decoded& o) {
  if constexpr (T == KType::Q6K) {
    decode_q6k(b, o);
  } else {
    decode_q45k(b, T == KType::Q5K, o);
  }
}

// One block's 256 weights into out, as gguf-py's dequantize computes them: d sc and dmin m are
// exact in fp32 (11 x 6 or 7 bits), so are their products with q, and the one subtraction rounds
// once. Stored through simd.h's vstore (GCC 12's own vectorization of the fp32 -> bf16 loop
// stored wrong lanes).
template <KType T, typename Out>
void dequant_block(const uint8_t* b, Out* out) {
  Decoded o;
  decode<T>(b, o);
  alignas(64) float w[kQK];
  if constexpr (T == KType::Q6K) {
    for (int i = 0; i < kQK; ++i) w[i] = (o.d * static_cast<float>(o.sc[i / 16])) * static_cast<float>(o.q[i] - 32);
  } else {
    for (int r = 0; r < 8; ++r) {
      const float ds = o.d * static_cast<float>(o.sc[r]), dm = o.dmin * static_cast<float>(o.mn[r]);
      for (int i = 32 * r; i < 32 * r + 32; ++i) w[i] = ds * static_cast<float>(o.q[i]) - dm;
    }
  }
  for (int i = 0; i < kQK; i += W) vstore(out + i, vload(w + i));
}

// ---- activations ---------------------------------------------------------------------------------

// x [M, K] quantized per row and super-block (see the top): row m's block j at index m kb + j.
struct XQuant {
  int64_t kb;
  std::vector<int8_t> q;      // [M, kb, 256]: input order, or the VNNI kernel's Q4_K / Q5_K order
  std::vector<float> s;       // [M, kb]
  std::vector<int16_t> bsum;  // [M, kb, 16]: xq's sum over each run of 16, input order
  std::vector<int32_t> negz;  // VNNI Q6_K: [M, kb, 64]: -32 x each vpdpbusd lane's four xq
};

// Input i of a super-block -> its byte in the VNNI kernel's Q4_K / Q5_K order: vector c (64 bytes)
// holds inputs 128 (c / 2) + 32 (c % 2) + [0, 32), then those 64 further.
inline int q45_position(int i) {
  const int pair = i / 128, half = (i % 128) / 64, odd = (i % 64) / 32;
  return 64 * (2 * pair + odd) + 32 * half + i % 32;
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float& s, int16_t* bsum, int32_t* negz, bool q45_order) {
  float amax = 0.f;
  for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  s = amax > 0.f ? amax / 127.f : 0.f;
  int8_t v[kQK];
  for (int i = 0; i < kQK; ++i) v[i] = static_cast<int8_t>(std::nearbyint(to_float(x[i]) * inv));  // half to even
  for (int r = 0; r < kRuns16; ++r) {
    int sum = 0;
    for (int k = 0; k < 16; ++k) sum += v[16 * r + k];
    bsum[r] = static_cast<int16_t>(sum);
  }
  for (int i = 0; i < kQK; ++i) q[q45_order ? q45_position(i) : i] = v[i];
  if (negz != nullptr)  // Q6_K's input order: lane l of vector c is inputs 64c + 4l + [0, 4)
    for (int lane = 0; lane < 64; ++lane) negz[lane] = -32 * (v[4 * lane] + v[4 * lane + 1] + v[4 * lane + 2] + v[4 * lane + 3]);
}

template <typename T>
XQuant quantize_x(const T* x, int64_t M, int64_t K, bool q45_order, bool with_negz) {
  const int64_t kb = K / kQK;
  XQuant r{kb, std::vector<int8_t>(M * K), std::vector<float>(M * kb), std::vector<int16_t>(M * kb * kRuns16),
           std::vector<int32_t>(with_negz ? M * kb * 64 : 0)};
  at::parallel_for(0, M * kb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quantize_block(x + i * kQK, r.q.data() + i * kQK, r.s[i], r.bsum.data() + i * kRuns16,
                     with_negz ? r.negz.data() + i * 64 : nullptr, q45_order);
  });
  return r;
}

// ---- plain loops (every build) -------------------------------------------------------------------

// Rows m0..m0+mc of x against block b's super-blocks (`blocks`, kb of them per feature) -> sums[mc][4].
template <KType T>
void block_dot_plain(const uint8_t* blocks, int64_t kb, const XQuant& x, int64_t m0, int mc, float* sums) {
  constexpr int64_t B = block_bytes(T);
  std::fill(sums, sums + mc * kBlock, 0.f);
  Decoded o;
  for (int64_t j = 0; j < kb; ++j)
    for (int r = 0; r < kBlock; ++r) {
      decode<T>(blocks + (j * kBlock + r) * B, o);
      for (int c = 0; c < mc; ++c) {
        const int64_t row = (m0 + c) * kb + j;
        const int8_t* xq = x.q.data() + row * kQK;
        const int16_t* bsum = x.bsum.data() + row * kRuns16;
        const float s = x.s[row];
        int32_t a = 0, mins = 0;
        if constexpr (T == KType::Q6K) {
          for (int i = 0; i < 16; ++i) {
            int32_t dot = 0;
            for (int k = 16 * i; k < 16 * i + 16; ++k) dot += o.q[k] * xq[k];
            a += o.sc[i] * (dot - 32 * bsum[i]);
          }
        } else {
          for (int i = 0; i < 8; ++i) {
            int32_t dot = 0;
            for (int k = 32 * i; k < 32 * i + 32; ++k) dot += o.q[k] * xq[k];
            a += o.sc[i] * dot;
            mins += o.mn[i] * (bsum[2 * i] + bsum[2 * i + 1]);
          }
        }
        sums[c * kBlock + r] += (s * o.d) * static_cast<float>(a) - (s * o.dmin) * static_cast<float>(mins);
      }
    }
}

#if defined(__AVX2__)  // the AVX2 and AVX-512 builds

// A Q4_K / Q5_K super-block's 12 scale bytes (at s, 4 bytes into the block: the 16-byte load
// stays inside it) -> bytes 0-7 sc[0..7], bytes 8-15 m[0..7]: scale_min_k4 for all eight runs at
// once, in 32-bit lanes of four runs each. With t0, t1, t2 the three words:
//   sc[0..3] = t0 & 63      sc[4..7] = (t2 & 15) | ((t0 >> 6) & 3) << 4
//   m[0..3]  = t1 & 63      m[4..7]  = ((t2 >> 4) & 15) | ((t1 >> 6) & 3) << 4
inline __m128i scales_mins_k4(const uint8_t* s) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i low = _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 1, 2, 0));   // t0, t2, t1, t2
  const __m128i high = _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 1, 0, 0));  // t0, t0, t1, t1
  const __m128i low_bits = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                                         _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i high_bits = _mm_and_si128(_mm_srli_epi32(high, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low_bits, high_bits);
}

#endif  // __AVX2__

// ---- AVX512-VNNI ---------------------------------------------------------------------------------

#if defined(__AVX512F__)

// One feature's super-block as the VNNI kernel multiplies it.
struct Unpacked {
  __m512i w[4];   // 64 unsigned values each, in xq's order
  __m512i sc[4];  // per int32 lane of w's products: its run's scale in the low 16 bits, 0 above
  __m256i mins;   // Q4_K / Q5_K: m of each run of 32, twice (it meets the bsums of two runs of 16)
  float d, dmin;
};

inline __m512i halves_epi8(int lo, int hi) {  // bytes 0-31 lo, 32-63 hi
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8(static_cast<char>(lo))), _mm256_set1_epi8(static_cast<char>(hi)), 1);
}

inline __m512i halves_epi16(int lo, int hi) {  // words 0-15 lo, 16-31 hi
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(lo))), _mm256_set1_epi16(static_cast<short>(hi)), 1);
}

LLMC_VNNI inline void unpack_q45k(const uint8_t* b, bool five, Unpacked& u) {
  u.d = half_at(b);
  u.dmin = half_at(b + 2);
  const __m128i scm = scales_mins_k4(b + 4);
  const __m512i all = _mm512_cvtepu8_epi32(scm);
  // vector c's lanes 0-7 are in run (0, 1, 4, 5)[c], lanes 8-15 in run (2, 3, 6, 7)[c]
  constexpr int run_lo[4] = {0, 1, 4, 5};
  for (int c = 0; c < 4; ++c) {
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(run_lo[c])), _mm256_set1_epi32(run_lo[c] + 2), 1);
    u.sc[c] = _mm512_permutexvar_epi32(idx, all);
  }
  u.mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
  const uint8_t* qs = b + (five ? 48 : 16);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i a = _mm512_loadu_si512(qs), c = _mm512_loadu_si512(qs + 64);
  u.w[0] = _mm512_and_si512(a, nibble);
  u.w[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
  u.w[2] = _mm512_and_si512(c, nibble);
  u.w[3] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
  if (five) {  // vector c's fifth bits: qh bit (0, 1, 4, 5)[c] for its first 32 values, 2 more for the next 32
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int v = 0; v < 4; ++v) {
      const __mmask64 set = _mm512_test_epi8_mask(qh, halves_epi8(1 << run_lo[v], 1 << (run_lo[v] + 2)));
      u.w[v] = _mm512_mask_add_epi8(u.w[v], set, u.w[v], sixteen);
    }
  }
}

LLMC_VNNI inline void unpack_q6k(const uint8_t* b, Unpacked& u) {
  u.d = half_at(b + 208);
  u.dmin = 0.f;
  const __m512i all = _mm512_cvtepu16_epi32(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
  for (int c = 0; c < 4; ++c)  // lane l of vector c: inputs 64c + 4l + [0, 4), run 4c + l / 4
    u.sc[c] = _mm512_permutexvar_epi32(_mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                                         4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3),
                                       all);
  const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {  // inputs 128h + [0, 64) are the low nibbles of 64 bytes, + [64, 128) the high ones
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    // high parts (qh >> 0, 2, 4, 6) & 3, moved to bits 4-5: shifted per 16-bit word, then masked per byte
    u.w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, nibble), _mm512_and_si512(_mm512_sllv_epi16(qh, halves_epi16(4, 2)), high));
    u.w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble),
                                     _mm512_and_si512(_mm512_srlv_epi16(qh, halves_epi16(0, 2)), high));
  }
}

template <KType T>
LLMC_VNNI inline void unpack(const uint8_t* b, Unpacked& u) {
  if constexpr (T == KType::Q6K) {
    unpack_q6k(b, u);
  } else {
    unpack_q45k(b, T == KType::Q5K, u);
  }
}

// Rows m0..m0+MC of x against block b's super-blocks -> sums[MC][4].
template <KType T, int MC>
LLMC_VNNI void block_dot_vnni(const uint8_t* blocks, int64_t kb, const XQuant& x, int64_t m0, float* sums) {
  constexpr int64_t B = block_bytes(T);
  vf acc[MC][kBlock];
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = vzero();
  Unpacked u;
  for (int64_t j = 0; j < kb; ++j)
    for (int r = 0; r < kBlock; ++r) {
      const uint8_t* blk = blocks + (j * kBlock + r) * B;
      for (int64_t o = 0; o < B; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
      unpack<T>(blk, u);
      for (int c = 0; c < MC; ++c) {
        const int64_t row = (m0 + c) * kb + j;
        const int8_t* xq = x.q.data() + row * kQK;
        __m512i a = _mm512_setzero_si512();
        for (int v = 0; v < 4; ++v) {
          __m512i dot = T == KType::Q6K ? _mm512_loadu_si512(x.negz.data() + row * 64 + 16 * v) : _mm512_setzero_si512();
          dot = _mm512_dpbusd_epi32(dot, u.w[v], _mm512_loadu_si512(xq + 64 * v));
          a = _mm512_dpwssd_epi32(a, dot, u.sc[v]);
        }
        const float s = x.s[row];
        acc[c][r] = vfma(_mm512_cvtepi32_ps(a), vset(s * u.d), acc[c][r]);
        if constexpr (T != KType::Q6K) {
          const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum.data() + row * kRuns16));
          const __m512i mins = _mm512_zextsi256_si512(_mm256_madd_epi16(u.mins, bsum));
          acc[c][r] = vfma(_mm512_cvtepi32_ps(mins), vset(-(s * u.dmin)), acc[c][r]);
        }
      }
    }
  for (int c = 0; c < MC; ++c) hsum4(acc[c], sums + c * kBlock);
}

template <KType T>
void run_block_vnni(const uint8_t* blocks, int64_t kb, const XQuant& x, int64_t m0, int mc, float* sums) {
  switch (mc) {
    case 1: block_dot_vnni<T, 1>(blocks, kb, x, m0, sums); break;
    case 2: block_dot_vnni<T, 2>(blocks, kb, x, m0, sums); break;
    case 3: block_dot_vnni<T, 3>(blocks, kb, x, m0, sums); break;
    default: block_dot_vnni<T, 4>(blocks, kb, x, m0, sums); break;
  }
}

// ---- many rows, AVX512-VNNI: a panel of 16 features decoded once for all rows --------------------
//
// From kPanelMinRows rows, each panel of 4 blocks (16 features) is decoded once per block of rows
// into a scratch where 32-bit lane f of vector v holds feature f's q of inputs 4v + [0, 4): one
// vpdpbusd, xq's four bytes broadcast from memory, adds four products to each of the 16 features.
// A run's vectors (Q4_K / Q5_K 8, Q6_K 4) sum into one int32 lane per feature (at most
// 32 x 31 x 127), vpmulld scales it by the run's sc and vpaddd adds it to the super-block's sum:
// per 16 features, run and row, 8 (4) vpdpbusd and 2 other ops, the VNNI port the bound. Q4_K's
// half runs fit 16 bits (16 x 15 x 127): their sums share a lane's two words and one vpdpwssd
// by (sc, sc) scales and adds both, cheaper than vpmulld. The mins' term is vpdpwssd of each
// feature's mins (two runs a lane) by the row's sums over those runs; Q6_K's -32 sc joins the
// main sum the same way. The same integers as the 4-row kernel above; each
// feature's super-block sum is one int32 lane, so the fp32 steps are those of the plain loops.
// The decode reads the 16 blocks' bytes in the panel's lanes first (panel_words), then unpacks
// q, scales and mins for 16 features at once.

constexpr int kPanelBlocks = 4;        // blocks of 4 features per panel: one output vector
constexpr int kPanelFeatures = kPanelBlocks * kBlock;
constexpr int kPanelMinRows = 8;       // rows from which the panel kernel runs (the crossover: docs/quantization.md)
constexpr int kPanelRows = 4;          // rows per pass: 4 int32 + 4 fp32 accumulators, a run's weights
constexpr int64_t kPanelRowBlock = 192;  // rows quantized and kept in L2 while every panel passes them
constexpr int64_t kPanelChunk = 4;       // super-blocks decoded at a time (~20 KB of scratch: L1)

// A panel's super-block in the scratch (bytes from its start); each entry a 64-byte vector, lane f
// feature f's.
template <KType T>
struct PanelLayout {
  static constexpr int runs = T == KType::Q6K ? 16 : 8;
  static constexpr int run_vectors = kQK / 4 / runs;                      // vectors of 4 inputs per run
  static constexpr int pairs = T == KType::Q6K ? 8 : 4;                   // mins' lanes: two runs each
  static constexpr int64_t q = 0;                                         // [64 v] uint8
  static constexpr int64_t sc = q + kQK / 4 * 64;                         // [runs] int32 (Q4_K: int16 twice)
  static constexpr int64_t mins = sc + runs * 64;                         // [pairs] int16 pairs
  static constexpr int64_t d = mins + pairs * 64;                         // fp32
  static constexpr int64_t dmin = d + 64;                                 // fp32 (Q4_K / Q5_K)
  static constexpr int64_t bytes = dmin + 64;
};

// 16 bytes at offset o of each of the panel's 16 blocks -> u[d]: lane f holds block f's bytes
// o + 4d + [0, 4). Source vector k takes blocks 4l + k (l = 0..3) in its 128-bit lanes; a 4 x 4
// transpose of 32-bit words within each lane then puts 4 blocks' words side by side.
inline void panel_words(const uint8_t* const blk[kPanelFeatures], int o, __m512i u[4]) {
  __m512i z[4];
  for (int k = 0; k < 4; ++k) {
    auto at = [&](int l) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * l + k] + o)); };
    z[k] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(at(0)), at(1), 1), at(2), 2), at(3), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  u[0] = _mm512_unpacklo_epi64(t0, t2);
  u[1] = _mm512_unpackhi_epi64(t0, t2);
  u[2] = _mm512_unpacklo_epi64(t1, t3);
  u[3] = _mm512_unpackhi_epi64(t1, t3);
}

inline __m512i bits_of(__m512i v, int shift, int mask, int to) {  // ((v >> shift) & mask) << to, per byte
  const __m512i x = _mm512_and_si512(_mm512_srli_epi16(v, shift), _mm512_set1_epi8(static_cast<char>(mask)));
  return _mm512_slli_epi16(x, to);
}
inline __m512i byte_of(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF)); }
inline __m512i signed_byte_of(__m512i v, int i) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24); }
inline __m512i word_pair(__m512i lo, __m512i hi) {  // two int32 vectors' low 16 bits as vpdpwssd's word pairs
  return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(hi, 16));
}
inline __m512 halves(__m512i v, int shift) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, shift))); }

// A panel's super-block (the 16 blocks blk[f], a zero block for padding features) into the
// scratch p, straight from the file's bytes: every field goes through panel_words, so each step
// below works on 16 features at once (decode_q45k's and decode_q6k's bits, scale_min_k4).
template <KType T>
void panel_decode(const uint8_t* const blk[kPanelFeatures], uint8_t* p) {
  using L = PanelLayout<T>;
  auto q = [&](int v, __m512i x) { _mm512_storeu_si512(p + L::q + v * 64, x); };
  __m512i sc[L::runs], mins[L::runs];
  __m512i u[4];
  if constexpr (T == KType::Q6K) {
    for (int h = 0; h < 2; ++h) {  // inputs 128h + [0, 128): ql 64h + [0, 64), qh 128 + 32h + [0, 32)
      for (int half = 0; half < 2; ++half) {
        __m512i a[4], c[4], hb[4];
        panel_words(blk, 64 * h + 16 * half, a);
        panel_words(blk, 64 * h + 32 + 16 * half, c);
        panel_words(blk, 128 + 32 * h + 16 * half, hb);
        for (int d = 0; d < 4; ++d) {
          const int t = 4 * half + d, v = 32 * h + t;
          const __m512i nibble = _mm512_set1_epi8(0x0F);
          q(v, _mm512_or_si512(_mm512_and_si512(a[d], nibble), bits_of(hb[d], 0, 3, 4)));
          q(v + 8, _mm512_or_si512(_mm512_and_si512(c[d], nibble), bits_of(hb[d], 2, 3, 4)));
          q(v + 16, _mm512_or_si512(bits_of(a[d], 4, 0x0F, 0), bits_of(hb[d], 4, 3, 4)));
          q(v + 24, _mm512_or_si512(bits_of(c[d], 4, 0x0F, 0), bits_of(hb[d], 6, 3, 4)));
        }
      }
    }
    panel_words(blk, 192, u);  // the 16 int8 scales
    for (int r = 0; r < 16; ++r) sc[r] = signed_byte_of(u[r / 4], r % 4);
    for (int r = 0; r < 16; ++r) mins[r] = _mm512_mullo_epi32(sc[r], _mm512_set1_epi32(-32));
    panel_words(blk, 194, u);  // d: bytes 208-209, the high half of u[3]
    _mm512_storeu_ps(p + L::d, halves(u[3], 16));
    _mm512_storeu_ps(p + L::dmin, _mm512_setzero_ps());
  } else {
    constexpr bool five = T == KType::Q5K;
    __m512i qh[8];
    if (five) {
      panel_words(blk, 16, qh);
      panel_words(blk, 32, qh + 4);
    }
    for (int c = 0; c < 4; ++c)  // pair c of runs: 32 bytes, low nibbles inputs 64c + l, high 64c + 32 + l
      for (int half = 0; half < 2; ++half) {
        panel_words(blk, (five ? 48 : 16) + 32 * c + 16 * half, u);
        for (int d = 0; d < 4; ++d) {
          const int t = 4 * half + d;
          __m512i lo = _mm512_and_si512(u[d], _mm512_set1_epi8(0x0F)), hi = bits_of(u[d], 4, 0x0F, 0);
          if (five) {
            lo = _mm512_or_si512(lo, bits_of(qh[t], 2 * c, 1, 4));
            hi = _mm512_or_si512(hi, bits_of(qh[t], 2 * c + 1, 1, 4));
          }
          q(16 * c + t, lo);
          q(16 * c + 8 + t, hi);
        }
      }
    panel_words(blk, 0, u);  // d, dmin, then the scales' words t0, t1, t2 (scales_mins_k4's)
    const __m512i low6 = _mm512_set1_epi8(0x3F), low4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30);
    const __m512i sc_lo = _mm512_and_si512(u[1], low6), m_lo = _mm512_and_si512(u[2], low6);
    const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(u[3], low4), _mm512_and_si512(_mm512_srli_epi32(u[1], 2), top2));
    const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u[3], 4), low4),
                                         _mm512_and_si512(_mm512_srli_epi32(u[2], 2), top2));
    for (int r = 0; r < 8; ++r) {
      sc[r] = byte_of(r < 4 ? sc_lo : sc_hi, r % 4);
      mins[r] = byte_of(r < 4 ? m_lo : m_hi, r % 4);
    }
    _mm512_storeu_ps(p + L::d, halves(u[0], 0));
    _mm512_storeu_ps(p + L::dmin, halves(u[0], 16));
  }
  for (int r = 0; r < L::runs; ++r)  // Q4_K: the scale in both words of its lane (vpdpwssd's)
    _mm512_storeu_si512(p + L::sc + r * 64, T == KType::Q4K ? word_pair(sc[r], sc[r]) : sc[r]);
  for (int k = 0; k < L::pairs; ++k) _mm512_storeu_si512(p + L::mins + k * 64, word_pair(mins[2 * k], mins[2 * k + 1]));
}

// x quantized as for the other kernels, in input order, with per row and super-block 16 int16
// `aux` words whose pairs meet the mins' lanes: Q4_K / Q5_K the sums over runs of 32 (then 0),
// Q6_K the bsums.
struct XPanel {
  XQuant x;
  std::vector<int16_t> aux;  // [M, kb, 16]
};

template <KType K, typename T>
XPanel quantize_panel_x(const T* x, int64_t M, int64_t Kin) {
  XPanel r{quantize_x(x, M, Kin, false, false), std::vector<int16_t>(M * (Kin / kQK) * 16)};
  for (int64_t i = 0; i < M * r.x.kb; ++i) {
    const int16_t* bsum = r.x.bsum.data() + i * kRuns16;
    int16_t* aux = r.aux.data() + i * 16;
    for (int k = 0; k < 16; ++k)
      aux[k] = K == KType::Q6K ? bsum[k] : k < 8 ? static_cast<int16_t>(bsum[2 * k] + bsum[2 * k + 1]) : 0;
  }
  return r;
}

inline __m512i at64(const uint8_t* p, int64_t offset) { return _mm512_loadu_si512(p + offset); }
inline __m512i bcast32(const void* p) {  // four bytes (two words) to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR rows (from m0) against super-blocks [sb0, sb1) of a panel, decoded into `panel` from sb0 on
// (PanelLayout<K>::bytes each), added to out [MR][16]: the panel's 16 features in order.
template <KType K, int MR>
LLMC_VNNI void panel_dot(const uint8_t* panel, int64_t sb0, int64_t sb1, const XPanel& xp, int64_t m0, float* out) {
  using L = PanelLayout<K>;
  constexpr int RV = L::run_vectors;
  const int64_t kb = xp.x.kb;
  vf acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = vload(out + 16 * m);
  for (int64_t sb = sb0; sb < sb1; ++sb) {
    const uint8_t* p = panel + (sb - sb0) * L::bytes;
    const int8_t* x0 = xp.x.q.data() + (m0 * kb + sb) * kQK;
    __m512i sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_setzero_si512();
    for (int r = 0; r < L::runs; ++r) {
      const __m512i sc = at64(p, L::sc + r * 64);
      __m512i w[RV];
      for (int v = 0; v < RV; ++v) w[v] = at64(p, L::q + (RV * r + v) * 64);
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = x0 + m * kb * kQK + 4 * RV * r;
        if constexpr (K == KType::Q4K) {  // each half run's sum fits 16 bits: both halves in one vpdpwssd
          __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast32(x));
          __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[RV / 2], bcast32(x + 2 * RV));
          for (int v = 1; v < RV / 2; ++v) {
            lo = _mm512_dpbusd_epi32(lo, w[v], bcast32(x + 4 * v));
            hi = _mm512_dpbusd_epi32(hi, w[RV / 2 + v], bcast32(x + 2 * RV + 4 * v));
          }
          sum[m] = _mm512_dpwssd_epi32(sum[m], _mm512_mask_blend_epi16(0xAAAAAAAA, lo, _mm512_slli_epi32(hi, 16)), sc);
        } else {
          __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast32(x));
          for (int v = 1; v < RV; ++v) a = _mm512_dpbusd_epi32(a, w[v], bcast32(x + 4 * v));
          sum[m] = _mm512_add_epi32(sum[m], _mm512_mullo_epi32(a, sc));
        }
      }
    }
    const vf d = _mm512_loadu_ps(p + L::d);
    for (int m = 0; m < MR; ++m) {
      const int64_t row = (m0 + m) * kb + sb;
      const int16_t* aux = xp.aux.data() + row * 16;
      const vf s = vset(xp.x.s[row]);
      __m512i mins = _mm512_setzero_si512();
      for (int k = 0; k < L::pairs; ++k) mins = _mm512_dpwssd_epi32(mins, at64(p, L::mins + k * 64), bcast32(aux + 2 * k));
      if constexpr (K == KType::Q6K) {
        acc[m] = vfma(_mm512_cvtepi32_ps(_mm512_add_epi32(sum[m], mins)), vmul(s, d), acc[m]);
      } else {
        acc[m] = vfma(_mm512_cvtepi32_ps(sum[m]), vmul(s, d), acc[m]);
        acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), vmul(s, _mm512_loadu_ps(p + L::dmin)), acc[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) vstore(out + 16 * m, acc[m]);
}

template <KType K>
void run_panel(int mr, const uint8_t* panel, int64_t sb0, int64_t sb1, const XPanel& xp, int64_t m0, float* acc) {
  switch (mr) {
    case 1: panel_dot<K, 1>(panel, sb0, sb1, xp, m0, acc); break;
    case 2: panel_dot<K, 2>(panel, sb0, sb1, xp, m0, acc); break;
    case 3: panel_dot<K, 3>(panel, sb0, sb1, xp, m0, acc); break;
    default: panel_dot<K, 4>(panel, sb0, sb1, xp, m0, acc); break;
  }
}

// out [M, N] = x @ w^T (+ bias) from kPanelMinRows rows: per row block, each thread takes its
// panels one at a time, kPanelChunk super-blocks at a time: decodes them, asks for the next
// chunk's blocks, then passes every row of the block against them, so the weights' memory
// traffic overlaps the products (decoding a whole panel first, then the rows, left the decode
// waiting on memory and the products waiting on nothing).
template <KType K, typename T>
void kquant_panel_gemm(T* out, const T* x, const uint8_t* w, const T* bias, int64_t M, int64_t N, int64_t Kin) {
  using L = PanelLayout<K>;
  constexpr int64_t B = block_bytes(K);
  const int64_t kb = Kin / kQK, blocks = (N + kBlock - 1) / kBlock;
  const int64_t panels = (blocks + kPanelBlocks - 1) / kPanelBlocks;
  for (int64_t m0 = 0; m0 < M; m0 += kPanelRowBlock) {
    const int64_t mb = std::min(kPanelRowBlock, M - m0);
    const XPanel xp = quantize_panel_x<K>(x + m0 * Kin, mb, Kin);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      std::vector<uint8_t> scratch(kPanelChunk * L::bytes);
      std::vector<float> acc(mb * kPanelFeatures);
      alignas(64) static const uint8_t zero_block[256] = {};
      auto blocks_at = [&](int64_t p, int64_t sb, int j) { return w + ((p * kPanelBlocks + j) * kb + sb) * kBlock * B; };
      for (int64_t p = p0; p < p1; ++p) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t sb0 = 0; sb0 < kb; sb0 += kPanelChunk) {
          const int64_t sb1 = std::min(kb, sb0 + kPanelChunk);
          for (int64_t sb = sb0; sb < sb1; ++sb) {
            const uint8_t* blk[kPanelFeatures];
            for (int j = 0; j < kPanelBlocks; ++j) {
              const bool real = p * kPanelBlocks + j < blocks;
              for (int f = 0; f < kBlock; ++f) blk[kBlock * j + f] = real ? blocks_at(p, sb, j) + f * B : zero_block;
            }
            panel_decode<K>(blk, scratch.data() + (sb - sb0) * L::bytes);
          }
          // The next chunk's blocks (this panel's or the next one's) stream into L2 while the rows pass.
          const int64_t np = sb1 < kb ? p : p + 1, nsb = sb1 < kb ? sb1 : 0;
          if (np < p1)
            for (int j = 0; j < kPanelBlocks; ++j)
              if (np * kPanelBlocks + j < blocks)
                for (int64_t o = 0; o < std::min(kPanelChunk, kb - nsb) * kBlock * B; o += 64)
                  _mm_prefetch(reinterpret_cast<const char*>(blocks_at(np, nsb, j) + o), _MM_HINT_T1);
          for (int64_t r = 0; r < mb; r += kPanelRows)
            run_panel<K>(static_cast<int>(std::min<int64_t>(kPanelRows, mb - r)), scratch.data(), sb0, sb1, xp, r,
                         acc.data() + r * kPanelFeatures);
        }
        const int64_t n0 = p * kPanelFeatures;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
        const vf bv = bias ? load_masked(bias + n0, mask) : vzero();
        for (int64_t r = 0; r < mb; ++r) store_masked(out + (m0 + r) * N + n0, vadd(vload(acc.data() + r * kPanelFeatures), bv), mask);
      }
    });
  }
}
#endif  // __AVX512F__

// ---- AVX2: unsigned q times signed xq in pairs (vpmaddubsw) -------------------------------------
//
// What runs where AVX512-VNNI is missing (the AVX2 build; the AVX-512 build on a CPU without
// VNNI), as llama.cpp's AVX2 k-quant dot products do it: a super-block's q become eight vectors
// of 32 unsigned values in input order (xq's order too); vpmaddubsw sums adjacent products into
// int16 (at most 2 x 63 x 127: no saturation), vpmaddwd by the scale of the run each word lies in
// widens to int32 and adds pairs. Q6_K's -32 is -32 sc times the bsums, one vpmaddwd per
// super-block; Q4_K / Q5_K's mins likewise. The same integers as the plain loops; fp32
// accumulators per row and feature, as in the VNNI kernel. A block is unpacked once for up to
// kAvx2Rows rows: with 16 ymm registers the unpacked block and the accumulators live in L1
// either way, so more rows a pass only saves unpacking (16 rows ran 1.5-1.8x 4 a pass at 16-64).

#if defined(__AVX2__)
#define LLMC_AVX2 __attribute__((target("avx2,fma")))

struct alignas(32) Unpacked2 {
  __m256i w[8];   // inputs 32v + [0, 32), unsigned
  __m256i sc[8];  // vpmaddubsw's 16 words of vector v: each its run's scale
  __m256i aux;    // 16 words against the 16 bsums: Q4_K / Q5_K m of each run of 32 (twice), Q6_K -32 sc
  float d, dmin;
};

LLMC_AVX2 inline __m256i nibbles_at(__m256i v, int shift, int mask, int to) {  // ((v >> shift) & mask) << to, per byte
  const __m256i x = _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
  return _mm256_slli_epi16(x, to);
}

// pshufb's control for 16-bit words: word lo of each 128-bit lane's 8 to every word of the low lane,
// word hi to every word of the high lane.
LLMC_AVX2 inline __m256i word_pattern(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(0x0100 + 0x0202 * hi)),
                          _mm_set1_epi16(static_cast<short>(0x0100 + 0x0202 * lo)));
}

LLMC_AVX2 inline void unpack2_q45k(const uint8_t* b, bool five, Unpacked2& u) {
  u.d = half_at(b);
  u.dmin = half_at(b + 2);
  const __m256i words = _mm256_cvtepu8_epi16(scales_mins_k4(b + 4));  // sc, then m
  const __m128i sc8 = _mm256_castsi256_si128(words), mn8 = _mm256_extracti128_si256(words, 1);
  const __m256i sc2 = _mm256_set_m128i(sc8, sc8);
  for (int j = 0; j < 8; ++j) u.sc[j] = _mm256_shuffle_epi8(sc2, word_pattern(j, j));
  u.aux = _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8));
  const uint8_t* qs = b + (five ? 48 : 16);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  for (int c = 0; c < 4; ++c) {  // pair c of runs: 32 bytes, low nibbles run 2c, high ones run 2c + 1
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i lo = _mm256_and_si256(v, nibble), hi = nibbles_at(v, 4, 0x0F, 0);
    if (five) {
      lo = _mm256_or_si256(lo, nibbles_at(qh, 2 * c, 1, 4));
      hi = _mm256_or_si256(hi, nibbles_at(qh, 2 * c + 1, 1, 4));
    }
    u.w[2 * c] = lo;
    u.w[2 * c + 1] = hi;
  }
}

LLMC_AVX2 inline void unpack2_q6k(const uint8_t* b, Unpacked2& u) {
  u.d = half_at(b + 208);
  u.dmin = 0.f;
  const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m256i first = _mm256_permute2x128_si256(sc, sc, 0x00), last = _mm256_permute2x128_si256(sc, sc, 0x11);
  for (int v = 0; v < 8; ++v)  // words 0-7 (inputs 32v + [0, 16)) in run 2v, words 8-15 in run 2v + 1
    u.sc[v] = _mm256_shuffle_epi8(v < 4 ? first : last, word_pattern(2 * (v % 4), 2 * (v % 4) + 1));
  u.aux = _mm256_mullo_epi16(sc, _mm256_set1_epi16(-32));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {  // decode_q6k's bits, 32 inputs at a time
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    u.w[4 * h] = _mm256_or_si256(_mm256_and_si256(a, nibble), nibbles_at(hb, 0, 3, 4));
    u.w[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(c, nibble), nibbles_at(hb, 2, 3, 4));
    u.w[4 * h + 2] = _mm256_or_si256(nibbles_at(a, 4, 0x0F, 0), nibbles_at(hb, 4, 3, 4));
    u.w[4 * h + 3] = _mm256_or_si256(nibbles_at(c, 4, 0x0F, 0), nibbles_at(hb, 6, 3, 4));
  }
}

LLMC_AVX2 inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows m0..m0+MC of x against block b's super-blocks -> sums[MC][4].
template <KType T, int MC>
LLMC_AVX2 void block_dot_avx2(const uint8_t* blocks, int64_t kb, const XQuant& x, int64_t m0, float* sums) {
  constexpr int64_t B = block_bytes(T);
  __m256 acc[MC][kBlock];
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = _mm256_setzero_ps();
  Unpacked2 u;
  for (int64_t j = 0; j < kb; ++j)
    for (int r = 0; r < kBlock; ++r) {
      const uint8_t* blk = blocks + (j * kBlock + r) * B;
      for (int64_t o = 0; o < B; o += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
      if constexpr (T == KType::Q6K) {
        unpack2_q6k(blk, u);
      } else {
        unpack2_q45k(blk, T == KType::Q5K, u);
      }
      for (int c = 0; c < MC; ++c) {
        const int64_t row = (m0 + c) * kb + j;
        const int8_t* xq = x.q.data() + row * kQK;
        const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum.data() + row * kRuns16));
        const __m256i aux = _mm256_madd_epi16(u.aux, bsum);
        __m256i a = T == KType::Q6K ? aux : _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
          const __m256i p = _mm256_maddubs_epi16(u.w[v], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * v)));
          a = _mm256_add_epi32(a, _mm256_madd_epi16(p, u.sc[v]));
        }
        const float s = x.s[row];
        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(s * u.d), acc[c][r]);
        if constexpr (T != KType::Q6K)
          acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(aux), _mm256_set1_ps(-(s * u.dmin)), acc[c][r]);
      }
    }
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) sums[c * kBlock + r] = hsum8(acc[c][r]);
}

#endif  // __AVX2__

// ---- the linear op -------------------------------------------------------------------------------

// out [M, N] from blocks of four features: dot(b, m0, mc, sums) puts rows m0..m0+mc times block b
// into sums [mc][4]; up to `rows` rows a pass. The threads' ranges of blocks are each one stream.
template <typename T, typename Dot>
void over_blocks(T* out, const T* bias, int64_t M, int64_t N, int rows, int64_t block_stride, const Dot& dot) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, block_stride));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(static_cast<size_t>(rows) * kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const int nr = static_cast<int>(std::min<int64_t>(kBlock, N - b * kBlock));
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int mc = static_cast<int>(std::min<int64_t>(rows, M - m0));
        dot(b, m0, mc, sums.data());
        for (int c = 0; c < mc; ++c)
          for (int r = 0; r < nr; ++r) {
            const int64_t n = b * kBlock + r;
            out[(m0 + c) * N + n] = static_cast<T>(sums[c * kBlock + r] + (bias ? to_float(bias[n]) : 0.f));
          }
      }
    }
  });
}

template <KType K, typename T>
void kquant_gemm(T* out, const T* x, const uint8_t* w, const T* bias, int64_t M, int64_t N, int64_t Kin, bool simd) {
  const int64_t kb = Kin / kQK, stride = kb * kBlock * block_bytes(K);
#if defined(__AVX512F__)
  if (simd && LLMC_NAMESPACE::int8_gemm_available()) {
    if (M >= kPanelMinRows) return kquant_panel_gemm<K>(out, x, w, bias, M, N, Kin);
    const XQuant xq = quantize_x(x, M, Kin, K != KType::Q6K, K == KType::Q6K);
    return over_blocks(out, bias, M, N, kVnniRows, stride, [&](int64_t b, int64_t m0, int mc, float* sums) {
      run_block_vnni<K>(w + b * stride, kb, xq, m0, mc, sums);
    });
  }
#endif
  const XQuant xq = quantize_x(x, M, Kin, false, false);
#if defined(__AVX2__)
  if (simd) {
    return over_blocks(out, bias, M, N, kAvx2Rows, stride, [&](int64_t b, int64_t m0, int mc, float* sums) {
      with_rows<kAvx2Rows>(mc, [&](auto rows) { block_dot_avx2<K, rows()>(w + b * stride, kb, xq, m0, sums); });
    });
  }
#endif
  over_blocks(out, bias, M, N, kScalarRows, stride, [&](int64_t b, int64_t m0, int mc, float* sums) {
    block_dot_plain<K>(w + b * stride, kb, xq, m0, mc, sums);
  });
}

// packed checked against a [N, K] weight; returns its type.
KType check_packed(const char* op, const at::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == kBlock,
              op, ": packed must be kquant_pack's contiguous uint8 [N/4, K/256, 4, block bytes] blocks, got ", packed.sizes(),
              " ", packed.scalar_type());
  const KType t = ktype_of(op, packed.size(3));
  TORCH_CHECK(K % kQK == 0 && packed.size(0) == (N + kBlock - 1) / kBlock && packed.size(1) == K / kQK, op, ": packed ",
              packed.sizes(), " is not kquant_pack of a [", N, ", ", K, "] weight (K a multiple of ", kQK, ")");
  return t;
}

template <typename T>
void kquant_gemm_for(KType t, T* out, const T* x, const uint8_t* w, const T* bias, int64_t M, int64_t N, int64_t K, bool simd) {
  switch (t) {
    case KType::Q4K: return kquant_gemm<KType::Q4K>(out, x, w, bias, M, N, K, simd);
    case KType::Q5K: return kquant_gemm<KType::Q5K>(out, x, w, bias, M, N, K, simd);
    case KType::Q6K: return kquant_gemm<KType::Q6K>(out, x, w, bias, M, N, K, simd);
  }
}

// x @ w^T (+ bias) through the SIMD kernels (`simd`: VNNI where int8_gemm_available, else AVX2) or the plain loops.
at::Tensor kquant_run(const char* op, const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t N, bool simd) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op, ": x must be float32 or bfloat16, got ",
              x.scalar_type());
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  const KType t = check_packed(op, packed, N, K);
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type() && bias->is_contiguous(), op,
                        ": bias must be [", N, "] in x's dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = x.new_empty(shape);
  if (M == 0) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
    kquant_gemm_for<bf16>(t, out.data_ptr<bf16>(), x.data_ptr<bf16>(), w, bias ? bias->data_ptr<bf16>() : nullptr, M, N, K, simd);
  } else {
    kquant_gemm_for<float>(t, out.data_ptr<float>(), x.data_ptr<float>(), w, bias ? bias->data_ptr<float>() : nullptr, M, N, K, simd);
  }
  return out;
}

// The plain loops whatever the CPU (what the scalar build runs): for tests of the SIMD kernels.
}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

at::Tensor kquant_linear_plain(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  return kquant_run("kquant_linear_plain", x, packed, bias, N, false);
}

template <typename Out>
void dequant_rows(KType t, Out* out, const uint8_t* w, int64_t N, int64_t K) {
  const int64_t kb = K / kQK, B = block_bytes(t);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < kb; ++j) {
        const uint8_t* blk = w + (((n / kBlock) * kb + j) * kBlock + n % kBlock) * B;
        Out* dst = out + n * K + j * kQK;
        switch (t) {
          case KType::Q4K: dequant_block<KType::Q4K>(blk, dst); break;
          case KType::Q5K: dequant_block<KType::Q5K>(blk, dst); break;
          case KType::Q6K: dequant_block<KType::Q6K>(blk, dst); break;
        }
      }
  });
}

void kquant_dequant_(at::Tensor out, const at::Tensor& packed) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "kquant_dequant_: out must be a contiguous [N, K] tensor");
  const KType t = check_packed("kquant_dequant_", packed, out.size(0), out.size(1));
  if (out.scalar_type() == at::kBFloat16) {
    dequant_rows<bf16>(t, out.data_ptr<bf16>(), packed.data_ptr<uint8_t>(), out.size(0), out.size(1));
  } else {
    TORCH_CHECK(out.scalar_type() == at::kFloat, "kquant_dequant_: out must be float32 or bfloat16, got ", out.scalar_type());
    dequant_rows<float>(t, out.data_ptr<float>(), packed.data_ptr<uint8_t>(), out.size(0), out.size(1));
  }
}

at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  return kquant_run("kquant_linear", x, packed, bias, N, true);
}

}  // namespace LLMC_NAMESPACE
