"""``vllm bench serve`` flags as Hydra overrides, so a vLLM user's command line carries over.

    python -m experiments.bench --base-url http://127.0.0.1:8000 --request-rate 4 --burstiness 0.5 \\
        --num-prompts 200 --max-concurrency 8 --goodput ttft:500 tpot:50 --random-input-len 256

Hydra-style arguments (``key=value``) and Hydra's own flags (``--help``, ``--cfg job``, ``--multirun``,
...) pass through untouched and may be mixed in. Flags that change nothing here (``--model``,
``--save-result``, ...) are accepted and ignored; any other flag is an error naming the ones understood.
"""

from __future__ import annotations

VALUE_FLAGS = {  # vLLM flag -> our override key
    "--base-url": "bench.url",
    "--num-prompts": "workload.num_requests",
    "--max-concurrency": "bench.max_concurrency",
    "--seed": "workload.seed",
    "--random-input-len": "workload.prompt.value",
    "--input-len": "workload.prompt.value",
    "--random-output-len": "workload.output.value",
    "--output-len": "workload.output.value",
    "--result-dir": "hydra.run.dir",
}
SWITCHES = {"--ignore-eos": "bench.ignore_eos=true", "--disable-tqdm": "bench.progress=false"}
IGNORED_WITH_VALUE = ("--model", "--served-model-name", "--tokenizer", "--dataset-name", "--backend",
                      "--endpoint", "--label", "--result-filename", "--percentile-metrics", "--metric-percentiles")
IGNORED_SWITCHES = ("--save-result", "--save-detailed", "--skip-tokenizer-init")
HANDLED = ("--host", "--port", "--request-rate", "--burstiness", "--goodput")
# Hydra's own command-line flags (hydra/_internal/utils.py get_args_parser): every Hydra app takes them
HYDRA_FLAGS = ("--help", "--hydra-help", "--version", "--cfg", "--package", "--resolve", "--run", "--multirun",
               "--shell-completion", "--config-path", "--config-name", "--config-dir", "--experimental-rerun",
               "--info")


def _split(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(flag, values) in order; ``--flag=value`` is the same as ``--flag value``."""
    out: list[tuple[str, list[str]]] = []
    for arg in argv:
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            out.append((flag, [value] if eq else []))
        elif out and out[-1][0] != "":
            out[-1][1].append(arg)
        else:
            out.append(("", [arg]))
    return out


def vllm_to_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides for a command line that may hold ``vllm bench serve`` flags."""
    overrides: list[str] = []
    host, port, rate, burstiness = None, None, None, None
    for flag, values in _split(argv):
        if flag == "":  # Hydra arguments (key=value, -m, ...)
            overrides += values
            continue
        if flag in HYDRA_FLAGS:  # its values (--cfg job) and the overrides after it are Hydra's too
            overrides += [flag, *values]
            continue
        if flag in SWITCHES or flag in IGNORED_SWITCHES:
            if flag in SWITCHES:
                overrides.append(SWITCHES[flag])
            if values:  # a switch took no value: what follows is Hydra's
                overrides += values
            continue
        known = (*VALUE_FLAGS, *IGNORED_WITH_VALUE, *HANDLED)
        if flag not in known:
            raise ValueError(f"unknown option {flag}; vLLM options understood: "
                             f"{', '.join(sorted((*known, *SWITCHES, *IGNORED_SWITCHES)))}")
        if not values:
            raise ValueError(f"{flag} needs a value")
        if flag == "--goodput":  # nargs='+' as in vLLM: every KEY:VALUE up to the next option
            slos = [v for v in values if ":" in v and "=" not in v]
            overrides += [f"bench.goodput='{' '.join(slos)}'", *values[len(slos):]]
            continue
        value, rest = values[0], values[1:]
        overrides += rest
        if flag in VALUE_FLAGS:
            overrides.append(f"{VALUE_FLAGS[flag]}={value}")
            if flag in ("--random-input-len", "--input-len"):
                overrides.append("workload.prompt.kind=fixed")
            if flag in ("--random-output-len", "--output-len"):
                overrides.append("workload.output.kind=fixed")
        elif flag == "--host":
            host = value
        elif flag == "--port":
            port = value
        elif flag == "--request-rate":
            rate = value
        elif flag == "--burstiness":
            burstiness = value
    # vLLM's defaults: 127.0.0.1, 8000; --base-url, where given, wins over both (as in vLLM)
    base_url = any(arg.split("=", 1)[0] == "--base-url" for arg in argv)
    if (host is not None or port is not None) and not base_url:
        overrides.append(f"bench.url=http://{host or '127.0.0.1'}:{port or 8000}")
    if rate is not None and rate.lower() != "inf":
        overrides += [f"workload.arrival={'poisson' if burstiness in (None, '1', '1.0') else 'gamma'}",
                      f"workload.rate={rate}"]
        if burstiness is not None:
            overrides.append(f"workload.burstiness={burstiness}")
    elif rate is not None:
        overrides.append("workload.arrival=burst")
    return overrides
