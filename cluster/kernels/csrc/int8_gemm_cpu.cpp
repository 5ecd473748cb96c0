// W8A8 GEMM on `int8_pack`'ed weights, through AVX512-VNNI's u8 x s8 dot products:
//
//   int8_gemm_available() -> bool                   this CPU has AVX512-VNNI and the build AVX-512
//   int8_gemm_offsets(qp, sp) -> offsets            once per weight: [N/4, groups, 4] int32
//   int8_gemm(x, qp, sp, offsets, bias, N) -> out    out = x @ w^T (+ bias), w = q * scale
//
// Activations are quantized on the fly per row and group of inputs, symmetric: s = absmax / 127,
// xq = round(x * (127 / absmax)) in [-127, 127] (an all-zero group: s = 0). The group is 64 inputs
// for a weight with one scale per feature (int8; per row instead cost SmolLM2 3.8% perplexity
// against bf16, per 64 1.0%), and the weight's own groups for one with a scale per group of 32 or
// 64 inputs (GGUF's Q8_0: 32, as llama.cpp's Q8_0 dot products quantize x). VNNI multiplies
// unsigned by signed bytes, so the kernel feeds xq + 128 and starts each group's int32 sum at
// offsets = -128 x the group's sum of q:
//   per feature: out[m, n] = scale[n] * sum_g s[m, g] * (sum_k in g xq w) (+ bias[n])
//   per group:   out[m, n] = sum_g (scale[n, g] * s[m, g]) * (sum_k in g xq w) (+ bias[n])
// each group's sum exact in int32, the rest fp32, one rounding into out. offsets cost 1/16 (a
// group of 64) or 1/8 (32) of the int8 weight's bytes. The fp32 part rounds partial sums that
// still carry 128 x q (a feature's 4 lanes are summed after scaling): an error up to ~1e-6 of
// the sum of |x w| on SmolLM2's head, where x's quantization costs ~1e-2 of the output.
//
// Layout: int8_pack's [N/4, K/16, 4, 16] blocks. One 64-byte vector is 4 features x 16 inputs; a
// row's 16 inputs broadcast to the four 128-bit lanes line up with it, so one vpdpbusd adds 4
// features x 4 partial sums of 4 products. A panel of 4 blocks (16 features, one output vector)
// against 4 rows keeps 16 fp32 accumulators (6 rows spilled with GCC 12); the panel's weights
// (16 x K bytes) stay in L1/L2 while the rows pass, and a row block's quantized rows (<= 192 x K
// bytes) in L2 while the panels pass.
//
// AMX (int8_amx_available: a CPU with AMX-INT8, Sapphire Rapids on): from kAmxMinRows rows the
// same math runs on tiles. One tdpbssd multiplies 16 rows by 16 features over one activation group
// (64 or 32 inputs), signed by signed, so xq needs no +128 and no offsets. Each group's int32 tile is
// stored and scaled into fp32 sums (s[m, g], times scale[n, g] with group scales), as the VNNI path
// scales each group's sum: the same integers and scales, fp32 sums in another order. A pass is 32
// rows x 32 features (two A, two B and four C tiles of the eight); each panel of 32 features is first
// rearranged into the tiles' layout (a tile row: inputs 4r..4r+3 of its 16 features side by side),
// K x 32 bytes per thread. The scaling, not the tiles, bounds it: 64 vector FMAs per 4 tdpbssd.
// LLM_CLUSTER_INT8_AMX=0 turns it off (the VNNI kernel at every size).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"
#include "simd.h"

#if defined(LLMC_HAS_AMX_PATH)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace llmc;

constexpr int kBlock = 4;          // int8_pack's features per block
constexpr int kPanel = 4;          // blocks per panel: 16 features
constexpr int kLanes = 16;         // inputs per packed vector (int8_pack on AVX-512)
constexpr int kMaxRows = 4;        // rows per pass
constexpr int kFeatureGroupVectors = 4;  // packed vectors per activation group under per-feature scales: 64 inputs
constexpr int64_t kRowBlock = 192; // rows quantized and kept in L2 while every panel passes them
constexpr int64_t kAmxMinRows = 24;  // rows from which int8_gemm runs on AMX tiles where it can (the VNNI kernel wins at 16)
constexpr int kAmxRows = 32;         // rows per AMX pass: two A tiles
constexpr int kAmxBlocks = 8;        // int8_pack blocks per AMX panel: 32 features, two B tiles

