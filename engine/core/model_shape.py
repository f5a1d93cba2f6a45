"""A model's cost-determining shape, read from its config JSON without torch or transformers.

The simulator checks a calibration profile against the model it is asked to simulate; that check
only needs the architecture's shapes, so it reads the bundled ``engine/configs/<name>.json`` or a
checkpoint's ``config.json`` directly and stays torch-free (start-up in well under a second).
``engine.model.loader`` uses the same functions, so there is one fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.core.config import ModelConfig

CONFIG_DIR = Path(__file__).parents[1] / "configs"
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
# What transformers' Qwen2Config / Qwen3Config put in ``to_dict()`` for a key the JSON leaves out
# (Qwen2 has no head_dim attribute unless one is given; Qwen3 defaults it to 128).
_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen2": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "head_dim": None, "vocab_size": 151936, "tie_word_embeddings": False,
              "max_position_embeddings": 32768},
    "qwen3": {"hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
              "max_position_embeddings": 32768},
}


def config_path(model_config: ModelConfig) -> Path:
    """The JSON that defines the model: the checkpoint's config.json or a bundled config."""
    if model_config.path is not None:
        path = Path(model_config.path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model.path {model_config.path} has no config.json "
                                    "(a local checkpoint directory is needed)")
        return path
    return CONFIG_DIR / f"{model_config.name}.json"


def read_config_json(model_config: ModelConfig) -> dict:
    """The config JSON as a dict, its model type checked."""
    path = config_path(model_config)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    return config


def model_shape(model_config: ModelConfig) -> dict:
    """The keys that determine a call's cost, with transformers' defaults for missing ones."""
    config = read_config_json(model_config)
    shape = {k: config.get(k, _DEFAULTS[config["model_type"]].get(k)) for k in SHAPE_KEYS}
    if shape["num_key_value_heads"] is None:  # an explicit null means plain multi-head attention, as in transformers
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    return shape


def max_positions(model_config: ModelConfig) -> int:
    """The longest sequence the model has positions for (``max_position_embeddings``; transformers'
    default where the JSON leaves it out, as the runner gets it)."""
    config = read_config_json(model_config)
    return config.get("max_position_embeddings", _DEFAULTS[config["model_type"]]["max_position_embeddings"])


def config_fingerprint(model_config: ModelConfig) -> str:
    """Hash of what determines cost: architecture shapes and dtype (not weights, not seed)."""
    shape = model_shape(model_config)
    shape["dtype"] = model_config.dtype
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
