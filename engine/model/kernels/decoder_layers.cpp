// miniserve.DecoderLayers — every decoder layer of a step in one call from Python: the same kernels the
// lean forward calls one by one (gemv, add_rms_norm, rotary_kv, decode_attention, gate_up_silu), in
// the same order on the same tensors, so the logits are the same bits.
//
// Why: a layer is eight kernel calls, and from Python each costs its argument parsing and dispatch
// (~7 us a call); at 24 layers that is ~1.5 ms of a decode step during which no core reads weights
// or multiplies. Where a step's products all run on the gemv and its attention on the kernel (what
// dispatch.py chose for that row count on this machine), engine/model/lean_qwen2.py hands the whole
// loop to this class instead (where the layer ops are the fused ones and every layer has one shape).
// The weights are bound once, when the model is built; a step passes its activations, rotary tables,
// KV stores and slots.
//
// Each kernel call is a profiler region of the op's own name (miniserve::gemv, ...), as it is when
// Python calls the op, so a profile of a step still says where its time goes (with its main inputs'
// shapes under record_shapes; the inputs are only gathered while a profiler records).

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

// a layer's tensors, in the order DecoderLayers' constructor takes them
enum Weight { kLn1, kQkv, kO, kLn2, kGateUp, kDown, kWeights };
enum Optional { kQkvBias, kOBias, kGateUpBias, kDownBias, kQNorm, kKNorm, kOptionals };
enum Scalar { kEps1, kEps2, kQkEps, kScale, kScalars };
enum Projection { kPQkv, kPO, kPGateUp, kPDown, kProjections };

