"""A lean CPU forward for the Qwen2 and Qwen3 decoders: the same arithmetic as transformers'
modules, with less Python around it.

Why: on this 2-core CPU a B=1 decode step spends ~10-15 ms of ~50 in Python and dispatch inside
transformers' layers (module ``__call__``, kwargs plumbing, decorators, one linear call per
projection), time during which neither core reads weights. ``LeanQwen2`` runs the same
operations in one flat loop, with q/k/v as one weight and gate/up as one weight (fewer, larger
matrix products; the concatenation does not change any output column). Between the products a
layer makes three calls (``engine.model.kernels.LayerOps``): residual add + RMSNorm, rotary + KV write,
SiLU·up. Where this CPU runs miniserve's kernels they are fused C++ passes (layer_ops.cpp);
elsewhere the stock modules' ops, op for op. Either way they round where stock rounds, so fp32
logits match stock transformers (tests compare them at 1e-5) and bf16 rounds where stock rounds.
Where the gemv runs the gate/up product, SiLU·up is made inside it instead (``kernels.gate_up_silu``
over panels that interleave gate and up; in C++ whichever layer ops the loop runs), so such a layer
makes two calls between its products. Where a step's products all run on the gemv and all its tokens
attend on the attention kernel (and the layers run the fused layer ops and share one shape), the
whole loop is one C++ call (``DecoderLayers``, decoder_layers.cpp): the same kernels in the same
order, so the same bits, without ~8 trips from Python a layer.

Each projection runs the candidate ``engine.model.kernels.dispatch`` measured fastest on this
machine for its row count: miniserve's gemv over a panel-packed copy of the weight, oneDNN's
linear over its pre-packed copy, or stock ``F.linear`` over the plain weight. Only the copies the
chosen candidates read are made, each packed straight from the model's weight, and the model's
own projection weights are then released (zero-stride views of the same shape, dtype and count).
The dispatch table gives every row count one candidate, so each weight lives in one layout, and a
tied embedding is read out of its lm_head's panels (or is the lm_head's plain weight): the engine
holds one copy of the weights, not three (issue 16, memory); only oneDNN with tied embeddings keeps
the embedding a second time, its packed layout being opaque.

Qwen3 is Qwen2's decoder with three differences, all handled here so both run the same loop and
kernels (and a cost profile measured on one transfers to the other): an explicit ``head_dim``
(not hidden / heads), no q/k/v bias, and a per-head RMSNorm of q and k after their projection and
before the rotation (``q_norm`` / ``k_norm``), which the rotary layer op applies in its pass.

Only the engine's own model gets it (``ModelRunner``); a reference twin built by ``load_model``
stays stock. The engine's model keeps its parameters' shapes and state-dict keys, but its stock
``forward`` refuses to run once its weights have moved.
Used only on CPU, for qwen2 and qwen3 models without sliding-window layers; anything else runs
the stock forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model import kernels
from engine.model.attention import ragged_attention
from engine.model.kernels import dispatch
from engine.model.weights import release, trim_heap


def rope_is_fixed(rotary) -> bool:
    """Whether a rotary module's cos/sin at a position never change, so they can be tabled once.
    transformers' dynamic_rope_update changes the frequencies with the longest sequence seen for
    every rope type naming "dynamic" and for "longrope"; a module that names no type is not assumed
    fixed."""
    rope_type = getattr(rotary, "rope_type", None)
    return isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"


@dataclass
class Projection:
    """One projection's weight in the copies its chosen kernels read (None where none reads it)."""

    n: int
    panels: kernels.Panels | None
    packed: torch.Tensor | None  # oneDNN's
    plain: torch.Tensor | None  # F.linear's
    bias: torch.Tensor | None
    row_block: int
    k_block: int
    gate_up_inter: int = 0  # the MLP's width where the panels interleave gate and up (gate_up_silu reads them)


def _weights_moved(*args, **kwargs):
    raise RuntimeError("this model's projection weights moved into the engine's lean forward "
                       "(engine/model/lean_qwen2.py); build another with load_model for the stock forward")


MODEL_TYPES = ("qwen2", "qwen3")


