"""Build the Qwen model: a local checkpoint, or a bundled real config with seeded random weights."""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.core.config import ModelConfig
from engine.core import model_shape
from engine.core.model_shape import config_path, read_config_json
from engine.model.attention import ATTN_IMPLEMENTATION
from engine.model.device import resolve
from engine.model.kernels import dispatch
from engine.model.tokenizer import byte_tokenizer
from engine.model.weights import release, trim_heap

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_config(model_config: ModelConfig) -> PretrainedConfig:
    """transformers' config for the model; the JSON is found and its model type checked by
    ``engine.core.model_shape``, which also gives the fingerprint (torch-free)."""
    config_json = read_config_json(model_config)
    if model_config.path is not None:
        return AutoConfig.from_pretrained(config_path(model_config).parent, local_files_only=True)
    return AutoConfig.for_model(**config_json)


def config_fingerprint(model_config: ModelConfig) -> str:
    """engine.core.model_shape.config_fingerprint with ``dtype=auto`` resolved for
    ``model_config.device`` on this machine (the dtype the runner will build)."""
    if model_config.dtype == "auto":
        model_config = resolve(model_config)
    return model_shape.config_fingerprint(model_config)


def pack_linear_weights(model: PreTrainedModel) -> int:
    """Give every Linear (lm_head included) a copy of its weight pre-packed for oneDNN, and run it
    through oneDNN's linear with that copy: bf16 F.linear on this CPU repacks or falls back on
    every call. Each source weight is then released (``engine.model.weights``: shapes and counts
    stay), one layer at a time, except a tied lm_head's, which is the embedding the model still
    reads; returns the number of layers packed."""
    def onednn_forward(packed: torch.Tensor, bias: torch.Tensor | None):
        # a closure over the tensors, not a method bound to the Linear: that would be a reference
        # cycle, never freed once the runner froze it (engine.model.runner.freeze_startup_objects)
        def forward(x: torch.Tensor) -> torch.Tensor:
            y = dispatch.onednn_linear(x.reshape(-1, x.shape[-1]), packed, bias)
            return y.view(*x.shape[:-1], y.shape[-1])

        return forward

    if model.device.type != "cpu" or not dispatch.onednn_available(model.dtype):
        return 0  # oneDNN packing is a CPU path (bf16 only where oneDNN has it); elsewhere the stock linears run
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for m in linears:
        m.packed_weight = dispatch.onednn_pack(m.weight)
        m.forward = onednn_forward(m.packed_weight, m.bias)
        if m.weight.data_ptr() not in embeddings:
            release(m.weight)
            trim_heap()
    return len(linears)


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def has_weights(path: str) -> bool:
    """Whether a checkpoint directory holds weights, or only a config.json (a shape to run with
    seeded random weights: cost depends on shapes, not values)."""
    from pathlib import Path

    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in Path(path).iterdir())


def load_model(model_config: ModelConfig) -> tuple[PreTrainedModel, object | None]:
    """The model (eval, requested dtype, on the requested device, packed ragged attention) and its
    tokenizer: the checkpoint's if it has one, the built-in byte-level one for the bundled configs
    and for a ``model.path`` that holds only a config.json (seeded random weights of that shape).
    ``auto`` device and dtype are resolved here (engine/model/device.py)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_config = resolve(model_config)
    if model_config.num_threads is not None:
        torch.set_num_threads(model_config.num_threads)
    dtype = TORCH_DTYPES[model_config.dtype]
    config = load_hf_config(model_config)
    tokenizer = None
    if model_config.path is not None and has_weights(model_config.path):
        model = AutoModelForCausalLM.from_pretrained(
            model_config.path, config=config, dtype=dtype, local_files_only=True,
            attn_implementation=ATTN_IMPLEMENTATION)
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model_config.path, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
    else:  # a bundled config, or a directory with only a config.json: seeded random weights of its shape
        torch.manual_seed(model_config.seed)
        config._attn_implementation = ATTN_IMPLEMENTATION
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        eos = config.eos_token_id if isinstance(config.eos_token_id, int) else None
        tokenizer = byte_tokenizer(config.vocab_size, eos)
    return model.to(model_config.device).eval(), tokenizer
