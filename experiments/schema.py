"""Typed Hydra schemas: each app's dataclass (built from the engine's own frozen config
dataclasses) goes into the ConfigStore, so a misspelt key or a wrong type fails at compose time,
and ``__post_init__`` checks values when the config becomes objects."""

from __future__ import annotations

import logging

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

log = logging.getLogger("miniserve.config")


def _writable(node: DictConfig | ListConfig) -> DictConfig | ListConfig:
    """Frozen dataclasses become read-only nodes; Hydra must still apply overrides to them."""
    OmegaConf.set_readonly(node, None)
    children = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in children:
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            _writable(child)
        else:
            child._set_flag("readonly", None)
    return node


def register(name: str, schema: type) -> None:
    ConfigStore.instance().store(name=name, node=_writable(OmegaConf.structured(schema)))


def to_object(cfg: DictConfig, *, runs_model: bool = False):
    """The composed config as the schema's dataclasses, with their value checks run. An app that
    runs the model (``runs_model``) gets ``model.device``/``model.dtype`` resolved here, once, for
    this machine: an absent device fails before anything starts, and the processes it spawns
    inherit one concrete choice."""
    app = OmegaConf.to_object(cfg)
    if runs_model:
        from engine.model.device import resolve  # imports torch

        app.model = resolve(app.model)
    scheduler, model = getattr(app, "scheduler", None), getattr(app, "model", None)
    if scheduler is not None and model is not None:  # the same limit for the real engine and the simulator
        from engine.core.model_shape import max_positions

        within = scheduler.within(max_positions(model))
        if within is not scheduler:
            log.warning("scheduler.max_model_len=%d is longer than the model's %d positions "
                        "(max_position_embeddings): requests are limited to %d tokens",
                        scheduler.max_model_len, within.max_model_len, within.max_model_len)
            app.scheduler = within
    return app