// Packed vectors (16 inputs) per activation group for a weight of kv vectors with `weight_groups`
// scales per feature: 4 with one scale per feature, else the weight's groups (2 or 4 vectors).
int64_t group_vectors(const char* op, int64_t kv, int64_t weight_groups) {
  if (weight_groups == 1) return kFeatureGroupVectors;
  const int64_t gv = kv / weight_groups;
  TORCH_CHECK(gv * weight_groups == kv && (gv == 2 || gv == 4), op, ": ", weight_groups, " scale groups over ", kv * kLanes,
              " inputs; int8_gemm takes one scale per feature or per group of 32 or 64 inputs");
  return gv;
}

#if defined(__AVX512F__)

// Row x [K] -> `groups` groups of `group` bytes, group g at q + g * stride (xq + kZero: 128 for
// VNNI's unsigned bytes, 0 for AMX's signed ones; the padding past K kZero, i.e. 0), and a scale
// per group.
template <int kZero, typename T>
void quantize_row(const T* x, int64_t K, int64_t groups, int64_t group, int64_t stride, uint8_t* q, float* scales) {
  const __m512i zero_point = _mm512_set1_epi32(kZero);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * group, k1 = std::min(K, k0 + group);
    uint8_t* qg = q + g * stride - k0;  // indexed by k
    vf amax = vzero();
    int64_t k = k0;
    for (; k + W <= k1; k += W) amax = vmax(amax, vabs(vload(x + k)));
    float a = _mm512_reduce_max_ps(amax);
    for (; k < k1; ++k) a = std::max(a, std::fabs(static_cast<float>(x[k])));
    const float inv = a > 0.f ? 127.f / a : 0.f;
    // s = 0 for an all-zero group: its int32 lanes still hold 128 x q (the offsets cancel them only
    // once a feature's four lanes are summed), and scaled by 0 they add nothing, exactly.
    scales[g] = a > 0.f ? a / 127.f : 0.f;
    for (k = k0; k + W <= k1; k += W) {  // cvtps rounds to nearest even, as torch.round
      const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(vmul(vload(x + k), vset(inv))), zero_point);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + k), _mm512_cvtepi32_epi8(i));
    }
    for (; k < k1; ++k) qg[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(static_cast<float>(x[k]) * inv)) + kZero);
    std::fill(qg + k1, qg + k0 + group, static_cast<uint8_t>(kZero));
  }
}

// One group's int32 sum for a row (xv: its vectors broadcast) and block, started at the offset.
template <int NV>
LLMC_VNNI inline __m512i group_dot(__m512i acc, const __m512i* xv, const int8_t* w) {
#pragma GCC unroll 4
  for (int t = 0; t < NV; ++t) acc = _mm512_dpbusd_epi32(acc, xv[t], _mm512_loadu_si512(w + t * kBlock * kLanes));
  return acc;
}

// A block's 4 scales of group g (ws: [groups, 4]) in the lanes its sums land in (feature r: lane r).
inline vf block_scales(const float* ws, int64_t g) {
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(ws + g * kBlock)));
}

// MR quantized rows (kq bytes and `groups` scales apart) against one panel (w[j], off[j], ws[j]:
// block j's vectors, offsets and, with kGroupScales, its per-group scales) -> sums[MR], the
// panel's 16 features (before the weight's scale when it is one per feature). GV: vectors per
// group. The unroll pragmas let GCC keep acc in registers.
template <int MR, int GV, bool kGroupScales>
LLMC_VNNI void panel_dot(const int8_t* const w[kPanel], const int32_t* const off[kPanel], const float* const ws[kPanel],
                         const uint8_t* xq, int64_t kq, const float* xs, int64_t groups, int64_t kv, vf* sums) {
  vf acc[MR][kPanel];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kPanel; ++j) acc[m][j] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t v0 = g * GV, nv = std::min<int64_t>(GV, kv - v0);
    __m512i start[kPanel];  // the offsets of the block's 4 features in lanes 0, 4, 8, 12
    vf scale[kPanel];
