"""results.json: vllm bench serve --save-result's keys and units; --goodput's syntax; vLLM's flags."""

import json
import math

import pytest

from engine.loadgen.vllm_args import vllm_to_overrides
from engine.observe.metrics import RequestRecord, summarize
from engine.observe.results import Goodput, vllm_results, write_results_json
from engine.observe.workload import WorkloadConfig

# The keys vLLM's serve.py writes for a generation benchmark (per-request lists left out).
VLLM_KEYS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput",
             *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99"))}


def check_vllm_keys(results: dict) -> None:
    """Shared with the app tests: every vLLM key is there, with JSON-able values."""
    assert VLLM_KEYS <= results.keys(), VLLM_KEYS - results.keys()
    json.dumps(results, allow_nan=False)


def two_requests():
    return [RequestRecord("a", 0.0, 0.0, (0.1, 0.2, 0.3), 10, 3),       # TTFT 100 ms, TPOT 100 ms, E2E 300 ms
            RequestRecord("b", 0.5, 0.5, (1.5, 1.6), 20, 2)]            # TTFT 1000 ms, TPOT 100 ms, E2E 1100 ms


def test_keys_units_and_goodput(tmp_path):
    metrics = summarize(two_requests(), duration_s=2.0, **Goodput.parse("ttft:500 tpot:150").seconds())
    wl = WorkloadConfig(arrival="gamma", num_requests=2, rate=4.0, burstiness=0.5)
    r = write_results_json(tmp_path / "results.json", metrics, backend="miniserve-sim", label="continuous",
                           model_id="tiny", workload=wl, goodput=Goodput.parse("ttft:500 tpot:150"))
    assert json.loads((tmp_path / "results.json").read_text()) == r
    check_vllm_keys(r)
    assert r["mean_ttft_ms"] == pytest.approx(550.0) and r["median_ttft_ms"] == pytest.approx(550.0)
    assert r["std_ttft_ms"] == pytest.approx(450.0) and r["mean_tpot_ms"] == pytest.approx(100.0)
    assert r["p99_e2el_ms"] == pytest.approx(1092.0)  # numpy's linear percentile between 300 and 1100
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.5 and r["total_token_throughput"] == 17.5
    assert r["request_goodput"] == 0.5  # only a meets TTFT <= 500 ms
    assert (r["request_rate"], r["burstiness"], r["max_concurrency"], r["num_prompts"]) == (4.0, 0.5, None, 2)


def test_without_slos_goodput_is_null_and_an_e2el_slo_counts():
    recs = two_requests()
    assert vllm_results(summarize(recs, 2.0), backend="b", label="l", model_id="m", num_prompts=2, traffic={},
                        goodput=Goodput())["request_goodput"] is None
    assert summarize(recs, 2.0, **Goodput.parse("e2el:1000").seconds())["goodput_req_s"] == 0.5


def test_traffic_is_stated_as_vllm_does():
    from engine.observe.results import offered_load
    assert offered_load(WorkloadConfig())["request_rate"] == "inf"  # the burst
    assert offered_load(WorkloadConfig(arrival="closed_loop", concurrency=8)) == {
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 8}


@pytest.mark.parametrize("spec, error", [("ttft500", "KEY:VALUE"), ("latency:5", "unknown metric"),
                                         ("ttft:fast", "number of milliseconds"), ("tpot:-1", ">= 0")])
def test_bad_goodput_is_a_clear_error(spec, error):
    with pytest.raises(ValueError, match=error):
        Goodput.parse(spec)


def test_goodput_round_trips_through_its_spec():
    g = Goodput.parse("ttft:500, tpot:50")
    assert (g.ttft_ms, g.tpot_ms, g.e2el_ms) == (500.0, 50.0, None) and Goodput.parse(g.spec()) == g
    assert not Goodput.parse(None) and math.isclose(g.seconds()["slo_ttft_s"], 0.5)


def test_vllm_flags_become_overrides():
    argv = ["--base-url", "http://h:1", "--request-rate", "4", "--burstiness", "0.5", "--num-prompts=20",
            "--max-concurrency", "8", "--goodput", "ttft:500", "tpot:50", "--ignore-eos", "--model", "x",
            "--save-result", "hydra.run.dir=/tmp/x", "--random-input-len", "256"]
    assert vllm_to_overrides(argv) == [
        "bench.url=http://h:1", "workload.num_requests=20", "bench.max_concurrency=8",
        "bench.goodput='ttft:500 tpot:50'", "bench.ignore_eos=true", "hydra.run.dir=/tmp/x",
        "workload.prompt.value=256", "workload.prompt.kind=fixed",
        "workload.arrival=gamma", "workload.rate=4", "workload.burstiness=0.5"]
    assert vllm_to_overrides(["bench.url=u", "--port", "9000"]) == ["bench.url=u", "bench.url=http://127.0.0.1:9000"]
    # as in vLLM, --base-url wins over --host and --port
    assert vllm_to_overrides(["--port", "9000", "--base-url", "http://h:1"]) == ["bench.url=http://h:1"]
    assert vllm_to_overrides(["--request-rate", "inf"]) == ["workload.arrival=burst"]
    with pytest.raises(ValueError, match="unknown option --dataset-path"):
        vllm_to_overrides(["--dataset-path", "x.json"])
    with pytest.raises(ValueError, match="--num-prompts needs a value"):
        vllm_to_overrides(["--num-prompts"])
    # Hydra's own flags stay Hydra's, as in every other app: --help, --cfg job, --multirun
    assert vllm_to_overrides(["--cfg", "job", "--num-prompts", "5"]) == ["--cfg", "job", "workload.num_requests=5"]
    assert vllm_to_overrides(["--help"]) == ["--help"]
    assert vllm_to_overrides(["--multirun", "bench.max_concurrency=1,2"]) == ["--multirun", "bench.max_concurrency=1,2"]
