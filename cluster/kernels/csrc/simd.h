// SIMD helpers shared by the CPU kernels: a vector `vf` of W floats, loads from fp32, bf16 or int8,
// stores to fp32 or bf16 (round to nearest even, as torch converts), arithmetic and exp.
// The widest the build's -m flags allow (AVX-512, AVX2 + FMA), else plain scalar code.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// AVX512-VNNI's integer dot products (int8_gemm_cpu.cpp, skinny_gemm_cpu.cpp), enabled per function
// and checked at run time (int8_gemm_available in ops.h).
#if defined(__AVX512F__)
#define LLMC_VNNI __attribute__((target("avx512vnni")))
#endif

// AMX's int8 tiles (int8_gemm_cpu.cpp), enabled per function and checked at run
// time (int8_amx_available in ops.h, which also asks Linux for the tile state).
#if defined(__AVX512F__) && defined(__x86_64__) && defined(__linux__)
#define LLMC_HAS_AMX_PATH 1
#define LLMC_AMX __attribute__((target("amx-tile,amx-int8")))
#endif

namespace llmc {

using bf16 = c10::BFloat16;

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
inline vf vload(const int8_t* p) {  // W int8 -> fp32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline __m512i bf16_bits(vf x) {  // round to nearest even in the high half; NaN stays a quiet NaN
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16),
                                 _mm512_set1_epi32(0x7fc0));
}
inline void vstore(bf16* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
inline vf vround_bf16(vf x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vabs(vf x) { return _mm512_abs_ps(x); }
inline vf vselect_nonneg(vf x, vf a, vf b) {  // x >= 0 ? a : b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
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

// Panel GEMMs (int8_gemm_cpu.cpp, kquant_gemm_cpu.cpp): lane 4r + j of four accumulators' sums
// (block j's feature r, 4 partials each in 128-bit lane r) -> one vector of the panel's 16
// features in order (lane 4j + r).
inline vf reduce_panel(vf a, vf b, vf c, vf d) {
  const vf ab = vadd(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const vf cd = vadd(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const vf t = vadd(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

// The first lanes of a row of out (mask), as fp32.
inline vf load_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline vf load_masked(const bf16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store_masked(float* p, vf x, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, x); }
inline void store_masked(bf16* p, vf x, __mmask16 mask) { _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(bf16_bits(x))); }
#if defined(LLMC_HAS_AMX_PATH)
struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles int8_gemm uses (palette 1): 0-1 A (16 rows x a_bytes of x), 2-3 B (b_rows x 16 features
// x 4 inputs), 4-7 C (16 x 16 int32), C[2a + b] = A[a] x B[b].
inline TileConfig tile_config(int a_bytes, int b_rows) {
  TileConfig c;
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t == 2 || t == 3 ? b_rows : 16;
    c.colsb[t] = t < 2 ? a_bytes : 64;
  }
  return c;
}

// Loads `c` on this thread and returns the config it replaces: another library's (oneDNN's) tiles
// may be configured here, and tile_end puts them back.
LLMC_AMX inline TileConfig tile_begin(const TileConfig& c) {
  TileConfig saved;
  _tile_storeconfig(&saved);
  _tile_loadconfig(&c);
  return saved;
}

LLMC_AMX inline void tile_end(const TileConfig& saved) {
  if (saved.palette) _tile_loadconfig(&saved);
  else _tile_release();
}
#endif  // LLMC_HAS_AMX_PATH
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
inline vf vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline __m256i bf16_bits(vf x) {  // round to nearest even in the high half; NaN stays a quiet NaN
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
inline void vstore(bf16* p, vf x) {
  __m256i u = bf16_bits(x);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
inline vf vround_bf16(vf x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline vf vselect_nonneg(vf x, vf a, vf b) {  // x >= 0 ? a : b
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
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
#else
constexpr int W = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const bf16* p) { return static_cast<float>(*p); }
inline vf vload(const int8_t* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vf x) { *p = x; }
inline void vstore(bf16* p, vf x) { *p = bf16(x); }
inline vf vround_bf16(vf x) { return static_cast<float>(bf16(x)); }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vabs(vf x) { return std::fabs(x); }
inline vf vselect_nonneg(vf x, vf a, vf b) { return x >= 0.f ? a : b; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float hsum(vf x) { return x; }
inline vf vexp(vf x) { return std::exp(x); }
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

// out[i] = hsum(acc[i]), i < 4: the four reductions share their shuffles.
inline void hsum4(const vf* acc, float* out) {
#if defined(__AVX512F__)
  // 512 -> 256 bits (a|b, c|d), -> 128 bits (a|b|c|d), then within each 128-bit lane.
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], 0x44), _mm512_shuffle_f32x4(acc[0], acc[1], 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], 0x44), _mm512_shuffle_f32x4(acc[2], acc[3], 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, x)));
#elif defined(__AVX2__)
  // hadd pairs within each 128-bit lane twice (a|b|c|d per lane), then the two lanes.
  const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
#else
  for (int i = 0; i < 4; ++i) out[i] = acc[i];
#endif
}

// f(std::integral_constant<int, mc>{}) for a run-time mc in [1, MC]: a kernel templated on its
// number of rows (its accumulators), called with the rows a pass has.
template <int MC, typename F>
inline void with_rows(int mc, const F& f) {
  if constexpr (MC > 1) {
    if (mc < MC) return with_rows<MC - 1>(mc, f);
  }
  f(std::integral_constant<int, MC>{});
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }

// The value a T-typed torch op would store: rounded to bf16 for bf16, exact for fp32. Used to
// reproduce the roundings of an unfused sequence of bf16 ops (HF's reference order).
template <typename T>
inline vf vquant(vf x) { return x; }
template <>
inline vf vquant<bf16>(vf x) { return vround_bf16(x); }
template <typename T>
inline float quant(float x) { return x; }
template <>
inline float quant<bf16>(float x) { return static_cast<float>(bf16(x)); }

// sigmoid(x) = 1 / (1 + exp(-x)), evaluated through exp(-|x|) <= 1 so it never overflows;
// exp(-|x|) below vexp's floor (|x| > 87) is taken as 0, as fp32 rounds it.
inline vf vsigmoid(vf x) {
  const vf neg = vsub(vzero(), vabs(x));
  vf e = vselect_nonneg(vadd(neg, vset(87.0f)), vexp(neg), vzero());
  vf r = vdiv(vset(1.0f), vadd(vset(1.0f), e));  // sigmoid(|x|)
  return vselect_nonneg(x, r, vmul(e, r));        // sigmoid(-|x|) = e / (1 + e)
}

}  // namespace llmc
