// The decoder layers of a Llama-family model in one call, for decode steps of a few rows on CPU:
//
//   decoder_layers(hidden, ...) -> (hidden', residual), per layer:
//     residual' = hidden + residual (the embeddings themselves at the first layer)
//     h = rms_norm(residual') ; qkv = h Wqkv^T ; with q_norm / k_norm (Qwen3), each q and k head
//     of qkv RMS-normed ; a = attention(rotary(qkv)) with this step's K/V written to the cache ;
//     residual' += a Wo^T ; h = rms_norm(residual') ;
//     hidden' = silu_and_mul(h Wgu^T) Wdown^T
//
// It runs the library's own ops in the order the modular layer (cluster/model/models/llama.py)
// runs them, so the result is the same bits; what it saves is the Python calls, module
// dispatches and views between them: a batch-1 SmolLM2 decode step went from 11.3 to 8.5 ms on
// 2 cores (~95 us a layer) with one call a layer, and one call for the stack took the ~30
// argument conversions and dispatches of the other calls off too. The embeddings `hidden` become the
// residual stream, updated in place. Each weight is a packed_linear weight: {skinny_pack},
// {k-quant blocks}, {int8 q, scales[, offsets]}, {4-bit q, d, m} or such weights stacked (ops.h).
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

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

// One layer's weights, as decoder_layers takes them: projections in the order qkv, o, gate_up, down.
struct Layer {
  const at::Tensor *input_norm, *post_norm;
  const at::Tensor *q_norm, *k_norm;  // both or neither
  at::TensorList proj[4];
  c10::optional<at::Tensor> bias[4];
  int64_t n[4];
};

// Everything a layer's attention takes besides its cache.
struct Step {
  double eps, qk_eps, scale;
  int64_t tile_queries;
  const at::Tensor &cos, &sin, &slot_mapping, &block_table, &seq_lens, &query_start, &query_len;
};

// hidden' (new); residual updated in place (the embeddings `hidden` when undefined: the first layer).
at::Tensor decoder_layer(at::Tensor hidden, at::Tensor& residual, const Layer& w, const Step& s, at::Tensor& k_cache,
                         at::Tensor& v_cache) {
  at::Tensor h;
  if (residual.defined()) {
    ops::add_norm_(hidden, residual, *w.input_norm, s.eps);
    h = hidden;
  } else {  // the first layer: the embeddings are the residual stream
    residual = hidden;
    h = hidden.new_empty(hidden.sizes());
    ops::norm_into(h, hidden, *w.input_norm, s.eps);
  }
  at::Tensor qkv = ops::packed_linear(h, w.proj[0], w.bias[0], w.n[0]);
  if (w.q_norm) {
    const int64_t hd = k_cache.size(3), kv_width = k_cache.size(2) * hd, q_width = qkv.size(1) - 2 * kv_width;
    norm_heads(qkv, 0, q_width, hd, *w.q_norm, s.qk_eps);
    norm_heads(qkv, q_width, kv_width, hd, *w.k_norm, s.qk_eps);
  }
  at::Tensor attn = ops::attend_qkv(qkv, s.cos, s.sin, k_cache, v_cache, s.slot_mapping, s.block_table, s.seq_lens,
                                    s.query_start, s.query_len, s.scale, s.tile_queries);
  h = ops::packed_linear(attn, w.proj[1], w.bias[1], w.n[1]);
  ops::add_norm_(h, residual, *w.post_norm, s.eps);
  at::Tensor gate_up = ops::packed_linear(h, w.proj[2], w.bias[2], w.n[2]);
  at::Tensor act = gate_up.new_empty({gate_up.size(0), gate_up.size(1) / 2});
  ops::silu_mul_into(act, gate_up);
  return ops::packed_linear(act, w.proj[3], w.bias[3], w.n[3]);
}

}  // namespace

namespace LLMC_NAMESPACE {

// Every layer of a stack in one call. Per layer l: norms[2l], norms[2l + 1] (input, post-attention);
// qk_norms[2l], qk_norms[2l + 1] (Qwen3's per-head q / k norms) or an empty list; projection
// p = 4l + j (qkv, o, gate_up, down) is proj_tensors[p] consecutive tensors of proj, with
// biases[p] and out_features[p]; k_caches[l], v_caches[l]. The lists are checked before any layer runs.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    at::Tensor hidden, at::TensorList norms, const c10::List<c10::optional<at::Tensor>>& qk_norms, double eps,
    double qk_eps, at::TensorList proj, at::IntArrayRef proj_tensors, const c10::List<c10::optional<at::Tensor>>& biases,
    at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& query_start, const at::Tensor& query_len, double scale, int64_t tile_queries) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                  static_cast<int64_t>(norms.size()) == 2 * layers && (qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers) &&
                  static_cast<int64_t>(proj_tensors.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers,
              "decoder_layers: per layer give 2 norms, 2 or no qk_norms, 4 projections (proj_tensors, biases, "
              "out_features) and a k and v cache; got ", layers, " caches, ", norms.size(), " norms, ", qk_norms.size(),
              " qk_norms, ", proj_tensors.size(), " projections");
  int64_t total = 0;
  for (const int64_t count : proj_tensors) {
    TORCH_CHECK(count > 0, "decoder_layers: a projection of ", count, " tensors");
    total += count;
  }
  TORCH_CHECK(total == static_cast<int64_t>(proj.size()), "decoder_layers: proj_tensors add up to ", total,
              " tensors, proj has ", proj.size());
  std::vector<c10::optional<at::Tensor>> qk(qk_norms.begin(), qk_norms.end());
  for (const auto& norm : qk) TORCH_CHECK(norm.has_value(), "decoder_layers: a qk_norms entry is None");
  const Step s{eps, qk_eps, scale, tile_queries, cos, sin, slot_mapping, block_table, seq_lens, query_start, query_len};
  at::Tensor residual;
  int64_t next = 0;  // proj's next tensor
  for (int64_t l = 0; l < layers; ++l) {
    Layer w{&norms[2 * l], &norms[2 * l + 1], nullptr, nullptr, {}, {}, {}};
    if (!qk.empty()) {
      w.q_norm = &*qk[2 * l];
      w.k_norm = &*qk[2 * l + 1];
    }
    for (int j = 0; j < 4; ++j) {
      const int64_t p = 4 * l + j, count = proj_tensors[p];
      w.proj[j] = proj.slice(next, count);
      w.bias[j] = biases.get(p);
      w.n[j] = out_features[p];
      next += count;
    }
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    hidden = decoder_layer(hidden, residual, w, s, k_cache, v_cache);
  }
  return {hidden, residual};
}

}  // namespace LLMC_NAMESPACE