#pragma GCC unroll 4
    for (int j = 0; j < kPanel; ++j) {
      start[j] = _mm512_maskz_expandloadu_epi32(0x1111, off[j] + g * kBlock);
      if constexpr (kGroupScales) scale[j] = block_scales(ws[j], g);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      __m512i xv[GV];
      for (int t = 0; t < nv; ++t)
        xv[t] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + m * kq + (v0 + t) * kLanes)));
      const vf s = vset(xs[m * groups + g]);
#pragma GCC unroll 4
      for (int j = 0; j < kPanel; ++j) {
        const int8_t* wj = w[j] + v0 * kBlock * kLanes;
        __m512i sum;
        if (nv == GV) {
          sum = group_dot<GV>(start[j], xv, wj);
        } else {  // K's last group (per-feature scales only: a weight's groups are whole)
          sum = start[j];
          for (int t = 0; t < nv; ++t) sum = _mm512_dpbusd_epi32(sum, xv[t], _mm512_loadu_si512(wj + t * kBlock * kLanes));
        }
        acc[m][j] = vfma(_mm512_cvtepi32_ps(sum), kGroupScales ? vmul(scale[j], s) : s, acc[m][j]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) sums[m] = reduce_panel(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
}

template <int GV, bool kGroupScales>
LLMC_VNNI void run_panel(int mr, const int8_t* const w[kPanel], const int32_t* const off[kPanel], const float* const ws[kPanel],
                         const uint8_t* xq, int64_t kq, const float* xs, int64_t groups, int64_t kv, vf* sums) {
  switch (mr) {
    case 1: panel_dot<1, GV, kGroupScales>(w, off, ws, xq, kq, xs, groups, kv, sums); break;
    case 2: panel_dot<2, GV, kGroupScales>(w, off, ws, xq, kq, xs, groups, kv, sums); break;
    case 3: panel_dot<3, GV, kGroupScales>(w, off, ws, xq, kq, xs, groups, kv, sums); break;
    default: panel_dot<4, GV, kGroupScales>(w, off, ws, xq, kq, xs, groups, kv, sums); break;
  }
}

// out [M, N] = x @ w^T (+ bias): GV vectors per activation group; kGroupScales: scales [N/4,
// groups, 4] per weight group (the activation's), else [N/4, 1, 4] per feature.
template <int GV, bool kGroupScales, typename T>
LLMC_VNNI void gemm(T* out, const T* x, const int8_t* qp, const float* scales, const int32_t* offsets, const T* bias,
                    int64_t M, int64_t N, int64_t K) {
  const int64_t kv = (K + kLanes - 1) / kLanes, groups = (kv + GV - 1) / GV, kq = groups * GV * kLanes;
  const int64_t blocks = (N + kBlock - 1) / kBlock, panels = (blocks + kPanel - 1) / kPanel;
  const int64_t block_bytes = kv * kBlock * kLanes, block_scales = (kGroupScales ? groups : 1) * kBlock;
  // The last panel's missing blocks read zeros: weights, offsets and scales.
  const std::vector<int8_t> zero_w(blocks % kPanel ? block_bytes : 0, 0);
  const std::vector<int32_t> zero_off(blocks % kPanel ? groups * kBlock : 0, 0);
  const std::vector<float> zero_s(blocks % kPanel ? block_scales : 0, 0.f);
  std::vector<uint8_t> xq(std::min(M, kRowBlock) * kq);
  std::vector<float> xs(std::min(M, kRowBlock) * groups);
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, M - m0);
    at::parallel_for(0, mb, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        quantize_row<128>(x + (m0 + r) * K, K, groups, GV * kLanes, GV * kLanes, xq.data() + r * kq, xs.data() + r * groups);
    });
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      vf sums[kMaxRows];
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* w[kPanel];
        const int32_t* off[kPanel];
        const float* ws[kPanel];
        for (int j = 0; j < kPanel; ++j) {
          const int64_t b = p * kPanel + j;
          w[j] = b < blocks ? qp + b * block_bytes : zero_w.data();
          off[j] = b < blocks ? offsets + b * groups * kBlock : zero_off.data();
          ws[j] = b < blocks ? scales + b * block_scales : zero_s.data();
        }
        const int64_t n0 = p * kPanel * kBlock;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
        const vf scale = kGroupScales ? vset(1.f) : load_masked(scales + n0, mask);
        const vf b = bias ? load_masked(bias + n0, mask) : vzero();
        for (int64_t r = 0; r < mb; r += kMaxRows) {
          const int mr = static_cast<int>(std::min<int64_t>(kMaxRows, mb - r));
          run_panel<GV, kGroupScales>(mr, w, off, ws, xq.data() + r * kq, kq, xs.data() + r * groups, groups, kv, sums);
          for (int i = 0; i < mr; ++i) store_masked(out + (m0 + r + i) * N + n0, vfma(sums[i], scale, b), mask);
        }
      }
    });
  }
}

