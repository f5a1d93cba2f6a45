"""Build the Qwen model: a local checkpoint, or a bundled real config with seeded random weights."""

from __future__ import annotations

import hashlib
import json
import os
import types
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.model.attention import ATTN_IMPLEMENTATION
from engine.core.config import ModelConfig
from engine.model.device import resolve

CONFIG_DIR = Path(__file__).parents[1] / "configs"
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_config(model_config: ModelConfig) -> PretrainedConfig:
    if model_config.path is not None:
        path = Path(model_config.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path} has no config.json (a local checkpoint directory is needed)")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        config = AutoConfig.for_model(**json.loads((CONFIG_DIR / f"{model_config.name}.json").read_text()))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    return config


def config_fingerprint(model_config: ModelConfig) -> str:
    """Hash of what determines cost: architecture shapes and dtype (not weights, not seed, not the
    device: a profile from another device is warned about, not refused). ``dtype=auto`` is
    resolved for ``model_config.device`` on this machine."""
    if model_config.dtype == "auto":
        model_config = resolve(model_config)
    cfg = load_hf_config(model_config).to_dict()
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    shape = {k: cfg.get(k) for k in keys}
    shape["dtype"] = model_config.dtype
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def pack_linear_weights(model: PreTrainedModel) -> int:
    """Give every Linear (lm_head included) a copy of its weight pre-packed for oneDNN, and run it
    through oneDNN's linear with that copy: bf16 F.linear on this CPU repacks or falls back on
    every call. Parameters stay as they are (state dict, shapes, tied embeddings); returns the
    number of layers packed."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed_weight, self.bias,
                                               "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    if model.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0  # oneDNN packing is a CPU path; elsewhere the stock linears run
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
        m.forward = types.MethodType(forward, m)
    return len(linears)


def load_model(model_config: ModelConfig) -> tuple[PreTrainedModel, object | None]:
    """The model (eval, requested dtype, on the requested device, packed ragged attention) and its
    tokenizer if it has one. ``auto`` device and dtype are resolved here (engine/model/device.py)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_config = resolve(model_config)
    if model_config.num_threads is not None:
        torch.set_num_threads(model_config.num_threads)
    dtype = TORCH_DTYPES[model_config.dtype]
    config = load_hf_config(model_config)
    tokenizer = None
    if model_config.path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            model_config.path, config=config, dtype=dtype, local_files_only=True,
            attn_implementation=ATTN_IMPLEMENTATION)
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(model_config.path, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
    else:
        torch.manual_seed(model_config.seed)
        config._attn_implementation = ATTN_IMPLEMENTATION
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return model.to(model_config.device).eval(), tokenizer
