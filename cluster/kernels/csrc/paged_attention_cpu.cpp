// Paged attention for CPU: every query attends over its sequence's context read straight from
// the paged KV cache ([num_blocks, block_size, kv_heads, head_dim]) through the block table,
// with no gather into a workspace. bf16 or fp32 cache, fp32 math throughout.
//
// Work = (sequence, kv head, tile of up to tile_queries queries): the tile's rows are its
// queries times the kv head's query group (GQA), so every K/V row loaded from the cache serves
// the whole group. An item is one such unit or a tile's kv heads in turn (see run). Items are handed out largest first from an atomic counter to the intra-op
// threads (at::parallel_for, torch's thread count), since context lengths are ragged.
//
// Query i of a chunk of q_len queries over a context of ctx_len tokens sees keys
// [0, ctx_len - q_len + i] (causal, the chunk being the last q_len positions); decodes are
// chunks of one. Per chunk of rows: scores = q K^T, softmax per row, out = P V / row sum.
//
// Built by cluster/kernels/cpu_kernels.py with -mavx512* or -mavx2 from torch's view of the
// CPU; the SIMD helpers (simd.h) use the widest the build allows, else plain scalar code.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "rotary.h"
#include "simd.h"
#include "ops.h"

#ifndef LLMC_NAMESPACE
#define LLMC_NAMESPACE llm_cluster
#endif

namespace {

using namespace llmc;

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
  int32_t seq, tile_start, tile_len, kv_head, kv_head_end;  // kv heads [kv_head, kv_head_end), in turn
  int64_t cost;
};

struct Scratch {
  std::vector<float> q, scores, acc, inv_sum;
};

// One work item's geometry. Rows are (query, group member) pairs in that order; query j of the
// tile (absolute i = tile_start + j) sees `base + j + 1` keys.
template <typename T>
struct Tile {
  const Args& a;
  const Item& it;
  int64_t rows, base, span;  // span: keys seen by the last query
  const int32_t* table;
  int64_t token_stride;
  const T* k;  // this kv head's column of the caches
  const T* v;

  Tile(const Args& args, const Item& item)
      : a(args), it(item), rows(item.tile_len * args.group),
        base(args.seq_lens[item.seq] - args.query_len[item.seq] + item.tile_start),
        span(base + item.tile_len), table(args.block_table + item.seq * args.table_stride),
        token_stride(args.kv_heads * args.head_dim),
        k(static_cast<const T*>(args.k_cache) + item.kv_head * args.head_dim),
        v(static_cast<const T*>(args.v_cache) + item.kv_head * args.head_dim) {}

  int64_t visible(int64_t row) const { return base + row / a.group + 1; }
  int64_t q_row(int64_t row) const { return a.query_start[it.seq] + it.tile_start + row / a.group; }
  int64_t head(int64_t row) const { return it.kv_head * a.group + row % a.group; }

  // f(t, key row) for keys t in [0, n), block by block (no division per key). The next
  // block's rows are prefetched (into L2) first: blocks sit at random places the hardware
  // cannot guess; this took a bf16 decode from ~60 to ~30 ns per key and kv head on one core.
  template <typename F>
  void for_each_key(const T* cache, int64_t n, F&& f) const {
    const int64_t bs = a.block_size, row_bytes = a.head_dim * int64_t(sizeof(T));
    for (int64_t start = 0, b = 0; start < n; start += bs, ++b) {
      const T* row = cache + int64_t(table[b]) * bs * token_stride;
      if (start + bs < n) {
        const char* next = reinterpret_cast<const char*>(cache + int64_t(table[b + 1]) * bs * token_stride);
        const int64_t n_next = std::min(bs, n - start - bs);
        for (int64_t o = 0; o < n_next; ++o)
          for (int64_t off = 0; off < row_bytes; off += 64)
            __builtin_prefetch(next + o * token_stride * int64_t(sizeof(T)) + off, 0, 1);
      }
      const int64_t end = std::min(bs, n - start);
      for (int64_t o = 0; o < end; ++o, row += token_stride) f(start + o, row);
    }
  }