#if defined(LLMC_HAS_AMX_PATH)
// v grown to at least n elements (never shrunk, not cleared): a thread's scratch kept between
// calls, so a decode step's GEMMs do not allocate and zero-fill it each time.
template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// Panel p's blocks (b0..b0+7) as group-by-group pairs of B tiles: tile 2g + h, row r (inputs 4r..4r+3
// of group g), bytes 4f..4f+3: feature 16h + f. An int8_pack vector (4 features x 16 inputs, as
// [feature][4 dwords]) transposed to [dword][feature] holds four tile rows' 16 bytes, one per
// 128-bit lane; the four blocks of a tile, transposed lane by lane, give four whole rows. Group
// scales (ws) go to gs [groups][32]: the panel's 32 features' scales of each group.
void amx_pack_panel(const int8_t* qp, const float* ws, int64_t blocks, int64_t kv, int64_t groups, int gv, int64_t b0,
                    int8_t* tiles, float* gs) {
  const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const int64_t tile_bytes = gv * kLanes / 4 * 64;
  for (int64_t g = 0; g < groups; ++g)
    for (int h = 0; h < 2; ++h) {
      int8_t* tile = tiles + (2 * g + h) * tile_bytes;
      for (int t = 0; t < gv; ++t) {
        const int64_t v = g * gv + t;
        __m512i a[kBlock];
        for (int j = 0; j < kBlock; ++j) {
          const int64_t b = b0 + h * kBlock + j;
          a[j] = v < kv && b < blocks ? _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(qp + (b * kv + v) * kBlock * kLanes))
                                      : _mm512_setzero_si512();
        }
        const __m512i t0 = _mm512_shuffle_i32x4(a[0], a[1], 0x44), t1 = _mm512_shuffle_i32x4(a[0], a[1], 0xEE);
        const __m512i t2 = _mm512_shuffle_i32x4(a[2], a[3], 0x44), t3 = _mm512_shuffle_i32x4(a[2], a[3], 0xEE);
        int8_t* row = tile + 4 * t * 64;
        _mm512_storeu_si512(row, _mm512_shuffle_i32x4(t0, t2, 0x88));
        _mm512_storeu_si512(row + 64, _mm512_shuffle_i32x4(t0, t2, 0xDD));
        _mm512_storeu_si512(row + 128, _mm512_shuffle_i32x4(t1, t3, 0x88));
        _mm512_storeu_si512(row + 192, _mm512_shuffle_i32x4(t1, t3, 0xDD));
      }
      if (gs)
        for (int j = 0; j < kBlock; ++j) {
          const int64_t b = b0 + h * kBlock + j;
          float* dst = gs + g * 32 + (h * kBlock + j) * kBlock;
          if (b < blocks) std::memcpy(dst, ws + (b * groups + g) * kBlock, kBlock * sizeof(float));
          else std::fill_n(dst, kBlock, 0.f);
        }
    }
}

// Groups g0..g0+nb of one pass on the tiles: each group's four int32 C tiles into c[b] (b = g - g0).
LLMC_AMX inline void amx_tiles(const int8_t* xq, const int8_t* tiles, int kg, int64_t g0, int nb, int32_t (*c)[4][16 * 16]) {
  const int64_t tile_bytes = kg / 4 * 64;
  for (int b = 0; b < nb; ++b) {
    const int64_t g = g0 + b;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(0, xq + g * 2 * 16 * kg, kg);
    _tile_loadd(1, xq + (g * 2 + 1) * 16 * kg, kg);
    _tile_loadd(2, tiles + 2 * g * tile_bytes, 64);
    _tile_loadd(3, tiles + (2 * g + 1) * tile_bytes, 64);
    _tile_dpbssd(4, 0, 2);
    _tile_dpbssd(5, 0, 3);
    _tile_dpbssd(6, 1, 2);
    _tile_dpbssd(7, 1, 3);
    _tile_stored(4, c[b][0], 64);
    _tile_stored(5, c[b][1], 64);
    _tile_stored(6, c[b][2], 64);
    _tile_stored(7, c[b][3], 64);
  }
}

