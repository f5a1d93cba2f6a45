"""Build the Qwen model: a local checkpoint, or a bundled real config with seeded random weights."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.attention import ATTN_IMPLEMENTATION
from engine.config import ModelConfig

CONFIG_DIR = Path(__file__).parent / "configs"
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
    """Hash of what determines cost: architecture shapes and dtype (not weights, not seed)."""
    cfg = load_hf_config(model_config).to_dict()
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    shape = {k: cfg.get(k) for k in keys}
    shape["dtype"] = model_config.dtype
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def load_model(model_config: ModelConfig) -> tuple[PreTrainedModel, object | None]:
    """The model (eval, requested dtype, packed ragged attention) and its tokenizer if it has one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
    return model.eval(), tokenizer