  void load_q(Scratch& s) const {  // fp32 q rows, pre-scaled
    const T* q = static_cast<const T*>(a.q);
    const int64_t hd = a.head_dim;
    s.q.resize(rows * hd);
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = q + q_row(r) * a.q_stride + head(r) * hd;
      for (int64_t d = 0; d < hd; ++d) s.q[r * hd + d] = to_float(src[d]) * a.scale;
    }
  }

  void store(int64_t r, const float* acc, float inv_sum) const {
    T* dst = static_cast<T*>(a.out) + q_row(r) * a.out_stride + head(r) * a.head_dim;
    for (int64_t d = 0; d < a.head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv_sum);
  }
};

// Any head dim, plain loops: scores row-major [rows][span], softmax per row, then P V.
template <typename T>
void attend_scalar(const Args& a, const Item& it, Scratch& s) {
  const Tile<T> tile(a, it);
  const int64_t hd = a.head_dim, G = a.group, rows = tile.rows, stride = tile.span;
  tile.load_q(s);
  s.scores.resize(rows * stride);
  s.acc.assign(rows * hd, 0.f);
  // Key t is seen by rows >= first(t).
  auto first = [&](int64_t t) { return t < tile.base ? 0 : (t - tile.base) * G; };
  tile.for_each_key(tile.k, tile.span, [&](int64_t t, const T* k) {
    for (int64_t r = first(t); r < rows; ++r) {
      float acc = 0.f;
      for (int64_t d = 0; d < hd; ++d) acc += s.q[r * hd + d] * to_float(k[d]);
      s.scores[r * stride + t] = acc;
    }
  });
  s.inv_sum.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s.scores.data() + r * stride;
    const int64_t n = tile.visible(r);
    const float m = *std::max_element(row, row + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (row[t] = std::exp(row[t] - m));
    s.inv_sum[r] = 1.f / sum;
  }
  tile.for_each_key(tile.v, tile.span, [&](int64_t t, const T* v) {
    for (int64_t r = first(t); r < rows; ++r) {
      const float p = s.scores[r * stride + t];
      for (int64_t d = 0; d < hd; ++d) s.acc[r * hd + d] += p * to_float(v[d]);
    }
  });
  for (int64_t r = 0; r < rows; ++r) tile.store(r, s.acc.data() + r * hd, s.inv_sum[r]);
}

// Rows go through in chunks of up to R whose q vectors (QK) or accumulators (PV) stay in
// registers beside one K/V row of NV vectors: RB of them fit (32 vector registers with
// AVX-512, 16 with AVX2). A chunk's scores are token-major [t][R], so one key's R scores
// are reduced together and the softmax runs over all R rows at once.
constexpr int R = 4;  // hsum4 reduces four vectors at once

template <int NV>
constexpr int chunk_rows() {
  constexpr int regs = W == 16 ? 28 : 14;
  constexpr int r = regs / NV - 1;
  return r < 1 ? 1 : (r > R ? R : r);
}

// Softmax over each of the R interleaved rows of sc[t * R + i], t < span, row i seeing its
// first n[i] keys (the rest come out 0); inv[i] = 1 / row sum (applied to the output).
void softmax_chunk(float* sc, int64_t span, const int64_t* n, float* inv) {
  const int64_t total = span * R;
  for (int i = 0; i < R; ++i)
    for (int64_t t = n[i]; t < span; ++t) sc[t * R + i] = -INFINITY;
  float m[R], sum[R];
  std::fill(m, m + R, -INFINITY);
  std::fill(sum, sum + R, 0.f);
  int64_t e = 0;
  if constexpr (W % R == 0) {  // a vector holds W / R keys of all R rows
    vf vm = vset(-INFINITY);
    for (; e + W <= total; e += W) vm = vmax(vm, vload(sc + e));
    float lane[W];
    vstore(lane, vm);
    for (int l = 0; l < W; ++l) m[l % R] = std::max(m[l % R], lane[l]);
  }
  for (int64_t j = e; j < total; ++j) m[j % R] = std::max(m[j % R], sc[j]);
  if constexpr (W % R == 0) {
    float pattern[W];
    for (int l = 0; l < W; ++l) pattern[l] = m[l % R];
    const vf vmx = vload(pattern);
    vf vs = vzero();
    for (e = 0; e + W <= total; e += W) {
      const vf x = vexp(vsub(vload(sc + e), vmx));
      vstore(sc + e, x);
      vs = vadd(vs, x);
    }
    float lane[W];
    vstore(lane, vs);
    for (int l = 0; l < W; ++l) sum[l % R] += lane[l];
  } else {
    e = 0;
  }
  for (; e < total; ++e) sum[e % R] += (sc[e] = std::exp(sc[e] - m[e % R]));
  for (int i = 0; i < R; ++i) {  // the vector exp floors at e^-87, not 0: zero the unseen keys
    for (int64_t t = n[i]; t < span; ++t) sc[t * R + i] = 0.f;
    inv[i] = 1.f / sum[i];
  }
}