// One pass: 32 quantized rows x one packed panel -> acc [32][32] fp32, the sum over groups of s[m, g]
// (x scale[n, g] with group scales) x the group's int32 tile. xq: the pass's two A tiles of each
// group, 16 x kg bytes each, group by group (rows past `rows` are zeros). Software-pipelined: the
// tiles of the next kBatch groups are issued before this batch's are scaled, so the tile unit and
// the vector units work at once; each fp32 sum is loaded and stored once a batch.
template <bool kGroupScales>
LLMC_AMX void amx_pass(const int8_t* xq, const float* xs, int64_t groups, int kg, int rows, const int8_t* tiles,
                       const float* gs, float* acc) {
  constexpr int kBatch = 2;
  alignas(64) int32_t c[2][kBatch][4][16 * 16];
  std::fill_n(acc, kAmxRows * 32, 0.f);
  amx_tiles(xq, tiles, kg, 0, static_cast<int>(std::min<int64_t>(kBatch, groups)), c[0]);
  for (int64_t g0 = 0, batch = 0; g0 < groups; g0 += kBatch, ++batch) {
    const int nb = static_cast<int>(std::min<int64_t>(kBatch, groups - g0));
    if (g0 + kBatch < groups)
      amx_tiles(xq, tiles, kg, g0 + kBatch, static_cast<int>(std::min<int64_t>(kBatch, groups - g0 - kBatch)), c[(batch + 1) % 2]);
    int32_t (*cb)[4][16 * 16] = c[batch % 2];
    for (int i = 0; i < rows; ++i)
      for (int h = 0; h < 2; ++h) {
        float* a = acc + i * 32 + h * 16;
        vf sum = vload(a);
        for (int b = 0; b < nb; ++b) {
          const vf s = vset(xs[i * groups + g0 + b]);
          const vf tile = _mm512_cvtepi32_ps(_mm512_load_si512(cb[b][(i / 16) * 2 + h] + (i % 16) * 16));
          sum = vfma(tile, kGroupScales ? vmul(vload(gs + (g0 + b) * 32 + h * 16), s) : s, sum);
        }
        vstore(a, sum);
      }
  }
}

// Panels p0..p1 of amx_gemm for its rows m0..m0+mb (quantized in xq, xs: each pass's 32 rows kq
// bytes a row, as amx_pass reads them; zero rows up to whole passes), on one thread (tile configs
// are per thread).
template <int GV, bool kGroupScales, typename T>
LLMC_AMX void amx_panels(int64_t p0, int64_t p1, T* out, const uint8_t* xq, const float* xs, const int8_t* qp,
                         const float* scales, const T* bias, int64_t m0, int64_t mb, int64_t N, int64_t K) {
  constexpr int kg = GV * kLanes;
  const int64_t kv = (K + kLanes - 1) / kLanes, groups = (kv + GV - 1) / GV, kq = groups * kg;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const TileConfig saved = tile_begin(tile_config(kg, kg / 4));
  thread_local std::vector<int8_t> tile_scratch;
  thread_local std::vector<float> scale_scratch;
  int8_t* tiles = grown(tile_scratch, groups * 2 * (kg / 4) * 64);  // every byte written by amx_pack_panel
  float* gs = kGroupScales ? grown(scale_scratch, groups * 32) : nullptr;
  alignas(64) float acc[kAmxRows * 32];
  for (int64_t p = p0; p < p1; ++p) {
    amx_pack_panel(qp, scales, blocks, kv, groups, GV, p * kAmxBlocks, tiles, gs);
    for (int64_t r = 0; r < mb; r += kAmxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, mb - r));
      amx_pass<kGroupScales>(reinterpret_cast<const int8_t*>(xq) + r * kq, xs + r * groups, groups, kg, rows, tiles, gs, acc);
      for (int h = 0; h < 2; ++h) {
        const int64_t n0 = p * kAmxBlocks * kBlock + h * 16;
        if (n0 >= N) break;
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
        const vf scale = kGroupScales ? vset(1.f) : load_masked(scales + n0, mask);
        const vf b = bias ? load_masked(bias + n0, mask) : vzero();
        for (int i = 0; i < rows; ++i) store_masked(out + (m0 + r + i) * N + n0, vfma(vload(acc + i * 32 + h * 16), scale, b), mask);
      }
    }
  }
  tile_end(saved);
}

