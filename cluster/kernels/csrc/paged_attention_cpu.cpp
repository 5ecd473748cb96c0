// Paged attention for CPU: every query attends over its sequence's context read straight from
// the paged KV cache ([num_blocks, block_size, kv_heads, head_dim]) through the block table,
// with no gather into a workspace. bf16 or fp32 cache, fp32 math throughout.
//
// Work item = (sequence, kv head, tile of up to TILE_QUERIES queries): the tile's rows are its
// queries times the kv head's query group (GQA), so every K/V row loaded from the cache serves
// all of them. Items are handed out largest first from an atomic counter to the intra-op threads
// (at::parallel_for, torch's thread count), since context lengths are ragged.
//
// Query i of a chunk of q_len queries over a context of ctx_len tokens sees keys
// [0, ctx_len - q_len + i] (causal, the chunk being the last q_len positions); decodes are
// chunks of one. Per tile: scores = q K^T (into a row-major scratch), softmax per row, then
// out = P V accumulated in fp32.
//
// Built by cluster/kernels/cpu_attention.py with -mavx512* / -mavx2 chosen from the CPU's flags;
// the SIMD helpers below pick the widest the build allows, else plain scalar code.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef LLMC_NAMESPACE
#define LLMC_NAMESPACE llm_cluster
#endif

namespace {

using bf16 = c10::BFloat16;

// ---- SIMD helpers: a vector of W floats ------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {  // bf16 -> fp32 is a 16-bit shift into the high half
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2i(vf n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
#elif defined(__AVX2__)
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2i(vf n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline float hsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int W = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const bf16* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vf x) { *p = x; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float hsum(vf x) { return x; }
inline float hmax(vf x) { return x; }
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// exp(x) for x <= 0 (scores minus their max): Cephes' expf polynomial after x = n ln2 + r,
// |r| <= ln2 / 2; relative error ~1e-7. Inputs below -87 flush to ~1e-38 (weight ~0).
inline vf vexp(vf x) {
  x = vmax(x, vset(-87.0f));
  vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vsub(x, vmul(n, vset(0.693359375f)));
  r = vsub(r, vmul(n, vset(-2.12194440e-4f)));
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.0f)));
  return vmul(p, vexp2i(n));
}
#endif

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// Softmax of row[0, n) in place; returns 1 / sum (the caller scales the output once).
float softmax_unnormalised(float* row, int64_t n) {
  int64_t t = 0;
  float m = -INFINITY;
  if (n >= W) {
    vf vm = vload(row);
    for (t = W; t + W <= n; t += W) vm = vmax(vm, vload(row + t));
    m = hmax(vm);
  }
  for (; t < n; ++t) m = std::max(m, row[t]);
  float sum = 0.f;
  t = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  vf vs = vzero(), vmx = vset(m);
  for (; t + W <= n; t += W) {
    vf e = vexp(vsub(vload(row + t), vmx));
    vstore(row + t, e);
    vs = vadd(vs, e);
  }
  sum = hsum(vs);
#endif
  for (; t < n; ++t) {
    row[t] = std::exp(row[t] - m);
    sum += row[t];
  }
  return 1.f / sum;
}

struct Args {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* query_len;
  int64_t q_stride, out_stride, table_stride;
  int64_t block_size, kv_heads, head_dim, group;
  float scale;
};

struct Item {
  int32_t seq, tile_start, tile_len, kv_head;
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, scores, acc, inv_sum;
};

// Rows of a tile are (query, group member) pairs in that order; query j of the tile (absolute
// i = tile_start + j) sees `base + j + 1` keys. Key t is seen by rows >= first_row(t).
inline int64_t first_row(int64_t t, int64_t base, int64_t group) {
  return t < base ? 0 : (t - base) * group;
}