struct DecoderLayers : torch::CustomClassHolder {
  // weights: kWeights per layer (the products' as packed panels, gate/up's interleaved for
  // gate_up_silu: engine.kernels.interleave_gate_up); optionals: kOptionals per layer
  // (biases, Qwen3's q/k norms; None where the model has none); scalars: kScalars per layer;
  // dims: heads, kv_heads, head_dim, intermediate size; blocks: each projection's row_block, then
  // each one's k_block (dispatch.row_block / k_block); tuning: GemvTuning's fields in order
  // (prefetch_one, prefetch, prefetch_l2, amx_rows, prefetch_one_l2, stream_rows)
  DecoderLayers(std::vector<at::Tensor> weights, c10::List<std::optional<at::Tensor>> optionals,
                std::vector<double> scalars, std::vector<int64_t> dims, std::vector<int64_t> blocks,
                std::vector<int64_t> tuning)
      : weights_(std::move(weights)), scalars_(std::move(scalars)), blocks_(std::move(blocks)),
        tuning_(std::move(tuning)) {
    const char* op = "miniserve.DecoderLayers: ";
    TORCH_CHECK(!weights_.empty() && weights_.size() % kWeights == 0, op, kWeights, " weights a layer, got ",
                weights_.size());
    layers_ = static_cast<int64_t>(weights_.size()) / kWeights;
    TORCH_CHECK(static_cast<int64_t>(optionals.size()) == layers_ * kOptionals, op, kOptionals,
                " optional tensors a layer, got ", optionals.size(), " for ", layers_, " layers");
    TORCH_CHECK(static_cast<int64_t>(scalars_.size()) == layers_ * kScalars, op, kScalars,
                " scalars a layer, got ", scalars_.size());
    TORCH_CHECK(dims.size() == 4, op, "dims are heads, kv_heads, head_dim, intermediate size");
    TORCH_CHECK(blocks_.size() == 2 * kProjections, op, "a row_block and a k_block for each of the ",
                kProjections, " projections");
    TORCH_CHECK(tuning_.size() == 6, op, "the gemv tuning has 6 fields, got ", tuning_.size());
    optionals_.reserve(optionals.size());
    for (const auto& t : optionals) optionals_.push_back(t);
    for (int64_t i = 0; i < layers_; ++i) {
      const auto& bias = optionals_[i * kOptionals + kGateUpBias];
      TORCH_CHECK(!(bias.has_value() && bias->defined()), op, "layer ", i, "'s gate/up has a bias, which ",
                  "gate_up_silu does not add");
    }
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], inter_ = dims[3];
    TORCH_CHECK(heads_ >= 1 && kv_heads_ >= 1 && head_dim_ >= 1 && inter_ >= 1, op, "dims must be positive");
    hidden_ = weights_[kLn1].size(0);
    // each projection's outputs and inputs (N, K), as the lean forward's Projection holds them
    n_k_ = {{(heads_ + 2 * kv_heads_) * head_dim_, hidden_},
            {hidden_, heads_ * head_dim_},
            {2 * inter_, hidden_},
            {hidden_, inter_}};
  }

  // every layer over h (tokens, hidden), updated in place by each layer's residual adds; returns
  // what the last layer's MLP adds to h (the lean forward adds it in its final norm)
  at::Tensor run(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<at::Tensor>& k_stores, const std::vector<at::Tensor>& v_stores,
                 const at::Tensor& write_slots, const at::Tensor& write_positions, const at::Tensor& kernel_slots,
                 const at::Tensor& kernel_lens) const {
    const char* op = "miniserve.DecoderLayers.run: ";
    TORCH_CHECK(static_cast<int64_t>(k_stores.size()) == layers_ && static_cast<int64_t>(v_stores.size()) == layers_,
                op, "one key and one value store per layer (", layers_, "), got ", k_stores.size(), " and ",
                v_stores.size());
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_, op, "h must be (tokens, ", hidden_, "), got ", h.sizes());
    const int64_t tokens = h.size(0);
    std::optional<at::Tensor> delta;
    for (int64_t i = 0; i < layers_; ++i) {
      const at::Tensor* w = weights_.data() + i * kWeights;
      const std::optional<at::Tensor>* opt = optionals_.data() + i * kOptionals;
      const double* s = scalars_.data() + i * kScalars;
      at::Tensor x = norm(h, delta, w[kLn1], s[kEps1]);
      at::Tensor qkv = project(x, w[kQkv], opt[kQkvBias], kPQkv);
      at::Tensor q;
      {
        RECORD_FUNCTION("miniserve::rotary_kv", std::vector<c10::IValue>({qkv, cos, sin}));
        q = miniserve_ops::rotary_kv(qkv, cos, sin, heads_, kv_heads_, k_stores[i], v_stores[i], write_slots,
                                     write_positions, opt[kQNorm], opt[kKNorm], s[kQkEps]);
      }
      at::Tensor attn;
      {
        RECORD_FUNCTION("miniserve::decode_attention", std::vector<c10::IValue>({q, k_stores[i], v_stores[i]}));
        attn = miniserve_ops::decode_attention(q, k_stores[i], v_stores[i], kernel_slots, kernel_lens, s[kScale]);
      }
      x = norm(h, project(attn.view({tokens, heads_ * head_dim_}), w[kO], opt[kOBias], kPO), w[kLn2], s[kEps2]);
      at::Tensor act;
      {
        RECORD_FUNCTION("miniserve::gate_up_silu", std::vector<c10::IValue>({x, w[kGateUp]}));
        const auto& t = tuning_;
        act = miniserve_ops::gate_up_silu(x, w[kGateUp], inter_, hidden_, blocks_[kPGateUp],
                                          blocks_[kProjections + kPGateUp], t[0], t[1], t[2] != 0, t[3], t[4] != 0,
                                          t[5]);
      }
      delta = project(act, w[kDown], opt[kDownBias], kPDown);
    }
    return *delta;
  }

  int64_t num_layers() const { return layers_; }

 private:
  at::Tensor norm(const at::Tensor& h, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                  double eps) const {
    RECORD_FUNCTION("miniserve::add_rms_norm", std::vector<c10::IValue>({h, delta, weight}));
    return miniserve_ops::add_rms_norm(h, delta, weight, eps);
  }

  at::Tensor project(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                     Projection p) const {
    RECORD_FUNCTION("miniserve::gemv", std::vector<c10::IValue>({x, panels}));
    const auto& t = tuning_;
    return miniserve_ops::gemv(x, panels, bias, n_k_[p][0], n_k_[p][1], blocks_[p], blocks_[kProjections + p], t[0],
                               t[1], t[2] != 0, t[3], t[4] != 0, t[5]);
  }

  std::vector<at::Tensor> weights_;
  std::vector<std::optional<at::Tensor>> optionals_;
  std::vector<double> scalars_;
  std::vector<int64_t> blocks_, tuning_;
  int64_t layers_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0, hidden_ = 0;
  std::vector<std::vector<int64_t>> n_k_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(miniserve, m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>, std::vector<double>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>())
      .def("run", &DecoderLayers::run)
      .def("num_layers", &DecoderLayers::num_layers);
}