// int8_gemm on AMX tiles: same arguments as `gemm` (GV: vectors per activation group).
template <int GV, bool kGroupScales, typename T>
void amx_gemm(T* out, const T* x, const int8_t* qp, const float* scales, const T* bias, int64_t M, int64_t N, int64_t K) {
  constexpr int kg = GV * kLanes;
  const int64_t kv = (K + kLanes - 1) / kLanes, groups = (kv + GV - 1) / GV, kq = groups * kg;
  const int64_t panels = ((N + kBlock - 1) / kBlock + kAmxBlocks - 1) / kAmxBlocks;
  const int64_t row_block = std::min<int64_t>(kRowBlock, (M + kAmxRows - 1) / kAmxRows * kAmxRows);
  thread_local std::vector<uint8_t> xq_scratch;
  thread_local std::vector<float> xs_scratch;
  uint8_t* xq = grown(xq_scratch, row_block * kq);  // every byte of the rows' passes written below
  float* xs = grown(xs_scratch, row_block * groups);
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, M - m0), whole = mb / kAmxRows * kAmxRows;
    // A last pass of fewer rows: zeros in the rest (its rows are interleaved group by group).
    std::fill(xq + whole * kq, xq + (whole < mb ? whole + kAmxRows : whole) * kq, uint8_t{0});
    std::fill(xs + mb * groups, xs + (whole < mb ? whole + kAmxRows : whole) * groups, 0.f);
    at::parallel_for(0, mb, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)  // row r of its pass's A tiles: (r / 16) tile of each group
        quantize_row<0>(x + (m0 + r) * K, K, groups, kg, 2 * 16 * kg, xq + (r / kAmxRows) * kAmxRows * kq +
                        (r % kAmxRows / 16) * 16 * kg + (r % 16) * kg, xs + r * groups);
    });
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      amx_panels<GV, kGroupScales>(p0, p1, out, xq, xs, qp, scales, bias, m0, mb, N, K);
    });
  }
}

// Whether this CPU has AMX-INT8 and Linux lets this process use its tiles (asked once), and
// LLM_CLUSTER_INT8_AMX is not 0 (read at each call: a benchmark or test can compare the two paths).
bool amx_usable() {
  static const bool supported = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  const char* env = std::getenv("LLM_CLUSTER_INT8_AMX");
  return supported && !(env && std::string(env) == "0");
}
#endif  // LLMC_HAS_AMX_PATH

template <typename T>
void gemm_for(int64_t gv, bool group_scales, T* out, const T* x, const int8_t* qp, const float* scales, const int32_t* offsets,
              const T* bias, int64_t M, int64_t N, int64_t K) {
#if defined(LLMC_HAS_AMX_PATH)
  if (M >= kAmxMinRows && amx_usable()) {
    if (!group_scales) return amx_gemm<kFeatureGroupVectors, false>(out, x, qp, scales, bias, M, N, K);
    if (gv == 2) return amx_gemm<2, true>(out, x, qp, scales, bias, M, N, K);
    return amx_gemm<4, true>(out, x, qp, scales, bias, M, N, K);
  }
#endif
  if (!group_scales) return gemm<kFeatureGroupVectors, false>(out, x, qp, scales, offsets, bias, M, N, K);
  if (gv == 2) return gemm<2, true>(out, x, qp, scales, offsets, bias, M, N, K);
  gemm<4, true>(out, x, qp, scales, offsets, bias, M, N, K);
}
#endif  // __AVX512F__

#if !defined(LLMC_HAS_AMX_PATH)
bool amx_usable() { return false; }
#endif

// -128 x each activation group's sum of q, per feature: [N/4, groups, 4] int32 (int8_gemm's
// offsets for the weight int8_pack made of q and scales: qp, sp).
}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

