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
//
// Math: per block of four features and each row of x, one fp32 accumulator per vector lane;
// weights widened exactly (bf16 -> fp32 is a 16-bit shift), products and sums in fp32, one
// rounding into out. x is widened to fp32 once per call (M x K floats, in L1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

using namespace llmc;

constexpr int kBlock = 4;  // output features interleaved per block: 4 x M accumulators
constexpr int kMaxRows = W == 8 ? 2 : 4;  // rows of x per pass (AVX2 has half the registers)
// Blocks per parallel task item: a few KB of weights each, enough items for the threads to
// balance; the threads' contiguous ranges are each one stream.
constexpr int64_t kTaskBytes = 64 * 1024;

int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

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

// Rows m0..m0+MC of x (fp32, K padded to kv vectors) against one packed block, into sums[MC][4].
template <typename T, int MC>
inline void block_dot(const T* wb, const float* x, int64_t kv, float* sums) {
  vf acc[MC][kBlock];
  for (int c = 0; c < MC; ++c)
    for (int r = 0; r < kBlock; ++r) acc[c][r] = vzero();
  for (int64_t v = 0; v < kv; ++v) {
    const T* p = wb + v * kBlock * W;
    vf w0 = vload(p), w1 = vload(p + W), w2 = vload(p + 2 * W), w3 = vload(p + 3 * W);
    for (int c = 0; c < MC; ++c) {
      const vf xv = vload(x + c * kv * W + v * W);
      acc[c][0] = vfma(w0, xv, acc[c][0]);
      acc[c][1] = vfma(w1, xv, acc[c][1]);
      acc[c][2] = vfma(w2, xv, acc[c][2]);
      acc[c][3] = vfma(w3, xv, acc[c][3]);
    }
  }
  for (int c = 0; c < MC; ++c) hsum4(acc[c], sums + c * kBlock);
}

template <typename T>
void rows_pass(T* out, const T* packed, const float* x, const T* bias, int64_t m0, int mc, int64_t N,
               int64_t kv, int64_t b0, int64_t b1) {
  float sums[kMaxRows * kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const T* wb = packed + b * kv * kBlock * W;
    const float* xm = x + m0 * kv * W;
    switch (mc) {
      case 1: block_dot<T, 1>(wb, xm, kv, sums); break;
      case 2: block_dot<T, 2>(wb, xm, kv, sums); break;
#if !(defined(__AVX2__) && !defined(__AVX512F__))
      case 3: block_dot<T, 3>(wb, xm, kv, sums); break;
      case 4: block_dot<T, 4>(wb, xm, kv, sums); break;
#endif
    }
    const int nr = static_cast<int>(std::min<int64_t>(kBlock, N - b * kBlock));
    for (int c = 0; c < mc; ++c)
      for (int r = 0; r < nr; ++r) {
        const int64_t n = b * kBlock + r;
        out[(m0 + c) * N + n] = static_cast<T>(sums[c * kBlock + r] + (bias ? to_float(bias[n]) : 0.f));
      }
  }
}

template <typename T>
void skinny(T* out, const T* x_in, const T* packed, const T* bias, int64_t M, int64_t N, int64_t K) {
  const int64_t kv = padded(K, W) / W, kp = kv * W;
  std::vector<float> x(M * kp, 0.f);  // widened and zero-padded once; every block reads it
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) x[m * kp + k] = to_float(x_in[m * K + k]);
  const int64_t blocks = padded(N, kBlock) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / (kBlock * kp * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      rows_pass<T>(out, packed, x.data(), bias, m0, static_cast<int>(std::min<int64_t>(kMaxRows, M - m0)), N, kv, b0, b1);
  });
}

at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "skinny_pack: w must be a contiguous [N, K] tensor, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor packed = at::empty({padded(N, kBlock) / kBlock, padded(K, W) / W, kBlock, W}, w.options());
  if (w.scalar_type() == at::kBFloat16) {
    pack<bf16>(packed.data_ptr<bf16>(), w.data_ptr<bf16>(), N, K);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "skinny_pack: float32 or bfloat16, got ", w.scalar_type());
    pack<float>(packed.data_ptr<float>(), w.data_ptr<float>(), N, K);
  }
  return packed;
}

// x [..., K] -> a new [..., N]: the output is allocated here, so a decode layer pays one op call.
at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == padded(N, kBlock) / kBlock && packed.size(1) == padded(K, W) / W &&
                  packed.size(2) == kBlock && packed.size(3) == W,
              "skinny_linear: packed is ", packed.sizes(), ", not skinny_pack of a [", N, ", ", K, "] weight");
  TORCH_CHECK(packed.is_contiguous() && x_in.scalar_type() == packed.scalar_type(),
              "skinny_linear: x (", x_in.scalar_type(), ") and packed (", packed.scalar_type(), ") must share a dtype");
  if (bias) TORCH_CHECK(bias->numel() == N && bias->scalar_type() == x_in.scalar_type() && bias->is_contiguous(),
                        "skinny_linear: bias must be [", N, "] in x's dtype");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor out = at::empty(shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    skinny<bf16>(out.data_ptr<bf16>(), x.data_ptr<bf16>(), packed.data_ptr<bf16>(),
                 bias ? bias->data_ptr<bf16>() : nullptr, M, N, K);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "skinny_linear: float32 or bfloat16, got ", x.scalar_type());
    skinny<float>(out.data_ptr<float>(), x.data_ptr<float>(), packed.data_ptr<float>(),
                  bias ? bias->data_ptr<float>() : nullptr, M, N, K);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LLMC_NAMESPACE, m) {
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(LLMC_NAMESPACE, CPU, m) {
  m.impl("skinny_pack", &skinny_pack);
  m.impl("skinny_linear", &skinny_linear);
}
