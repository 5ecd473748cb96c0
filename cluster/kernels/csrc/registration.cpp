// The library's torch ops: every schema and its CPU implementation, in one translation unit. Only
// this file includes <torch/library.h>, the heaviest header of the build: the kernel files compile
// against <ATen/core/Tensor.h> and the ATen ops they call, and are built in parallel.
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace LLMC_NAMESPACE {

// decoder_layer_cpu.cpp
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    at::Tensor hidden, at::TensorList norms, const c10::List<c10::optional<at::Tensor>>& qk_norms, double eps,
    double qk_eps, at::TensorList proj, at::IntArrayRef proj_tensors, const c10::List<c10::optional<at::Tensor>>& biases,
    at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start, const at::Tensor& query_len, double scale, int64_t tile_queries);

// fma_gemm_cpu.cpp
bool fma_gemm_available();
at::Tensor fma_linear(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor fma_pack(const at::Tensor& w);

// int8_gemm_cpu.cpp
at::Tensor int8_gemm_offsets(const at::Tensor& qp, const at::Tensor& sp);

// kquant_gemm_cpu.cpp
void kquant_dequant_(at::Tensor out, const at::Tensor& packed);
at::Tensor kquant_linear_plain(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N);

// layer_ops_cpu.cpp
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void fused_add_rms_norm_(at::Tensor x, at::Tensor res, const at::Tensor& w, double eps);
void rotary_(at::Tensor qk, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(at::Tensor out, const at::Tensor& x);

// lora_cpu.cpp
void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& seg_start, const at::Tensor& seg_len, const at::Tensor& seg_slot, const at::Tensor& scales);

// paged_attention_cpu.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& query_len, double scale, int64_t tile_queries);
at::Tensor qkv_attention(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& query_len, double scale, int64_t tile_queries);
int64_t simd_width();

// prefill_attention_cpu.cpp
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
bool prefill_attention_available();

// skinny_gemm_cpu.cpp
void int8_dequant_(at::Tensor out, const at::Tensor& qp, const at::Tensor& sp);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& sp, const c10::optional<at::Tensor>& bias, int64_t N);
std::vector<at::Tensor> int8_pack(const at::Tensor& q, const at::Tensor& scales);
void q4_dequant_(at::Tensor out, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& dp, const at::Tensor& mp, const c10::optional<at::Tensor>& bias, int64_t N);
std::vector<at::Tensor> q4_pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor skinny_pack(const at::Tensor& w);

}  // namespace LLMC_NAMESPACE