at::Tensor int8_gemm_offsets(const at::Tensor& qp, const at::Tensor& sp) {
  TORCH_CHECK(qp.dim() == 4 && qp.size(2) == kBlock && qp.size(3) == kLanes && qp.scalar_type() == at::kChar && qp.is_contiguous(),
              "int8_gemm_offsets: qp is ", qp.sizes(), ", not int8_pack's [N/4, K/16, 4, 16] int8 blocks");
  TORCH_CHECK(sp.dim() == 3 && sp.size(0) == qp.size(0) && sp.size(2) == kBlock,
              "int8_gemm_offsets: sp is ", sp.sizes(), ", not int8_pack's [N/4, groups, 4] scales of these blocks");
  const int64_t blocks = qp.size(0), kv = qp.size(1), gv = group_vectors("int8_gemm_offsets", kv, sp.size(1));
  const int64_t groups = (kv + gv - 1) / gv;
  at::Tensor offsets = qp.new_zeros({blocks, groups, kBlock}, qp.options().dtype(at::kInt));
  const int8_t* q = qp.data_ptr<int8_t>();
  int32_t* o = offsets.data_ptr<int32_t>();
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t v = 0; v < kv; ++v)
        for (int r = 0; r < kBlock; ++r) {
          const int8_t* vec = q + ((b * kv + v) * kBlock + r) * kLanes;
          int32_t sum = 0;
          for (int i = 0; i < kLanes; ++i) sum += vec[i];
          o[(b * groups + v / gv) * kBlock + r] -= 128 * sum;
        }
  });
  return offsets;
}

bool int8_gemm_available() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool int8_amx_available() { return int8_gemm_available() && amx_usable(); }

at::Tensor int8_gemm(const at::Tensor& x_in, const at::Tensor& qp, const at::Tensor& sp, const at::Tensor& offsets,
                     const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(int8_gemm_available(), "int8_gemm: needs AVX512-VNNI and the AVX-512 build of the kernels");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "int8_gemm: x must be float32 or bfloat16, got ",
              x.scalar_type());
  const int64_t blocks = (N + kBlock - 1) / kBlock, kv = (K + kLanes - 1) / kLanes;
  TORCH_CHECK(qp.dim() == 4 && qp.size(0) == blocks && qp.size(1) == kv && qp.size(2) == kBlock && qp.size(3) == kLanes &&
                  qp.scalar_type() == at::kChar && qp.is_contiguous(),
              "int8_gemm: qp is ", qp.sizes(), ", not int8_pack of a [", N, ", ", K, "] weight");
  TORCH_CHECK(sp.dim() == 3 && sp.size(0) == blocks && sp.size(2) == kBlock && sp.scalar_type() == at::kFloat && sp.is_contiguous(),
              "int8_gemm: sp is ", sp.sizes(), ", not int8_pack's [", blocks, ", groups, 4] float32 scales");
  const bool group_scales = sp.size(1) > 1;
  const int64_t gv = group_vectors("int8_gemm", kv, sp.size(1)), groups = (kv + gv - 1) / gv;
  TORCH_CHECK(offsets.dim() == 3 && offsets.size(0) == blocks && offsets.size(1) == groups && offsets.size(2) == kBlock &&
                  offsets.scalar_type() == at::kInt && offsets.is_contiguous(),
              "int8_gemm: offsets is ", offsets.sizes(), ", not int8_gemm_offsets of this weight ([", blocks, ", ", groups,
              ", 4] int32)");
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type() && bias->is_contiguous(),
                        "int8_gemm: bias must be [", N, "] in x's dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = x.new_empty(shape);
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kBFloat16) {
    gemm_for<bf16>(gv, group_scales, out.data_ptr<bf16>(), x.data_ptr<bf16>(), qp.data_ptr<int8_t>(), sp.data_ptr<float>(),
                   offsets.data_ptr<int32_t>(), bias ? bias->data_ptr<bf16>() : nullptr, M, N, K);
  } else {
    gemm_for<float>(gv, group_scales, out.data_ptr<float>(), x.data_ptr<float>(), qp.data_ptr<int8_t>(), sp.data_ptr<float>(),
                    offsets.data_ptr<int32_t>(), bias ? bias->data_ptr<float>() : nullptr, M, N, K);
  }
#endif
  return out;
}

}  // namespace LLMC_NAMESPACE
