// The elementwise ops of a decoder layer for CPU, each one pass over its rows instead of the
// chain of small torch ops (casts, pow, mean, rsqrt, mul, add, cat) they replace. On 2 cores those
// chains cost a third of a bf16 prefill and a sixth of a decode step; these are memory-bound
// loops over rows already in cache.
//
// Rounding: for bf16 every op rounds where the unfused torch sequence of HF's modelling code
// rounds (see `vquant`), so the results match that sequence up to exp's last bit in SiLU and the
// order of the fp32 sum of squares. fp32 runs the same math without rounding.
//
//   rms_norm(out, x, w, eps)              out = w * q(x * rsqrt(mean(x^2) + eps))   (HF's order)
//   fused_add_rms_norm_(x, res, w, eps)   res = q(x + res); x = rms_norm(res)      (in place)
//   silu_and_mul(out, x)                  out = q(q(silu(x[:, :d])) * x[:, d:])
//   rotary_(qk, cos, sin)                 neox rotate-half of the first 2 * cos.size(-1) dims of
//                                         every head, in place; cos / sin [tokens, half] in qk's dtype
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "rotary.h"
#include "simd.h"
#include "ops.h"

namespace {

using namespace llmc;

// Rows per parallel task: at least ~16K elements each, so a decode-sized batch stays on one
// thread instead of paying a fork-join for microseconds of work.
int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_len)); }

template <typename T>
void norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  vf acc = vzero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const vf vr = vset(r);
  for (i = 0; i + W <= n; i += W) vstore(out + i, vmul(vload(w + i), vquant<T>(vmul(vload(x + i), vr))));
  for (; i < n; ++i) out[i] = static_cast<T>(to_float(w[i]) * quant<T>(to_float(x[i]) * r));
}

template <typename T>
void add_norm_row(T* x, T* res, const T* w, int64_t n, float eps) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(res + i, vadd(vload(x + i), vload(res + i)));
  for (; i < n; ++i) res[i] = static_cast<T>(to_float(x[i]) + to_float(res[i]));
  norm_row<T>(x, res, w, n, eps);
}

template <typename T>
void silu_mul_row(T* out, const T* x, int64_t d) {
  const T* up = x + d;
  int64_t i = 0;
  for (; i + W <= d; i += W) {
    vf g = vload(x + i);
    vstore(out + i, vmul(vquant<T>(vmul(g, vsigmoid(g))), vload(up + i)));
  }
  for (; i < d; ++i) {
    const float g = to_float(x[i]);
    out[i] = static_cast<T>(quant<T>(g / (1.0f + std::exp(-g))) * to_float(up[i]));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows, got sizes ",
              t.sizes(), " strides ", t.strides());
}

void check_float(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op,
              " supports float32 and bfloat16, got ", t.scalar_type());
}

template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(bf16{});
  }
}

// Both norms: `other` is the output (rms_norm) or the residual, updated in place (kAdd).
template <bool kAdd>
void norm_rows(const at::Tensor& x, const at::Tensor& other, const at::Tensor& w, double eps, const char* op) {
  const char* other_name = kAdd ? "residual" : "out";
  check_float(x, op);
  check_rows(x, "x");
  check_rows(other, other_name);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(other.sizes() == x.sizes() && w.is_contiguous() && w.numel() == n &&
                  other.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(),
              op, ": ", other_name, " / weight do not match x");
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    T* op_ = other.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * x.stride(0);
        T* orow = op_ + r * other.stride(0);
        if constexpr (kAdd) {
          add_norm_row<T>(xr, orow, wp, n, float(eps));
        } else {
          norm_row<T>(orow, xr, wp, n, float(eps));
        }
      }
    });
  });
}

}  // namespace

namespace LLMC_NAMESPACE {

using namespace llmc;

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  norm_rows<false>(x, out, w, eps, "rms_norm");
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor res, const at::Tensor& w, double eps) {
  norm_rows<true>(x, res, w, eps, "fused_add_rms_norm_");
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_float(x, "silu_and_mul");
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0 && out.size(0) == rows && out.size(1) == d && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be [rows, x.size(1) / 2] of x's dtype");
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_row<T>(o + r * out.stride(0), xp + r * x.stride(0), d);
    });
  });
}

void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin) {
  check_float(qk, "rotary_");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [tokens, heads, head_dim] with contiguous heads");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = qk.size(0), heads = qk.size(1), half = cos.size(1);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && 2 * half <= qk.size(2) &&
                  cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "rotary_: cos / sin must be [tokens, rotary_dim / 2] of qk's dtype");
  dispatch(qk, [&](auto tag) {
    using T = decltype(tag);
    T* p = qk.data_ptr<T>();
    const T* c = cos.data_ptr<T>();
    const T* s = sin.data_ptr<T>();
    at::parallel_for(0, tokens, grain(heads * half * 2), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_head<T>(p + t * qk.stride(0) + h * qk.stride(1), c + t * cos.stride(0), s + t * sin.stride(0), half);
    });
  });
}

void norm_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) { rms_norm(out, x, w, eps); }
void add_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) { fused_add_rms_norm_(x, residual, w, eps); }
void silu_mul_into(at::Tensor out, const at::Tensor& x) { silu_and_mul(out, x); }

}  // namespace LLMC_NAMESPACE
