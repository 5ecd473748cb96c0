// Causal attention of one prefill chunk in bf16 through AVX512-BF16's pair dot products
// (vdpbf16ps: 16 lanes x 2 bf16 products into fp32), flash style: scores for 64 keys at a time,
// an online softmax per row, P V accumulated in fp32. torch's SDPA (its CPU flash kernel) runs
// SmolLM2's shapes at 60-100 GFLOP/s on this project's EPYC; its bf16 GEMMs reach ~400.
//
//   prefill_attention_available() -> bool   this CPU has AVX512-BF16 and the build AVX-512
//   prefill_attention(q, k, v, scale) -> out
//
// q [Lq, heads, hd], k and v [Lk, kv_heads, hd] bf16 (each token's heads contiguous, any token
// stride), Lk >= Lq; query i sees keys [0, Lk - Lq + i] (the chunk is the context's last Lq
// positions); query head h reads kv head h / (heads / kv_heads) (GQA). out [Lq, heads * hd] bf16.
// Scores and softmax in fp32; P is rounded to bf16 for the P V products (as a bf16 GEMM rounds
// its inputs); one rounding into out.
//
// Layout: per kv head, K is packed [Lk/16][hd/2][16] key pairs (one vector = 16 keys x 2 dims,
// multiplied by a broadcast pair of q's dims) and V [Lk/2][hd][2] (one vector = 16 dims x 2 keys,
// multiplied by a broadcast pair of P). A work item is (kv head, tile of 16 queries): its rows are
// the queries times the head's query group, so each packed K / V vector serves the group; rows go
// through 4 at a time with 16 fp32 accumulators in registers. Items go largest first (the last
// tiles see the most keys) from an atomic counter to torch's intra-op threads.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace llmc;

constexpr int kKeys = 16;                    // keys per packed K vector (one score vector)
constexpr int kSub = 4;                      // K vectors per key block
constexpr int64_t kKeyBlock = kKeys * kSub;  // keys per online-softmax step
constexpr int64_t kTile = 16;                // queries per work item
constexpr int kRows = 4;                     // rows per register pass

#if defined(__AVX512F__)
#define LLMC_BF16 __attribute__((target("avx512bf16")))

struct Problem {
  const uint32_t* q;  // bf16 pairs
  int64_t q_stride;   // pairs between tokens
  bf16* out;
  int64_t Lq, Lk, heads, kv_heads, hd;
  float scale;
  const uint32_t* kp;  // per kv head: [Lk_pad / 16][hd / 2][16] pairs
  const uint32_t* vp;  // per kv head: [Lk_pad / 2][hd] pairs
  int64_t Lk_pad;
};

struct Scratch {
  std::vector<float> s, o, m, l;
  std::vector<uint32_t> p;  // bf16 pairs [rows][kKeyBlock / 2]
};

// Rows r0..r0+R of the item: scores of key block kb (kKeyBlock keys) into s[r][kKeyBlock], scaled.
template <int R>
LLMC_BF16 void scores(const Problem& a, const uint32_t* const* qrow, const uint32_t* kp, float* s) {
  const int64_t hdp = a.hd / 2;
  __m512 acc[R][kSub];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < kSub; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < hdp; ++dp) {
    __m512i kv[kSub];
    for (int u = 0; u < kSub; ++u) kv[u] = _mm512_loadu_si512(kp + (u * hdp + dp) * kKeys);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(qrow[r][dp]));
#pragma GCC unroll 4
      for (int u = 0; u < kSub; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)kv[u], (__m512bh)qb);
    }
  }
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < kSub; ++u) _mm512_storeu_ps(s + r * kKeyBlock + u * kKeys, _mm512_mul_ps(acc[r][u], sc));
}

// o[r][d0, d0 + 16 NV) = o[r] * alpha[r] + P[r] V over the key block (vp at its first key pair).
template <int R, int NV>
LLMC_BF16 void accumulate(const Problem& a, const uint32_t* p, const uint32_t* vp, const float* alpha, float* o, int64_t d0) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_mul_ps(_mm512_loadu_ps(o + r * a.hd + d0 + u * W), _mm512_set1_ps(alpha[r]));
  for (int64_t tp = 0; tp < kKeyBlock / 2; ++tp) {
    __m512i vv[NV];
    for (int u = 0; u < NV; ++u) vv[u] = _mm512_loadu_si512(vp + tp * a.hd + d0 + u * W);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i pb = _mm512_set1_epi32(static_cast<int>(p[r * (kKeyBlock / 2) + tp]));
#pragma GCC unroll 4
      for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)vv[u], (__m512bh)pb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) _mm512_storeu_ps(o + r * a.hd + d0 + u * W, acc[r][u]);
}

