"""Start the server: ``python -m experiments.serve model=tiny scheduler=continuous server.port=8000``
(also the ``miniserve-serve`` console script). The scheduler and its limits are fixed at start."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import hydra

from engine.core.config import ModelConfig, SchedulerConfig
from engine.serving.app import ServerConfig, serve
from experiments.schema import register, to_object


@dataclass
class ServeApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


register("serve_schema", ServeApp)


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg) -> None:
    app: ServeApp = to_object(cfg, runs_model=True)
    logging.basicConfig(level=app.server.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    sys.exit(serve(app.model, app.scheduler, app.server))


if __name__ == "__main__":
    main()
