"""The scheduler core must import and run with torch (and simpy) unavailable."""

import subprocess
import sys

CODE = """
import sys
sys.modules['torch'] = None      # any 'import torch' now raises ImportError
sys.modules['simpy'] = None
import time
sys.modules['time'] = None       # and no clock either
import engine.core.scheduler, engine.core.state, engine.core.plan, engine.core.request, engine.core.config, engine.core.arrivals
from engine.core.config import SchedulerConfig
from tests.helpers import drain, create_requests
plans, state = drain(SchedulerConfig(name='continuous'), create_requests(16))
assert sum(r.num_output_tokens for r in state.finished) == 160
assert not any(m in sys.modules and sys.modules[m] is not None for m in ('torch', 'simpy', 'transformers'))
print('ok', len(plans))
"""


def test_scheduler_core_imports_without_torch_simpy_or_clock():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok 28"


SIMULATE = """
import runpy, sys
sys.modules['torch'] = None
sys.modules['transformers'] = None
sys.argv = ['simulate', 'model=tiny', 'calibration.profile={profile}', 'workload=poisson',
            'workload.num_requests=50', 'workload.rate=20', 'hydra.run.dir={out}']
runpy.run_module('experiments.simulate', run_name='__main__', alter_sys=True)
"""


def test_a_simulation_runs_with_torch_and_transformers_blocked(tmp_path):
    from engine.core.config import ModelConfig
    from engine.core.model_shape import config_fingerprint
    from sim.executors import cost_model_from

    profile = tmp_path / "profile.json"
    cost_model_from(step_overhead_s=2e-4, fingerprint=config_fingerprint(ModelConfig(name="tiny")), const=2e-3,
                    decode_tokens=1e-4).save(profile)
    code = SIMULATE.format(profile=profile, out=tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "completed 50 requests" in out.stdout
    assert (tmp_path / "run" / "metrics.json").is_file()
