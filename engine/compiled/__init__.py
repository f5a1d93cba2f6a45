"""An optional compiled build of the torch-free hot path: the same source, compiled to C by mypyc.

The simulator spends its time in the core's Python (state, lane, schedulers, plans), the cost
model and the request log; compiled, the same code runs ~3x faster (README, "Simulator speed").
``python -m engine.compiled`` (``make compiled``; ``make setup`` tries it) builds the modules in
``MODULES`` into ``$MINISERVE_COMPILED_DIR`` (default ~/.cache/miniserve/compiled)/<key>, where
the key hashes those modules' sources and the Python ABI. Importing ``engine`` puts a finder for
that build first on ``sys.meta_path`` only when a build for the current key exists, so editing a
source falls back to the plain Python (one warning says so) until the next build: a compiled
module never runs code other than what its ``.py`` says. ``MINISERVE_COMPILED=0`` turns it off.

Compiled, every type annotation of these modules is checked at run time and their classes (but
those derived from a Python class such as ``ABC``) take no attributes they do not declare: the test
suite runs under the build (CI builds it) and its simulator tests again without it. A build that
failed leaves ``<key>.failed`` beside the builds, so ``make setup`` does not retry it on every call
(``make compiled`` does); the eight builds used last are kept, older ones removed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what the simulator's steps run through. Package __init__s stay Python (they hold registries), and
# engine.core.config too: Hydra reads its dataclasses as structured configs, through their annotations
MODULES = (
    "engine.core.arrivals", "engine.core.block_pool", "engine.core.engine_core",
    "engine.core.lane", "engine.core.plan", "engine.core.request", "engine.core.sampling", "engine.core.state",
    "engine.core.scheduler.base", "engine.core.scheduler.continuous", "engine.core.scheduler.static",
    "calibration.cost_model", "sim.executors", "sim.records", "sim.router", "sim.simulator",
)
PACKAGES = ("engine", "calibration", "sim")  # copied whole into the build directory: mypy reads their imports

KEEP_BUILDS = 8  # other checkouts and branches share the cache: the ones used last stay

_active: dict[str, str] = {}  # module -> compiled file, once installed
_status = "not installed"


def compiled_dir() -> Path:
    configured = os.environ.get("MINISERVE_COMPILED_DIR")
    if configured:
        return Path(configured).expanduser().resolve()
    return Path.home() / ".cache" / "miniserve" / "compiled"


def source_key(root: Path = ROOT) -> str:
    """What a build is valid for: the compiled modules' sources (in ``root``), this interpreter's ABI
    and the machine's architecture (macOS's ABI tag names none: an arm64 build in a shared cache
    would otherwise be loaded by an x86-64 Python under Rosetta)."""
    digest = hashlib.sha256(sysconfig.get_config_var("EXT_SUFFIX").encode())
    digest.update(f"{sys.platform} {platform.machine()}".encode())
    digest.update(" ".join(MODULES).encode())
    for package in PACKAGES:  # every source mypy reads: compiled code fixes the types of what it imports
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class _CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the build's extension modules (the compiled ones and mypyc's shared library)."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def find_spec(self, fullname, path, target=None):
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, file)
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def install() -> bool:
    """Use the build for the current sources, if there is one (engine/__init__.py calls this
    before any compiled module can be imported). True when installed; ``status()`` says why not."""
    global _status
    if _active:
        return True
    if os.environ.get("MINISERVE_COMPILED", "1") == "0":
        _status = "off (MINISERVE_COMPILED=0): plain Python"
        return False
    try:  # nothing here may break `import engine`: the plain Python is always there
        return _install()
    except Exception as error:  # an unreadable cache, no home directory, a damaged manifest
        _status = f"not used ({type(error).__name__}: {error}): plain Python"
        return False


def _install() -> bool:
    global _status
    root = compiled_dir()
    build = root / source_key()
    manifest = build / "manifest.json"
    if not manifest.is_file():
        stale = root.is_dir() and any(root.glob("*/manifest.json"))
        _status = (f"not built for these sources (the builds in {root} are from other sources): plain Python "
                   "until `make compiled`" if stale else "not built: plain Python (`make compiled` builds it)")
        return False
    already = [m for m in MODULES if m in sys.modules]
    if already:  # imported as Python before engine: mixing the two builds' classes would fail
        _status = f"not used: {', '.join(already)} imported before engine; plain Python"
        return False
    recorded = json.loads(manifest.read_text())
    files = {module: str(build / rel) for module, rel in recorded["modules"].items()}
    missing = [m for m in MODULES if m not in files or not os.path.isfile(files[m])]
    if missing:
        raise FileNotFoundError(f"the build in {build} lacks {', '.join(missing)}")
    # a library cut short (a crash or a full disk while it was copied) is loaded by the dynamic
    # linker regardless and kills the process (SIGBUS) at the first import: sizes are checked first
    damaged = _cut_short(build, recorded)
    if damaged:
        raise OSError(f"the build in {build} is damaged ({', '.join(damaged)}: not the size it was built at)")
    try:
        os.utime(manifest)  # last used: what pruning keeps
    except OSError:  # a read-only cache is fine
        pass
    sys.meta_path.insert(0, _CompiledFinder(files))
    _active.update(files)
    _status = f"compiled ({build})"
    return True


def status() -> str:
    """One line for an app's log: whether the core runs compiled, and if not, why."""
    if _active and not active():
        return f"{_status}, but some modules were imported as Python"
    return _status


