"""The compiled core (engine/compiled): the same simulation as plain Python, and used only when it
was built from the sources in the checkout."""

import importlib.machinery
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import engine.compiled as compiled

ROOT = Path(__file__).resolve().parents[1]

# a run that touches every compiled module: chunked prefill, preemption (few blocks), repeated
# decode steps, compact and full records; prints what must not depend on the build
RUN = """
import hashlib, importlib, json, sys
import engine.compiled as compiled
from engine.core.config import SchedulerConfig
from engine.observe.workload import LengthDist, WorkloadConfig
from sim import CostModelExecutor, simulate, workload_requests
from sim.executors import cost_model_from

cost = cost_model_from(step_overhead_s=1e-3, const=4e-3, prefill_tokens=2e-5, decode_tokens=5e-5,
                       decode_context=1e-8, prefill_attention=1e-9, num_requests=1e-5)
wl = WorkloadConfig(arrival="gamma", burstiness=0.5, num_requests=300, rate=40.0, seed=3,
                    prompt=LengthDist(kind="lognormal", value=300, sigma=0.6, max=1500),
                    output=LengthDist(kind="lognormal", value=60, sigma=0.6, max=400))
out = {"active": compiled.active(), "files": {m: importlib.import_module(m).__file__ for m in compiled.MODULES}}
for keep in (True, False):
    for cap in (8, 32):
        config = SchedulerConfig(name="continuous", max_num_seqs=cap, max_num_batched_tokens=512,
                                 long_prefill_token_threshold=256, num_kv_blocks=160, block_size=16,
                                 max_model_len=2048)
        result = simulate(workload_requests(wl)[0], config, lambda: CostModelExecutor(cost),
                          keep_token_times=keep, keep_steps=keep)
        digest = hashlib.sha256(repr([(s.plan._key(), float(s.start_s), s.end_s, s.model_s) for s in result.steps]).encode()).hexdigest()
        times = [r.token_times_s for r in result.records] if keep else None
        out[f"{keep}-{cap}"] = [result.metrics(), result.num_steps, digest, repr(times)]
print(json.dumps(out))
"""


def _run(env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra}
    done = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _can_build() -> str | None:
    """Why a build cannot be made on this machine (the compiled core is optional), or None."""
    if (compiled.compiled_dir() / compiled.source_key() / "manifest.json").is_file():
        return None
    if importlib.util.find_spec("mypyc") is None:
        return "mypyc is not installed (the dev extra brings it)"
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")[:1]
    if not compiler or shutil.which(compiler[0]) is None:
        return f"no C compiler ({compiler}) on this machine"
    return None


def test_the_compiled_core_runs_the_same_simulation_as_plain_python():
    reason = _can_build()
    if reason:
        pytest.skip(f"the compiled core cannot be built here: {reason}")
    compiled.build()  # a no-op where `make compiled` has built these sources (CI does)
    fast = _run({"MINISERVE_COMPILED": "1"})
    plain = _run({"MINISERVE_COMPILED": "0"})
    assert fast.pop("active") and not plain.pop("active")
    assert all(f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)) for f in fast.pop("files").values())
    assert all(f.endswith(".py") for f in plain.pop("files").values())
    assert fast == plain
    assert any(metrics[1] > 0 for metrics in fast.values())


def test_a_build_from_other_sources_is_never_used(tmp_path):
    stale = tmp_path / "0123456789abcdef"
    stale.mkdir()
    (stale / "manifest.json").write_text(json.dumps({"key": stale.name, "modules": {}}))
    done = subprocess.run([sys.executable, "-c", "import engine.compiled as c, engine.core.state as s; "
                           "print(c.active(), s.__file__); print(c.status())"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "MINISERVE_COMPILED_DIR": str(tmp_path), "MINISERVE_COMPILED": "1"})
    assert done.returncode == 0, done.stderr
    first, status = done.stdout.splitlines()
    active, file = first.split()
    assert active == "False" and file.endswith("state.py")
    assert status.startswith("not built for these sources")


def test_the_build_key_follows_every_compiled_source(tmp_path):
    import shutil
    for package in compiled.PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    key = compiled.source_key(tmp_path)
    assert key == compiled.source_key()
    for module in compiled.MODULES:  # one byte more in any of them: another build
        path = tmp_path / (module.replace(".", "/") + ".py")
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert compiled.source_key(tmp_path) != key, module
        path.write_bytes(original)


def _import_engine(cache: Path) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", "import engine.compiled as c, engine.core.state as s; "
                           "print(s.__file__); print(c.status())"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "MINISERVE_COMPILED_DIR": str(cache), "MINISERVE_COMPILED": "1"})
    assert done.returncode == 0, done.stderr
    file, status = done.stdout.splitlines()
    return file, status


def test_a_damaged_build_falls_back_to_python_and_says_why(tmp_path):
    build = tmp_path / compiled.source_key()
    build.mkdir()
    (build / "manifest.json").write_text("{not json")
    file, status = _import_engine(tmp_path)
    assert file.endswith("state.py") and status.startswith("not used (JSONDecodeError")
    (build / "manifest.json").write_text(json.dumps({"modules": {"engine.core.state": "gone.so"}}))
    file, status = _import_engine(tmp_path)
    assert file.endswith("state.py") and "lacks" in status
    # a library cut short: the dynamic linker would load it and die (SIGBUS); its size says so first
    modules = {m: f"{m}.so" for m in compiled.MODULES}
    for rel in modules.values():
        (build / rel).write_bytes(b"\x7fELF" + bytes(4092))
    (build / "manifest.json").write_text(json.dumps({"modules": modules, "bytes": {m: 65536 for m in modules}}))
    file, status = _import_engine(tmp_path)
    assert file.endswith("state.py") and "damaged" in status


def test_a_failed_build_is_not_retried_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISERVE_COMPILED_DIR", str(tmp_path))
    (tmp_path / f"{compiled.source_key()}.failed").write_text("RuntimeError: mypyc failed (1)\n")
    calls = []
    monkeypatch.setattr(compiled, "_build", lambda *a: calls.append(a))
    with pytest.raises(RuntimeError, match="earlier build for these sources failed"):
        compiled.build(retry_failed=False)
    assert calls == []
    monkeypatch.setattr(compiled, "_build", lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler")))
    with pytest.raises(RuntimeError, match="no compiler"):
        compiled.build()  # retried, and the marker says the new reason
    assert "no compiler" in (tmp_path / f"{compiled.source_key()}.failed").read_text()


def test_only_the_builds_used_last_are_kept(tmp_path):
    for i in range(12):
        build = tmp_path / f"{i:016x}"
        build.mkdir()
        (build / "manifest.json").write_text("{}")
        os.utime(build / "manifest.json", (1000 + i, 1000 + i))
    current = tmp_path / f"{11:016x}"
    compiled._prune(tmp_path, keep=current)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == compiled.KEEP_BUILDS
    assert left == [f"{i:016x}" for i in range(12 - compiled.KEEP_BUILDS, 12)]


def test_a_build_cut_short_is_not_taken_as_built(tmp_path):
    """build() returns an existing build only where its manifest reads and its libraries have their
    sizes: one cut short by a crash (an empty manifest, a truncated library) is built again."""
    build = tmp_path / "key"
    build.mkdir()
    (build / "m.so").write_bytes(bytes(100))
    (build / "manifest.json").write_text(json.dumps({"modules": {"m": "m.so"}, "bytes": {"m": 100}}))
    assert compiled._intact(build)
    (build / "m.so").write_bytes(bytes(10))
    assert not compiled._intact(build)
    (build / "manifest.json").write_text("")
    assert not compiled._intact(build)
