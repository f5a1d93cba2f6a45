"""Measure per-call cost by batch shape on this device and fit the cost model the simulator uses."""

import engine  # noqa: F401  first, so a compiled build of calibration.cost_model is found (engine/compiled)
