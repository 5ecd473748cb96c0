// bf16 linear layers for many rows (prefill, large decode batches) through fp32 FMAs:
//
//   fma_gemm_available() -> bool              the AVX-512 build
//   fma_pack(w) -> packed                     w [N, K] bf16 -> [ceil(N/32), K, 32] bf16
//   fma_linear(x, packed, bias, N) -> out      out = x @ w^T (+ bias); x [..., K], out [..., N]
//
// Why: on some AVX512-BF16 CPUs the bf16 dot product instruction is slow. On the project's 2-core
// Xeon (AVX512-BF16 and -FP16, no AMX) vdpbf16ps retires 0.5 an cycle where a 512-bit FMA retires 2:
// 86 against 174 GFLOP/s a core. oneDNN's bf16 GEMM rides vdpbf16ps and sat at ~165 GFLOP/s on two
// cores for SmolLM2's shapes at any batch; this one widens the weight to fp32 in registers and
// multiplies with FMAs: ~290. Where vdpbf16ps is fast (Zen 4) or AMX is there, oneDNN wins;
// cpu_gemm.py times both once per process and keeps the faster.
//
// Layout: a panel of 32 output features, for every input k its 32 weights (64 bytes), ordered so
// that interleaving the vector with zeros (vpunpcklwd / vpunpckhwd, bf16 -> fp32 is a 16-bit
// shift) gives features 0-15 and 16-31 in order. Microkernel: up to kRows rows of x (fp32, widened
// once per call) against a panel, 2 accumulators a row, each input k one weight load, two unpacks
// and 2 x rows FMAs with x[m, k] broadcast. Math: x widened to fp32, so with bf16 x each product
// is exact; the products summed in fp32 in k order, one rounding into out.
// Work: row chunks of kChunkRows (their fp32 rows stay in L2) times panels, threads over both,
// panels innermost, so a thread streams panels past a chunk.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace llmc;

constexpr int64_t kPanel = 32;      // output features per panel
constexpr int kRows = 12;           // rows per microkernel pass: 24 accumulators
constexpr int64_t kChunkRows = 96;  // rows of x per work chunk, at most

int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }

// Position of feature j (0-31) within a panel's 32 values of one k: unpacklo of 128-bit lane L
// takes its 16-bit elements 0-3, unpackhi 4-7; lo gives features 0-15, hi 16-31, 4 per lane.
inline int64_t slot(int64_t j) { return j < 16 ? (j / 4) * 8 + j % 4 : ((j - 16) / 4) * 8 + 4 + (j - 16) % 4; }

#if defined(__AVX512F__)
template <int MR>
inline void panel_rows(const float* x, int64_t K, const bf16* panel, float* out, int64_t ldo) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; ++k) {
    const __m512i w = _mm512_loadu_si512(panel + k * kPanel);
    const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w));
    const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w));
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(a, lo, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, hi, acc[m][1]);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out + m * ldo, acc[m][0]);
    _mm512_storeu_ps(out + m * ldo + 16, acc[m][1]);
  }
}

void rows_pass(int mc, const float* x, int64_t K, const bf16* panel, float* out, int64_t ldo) {
  switch (mc) {
    case 12: panel_rows<12>(x, K, panel, out, ldo); break;
    case 11: panel_rows<11>(x, K, panel, out, ldo); break;
    case 10: panel_rows<10>(x, K, panel, out, ldo); break;
    case 9: panel_rows<9>(x, K, panel, out, ldo); break;
    case 8: panel_rows<8>(x, K, panel, out, ldo); break;
    case 7: panel_rows<7>(x, K, panel, out, ldo); break;
    case 6: panel_rows<6>(x, K, panel, out, ldo); break;
    case 5: panel_rows<5>(x, K, panel, out, ldo); break;
    case 4: panel_rows<4>(x, K, panel, out, ldo); break;
    case 3: panel_rows<3>(x, K, panel, out, ldo); break;
    case 2: panel_rows<2>(x, K, panel, out, ldo); break;
    case 1: panel_rows<1>(x, K, panel, out, ldo); break;
  }
}

template <typename T>
void fma_gemm(T* out, const T* x_in, const bf16* packed, const T* bias, int64_t M, int64_t N, int64_t K) {
  std::vector<float> x(M * K);  // widened once; a chunk's rows stay in L2 while panels pass
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * K; i < m1 * K; ++i) x[i] = to_float(x_in[i]);
  });
  // Chunks of equal rows: the threads' ranges of (chunk, panel) items are equal work.
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows, rows = (M + chunks - 1) / chunks, panels = panels_of(N);
  at::parallel_for(0, chunks * panels, 1, [&](int64_t i0, int64_t i1) {
    float tile[kRows * kPanel];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i / panels, p = i % panels, n0 = p * kPanel, nr = std::min(kPanel, N - n0);
      const bf16* panel = packed + p * K * kPanel;
      for (int64_t m = c * rows, m_end = std::min(M, m + rows); m < m_end; m += kRows) {
        const int mc = static_cast<int>(std::min<int64_t>(kRows, m_end - m));
        rows_pass(mc, x.data() + m * K, K, panel, tile, kPanel);
        for (int r = 0; r < mc; ++r) {
          T* row = out + (m + r) * N + n0;
          for (int64_t j = 0; j < nr; ++j)
            row[j] = static_cast<T>(tile[r * kPanel + j] + (bias ? to_float(bias[n0 + j]) : 0.f));
        }
      }
    }
  });
}
#endif

}  // namespace

namespace LLMC_NAMESPACE {

bool fma_gemm_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor fma_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "fma_pack: w must be a contiguous [N, K] bfloat16 tensor, got ", w.sizes(), " ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), panels = panels_of(N);
  at::Tensor packed = w.new_zeros({panels, K, kPanel});
  const bf16* src = w.data_ptr<bf16>();
  bf16* dst = packed.data_ptr<bf16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + slot(j)] = src[(p * kPanel + j) * K + k];
  });
  return packed;
}

at::Tensor fma_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(fma_gemm_available(), "fma_linear: needs the AVX-512 build of the kernels");
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == panels_of(N) && packed.size(1) == K && packed.size(2) == kPanel &&
                  packed.scalar_type() == at::kBFloat16,
              "fma_linear: packed is not fma_pack of a [", N, ", ", K, "] bfloat16 weight: ", packed.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "fma_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x.scalar_type() && bias->is_contiguous(),
                        "fma_linear: bias must be [", N, "] in x's dtype");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = x.new_empty(shape);
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
#if defined(__AVX512F__)
  const bf16* w = packed.data_ptr<bf16>();
  if (x.scalar_type() == at::kBFloat16) {
    fma_gemm<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), w, bias ? bias->data_ptr<bf16>() : nullptr, M, N, K);
  } else {
    fma_gemm<float>(out.data_ptr<float>(), x.data_ptr<float>(), w, bias ? bias->data_ptr<float>() : nullptr, M, N, K);
  }
#endif
  return out;
}

}  // namespace LLMC_NAMESPACE
