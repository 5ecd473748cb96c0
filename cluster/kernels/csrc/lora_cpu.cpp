// Multi-LoRA for CPU, the punica / SGMV scheme: the caller orders the batch's rows by adapter,
// so every adapter's rows form a segment, and each segment goes through its slot's A and B
// together (shrink, then expand) instead of row by row.
//
//   lora_add_(out, x, a, b, seg_start, seg_len, seg_slot, scales)
//     for segment g: s = seg_start[g], n = seg_len[g], k = seg_slot[g]
//       out[s:s+n] += scales[k] * ((x[s:s+n] @ a[k]^T) @ b[k])
//
// x [T, in], out [T, out_features] (rows contiguous), a [S, R, in], b [S, R, out_features]
// (contiguous; S slots, R the padded rank; b is B transposed, so the expand runs along the
// output features), scales [S] fp32, the segments int64 [G]. The intermediate t = x a^T ([n, R])
// stays fp32 and the delta is accumulated in fp32, then added to out and rounded once to out's
// dtype: a bf16 t would lose bits the expand multiplies up.
//
// Every segment, decode's few rows as prefill's hundreds, runs the SIMD loops below in two
// parallel passes, the shrink over (piece of a segment, block of ranks), the expand over chunks
// of output features; a call pays at most two fork-joins whatever its number of adapters, and
// none when the work is too small to split (see kTaskMacs). There is no GEMM path: at::mm on
// fp32 copies of the operands lost to these loops at every segment length measured, 1 to 2048
// rows (1.4x to 3x slower at 64 to 512 rows, SmolLM2's projections, bf16 and fp32).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace llmc;

// Rows per piece: segments are cut into pieces of at most this many rows, the shrink's unit of
// work, so a prefill segment's shrink splits between the threads too and a piece's x rows stay
// in L1 / L2 across its blocks of ranks (16, 32 and 64 measured alike).
constexpr int64_t kPieceRows = 32;
// Shrink rows per register block: with the four rows of a they are dotted with, 4 x kRowBlock
// accumulators that share every load; AVX2 has half AVX-512's registers.
constexpr int kRowBlock = W == 8 ? 2 : 4;
// Expand register block: kExpandRows rows by kExpandPairs pairs of vectors of output features,
// 16 (AVX-512, of 32 registers) or 8 (AVX2, of 16) accumulators, plus the block's b vectors and
// a broadcast.
constexpr int kExpandRows = W == 8 ? 2 : 4;
constexpr int kExpandPairs = 2;
// Output features per expand task item: whole register blocks, b's R x kChunk slice small
// enough for L1 (bf16, R = 48: 6 KB), and enough items for two threads to balance.
constexpr int64_t kChunk = 64;
static_assert(kChunk % (kExpandPairs * 2 * W) == 0, "a chunk is whole register blocks");
// Multiply-adds per parallel task: a fork-join costs a few microseconds here, so a decode step's
// shrink (~30K for one row) runs on one thread, faster than on two.
constexpr int64_t kTaskMacs = 1 << 16;

// Task items ahead whose weights are prefetched into L2. A decode step streams every layer's A
// and B of every active slot from DRAM (8 slots: ~4 MB a layer for SmolLM2), and with the
// hardware prefetcher alone the loads stayed exposed: 1.8x the time of weights in cache (decode,
// 8 slots of 8 rows; 1.4x with this, 1, 3 or 4 items ahead doing no better).
constexpr int64_t kPrefetchAhead = 2;

int64_t grain(int64_t macs_per_item) { return std::max<int64_t>(1, kTaskMacs / std::max<int64_t>(1, macs_per_item)); }

// Prefetches the cache line of p into L2 (a prefetch never faults: p need not be in bounds). In
// asm on x86: GCC took a helper made only of __builtin_prefetch for a function without side
// effects and dropped its calls.
inline void prefetch_line_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// Prefetches `rows` rows of `bytes` bytes, `stride` bytes apart, into L2.
inline void prefetch_l2(const void* p, int64_t rows, int64_t stride, int64_t bytes) {
  const char* first = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < bytes; k += 64) prefetch_line_l2(first + r * stride + k);
}

// 2W consecutive elements as two fp32 vectors, in an order of their own: bf16's even elements,
// then its odd ones (a shift and a mask, no shuffle, where widening in order takes a shuffle
// per vector), fp32 (and bf16 without AVX) in order. store_pair undoes it; dot products and
// element-wise updates do not see the order.
template <typename T>
inline void load_pair(const T* p, vf& lo, vf& hi) {
  lo = vload(p);
  hi = vload(p + W);
}
template <typename T>
inline void store_pair(T* p, vf lo, vf hi) {
  vstore(p, lo);
  vstore(p + W, hi);
}
#if defined(__AVX512F__)
inline void load_pair(const bf16* p, vf& even, vf& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store_pair(bf16* p, vf even, vf odd) {  // bf16_bits: the rounded bf16 in each lane's low half
  _mm512_storeu_si512(p, _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32(bf16_bits(odd), 16)));
}
#elif defined(__AVX2__)
inline void load_pair(const bf16* p, vf& even, vf& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store_pair(bf16* p, vf even, vf odd) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_or_si256(bf16_bits(even), _mm256_slli_epi32(bf16_bits(odd), 16)));
}
#endif

