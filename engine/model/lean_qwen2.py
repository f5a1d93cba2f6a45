"""A lean CPU forward for the Qwen2 decoder: the same arithmetic as transformers' modules, with
less Python around it.

Why: on this 2-core CPU a B=1 decode step spends ~10-15 ms of ~50 in Python and dispatch inside
transformers' layers (module ``__call__``, kwargs plumbing, decorators, one linear call per
projection), time during which neither core reads weights. ``LeanQwen2`` runs the same
operations in one flat loop, with q/k/v as one weight and gate/up as one weight (fewer, larger
matrix products; the concatenation does not change any output column). Between the products a
layer makes three calls (``engine.model.kernels.LayerOps``): residual add + RMSNorm, rotary + KV write,
SiLU·up. Where this CPU runs miniserve's kernels they are fused C++ passes (layer_ops.cpp);
elsewhere the stock modules' ops, op for op. Either way they round where stock rounds, so fp32
logits match stock transformers (tests compare them at 1e-5) and bf16 rounds where stock rounds.

Each projection runs one of two kernels, by how many rows it multiplies: up to
``engine.model.kernels.MAX_ROWS`` (64: a decode step of up to 64 requests, a short chunk, the sampled
rows of a prefill) miniserve's own gemv over a panel-packed copy of the weight, which reads it
once at memory speed (benchmarks/gemv_kernel.py); more rows, oneDNN's linear over its pre-packed
copy. Two
packed copies beside the model's own weights: memory for speed, on a small model.

Only the engine's own model gets it (``ModelRunner``); the model's parameters, state dict and
stock ``forward`` are untouched, so a reference twin built by ``load_model`` stays stock.
Used only on CPU with oneDNN, for qwen2 models without sliding-window layers; anything else runs
the stock forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model import kernels
from engine.model.attention import ragged_attention

_linear = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class LeanQwen2:
    """Callable (input_ids (1, T), positions (T,), ragged batch, KV cache, sample rows) -> logits
    (rows, vocab) computed as Qwen2ForCausalLM would with ``logits_to_keep=rows``."""

    def __init__(self, model) -> None:
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.gemv = kernels.gemv(model.dtype)
        self.ops = kernels.layer_ops(model.dtype) or kernels.TORCH_LAYER_OPS
        self.lm = self._weights(model.lm_head.weight, model.lm_head.packed_weight, model.lm_head.bias)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a, mlp = layer.self_attn, layer.mlp
            qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
            gu_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            qkv_b = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
            if qkv_b is None and any(b is not None for b in biases):
                raise ValueError("mixed q/k/v biases")
            self.layers.append((
                i, a.scaling, a.q_proj.out_features, a.k_proj.out_features,
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                self._weights(qkv_w, _pack(qkv_w), qkv_b),
                self._weights(a.o_proj.weight, a.o_proj.packed_weight, a.o_proj.bias),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                self._weights(gu_w, _pack(gu_w), None), mlp.gate_proj.out_features,
                self._weights(mlp.down_proj.weight, mlp.down_proj.packed_weight, mlp.down_proj.bias),
            ))
            # the fused packed copies replace the per-projection ones; those modules fall back to
            # their stock forward if anything else calls them
            for m in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
                del m.packed_weight
                del m.forward
        if self.gemv is not None:  # the kernel streams the panels from memory: huge pages read faster
            for w, panels in zip(self.projections, kernels.in_huge_pages([w[0] for w in self.projections])):
                w[0] = panels

    @property
    def projections(self) -> list[list]:
        """Every projection's [gemv panels or None, oneDNN-packed, bias], in forward order."""
        return [w for layer in self.layers for w in layer if isinstance(w, list)] + [self.lm]

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
        return (_linear is not None and model.device.type == "cpu" and cfg.model_type == "qwen2"
                and cfg.hidden_act == "silu" and set(layer_types) == {"full_attention"}
                and hasattr(model.lm_head, "packed_weight"))

    def _weights(self, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> list:
        """One projection as its kernels take it: [gemv panels or None, oneDNN-packed, bias]."""
        panels = kernels.pack_panels(weight) if self.gemv is not None else None
        return [panels, packed, None if bias is None else bias.detach()]

    def _project(self, x: torch.Tensor, weights) -> torch.Tensor:
        """x (rows, in) times one projection."""
        panels, packed, bias = weights
        if panels is not None and self.gemv is not None and 0 < x.shape[0] <= kernels.MAX_ROWS:
            return self.gemv(x.contiguous(), panels, bias)
        return _linear(x, packed, bias, "none", [], "")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, cache,
                 rows: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids[0], self.embed)  # (T, hidden)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0], sin[0]  # (T, D)
        t = h.shape[0]
        d = self.head_dim
        project, ops = self._project, self.ops
        delta = None  # what the previous layer's MLP adds to h
        for i, scaling, nq, nkv, ln1, eps1, qkv, o, ln2, eps2, gu, inter, down in self.layers:
            k_store, v_store = cache.keys[i], cache.values[i]
            x = ops.add_rms_norm(h, delta, ln1, eps1)
            q = ops.rotary_kv(project(x, qkv), cos, sin, nq // d, nkv // d, k_store, v_store,
                              batch.write_slots, batch.write_positions)  # (T, H, D)
            attn, _ = ragged_attention(None, q.transpose(0, 1)[None], k_store, v_store, batch, scaling=scaling)
            x = ops.add_rms_norm(h, project(attn.reshape(t, -1), o), ln2, eps2)
            delta = project(ops.silu_mul(project(x, gu), inter), down)
        # row-wise from here on: the sampled rows alone give the same logits
        return project(ops.add_rms_norm(h[rows], delta[rows], self.norm_w, self.norm_eps), self.lm)
