// Rotary position embedding of one head, neox / HF "rotate_half" layout, in place: shared by
// layer_ops_cpu.cpp's rotary_ and paged_attention_cpu.cpp's qkv_attention, so both round alike.
#pragma once

#include <cstdint>

#include "simd.h"

namespace llmc {

// h[0:half], h[half:2 half] <- (x1 c - x2 s, x2 c + x1 s), each product rounded to T first as
// HF's unfused bf16 ops do; dims past 2 * half are left as they are.
template <typename T>
inline void rotate_head(T* h, const T* c, const T* s, int64_t half) {
  T* h2 = h + half;
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    vf x1 = vload(h + i), x2 = vload(h2 + i), vc = vload(c + i), vs = vload(s + i);
    vf y1 = vsub(vquant<T>(vmul(x1, vc)), vquant<T>(vmul(x2, vs)));
    vf y2 = vadd(vquant<T>(vmul(x2, vc)), vquant<T>(vmul(x1, vs)));
    vstore(h + i, y1);
    vstore(h2 + i, y2);
  }
  for (; i < half; ++i) {
    const float x1 = to_float(h[i]), x2 = to_float(h2[i]), fc = to_float(c[i]), fs = to_float(s[i]);
    h[i] = static_cast<T>(quant<T>(x1 * fc) - quant<T>(x2 * fs));
    h2[i] = static_cast<T>(quant<T>(x2 * fc) + quant<T>(x1 * fs));
  }
}

}  // namespace llmc