// f(i0, std::integral_constant<int, rows>) for the last block of rows < NR rows (none for 0).
template <int NR, typename F>
void last_row_block(int64_t i0, int64_t rows, F& f) {
  if constexpr (NR > 1) {
    if (rows == NR - 1)
      f(i0, std::integral_constant<int, NR - 1>{});
    else
      last_row_block<NR - 1>(i0, rows, f);
  }
}

// f(i0, std::integral_constant<int, rows>) over rows [0, n) in blocks of up to NR, so a block's
// row count is a compile-time constant (its accumulators stay in registers).
template <int NR, typename F>
void for_row_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + NR <= n; i += NR) f(i, std::integral_constant<int, NR>{});
  last_row_block<NR>(i, n - i, f);
}

struct Segment {
  int64_t start, len, slot, t_offset;  // t_offset: its first row in the fp32 scratch t [rows, R]
};

struct Operands {
  int64_t in, out_features, rank;
  int64_t x_stride, out_stride;
  const float* scales;
};

// dots[i][u] = <x[i], v[u]> over len elements, in fp32: NR rows of x `stride` apart against four
// rows of a. The accumulators stay in registers over the whole length: one horizontal sum per
// (row, rank) at the end.
template <int NR, typename T>
void dot_block(float (*dots)[4], const T* x, int64_t stride, const T* const* v, int64_t len) {
  vf acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int u = 0; u < 4; ++u) acc[i][u] = vzero();
  int64_t j = 0;
  for (; j + 2 * W <= len; j += 2 * W) {
    vf xl[NR], xh[NR];
    for (int i = 0; i < NR; ++i) load_pair(x + i * stride + j, xl[i], xh[i]);
    for (int u = 0; u < 4; ++u) {
      vf al, ah;
      load_pair(v[u] + j, al, ah);
      for (int i = 0; i < NR; ++i) acc[i][u] = vfma(xh[i], ah, vfma(xl[i], al, acc[i][u]));
    }
  }
  for (int i = 0; i < NR; ++i) {
    hsum4(acc[i], dots[i]);
    for (int64_t jj = j; jj < len; ++jj)
      for (int u = 0; u < 4; ++u) dots[i][u] += to_float(x[i * stride + jj]) * to_float(v[u][jj]);
  }
}

// Row r of piece s's slot of a.
template <typename T>
const T* a_row(const Operands& o, const T* a, const Segment& s, int64_t r) {
  return a + (s.slot * o.rank + r) * o.in;
}

// Prefetches the rows of a that shrink item q (of `blocks` a piece) reads, if it is still this
// task's (items before `end`).
template <typename T>
void prefetch_item(const Operands& o, const std::vector<Segment>& pieces, const T* a, int64_t q, int64_t blocks,
                   int64_t end) {
  if (q >= end) return;
  const int64_t r0 = q % blocks * 4;
  prefetch_l2(a_row(o, a, pieces[q / blocks], r0), 1, 0,
              std::min<int64_t>(4, o.rank - r0) * o.in * static_cast<int64_t>(sizeof(T)));
}

// t[piece rows, r] = x[piece rows] . a[slot, r] for every piece; a task item is a piece's block
// of four ranks (the last block's missing ranks dot the last rank again and are not stored).
template <typename T>
void shrink(const Operands& o, const std::vector<Segment>& pieces, const T* x, const T* a, float* t, int64_t rows) {
  const int64_t blocks = (o.rank + 3) / 4, items = static_cast<int64_t>(pieces.size()) * blocks;
  const int64_t rows_per_piece = std::max<int64_t>(1, rows / static_cast<int64_t>(pieces.size()));
  at::parallel_for(0, items, grain(rows_per_piece * o.in * 4), [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const Segment& s = pieces[q / blocks];
      const int64_t r0 = q % blocks * 4, live = std::min<int64_t>(4, o.rank - r0);
      prefetch_item(o, pieces, a, q + kPrefetchAhead, blocks, end);
      const T* v[4];
      for (int u = 0; u < 4; ++u) v[u] = a_row(o, a, s, std::min<int64_t>(r0 + u, o.rank - 1));
      for_row_blocks<kRowBlock>(s.len, [&](int64_t i0, auto nr) {
        constexpr int NR = decltype(nr)::value;
        float dots[NR][4];
        dot_block<NR>(dots, x + (s.start + i0) * o.x_stride, o.x_stride, v, o.in);
        for (int i = 0; i < NR; ++i)
          for (int64_t u = 0; u < live; ++u) t[(s.t_offset + i0 + i) * o.rank + r0 + u] = dots[i][u];
      });
    }
  });
}