template <typename T, int NV>
void attend_vec(const Args& a, const Item& it, Scratch& s) {
  constexpr int RB = chunk_rows<NV>();
  const Tile<T> tile(a, it);
  const int64_t hd = a.head_dim;
  tile.load_q(s);
  s.scores.resize(tile.span * R);
  float* sc = s.scores.data();
  for (int64_t r0 = 0; r0 < tile.rows; r0 += RB) {
    const int64_t live = std::min<int64_t>(RB, tile.rows - r0);
    const int64_t span = tile.visible(r0 + live - 1);  // keys seen by the chunk's last row
    vf q[RB][NV];
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < NV; ++j) q[i][j] = i < live ? vload(s.q.data() + (r0 + i) * hd + j * W) : vzero();
    tile.for_each_key(tile.k, span, [&](int64_t t, const T* k) {
      vf kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = vload(k + j * W);
      vf acc[R];
      for (int i = 0; i < R; ++i) {
        if (i < RB) {
          acc[i] = vmul(q[i][0], kv[0]);
          for (int j = 1; j < NV; ++j) acc[i] = vfma(q[i][j], kv[j], acc[i]);
        } else {
          acc[i] = vzero();
        }
      }
      hsum4(acc, sc + t * R);
    });
    int64_t n[R];
    for (int i = 0; i < R; ++i) n[i] = i < live ? tile.visible(r0 + i) : span;
    float inv[R];
    softmax_chunk(sc, span, n, inv);
    vf acc[RB][NV];
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < NV; ++j) acc[i][j] = vzero();
    tile.for_each_key(tile.v, span, [&](int64_t t, const T* v) {
      vf vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = vload(v + j * W);
      for (int i = 0; i < RB; ++i) {
        const vf p = vset(sc[t * R + i]);
        for (int j = 0; j < NV; ++j) acc[i][j] = vfma(p, vv[j], acc[i][j]);
      }
    });
    float out[NV * W];
    for (int i = 0; i < live; ++i) {
      for (int j = 0; j < NV; ++j) vstore(out + j * W, acc[i][j]);
      tile.store(r0 + i, out, inv[i]);
    }
  }
}

template <typename T>
using AttendFn = void (*)(const Args&, const Item&, Scratch&);

// A vectorised instance per head dim in vectors (NV); any other head dim takes plain loops.
template <typename T>
AttendFn<T> pick(int64_t head_dim) {
  if (W > 1 && head_dim % W == 0) {
    switch (head_dim / W) {
      case 1: return attend_vec<T, 1>;
      case 2: return attend_vec<T, 2>;
      case 3: return attend_vec<T, 3>;
      case 4: return attend_vec<T, 4>;
      case 5: return attend_vec<T, 5>;
      case 6: return attend_vec<T, 6>;
      case 8: return attend_vec<T, 8>;
      case 12: return attend_vec<T, 12>;
      case 16: return attend_vec<T, 16>;
      case 32: return attend_vec<T, 32>;
      default: break;
    }
  }
  return attend_scalar<T>;
}

// An item is a (sequence, query tile) with all its kv heads, one after another, when there are
// enough tiles to keep every thread busy: the heads' slices of a cache row then come from DRAM
// close together in time (decode at batch 128, context 650, bf16: 4.6 vs 5.3 ms per layer on
// this project's 2-core Xeon). Otherwise each kv head is an item of its own.
template <typename T>
void run(const Args& a, int64_t num_seqs, int64_t tile_queries) {
  int64_t tiles = 0;
  for (int32_t s = 0; s < num_seqs; ++s) tiles += (a.query_len[s] + tile_queries - 1) / tile_queries;
  const int32_t heads_per_item = tiles >= 4 * at::get_num_threads() ? int32_t(a.kv_heads) : 1;
  std::vector<Item> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t qlen = a.query_len[s], ctx = a.seq_lens[s];
    for (int32_t t0 = 0; t0 < qlen; t0 += tile_queries) {
      const int32_t n = std::min<int32_t>(tile_queries, qlen - t0);
      const int64_t cost = int64_t(n) * (ctx - qlen + t0 + n) * heads_per_item;
      for (int32_t h = 0; h < a.kv_heads; h += heads_per_item) items.push_back({s, t0, n, h, h + heads_per_item, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const AttendFn<T> fn = pick<T>(a.head_dim);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch scratch;
    for (int64_t i = next++; i < n_items; i = next++) {
      Item one = items[i];
      for (; one.kv_head < items[i].kv_head_end; ++one.kv_head) fn(a, one, scratch);
    }
  });
}

}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

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