// One work item. NV = head_dim / W vectors per row when the head dim is a multiple of W (the
// K/V row then lives in registers), NV = 0 for any other head dim (scalar loops).
template <typename T, int NV>
void attend(const Args& a, const Item& it, Scratch& s) {
  const int64_t hd = a.head_dim, G = a.group, rows = it.tile_len * G;
  const int64_t ctx = a.seq_lens[it.seq], qlen = a.query_len[it.seq];
  const int64_t base = ctx - qlen + it.tile_start;  // keys seen by the tile's first query, minus 1
  const int64_t span = base + it.tile_len;          // keys seen by its last query
  const int64_t stride = (span + 15) & ~int64_t(15);
  s.q.resize(rows * hd);
  s.scores.resize(rows * stride);
  s.acc.assign(rows * hd, 0.f);
  s.inv_sum.resize(rows);
  const T* q = static_cast<const T*>(a.q);
  const int64_t q0 = a.query_start[it.seq] + it.tile_start;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (q0 + r / G) * a.q_stride + (it.kv_head * G + r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) s.q[r * hd + d] = to_float(src[d]) * a.scale;
  }
  const int32_t* table = a.block_table + it.seq * a.table_stride;
  const int64_t token_stride = a.kv_heads * hd;
  const T* kc = static_cast<const T*>(a.k_cache) + it.kv_head * hd;
  const T* vc = static_cast<const T*>(a.v_cache) + it.kv_head * hd;
  // f(t, row) for keys t in [0, span), block by block (no division per key)
  auto for_each_key = [&](const T* cache, auto&& f) {
    for (int64_t start = 0, b = 0; start < span; start += a.block_size, ++b) {
      const T* row = cache + int64_t(table[b]) * a.block_size * token_stride;
      const int64_t end = std::min(a.block_size, span - start);
      for (int64_t o = 0; o < end; ++o, row += token_stride) f(start + o, row);
    }
  };

  // scores[r][t] = q_r . k_t for the keys row r sees
  for_each_key(kc, [&](int64_t t, const T* k) {
    int64_t r = first_row(t, base, G);
    if constexpr (NV > 0) {
      vf kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = vload(k + j * W);
      for (; r < rows; ++r) {
        const float* qr = s.q.data() + r * hd;
        vf acc = vmul(vload(qr), kv[0]);
        for (int j = 1; j < NV; ++j) acc = vfma(vload(qr + j * W), kv[j], acc);
        s.scores[r * stride + t] = hsum(acc);
      }
    } else {
      for (; r < rows; ++r) {
        const float* qr = s.q.data() + r * hd;
        float acc = 0.f;
        for (int64_t d = 0; d < hd; ++d) acc += qr[d] * to_float(k[d]);
        s.scores[r * stride + t] = acc;
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r)
    s.inv_sum[r] = softmax_unnormalised(s.scores.data() + r * stride, base + r / G + 1);

  // acc[r] += p[r][t] * v_t
  for_each_key(vc, [&](int64_t t, const T* v) {
    int64_t r = first_row(t, base, G);
    if constexpr (NV > 0) {
      vf vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * W);
      for (; r < rows; ++r) {
        float* ar = s.acc.data() + r * hd;
        vf p = vset(s.scores[r * stride + t]);
        for (int j = 0; j < NV; ++j) vstore(ar + j * W, vfma(p, vv[j], vload(ar + j * W)));
      }
    } else {
      for (; r < rows; ++r) {
        float* ar = s.acc.data() + r * hd;
        const float p = s.scores[r * stride + t];
        for (int64_t d = 0; d < hd; ++d) ar[d] += p * to_float(v[d]);
      }
    }
  });
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (q0 + r / G) * a.out_stride + (it.kv_head * G + r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(s.acc[r * hd + d] * s.inv_sum[r]);
  }
}

template <typename T>
using AttendFn = void (*)(const Args&, const Item&, Scratch&);

template <typename T>
AttendFn<T> pick(int64_t head_dim) {
  if (head_dim % W == 0) {
    switch (head_dim / W) {
      case 1: return attend<T, 1>;
      case 2: return attend<T, 2>;
      case 3: return attend<T, 3>;
      case 4: return attend<T, 4>;
      case 5: return attend<T, 5>;
      case 6: return attend<T, 6>;
      case 8: return attend<T, 8>;
      case 12: return attend<T, 12>;
      case 16: return attend<T, 16>;
      case 32: return attend<T, 32>;
      default: break;
    }
  }
  return attend<T, 0>;
}

template <typename T>
void run(const Args& a, int64_t num_seqs, int64_t tile_queries) {
  std::vector<Item> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t qlen = a.query_len[s], ctx = a.seq_lens[s];
    for (int32_t t0 = 0; t0 < qlen; t0 += tile_queries) {
      const int32_t n = std::min<int32_t>(tile_queries, qlen - t0);
      const int64_t cost = int64_t(n) * (ctx - qlen + t0 + n);
      for (int32_t h = 0; h < a.kv_heads; ++h) items.push_back({s, t0, n, h, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const AttendFn<T> fn = pick<T>(a.head_dim);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t i = next++; i < n_items; i = next++) fn(a, items[i], scratch);
  });
}

void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     const at::Tensor& query_start, const at::Tensor& query_len, double scale,
                     int64_t tile_queries) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache / v_cache must be [num_blocks, block_size, kv_heads, head_dim] and alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q, out and the cache must share one dtype");
  TORCH_CHECK(q.dim() == 2 && out.dim() == 2 && q.stride(1) == 1 && out.stride(1) == 1,
              "q and out must be [tokens, heads * head_dim] with contiguous rows");
  for (const auto* t : {&block_table, &seq_lens, &query_start, &query_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block tables and lengths must be contiguous int32");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == num_seqs && query_start.numel() == num_seqs &&
                  query_len.numel() == num_seqs,
              "block_table [S, W], seq_lens, query_start and query_len [S] must agree on S");
  TORCH_CHECK(tile_queries >= 1, "tile_queries must be >= 1");
  Args a;
  a.head_dim = k_cache.size(3);
  a.kv_heads = k_cache.size(2);
  a.block_size = k_cache.size(1);
  const int64_t heads = q.size(1) / a.head_dim;
  TORCH_CHECK(heads * a.head_dim == q.size(1) && heads % a.kv_heads == 0 && out.size(1) == q.size(1),
              "q's width must be a multiple of kv_heads * head_dim");
  a.group = heads / a.kv_heads;
  a.q = q.data_ptr();
  a.out = out.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.block_table = block_table.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start = query_start.data_ptr<int32_t>();
  a.query_len = query_len.data_ptr<int32_t>();
  a.q_stride = q.stride(0);
  a.out_stride = out.stride(0);
  a.table_stride = block_table.size(1);
  a.scale = static_cast<float>(scale);
  for (int64_t s = 0; s < num_seqs; ++s) {  // bounds, so a bad table raises instead of reading wild memory
    const int64_t ql = a.query_len[s], ctx = a.seq_lens[s], start = a.query_start[s];
    TORCH_CHECK(ql >= 1 && ql <= ctx && start >= 0 && start + ql <= q.size(0) && start + ql <= out.size(0),
                "sequence ", s, ": bad query range or context length");
    TORCH_CHECK((ctx + a.block_size - 1) / a.block_size <= a.table_stride, "sequence ", s,
                ": context longer than its block table");
    for (int64_t b = 0; b < (ctx + a.block_size - 1) / a.block_size; ++b) {
      const int32_t blk = a.block_table[s * a.table_stride + b];
      TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "sequence ", s, ": block id ", blk, " out of range");
    }
  }
  if (q.scalar_type() == at::kFloat) {
    run<float>(a, num_seqs, tile_queries);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<bf16>(a, num_seqs, tile_queries);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16, got ", q.scalar_type());
  }
}

int64_t simd_width() { return W; }

}  // namespace

TORCH_LIBRARY(LLMC_NAMESPACE, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start, Tensor query_len, float scale, int tile_queries) -> ()");
  m.def("simd_width() -> int", &simd_width);
}

TORCH_LIBRARY_IMPL(LLMC_NAMESPACE, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