// NR rows of out, features [0, 2 * NP * W) of the pointers given: out = round(out + scale * t . b).
// The NR x 2NP accumulators stay in registers over the ranks: each b vector, loaded once, serves
// the NR rows, and each broadcast t value the 2NP vectors. No horizontal sums: b's rows run
// along the output features.
template <int NR, int NP, typename T>
void expand_block(T* out, int64_t out_stride, const float* t, int64_t rank, const T* b, int64_t b_stride,
                  float scale) {
  vf acc[NR][2 * NP];
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 2 * NP; ++v) acc[i][v] = vzero();
  for (int64_t r = 0; r < rank; ++r) {
    vf bv[2 * NP];
    for (int p = 0; p < NP; ++p) load_pair(b + r * b_stride + p * 2 * W, bv[2 * p], bv[2 * p + 1]);
    for (int i = 0; i < NR; ++i) {
      const vf ti = vset(t[i * rank + r]);
      for (int v = 0; v < 2 * NP; ++v) acc[i][v] = vfma(ti, bv[v], acc[i][v]);
    }
  }
  const vf vscale = vset(scale);
  for (int i = 0; i < NR; ++i)
    for (int p = 0; p < NP; ++p) {
      T* y = out + i * out_stride + p * 2 * W;
      vf lo, hi;
      load_pair(y, lo, hi);  // the reference's order: out + (scale * delta)
      store_pair(y, vadd(lo, vmul(vscale, acc[i][2 * p])), vadd(hi, vmul(vscale, acc[i][2 * p + 1])));
    }
}

// The same for `rows` rows and nf < 2W features, one at a time (out_features not a multiple of 2W).
template <typename T>
void expand_scalar(T* out, int64_t out_stride, const float* t, int64_t rank, const T* b, int64_t b_stride,
                   int64_t rows, int64_t nf, float scale) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t f = 0; f < nf; ++f) {
      float acc = 0.f;
      for (int64_t r = 0; r < rank; ++r) acc += t[i * rank + r] * to_float(b[r * b_stride + f]);
      T* y = out + i * out_stride + f;
      *y = static_cast<T>(to_float(*y) + scale * acc);
    }
}

// Piece s's expand over features [f0, f0 + nf): register blocks of kExpandRows rows by
// kExpandPairs pairs of vectors, then single pairs, then single features. b[slot][:, f0:f0+nf]
// (R x nf) stays in L1 across the piece's row blocks.
template <typename T>
void expand_chunk(const Operands& o, const Segment& s, const float* t, const T* b, T* out, int64_t f0, int64_t nf) {
  const float scale = o.scales[s.slot];
  const T* bs = b + s.slot * o.rank * o.out_features + f0;
  for_row_blocks<kExpandRows>(s.len, [&](int64_t i0, auto nr) {
    constexpr int NR = decltype(nr)::value;
    T* y = out + (s.start + i0) * o.out_stride + f0;
    const float* ts = t + (s.t_offset + i0) * o.rank;
    int64_t f = 0;
    for (; f + kExpandPairs * 2 * W <= nf; f += kExpandPairs * 2 * W)
      expand_block<NR, kExpandPairs>(y + f, o.out_stride, ts, o.rank, bs + f, o.out_features, scale);
    for (; f + 2 * W <= nf; f += 2 * W) expand_block<NR, 1>(y + f, o.out_stride, ts, o.rank, bs + f, o.out_features, scale);
    if (f < nf) expand_scalar(y + f, o.out_stride, ts, o.rank, bs + f, o.out_features, NR, nf - f, scale);
  });
}

// Prefetches the b tile (R x kChunk) that the expand's loop over (chunk, piece) reaches
// kPrefetchAhead steps after (c, p), if it is still this task's (chunks before `end`).
template <typename T>
void prefetch_tile_ahead(const Operands& o, const std::vector<Segment>& pieces, const T* b, int64_t c, int64_t p,
                         int64_t end) {
  const int64_t n = static_cast<int64_t>(pieces.size()), step = p + kPrefetchAhead, chunk = c + step / n;
  if (chunk >= end) return;
  const int64_t f0 = chunk * kChunk, nf = std::min(kChunk, o.out_features - f0);
  const auto size = static_cast<int64_t>(sizeof(T));
  prefetch_l2(b + pieces[step % n].slot * o.rank * o.out_features + f0, o.rank, o.out_features * size, nf * size);
}

