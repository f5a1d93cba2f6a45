"""Calibrate the cost model on this machine: python -m experiments.calibrate [model=tiny]
[calibration.grid=quick|full] [hydra.run.dir=DIR] → DIR/profile.json, DIR/calibration.png, a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from calibration.calibrate import CalibrationConfig
from engine.core.config import ModelConfig
from experiments.schema import register, to_object


@dataclass
class CalibrateApp:
    model: ModelConfig = field(default_factory=ModelConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


register("calibrate_schema", CalibrateApp)


def calibrate(app: CalibrateApp, out_dir: Path) -> Path:
    """Measure, fit, write the profile and the figure; print the error table. Returns the profile path."""
    from calibration.calibrate import run_calibration
    from calibration.report import error_table_text, plot_calibration

    result = run_calibration(app.model, app.calibration)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = out_dir / "profile.json"
    result.cost_model.save(profile)
    plot_calibration(result, out_dir / "calibration.png")
    print(error_table_text(result))
    print(f"\nwrote {profile} and {out_dir / 'calibration.png'} ({result.wall_s:.1f} s)")
    return profile


@hydra.main(version_base="1.3", config_path="../conf", config_name="calibrate")
def main(cfg) -> None:
    app: CalibrateApp = to_object(cfg, runs_model=True)
    calibrate(app, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
