"""miniserve's real engine.

The scheduling core (``request``, ``plan``, ``state``, ``scheduler``, ``config``, ``metrics``) is
torch-free so the simulator can run the very same code; torch lives in ``model_runner`` and below.
"""
