"""Measure per-call cost by batch shape on this device and fit the cost model the simulator uses."""