// The head's dims 64 at a time (16 accumulators for 4 rows), then the rest.
template <int R>
LLMC_BF16 void accumulate_all(const Problem& a, const uint32_t* p, const uint32_t* vp, const float* alpha, float* o) {
  int64_t d0 = 0;
  for (; d0 + 4 * W <= a.hd; d0 += 4 * W) accumulate<R, 4>(a, p, vp, alpha, o, d0);
  switch ((a.hd - d0) / W) {
    case 3: accumulate<R, 3>(a, p, vp, alpha, o, d0); break;
    case 2: accumulate<R, 2>(a, p, vp, alpha, o, d0); break;
    case 1: accumulate<R, 1>(a, p, vp, alpha, o, d0); break;
    default: break;
  }
}

// Online softmax of one row's block of scores: keys past `valid` are masked; p gets bf16 pairs.
LLMC_BF16 float softmax_block(float* s, int64_t valid, float& m, float& l, uint32_t* p) {
  if (valid <= 0) {
    std::fill(p, p + kKeyBlock / 2, 0u);
    return 1.f;
  }
  __mmask16 keep[kSub];
  vf vmx = vset(-std::numeric_limits<float>::infinity());
  for (int u = 0; u < kSub; ++u) {
    const int64_t c0 = u * kKeys;
    keep[u] = valid >= c0 + kKeys ? 0xFFFF : valid <= c0 ? 0 : static_cast<__mmask16>((1u << (valid - c0)) - 1);
    vmx = _mm512_mask_max_ps(vmx, keep[u], vmx, vload(s + c0));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmx));
  const float alpha = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  vf sum = vzero();
  const vf vm = vset(m_new);
  for (int u = 0; u < kSub; ++u) {
    const int64_t c0 = u * kKeys;
    const vf e = _mm512_maskz_mov_ps(keep[u], vexp(vsub(vload(s + c0), vm)));
    sum = vadd(sum, e);
    vstore(reinterpret_cast<bf16*>(p) + c0, e);
  }
  m = m_new;
  l = l * alpha + hsum(sum);
  return alpha;
}

template <int R>
LLMC_BF16 void rows_block(const Problem& a, int64_t kv, int64_t t0, int64_t group, int64_t r0, int64_t kb,
                          Scratch& sc) {
  const uint32_t* qrow[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = t0 + row / group, head = kv * group + row % group;
    qrow[r] = a.q + i * a.q_stride + head * (a.hd / 2);
  }
  const int64_t hdp = a.hd / 2, nb16 = a.Lk_pad / kKeys;
  const uint32_t* kp = a.kp + (kv * nb16 + kb * kSub) * hdp * kKeys;
  float* s = sc.s.data() + r0 * kKeyBlock;
  scores<R>(a, qrow, kp, s);
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = t0 + row / group;
    const int64_t valid = std::min<int64_t>(kKeyBlock, a.Lk - a.Lq + i + 1 - kb * kKeyBlock);
    alpha[r] = softmax_block(s + r * kKeyBlock, valid, sc.m[row], sc.l[row], sc.p.data() + row * (kKeyBlock / 2));
  }
  const uint32_t* vp = a.vp + (kv * (a.Lk_pad / 2) + kb * (kKeyBlock / 2)) * a.hd;
  accumulate_all<R>(a, sc.p.data() + r0 * (kKeyBlock / 2), vp, alpha, sc.o.data() + r0 * a.hd);
}

LLMC_BF16 void run_item(const Problem& a, int64_t kv, int64_t t0, Scratch& sc) {
  const int64_t group = a.heads / a.kv_heads, n = std::min(kTile, a.Lq - t0), rows = n * group;
  sc.s.resize(rows * kKeyBlock);
  sc.p.resize(rows * (kKeyBlock / 2));
  sc.o.assign(rows * a.hd, 0.f);
  sc.m.assign(rows, -std::numeric_limits<float>::infinity());
  sc.l.assign(rows, 0.f);
  const int64_t blocks = (a.Lk - a.Lq + t0 + n + kKeyBlock - 1) / kKeyBlock;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    int64_t r0 = 0;
    for (; r0 + kRows <= rows; r0 += kRows) rows_block<kRows>(a, kv, t0, group, r0, kb, sc);
    switch (rows - r0) {
      case 3: rows_block<3>(a, kv, t0, group, r0, kb, sc); break;
      case 2: rows_block<2>(a, kv, t0, group, r0, kb, sc); break;
      case 1: rows_block<1>(a, kv, t0, group, r0, kb, sc); break;
      default: break;
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = t0 + row / group, head = kv * group + row % group;
    const vf inv = vset(1.f / sc.l[row]);
    for (int64_t d = 0; d < a.hd; d += W)
      vstore(a.out + (i * a.heads + head) * a.hd + d, vmul(vload(sc.o.data() + row * a.hd + d), inv));
  }
}

