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
