"""miniserve's real engine, in layers that import only downward.

- ``core``: torch-free — config, request, plan, state (+ KV blocks and the decode lane), the
  schedulers, arrivals and the one step loop. The simulator runs exactly this code.
- ``observe``: metrics, traces and workloads, shared by the engine, the simulator and the apps.
- ``model``: torch — model loading, device choice, attention, kernels, ``ModelRunner`` (an executor).
- ``serving``: the HTTP server around the step loop; ``loadgen``: the client that drives it.
- ``llm_engine``: the step loop with a ``ModelRunner`` on the wall clock.
"""

from engine.compiled import install as _install_compiled

_install_compiled()  # a compiled build of the core, if one matches these sources (engine/compiled)