// The expand of every piece, chunks of kChunk output features split between the threads.
template <typename T>
void expand(const Operands& o, const std::vector<Segment>& pieces, const float* t, const T* b, T* out, int64_t rows) {
  const int64_t chunks = (o.out_features + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, grain(rows * o.rank * kChunk), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t f0 = c * kChunk, nf = std::min(kChunk, o.out_features - f0);
      for (size_t p = 0; p < pieces.size(); ++p) {
        prefetch_tile_ahead(o, pieces, b, c, static_cast<int64_t>(p), end);
        expand_chunk(o, pieces[p], t, b, out, f0, nf);
      }
    }
  });
}

void check_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& seg_start, const at::Tensor& seg_len, const at::Tensor& seg_slot,
                  const at::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "lora_add_ supports float32 and bfloat16, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "lora_add_: out, x, a and b must share one dtype, got ", out.scalar_type(), ", ", x.scalar_type(),
              ", ", a.scalar_type(), ", ", b.scalar_type());
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1,
              "lora_add_: x and out must be 2-D with contiguous rows, got sizes ", x.sizes(), " and ", out.sizes());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous(),
              "lora_add_: a [slots, rank, in] and b [slots, rank, out_features] must be contiguous");
  TORCH_CHECK(x.size(0) == out.size(0) && a.size(2) == x.size(1) && b.size(0) == a.size(0) &&
                  b.size(1) == a.size(1) && b.size(2) == out.size(1),
              "lora_add_: shapes do not match: x ", x.sizes(), ", out ", out.sizes(), ", a ", a.sizes(), ", b ",
              b.sizes(), " (expected a [slots, rank, in], b [slots, rank, out_features])");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == a.size(0),
              "lora_add_: scales must be contiguous float32 [slots]");
  for (const auto* s : {&seg_start, &seg_len, &seg_slot})
    TORCH_CHECK(s->scalar_type() == at::kLong && s->is_contiguous() && s->dim() == 1 &&
                    s->numel() == seg_start.numel(),
                "lora_add_: seg_start, seg_len and seg_slot must be contiguous int64 [segments]");
}

// The segments cut into pieces of at most kPieceRows rows, each with its rows' place in t;
// raises on a segment out of bounds, so a bad mapping never reads wild memory.
std::vector<Segment> pieces_of(const at::Tensor& seg_start, const at::Tensor& seg_len, const at::Tensor& seg_slot,
                               int64_t tokens, int64_t slots, int64_t& rows) {
  const int64_t* starts = seg_start.data_ptr<int64_t>();
  const int64_t* lens = seg_len.data_ptr<int64_t>();
  const int64_t* slot_of = seg_slot.data_ptr<int64_t>();
  std::vector<Segment> pieces;
  rows = 0;
  for (int64_t g = 0; g < seg_start.numel(); ++g) {
    const int64_t start = starts[g], len = lens[g], slot = slot_of[g];
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= tokens && slot >= 0 && slot < slots, "lora_add_: segment ",
                g, " (start ", start, ", len ", len, ", slot ", slot, ") out of range for ", tokens, " rows and ",
                slots, " slots");
    for (int64_t i = 0; i < len; i += kPieceRows) {
      const int64_t n = std::min(kPieceRows, len - i);
      pieces.push_back(Segment{start + i, n, slot, rows});
      rows += n;
    }
  }
  return pieces;
}

}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& seg_start, const at::Tensor& seg_len, const at::Tensor& seg_slot,
               const at::Tensor& scales) {
  check_inputs(out, x, a, b, seg_start, seg_len, seg_slot, scales);
  const Operands o{x.size(1), out.size(1), a.size(1), x.stride(0), out.stride(0), scales.data_ptr<float>()};
  int64_t rows = 0;
  const std::vector<Segment> pieces = pieces_of(seg_start, seg_len, seg_slot, x.size(0), a.size(0), rows);
  if (pieces.empty() || o.rank == 0) return;
  std::vector<float> t(rows * o.rank);
  if (x.scalar_type() == at::kFloat) {
    shrink<float>(o, pieces, x.data_ptr<float>(), a.data_ptr<float>(), t.data(), rows);
    expand<float>(o, pieces, t.data(), b.data_ptr<float>(), out.data_ptr<float>(), rows);
  } else {
    shrink<bf16>(o, pieces, x.data_ptr<bf16>(), a.data_ptr<bf16>(), t.data(), rows);
    expand<bf16>(o, pieces, t.data(), b.data_ptr<bf16>(), out.data_ptr<bf16>(), rows);
  }
}

}  // namespace LLMC_NAMESPACE