TORCH_LIBRARY(LLMC_NAMESPACE, m) {
  // decoder_layer_cpu.cpp
  m.def("decoder_layers(Tensor(a!) hidden, Tensor[] norms, Tensor?[] qk_norms, float eps, float qk_eps, Tensor[] proj, "
        "int[] proj_tensors, Tensor?[] biases, int[] out_features, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor query_start, "
        "Tensor query_len, float scale, int tile_queries) -> (Tensor, Tensor)");
  // int8_gemm_cpu.cpp
  m.def("int8_gemm_available() -> bool", &LLMC_NAMESPACE::int8_gemm_available);  // no tensors to dispatch on
  m.def("int8_amx_available() -> bool", &LLMC_NAMESPACE::int8_amx_available);
  m.def("int8_gemm_offsets(Tensor qp, Tensor sp) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor qp, Tensor sp, Tensor offsets, Tensor? bias, int N) -> Tensor");
  // kquant_gemm_cpu.cpp
  m.def("kquant_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("kquant_dequant_(Tensor(a!) out, Tensor packed) -> ()");
  m.def("kquant_linear_plain(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  // layer_ops_cpu.cpp
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  // lora_cpu.cpp
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor seg_start, Tensor seg_len, "
        "Tensor seg_slot, Tensor scales) -> ()");
  // paged_attention_cpu.cpp
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start, Tensor query_len, float scale, int tile_queries) -> ()");
  m.def("qkv_attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, Tensor query_start, Tensor query_len, "
        "float scale, int tile_queries) -> Tensor");
  m.def("simd_width() -> int", &LLMC_NAMESPACE::simd_width);
  // skinny_gemm_cpu.cpp
  m.def("skinny_pack(Tensor w) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("int8_pack(Tensor q, Tensor scales) -> Tensor[]");
  m.def("int8_linear(Tensor x, Tensor qp, Tensor sp, Tensor? bias, int N) -> Tensor");
  m.def("int8_dequant_(Tensor(a!) out, Tensor qp, Tensor sp) -> ()");
  m.def("q4_pack(Tensor q, Tensor d, Tensor m) -> Tensor[]");
  m.def("q4_linear(Tensor x, Tensor qp, Tensor dp, Tensor mp, Tensor? bias, int N) -> Tensor");
  m.def("q4_dequant_(Tensor(a!) out, Tensor qp, Tensor dp, Tensor mp) -> ()");
  m.def("q4_int8_activations() -> bool", &LLMC_NAMESPACE::q4_int8_activations);  // no tensors to dispatch on
  m.def("int8_int8_activations() -> bool", &LLMC_NAMESPACE::int8_int8_activations);
  m.def("packed_linear(Tensor x, Tensor[] w, Tensor? bias, int N) -> Tensor");
  // fma_gemm_cpu.cpp
  m.def("fma_gemm_available() -> bool", &LLMC_NAMESPACE::fma_gemm_available);
  m.def("fma_pack(Tensor w) -> Tensor");
  m.def("fma_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  // prefill_attention_cpu.cpp
  m.def("prefill_attention_available() -> bool", &LLMC_NAMESPACE::prefill_attention_available);
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(LLMC_NAMESPACE, CPU, m) {
  // decoder_layer_cpu.cpp
  m.impl("decoder_layers", &LLMC_NAMESPACE::decoder_layers);
  // int8_gemm_cpu.cpp
  m.impl("int8_gemm_offsets", &LLMC_NAMESPACE::int8_gemm_offsets);
  m.impl("int8_gemm", &LLMC_NAMESPACE::int8_gemm);
  // kquant_gemm_cpu.cpp
  m.impl("kquant_linear", &LLMC_NAMESPACE::kquant_linear);
  m.impl("kquant_dequant_", &LLMC_NAMESPACE::kquant_dequant_);
  m.impl("kquant_linear_plain", &LLMC_NAMESPACE::kquant_linear_plain);
  // layer_ops_cpu.cpp
  m.impl("rms_norm", &LLMC_NAMESPACE::rms_norm);
  m.impl("fused_add_rms_norm_", &LLMC_NAMESPACE::fused_add_rms_norm_);
  m.impl("silu_and_mul", &LLMC_NAMESPACE::silu_and_mul);
  m.impl("rotary_", &LLMC_NAMESPACE::rotary_);
  // lora_cpu.cpp
  m.impl("lora_add_", &LLMC_NAMESPACE::lora_add_);
  // paged_attention_cpu.cpp
  m.impl("paged_attention", &LLMC_NAMESPACE::paged_attention);
  m.impl("qkv_attention", &LLMC_NAMESPACE::qkv_attention);
  // skinny_gemm_cpu.cpp
  m.impl("skinny_pack", &LLMC_NAMESPACE::skinny_pack);
  m.impl("skinny_linear", &LLMC_NAMESPACE::skinny_linear);
  m.impl("int8_pack", &LLMC_NAMESPACE::int8_pack);
  m.impl("int8_linear", &LLMC_NAMESPACE::int8_linear);
  m.impl("int8_dequant_", &LLMC_NAMESPACE::int8_dequant_);
  m.impl("q4_pack", &LLMC_NAMESPACE::q4_pack);
  m.impl("q4_linear", &LLMC_NAMESPACE::q4_linear);
  m.impl("q4_dequant_", &LLMC_NAMESPACE::q4_dequant_);
  m.impl("packed_linear", &LLMC_NAMESPACE::packed_linear);
  // fma_gemm_cpu.cpp
  m.impl("fma_pack", &LLMC_NAMESPACE::fma_pack);
  m.impl("fma_linear", &LLMC_NAMESPACE::fma_linear);
  // prefill_attention_cpu.cpp
  m.impl("prefill_attention", &LLMC_NAMESPACE::prefill_attention);
}
