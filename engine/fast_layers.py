"""A lean CPU forward for the Qwen2 decoder: the same arithmetic as transformers' modules, with
less Python around it.

Why: on this 2-core CPU a B=1 decode step spends ~10-15 ms of ~50 in Python and dispatch inside
transformers' layers (module ``__call__``, kwargs plumbing, decorators, one linear call per
projection), time during which neither core reads weights. ``LeanQwen2`` runs the same
operations in one flat loop, with q/k/v as one weight and gate/up as one weight (fewer, larger
matrix products; the concatenation does not change any output column). RMSNorm, rotary
embedding, SiLU·up and the residual adds are op-for-op the stock ones, in the stock dtypes, so
fp32 logits match stock transformers (tests compare them at 1e-5) and bf16 rounds where stock
rounds.

Each projection runs one of two kernels, by how many rows it multiplies: up to
``engine.kernels.MAX_ROWS`` (a decode step of up to eight requests, the sampled rows of a
prefill) miniserve's own gemv over a panel-packed copy of the weight, which reads it at memory
speed (benchmarks/gemv_kernel.py); more rows, oneDNN's linear over its pre-packed copy. Two
packed copies beside the model's own weights: memory for speed, on a small model.

Only the engine's own model gets it (``ModelRunner``); the model's parameters, state dict and
stock ``forward`` are untouched, so a reference twin built by ``load_model`` stays stock.
Used only on CPU with oneDNN, for qwen2 models without sliding-window layers; anything else runs
the stock forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.attention import ragged_attention

_linear = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm.forward, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
        return (_linear is not None and model.device.type == "cpu" and cfg.model_type == "qwen2"
                and cfg.hidden_act == "silu" and set(layer_types) == {"full_attention"}
                and hasattr(model.lm_head, "packed_weight"))

    def _weights(self, weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """One projection as its kernels take it: (gemv panels or None, oneDNN-packed, bias)."""
        panels = kernels.pack_panels(weight) if self.gemv is not None else None
        return panels, packed, None if bias is None else bias.detach()

    def _project(self, x: torch.Tensor, weights) -> torch.Tensor:
        """x (rows, in) times one projection."""
        panels, packed, bias = weights
        if panels is not None and self.gemv is not None and 0 < x.shape[0] <= kernels.MAX_ROWS:
            return self.gemv(x.contiguous(), panels, bias)
        return _linear(x, packed, bias, "none", [], "")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, cache,
                 rows: torch.Tensor) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed)  # (1, T, hidden)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, D): broadcast over heads
        t = h.shape[1]
        d = self.head_dim
        project = self._project
        for i, scaling, nq, nkv, ln1, eps1, qkv, o, ln2, eps2, gu, inter, down in self.layers:
            residual = h
            x = _rms_norm(h, ln1, eps1)
            qkv = project(x.view(t, -1), qkv)
            # q and k heads sit side by side in qkv: one rotary pass over both (elementwise, so
            # the same values as rotating each)
            qk = qkv[:, :nq + nkv].view(1, t, -1, d).transpose(1, 2)
            qk = (qk * cos) + (_rotate_half(qk) * sin)
            q, k = qk[:, :nq // d], qk[:, nq // d:]
            v = qkv[:, nq + nkv:].view(1, t, -1, d).transpose(1, 2)
            k_store, v_store = cache.update(k, v, i)
            attn, _ = ragged_attention(None, q, k_store, v_store, batch, scaling=scaling)
            attn = project(attn.reshape(t, -1), o)
            h = residual + attn.view(1, t, -1)
            residual = h
            x = _rms_norm(h, ln2, eps2)
            gu = project(x.view(t, -1), gu)
            x = project(F.silu(gu[:, :inter]) * gu[:, inter:], down)
            h = residual + x.view(1, t, -1)
        h = _rms_norm(h[:, rows], self.norm_w, self.norm_eps)  # row-wise, so slicing first is exact
        return project(h[0], self.lm)