class LeanQwen2:
    """Callable (input_ids (1, T), positions (T,), ragged batch, KV cache, sample rows) -> logits
    (rows, vocab) computed as Qwen2ForCausalLM (or Qwen3ForCausalLM) would with
    ``logits_to_keep=rows``; rows None: every row (a decodes-only step, no gather)."""

    def __init__(self, model, attention=None) -> None:
        """``attention``: the attention kernel the runner's steps attend on (where one does), which
        the layers in one call run; None: the Python loop always."""
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed: torch.Tensor | None = inner.embed_tokens.weight  # None: read from the lm_head's panels
        self.embed_panels: kernels.Panels | None = None
        self.rotary = inner.rotary_emb
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) by position: _cos_sin
        self._rope_fixed = rope_is_fixed(self.rotary)
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.choices = dispatch.linear_choices(model.dtype)
        self._by_rows = [dispatch.choice_for_rows(self.choices, r) for r in range(dispatch.ROW_CLASSES[-1] + 1)]
        self.gemv = kernels.gemv(model.dtype) if "gemv" in self.choices else None
        # the gate/up product and its activation as one kernel call where the gemv runs it (its panels
        # then interleave gate and up; oneDNN's and F.linear's copies keep the weight's order)
        interleave = (self.gemv is not None and
                      all(layer.mlp.gate_proj.out_features % kernels.GATE_UP_GROUP == 0 for layer in inner.layers))
        self.gate_up = kernels.gate_up_silu(model.dtype) if interleave else None
        self.gemv_tuning = dispatch.gemv_tuning(model.dtype)
        self._projector = self._gemv_projector()
        self.ops = kernels.layer_ops(model.dtype) or kernels.TORCH_LAYER_OPS
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # (source linears, bias) per projection, in forward order; q/k/v and gate/up as one weight each
        specs = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            if any(b is None for b in biases) and any(b is not None for b in biases):
                raise ValueError("mixed q/k/v biases")
            qkv_b = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
            inter = mlp.gate_proj.out_features if self.gate_up is not None else 0
            specs += [([a.q_proj, a.k_proj, a.v_proj], qkv_b, 0), ([a.o_proj], a.o_proj.bias, 0),
                      ([mlp.gate_proj, mlp.up_proj], None, inter), ([mlp.down_proj], mlp.down_proj.bias, 0)]
        specs.append(([model.lm_head], model.lm_head.bias, 0))
        tied = model.lm_head.weight.data_ptr() == self.embed.data_ptr()
        embed_from_panels = tied and "gemv" in self.choices
        self.projections = self._pack(specs, model.dtype, keep=None if embed_from_panels else self.embed)
        self.lm = self.projections[-1]
        if embed_from_panels:
            self.embed, self.embed_panels = None, self.lm.panels
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a, mlp = layer.self_attn, layer.mlp
            qkv, o, gu, down = self.projections[4 * i:4 * i + 4]
            # Qwen3's per-head q/k RMSNorm, as rotary_kv's optional arguments; none for Qwen2
            qk_norm = ((a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon)
                       if getattr(a, "q_norm", None) is not None else ())
            if qk_norm and a.q_norm.variance_epsilon != a.k_norm.variance_epsilon:
                raise ValueError("q_norm and k_norm with different eps")
            self.layers.append((
                i, a.scaling, a.q_proj.out_features, a.k_proj.out_features,
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, qkv, qk_norm, o,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                gu, mlp.gate_proj.out_features, down,
            ))
        self._attention = attention
        self.stack = self._decoder_layers()
        self._stack_ops = self.ops  # what the stack runs between its products: another set runs the loop
        model.forward = _weights_moved

    def _decoder_layers(self):
        """The layers as one C++ call (``kernels.decoder_layers``) where every piece of them runs on
        miniserve's kernels here (gemv panels, fused layer ops, the attention kernel) and the layers
        share their shapes; else None (the Python loop)."""
        make = kernels.decoder_layers()
        if (make is None or self.gemv is None or self.gate_up is None or self._attention is None
                or self.ops is kernels.TORCH_LAYER_OPS or not self.layers):
            return None
        d = self.head_dim
        weights, optionals, scalars, shapes = [], [], [], set()
        for i, scaling, nq, nkv, ln1, eps1, qkv, qk_norm, o, ln2, eps2, gu, inter, down in self.layers:
            projections = (qkv, o, gu, down)
            hidden = ln1.shape[0]  # each product's (N, K) as decoder_layers.cpp derives them from the dims
            derived = ((nq + 2 * nkv, hidden), (hidden, nq), (2 * inter, hidden), (hidden, inter))
            if any((p.n, p.panels.k) != nk for p, nk in zip(projections, derived)):
                return None
            shapes.add((nq, nkv, inter) + tuple((p.n, p.panels.k, p.row_block, p.k_block) for p in projections))
            weights += [ln1, qkv.panels.data, o.panels.data, ln2, gu.panels.data, down.panels.data]
            q_norm, k_norm, qk_eps = qk_norm or (None, None, 0.0)
            optionals += [qkv.bias, o.bias, gu.bias, down.bias, q_norm, k_norm]
            scalars += [eps1, eps2, qk_eps, scaling if scaling is not None else d ** -0.5]
        if len(shapes) != 1:
            return None
        # every layer's the same as the last one's (projections, nq, nkv, inter)
        return make([w.detach() for w in weights], [None if w is None else w.detach() for w in optionals], scalars,
                     [nq // d, nkv // d, d, inter],
                     [p.row_block for p in projections] + [p.k_block for p in projections],
                     [int(a) for a in self.gemv_tuning.op_args()])

    def _pack(self, specs: list, dtype: torch.dtype, keep: torch.Tensor | None) -> list[Projection]:
        """Each projection in the copies its kernels read, made one weight at a time (panels
        straight into their huge-page buffer) and each source weight released once nothing reads
        it (``keep``: the embedding, where the forward reads it plain), so the model's weights and
        their packed copies never all sit in memory together."""
        need = set(self.choices)
        shapes = [(sum(m.out_features for m in mods), mods[0].in_features) for mods, _, _ in specs]
        arena = (kernels.huge_page_arena([kernels.panel_shape(n, k, dtype) for n, k in shapes], dtype)
                 if "gemv" in need else [None] * len(specs))
        esize = torch.empty((), dtype=dtype).element_size()
        keep_ptr = None if keep is None else keep.data_ptr()
        out = []
        for (mods, bias, inter), (n, k), buf in zip(specs, shapes, arena):
            w = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
            plain = w if "torch" in need else None
            panels = None
            if "gemv" in need:
                panels = kernels.pack_panels(kernels.interleave_gate_up(w, inter) if inter else w, out=buf)
            out.append(Projection(
                n, panels, dispatch.onednn_pack(w) if "onednn" in need else None,
                plain, None if bias is None else bias.detach(), dispatch.row_block(k, esize),
                dispatch.k_block(esize), inter))
            del w
            for m in mods:  # F.linear's plain weight is the parameter itself: kept as it is
                if m.weight.data_ptr() not in (keep_ptr, None if plain is None else plain.data_ptr()):
                    release(m.weight)
            trim_heap()
        return out

    def decode_weights(self) -> list[torch.Tensor]:
        """The weight copies a one-row decode call streams, where they are plain tensors (oneDNN's
        packed copies are opaque, so a model decoding on them has none to show): what a stamp of
        the weights' own read rate reads (calibration.roofline.tensors_read_gb_s)."""
        choice = self._by_rows[1]
        copies = [p.panels.data if choice == "gemv" and p.panels is not None
                  else p.plain if choice == "torch" else None for p in self.projections]
        return [c for c in copies if c is not None]

    @classmethod
    def supports(cls, model) -> bool:
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
        return (model.device.type == "cpu" and cfg.model_type in MODEL_TYPES
                and cfg.hidden_act == "silu" and set(layer_types) == {"full_attention"})

    def _choice(self, rows: int) -> str:
        """The candidate measured fastest at this row count (the last class's past the table)."""
        return self._by_rows[rows] if rows < len(self._by_rows) else self.choices[-1]

    def _project(self, x: torch.Tensor, p: Projection) -> torch.Tensor:
        """x (rows, in) times one projection, by the candidate measured fastest at this row count."""
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, p.n)
        choice = self._choice(rows)
        if choice == "gemv":
            if p.gate_up_inter:  # its panels interleave gate and up: a plain product's columns would be permuted
                raise ValueError("interleaved gate/up panels are read by _gate_up_silu, not _project")
            return self.gemv(x.contiguous(), p.panels, p.bias, p.row_block, p.k_block, self.gemv_tuning)
        if choice == "onednn":
            return dispatch.onednn_linear(x, p.packed, p.bias)
        return F.linear(x, p.plain, p.bias)

    def _gate_up_silu(self, x: torch.Tensor, p: Projection, inter: int) -> torch.Tensor:
        """silu(x · gateᵀ) · (x · upᵀ): one call where the gemv runs these rows on interleaved panels,
        else the product by the candidate chosen and then the activation."""
        rows = x.shape[0]
        if p.gate_up_inter and self._choice(rows) == "gemv" and rows:
            return self.gate_up(x.contiguous(), p.panels, p.row_block, p.k_block, self.gemv_tuning)
        return self.ops.silu_mul(self._project(x, p), inter)

    def _gemv_projector(self):
        """Where the gemv runs every row count: ``_project`` without its per-call choice (a step
        makes ~100 of them); else None. Never ``self._project`` itself: a bound method kept on self
        is a reference cycle, which the collector no longer frees once the runner froze it
        (engine.model.runner.freeze_startup_objects)."""
        gemv, tuning = self.gemv, self.gemv_tuning
        if gemv is None or set(self.choices) != {"gemv"}:
            return None

        def project(x: torch.Tensor, p: Projection) -> torch.Tensor:
            if p.gate_up_inter:  # as _project
                raise ValueError("interleaved gate/up panels are read by _gate_up_silu, not the projector")
            if x.shape[0] == 0:
                return x.new_empty(0, p.n)
            return gemv(x.contiguous(), p.panels, p.bias, p.row_block, p.k_block, tuning)

        return project

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch, cache,
                 rows: torch.Tensor | None) -> torch.Tensor:
        h = (F.embedding(input_ids[0], self.embed) if self.embed is not None
             else kernels.panel_rows(self.embed_panels, input_ids[0]))  # (T, hidden)
        cos, sin = self._cos_sin(h, positions, cache.keys[0].shape[-2])  # (T, D)
        t = h.shape[0]
        d = self.head_dim
        project, ops = self._projector or self._project, self.ops
        # the attention kernel, where it attends every token of the step: called straight, as
        # ragged_attention would call it (every packed token a row of its slot); a step whose phases
        # attend differently goes through ragged_attention
        kernel = batch.kernel if batch.kernel_attends_all else None
        slots, positions, kernel_slots, lens = batch.write_slots, batch.write_positions, batch.kernel_slots, batch.kernel_lens
        rows_choice = self._choice(t)
        if self.stack is not None and kernel is self._attention and rows_choice == "gemv" and ops is self._stack_ops:
            # every layer in one C++ call: the same kernels in the same order as the loop below
            delta = self.stack.run(h, cos, sin, cache.keys, cache.values, slots, positions, kernel_slots, lens)
            return self._head(h, delta, rows)
        delta = None  # what the previous layer's MLP adds to h
        for i, scaling, nq, nkv, ln1, eps1, qkv, qk_norm, o, ln2, eps2, gu, inter, down in self.layers:
            k_store, v_store = cache.keys[i], cache.values[i]
            x = ops.add_rms_norm(h, delta, ln1, eps1)
            q = ops.rotary_kv(project(x, qkv), cos, sin, nq // d, nkv // d, k_store, v_store,
                              slots, positions, *qk_norm)  # (T, H, D)
            if kernel is not None:
                attn = kernel(q.contiguous(), k_store, v_store, kernel_slots, lens,
                              scaling if scaling is not None else d ** -0.5)
            else:
                attn, _ = ragged_attention(None, q.transpose(0, 1)[None], k_store, v_store, batch, scaling=scaling)
            x = ops.add_rms_norm(h, project(attn.reshape(t, -1), o), ln2, eps2)
            delta = project(self._gate_up_silu(x, gu, inter), down)
        return self._head(h, delta, rows)

    def _cos_sin(self, h: torch.Tensor, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's cos and sin at these positions: rows of a table it made once for every
        position the KV cache holds (2 · max_len · head_dim values), where its frequencies are fixed
        (``rope_is_fixed``: a row then depends on its position alone, so the same bits).

        Why: the module makes them anew each step in ~8 small ops (product, concatenation, cos, sin,
        scaling, casts), which after a step's weight sweep run with cold caches, several times what
        two row gathers cost (docs/architecture.md has the figures)."""
        if not self._rope_fixed:
            cos, sin = self.rotary(h, positions[None])
            return cos[0], sin[0]
        table = self._rope_table
        if table is None or table[0].shape[0] < max_len or table[0].dtype != h.dtype:
            cos, sin = self.rotary(h, torch.arange(max_len, device=h.device)[None])
            table = self._rope_table = (cos[0], sin[0])
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _head(self, h: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The last residual add, the final norm and the lm_head, for the sampled rows: row-wise from
        here on, so those rows alone give the same logits."""
        if rows is not None:
            h, delta = h[rows], delta[rows]
        return (self._projector or self._project)(self.ops.add_rms_norm(h, delta, self.norm_w, self.norm_eps),
                                                  self.lm)