def active() -> bool:
    """Whether this process runs the compiled modules."""
    return bool(_active) and all(_is_compiled(sys.modules.get(m)) for m in MODULES if m in sys.modules)


def _is_compiled(module) -> bool:
    return module is not None and str(getattr(module, "__file__", "")).endswith(tuple(
        importlib.machinery.EXTENSION_SUFFIXES))


def build(python: str = sys.executable, retry_failed: bool = True) -> Path:
    """Compile ``MODULES`` with mypyc (needs mypy: ``pip install -e '.[dev]'``) into the build
    directory for the current sources; returns it. Sources are copied to a scratch directory
    first, so no extension module ever lands beside a ``.py`` in the checkout. A failure is
    remembered in ``<key>.failed``; ``retry_failed=False`` raises it again without compiling."""
    key = source_key()
    root = compiled_dir()
    out = root / key
    failed = root / f"{key}.failed"
    if (out / "manifest.json").is_file():
        if _intact(out):
            return out
        import shutil

        shutil.rmtree(out, ignore_errors=True)  # cut short by a crash: built again
    if not retry_failed and failed.is_file():
        raise RuntimeError(f"an earlier build for these sources failed ({failed}; `make compiled` retries):\n"
                           + failed.read_text()[-2000:])
    try:
        _build(python, key, out)
    except Exception as error:
        _ensure(root)
        failed.write_text(f"{type(error).__name__}: {error}\n")
        raise
    failed.unlink(missing_ok=True)
    _prune(root, keep=out)
    return out


def _build(python: str, key: str, out: Path) -> None:
    import shutil
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="miniserve-mypyc-") as tmp:
        scratch = Path(tmp)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, scratch / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
        sources = [module.replace(".", "/") + ".py" for module in MODULES]
        done = subprocess.run([python, "-m", "mypyc", "--ignore-missing-imports", "--follow-imports=silent",
                               *sources], cwd=scratch, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"mypyc failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
        modules = {}
        staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_ensure(out.parent)))
        try:
            for file in scratch.rglob("*"):
                rel = file.relative_to(scratch)
                if rel.parts[0] == "build" or not file.name.endswith(suffixes):
                    continue
                name = ".".join(rel.parts[:-1] + (file.name.split(".", 1)[0],))
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(file, staging / rel)
                with open(staging / rel, "rb") as copied:  # on disk before the build is renamed in
                    os.fsync(copied.fileno())
                modules[name] = str(rel)
            missing = [m for m in MODULES if m not in modules]
            if missing:
                raise RuntimeError(f"mypyc built no extension for {missing}")
            sizes = {name: (staging / rel).stat().st_size for name, rel in modules.items()}
            with open(staging / "manifest.json", "w") as manifest:
                manifest.write(json.dumps({"key": key, "modules": modules, "bytes": sizes}, indent=1))
                manifest.flush()
                os.fsync(manifest.fileno())
            staging.rename(out)  # atomic: a reader sees a whole build or none
        except OSError:
            if not (out / "manifest.json").is_file():
                raise
            # another process built the same sources meanwhile: theirs is as good
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _cut_short(build: Path, recorded: dict) -> list[str]:
    """The libraries of a build whose size is not the one its manifest recorded."""
    return [m for m, size in recorded["bytes"].items() if (build / recorded["modules"][m]).stat().st_size != size]


def _intact(build: Path) -> bool:
    """Whether a build's manifest reads and every library in it has the size it was built at."""
    try:
        return not _cut_short(build, json.loads((build / "manifest.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the ``KEEP_BUILDS`` builds used last (``install`` touches a build's manifest)."""
    import shutil

    builds = sorted((m.parent for m in root.glob("*/manifest.json") if m.parent != keep),
                    key=lambda b: (b / "manifest.json").stat().st_mtime, reverse=True)
    for old in builds[KEEP_BUILDS - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
