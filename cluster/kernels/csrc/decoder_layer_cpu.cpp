// A Llama-family decoder layer in one call, for decode steps of a few rows on CPU:
//
//   decoder_layer(hidden, residual, ...) -> (hidden', residual')
//     residual' = hidden + residual (hidden itself when residual is None, the first layer)
//     h = rms_norm(residual') ; qkv = h Wqkv^T ; with q_norm / k_norm (Qwen3), each q and k head
//     of qkv RMS-normed ; a = attention(rotary(qkv)) with this step's K/V written to the cache ;
//     residual' += a Wo^T ; h = rms_norm(residual') ;
//     hidden' = silu_and_mul(h Wgu^T) Wdown^T
//
// It runs the library's own ops in the order the modular layer (cluster/model/models/llama.py)
// runs them, so the result is the same bits; what it saves is the Python calls, module
// dispatches and views between them: a batch-1 SmolLM2 decode step went from 11.3 to 8.5 ms on
// 2 cores (~95 us a layer). residual is updated in place when given; hidden is overwritten (it is the
// previous layer's output, a temporary). Each weight is a packed_linear weight: {skinny_pack},
// {int8 q, scales} or {4-bit q, d, m}.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "ops.h"

namespace {

namespace ops = LLMC_NAMESPACE;

// Every head of `width` columns from column `first` of each row of qkv, RMS-normed in place.
void norm_heads(at::Tensor& qkv, int64_t first, int64_t width, int64_t head_dim, const at::Tensor& w, double eps) {
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    at::Tensor heads = qkv.select(0, t).narrow(0, first, width).view({width / head_dim, head_dim});
    ops::norm_into(heads, heads, w, eps);
  }
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor hidden, const c10::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double qk_eps, at::TensorList qkv_w, const c10::optional<at::Tensor>& qkv_bias,
    int64_t qkv_n, at::TensorList o_w, const c10::optional<at::Tensor>& o_bias, int64_t o_n,
    at::TensorList gate_up_w, const c10::optional<at::Tensor>& gate_up_bias, int64_t gate_up_n,
    at::TensorList down_w, const c10::optional<at::Tensor>& down_bias, int64_t down_n, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start,
    const at::Tensor& query_len, double scale, int64_t tile_queries) {
  at::Tensor residual, h;
  if (residual_in.has_value()) {
    residual = *residual_in;
    ops::add_norm_(hidden, residual, input_norm, eps);
    h = hidden;
  } else {  // the first layer: the embeddings are the residual stream
    residual = hidden;
    h = at::empty_like(hidden);
    ops::norm_into(h, hidden, input_norm, eps);
  }
  at::Tensor qkv = ops::packed_linear(h, qkv_w, qkv_bias, qkv_n);
  if (q_norm.has_value() != k_norm.has_value()) TORCH_CHECK(false, "decoder_layer: give both q_norm and k_norm, or neither");
  if (q_norm.has_value()) {
    const int64_t hd = k_cache.size(3), kv_width = k_cache.size(2) * hd, q_width = qkv.size(1) - 2 * kv_width;
    norm_heads(qkv, 0, q_width, hd, *q_norm, qk_eps);
    norm_heads(qkv, q_width, kv_width, hd, *k_norm, qk_eps);
  }
  at::Tensor attn = ops::attend_qkv(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                                    query_start, query_len, scale, tile_queries);
  h = ops::packed_linear(attn, o_w, o_bias, o_n);
  ops::add_norm_(h, residual, post_norm, eps);
  at::Tensor gate_up = ops::packed_linear(h, gate_up_w, gate_up_bias, gate_up_n);
  at::Tensor act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  ops::silu_mul_into(act, gate_up);
  return {ops::packed_linear(act, down_w, down_bias, down_n), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LLMC_NAMESPACE, m) {
  m.def("decoder_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor? q_norm, Tensor? k_norm, float qk_eps, Tensor[] qkv, Tensor? qkv_bias, int qkv_n, Tensor[] o, Tensor? o_bias, int o_n, "
        "Tensor[] gate_up, Tensor? gate_up_bias, int gate_up_n, Tensor[] down, Tensor? down_bias, int down_n, "
        "Tensor cos, Tensor sin, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start, Tensor query_len, float scale, int tile_queries) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(LLMC_NAMESPACE, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
}