// K and V of every kv head into the packed layouts (zero past Lk).
void pack(const at::Tensor& k, const at::Tensor& v, int64_t Lk_pad, uint32_t* kp, uint32_t* vp) {
  const int64_t Lk = k.size(0), nkv = k.size(1), hd = k.size(2), hdp = hd / 2, nb16 = Lk_pad / kKeys;
  const auto* kb = reinterpret_cast<const uint16_t*>(k.data_ptr<bf16>());
  const auto* vb = reinterpret_cast<const uint16_t*>(v.data_ptr<bf16>());
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, nkv * nb16, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t h = b / nb16, blk = b % nb16;
      uint32_t* kd = kp + b * hdp * kKeys;
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t t = blk * kKeys + j;
        const auto* row = reinterpret_cast<const uint32_t*>(kb + t * ks + h * hd);
        for (int64_t dp = 0; dp < hdp; ++dp) kd[dp * kKeys + j] = t < Lk ? row[dp] : 0u;
      }
      uint16_t* vd = reinterpret_cast<uint16_t*>(vp + (h * (Lk_pad / 2) + blk * (kKeys / 2)) * hd);
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t t = blk * kKeys + j;
        const uint16_t* row = vb + t * vs + h * hd;
        uint16_t* dst = vd + (j / 2) * hd * 2 + (j % 2);
        for (int64_t d = 0; d < hd; ++d) dst[2 * d] = t < Lk ? row[d] : 0;
      }
    }
  });
}
#endif

}  // namespace

namespace LLMC_NAMESPACE {

bool prefill_attention_available() {
#if defined(__AVX512F__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(prefill_attention_available(), "prefill_attention: needs AVX512-BF16 and the AVX-512 build of the kernels");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "prefill_attention: q must be [Lq, heads, hd], k and v [Lk, kv_heads, hd] alike; got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: q, k and v must be bfloat16");
  const int64_t Lq = q.size(0), heads = q.size(1), hd = q.size(2), Lk = k.size(0), nkv = k.size(1);
  TORCH_CHECK(k.size(2) == hd && hd % 16 == 0, "prefill_attention: head_dim must match and be a multiple of 16, got ", hd);
  TORCH_CHECK(nkv > 0 && heads % nkv == 0, "prefill_attention: heads (", heads, ") must be a multiple of kv_heads (", nkv, ")");
  TORCH_CHECK(Lk >= Lq, "prefill_attention: Lk (", Lk, ") must be at least Lq (", Lq, ")");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == hd && t->stride(0) % 2 == 0,
                "prefill_attention: each token's heads must be contiguous (an even token stride)");
  at::Tensor out = q.new_empty({Lq, heads * hd});
#if defined(__AVX512F__)
  const int64_t Lk_pad = (Lk + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  at::Tensor kp = q.new_empty({nkv * Lk_pad * hd / 2}, q.options().dtype(at::kInt));
  at::Tensor vp = q.new_empty({nkv * Lk_pad * hd / 2}, q.options().dtype(at::kInt));
  pack(k, v, Lk_pad, reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>()), reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>()));
  const Problem a{reinterpret_cast<const uint32_t*>(q.data_ptr<bf16>()), q.stride(0) / 2, out.data_ptr<bf16>(), Lq, Lk,
                  heads, nkv, hd, static_cast<float>(scale), reinterpret_cast<const uint32_t*>(kp.data_ptr<int32_t>()),
                  reinterpret_cast<const uint32_t*>(vp.data_ptr<int32_t>()), Lk_pad};
  // Items (kv head, tile), the last tiles (most keys) first.
  const int64_t tiles = (Lq + kTile - 1) / kTile, n_items = tiles * nkv;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t it = next++; it < n_items; it = next++) {
      const int64_t tile = tiles - 1 - it / nkv, kv = it % nkv;
      run_item(a, kv, tile * kTile, scratch);
    }
  });
#endif
  return out;
}

}  // namespace LLMC_NAMESPACE