// qkv_attention: a step's attention in one call when this kernel takes every query. qkv is the
// fused projection's output [tokens, (heads + 2 kv_heads) * head_dim], q | k | v side by side.
// Per token, q's and k's heads are rotated in place (rotate_head, as rotary_ does, over the
// first 2 * cos.size(1) dims) and k and v are copied into the caches' rows slot_mapping[t] (as
// index_copy_ does); then every query attends as paged_attention does, q read from qkv. The
// result is the same bits as those three ops in turn, without their dispatch and views.
// An fp32 qkv over a bf16 cache (kv_cache_dtype) is rotated in fp32, k and v rounded into the
// cache, and q rounded to bf16 for the attention, whose output is widened to fp32: as the modular
// Attention.forward rounds them.
at::Tensor qkv_attention(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& query_len,
                         double scale, int64_t tile_queries) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache / v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim] and alike");
  const int64_t hd = k_cache.size(3), nkv = k_cache.size(2), slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [tokens, width] with contiguous rows");
  const int64_t tokens = qkv.size(0), heads = qkv.size(1) / hd - 2 * nkv, half = cos.size(-1);
  TORCH_CHECK(heads >= nkv && (heads + 2 * nkv) * hd == qkv.size(1), "qkv's width ", qkv.size(1),
              " is not (heads + 2 * ", nkv, ") * ", hd, " for the cache's kv_heads and head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == tokens && 2 * half <= hd &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "qkv_attention: cos / sin must be [tokens, rotary_dim / 2] of qkv's dtype, rows contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous int64 [tokens]");
  const bool same = qkv.scalar_type() == k_cache.scalar_type();
  TORCH_CHECK(same || (qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16),
              "qkv_attention: qkv and the cache share a dtype (float32 or bfloat16), or qkv is float32 over a "
              "bfloat16 cache; got ", qkv.scalar_type(), " and ", k_cache.scalar_type());
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "token ", t, ": cache slot ", slot[t], " out of range");
  const int64_t width = qkv.size(1), kv_width = nkv * hd, rotated = heads + nkv;
  auto prepare = [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using C = decltype(cache_tag);
    T* p = qkv.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    C* kc = k_cache.data_ptr<C>();
    C* vc = v_cache.data_ptr<C>();
    auto put = [](const T* src, int64_t n, C* dst) {  // c10's float -> bf16 rounds to nearest even, as .to() does
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(src[i]);
    };
    at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / width), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        T* row = p + t * qkv.stride(0);
        for (int64_t h = 0; h < rotated; ++h) rotate_head<T>(row + h * hd, c + t * cos.stride(0), s + t * sin.stride(0), half);
        put(row + heads * hd, kv_width, kc + slot[t] * kv_width);
        put(row + rotated * hd, kv_width, vc + slot[t] * kv_width);
      }
    });
  };
  if (qkv.scalar_type() == at::kFloat && same) {
    prepare(float{}, float{});
  } else if (qkv.scalar_type() == at::kFloat) {
    prepare(float{}, bf16{});
  } else if (qkv.scalar_type() == at::kBFloat16) {
    prepare(bf16{}, bf16{});
  } else {
    TORCH_CHECK(false, "qkv_attention supports float32 and bfloat16, got ", qkv.scalar_type());
  }
  at::Tensor q = qkv.narrow(1, 0, heads * hd);
  if (!same) q = q.to(k_cache.scalar_type());
  at::Tensor out = q.new_empty({tokens, heads * hd});
  paged_attention(out, q, k_cache, v_cache, block_table, seq_lens, query_start, query_len, scale, tile_queries);
  return same ? out : out.to(qkv.scalar_type());
}

int64_t simd_width() { return W; }

at::Tensor attend_qkv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& query_len,
                      double scale, int64_t tile_queries) {
  return qkv_attention(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start, query_len,
                       scale, tile_queries);
}

}  // namespace LLMC_NAMESPACE
