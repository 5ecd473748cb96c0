// The library's ops as C++ functions, for ops built from others (decoder_layer_cpu.cpp). They live
// in a namespace named per instruction set (LLMC_NAMESPACE), like the ops' torch namespace, so
// libraries built for several ISAs can be loaded into one process side by side.
//
// Every file of the library includes only ATen/core/Tensor.h of ATen's headers where it can, and
// allocates with Tensor::new_empty / new_zeros: ATen/ops/empty.h, zeros.h, cat.h and core/List.h each
// add seconds of compile time to a file, and the library is built at install and in the tests.
#pragma once

#include <ATen/core/Tensor.h>

#ifndef LLMC_NAMESPACE
#define LLMC_NAMESPACE llm_cluster
#endif

namespace LLMC_NAMESPACE {

// layer_ops_cpu.cpp: rms_norm into out; residual += x then x = rms_norm(residual); silu_and_mul.
void norm_into(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps);
void add_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps);
void silu_mul_into(at::Tensor out, const at::Tensor& x);

// paged_attention_cpu.cpp: qkv_attention (rotary, cache write, paged attention).
at::Tensor attend_qkv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& query_start, const at::Tensor& query_len,
                      double scale, int64_t tile_queries);

// skinny_gemm_cpu.cpp: x @ w^T (+ bias) for a weight packed by skinny_pack ({packed}), kquant_pack
// ({blocks}, uint8), int8_pack ({q, scales}; with int8_gemm_offsets, {q, scales, offsets}: W8A8) or
// q4_pack ({q, d, m}), told apart by how many tensors it is and the first one's dtype; or several
// such weights stacked by output features ({parts, then each part's tensors}: parts int64 [P, 2],
// each part's tensor count and out features), each computed alone and concatenated.
at::Tensor packed_linear(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& bias, int64_t N);

// kquant_gemm_cpu.cpp: x @ w^T (+ bias) for GGUF's Q4_K / Q5_K / Q6_K super-blocks (kquant_pack),
// x quantized to int8 per row and super-block of 256 inputs.
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N);

// int8_gemm_cpu.cpp: W8A8 x @ w^T (+ bias) on int8_pack's blocks (a scale per feature or per group of 32 / 64).
bool int8_gemm_available();
// Whether int8_gemm runs on AMX tiles from 24 rows here (AMX-INT8, the OS's permission, not turned off).
bool int8_amx_available();
// skinny_gemm_cpu.cpp: whether q4_linear quantizes x to int8 (W4A8) here: what int8_gemm needs.
bool q4_int8_activations();
// Whether int8_linear quantizes x to int8 (W8A8 without VNNI) where K and the scale groups are whole runs of 32.
bool int8_int8_activations();
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& sp, const at::Tensor& offsets,
                     const c10::optional<at::Tensor>& bias, int64_t N);

}  // namespace LLMC_NAMESPACE
