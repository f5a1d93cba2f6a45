"""The per-machine dispatch (engine/model/kernels/dispatch.py): the measured-faster candidate wins
(one candidate, so one layout of the weights, for every row count), a table cached for another machine is measured
again, and ``MINISERVE_DISPATCH`` forces a candidate or is refused."""

import json
import re
from dataclasses import asdict

import pytest
import torch

from engine.model import kernels
from engine.model.kernels import GemvTuning, dispatch
from tests.helpers import on_threads

KERNEL = {"decode": "kernel", "prefill": "kernel"}  # a table's attention: both phases by the kernel
SDPA = {"decode": "sdpa", "prefill": "sdpa"}
CLASSES = dispatch.ROW_CLASSES


def fake(per_class):
    return {r: per_class(r) for r in CLASSES}


def test_the_fastest_candidate_is_chosen():
    assert dispatch.choose({"kernel": 2e-4, "sdpa": 5e-4}) == "kernel"
    assert dispatch.choose({"kernel": 6e-4, "sdpa": 5e-4}) == "sdpa"


def test_one_candidate_serves_every_row_class_the_one_that_loses_least():
    # gemv fastest to 128 rows, oneDNN 30% faster from 256: gemv loses at most 1.43x, oneDNN 1.5x at one row
    def times(r):
        if r < 256:
            return {"gemv": 1.0 * r, "onednn": 1.5 * r, "torch": 2.0 * r}
        return {"gemv": 1.0 * r, "onednn": 0.7 * r, "torch": 2.0 * r}
    assert dispatch.choose_rows(fake(times)) == ["gemv"] * len(CLASSES)
    # oneDNN 2x faster from 256 rows: gemv's worst (2x) is now worse than oneDNN's (1.5x)
    assert dispatch.choose_rows(fake(lambda r: times(r) if r < 256 else {"gemv": 1.0, "onednn": 0.5})) \
        == ["onednn"] * len(CLASSES)
    # a tie on the worst ratio goes to the faster at one row (decode steps)
    assert dispatch.choose_rows(fake(lambda r: {"gemv": 1.0, "onednn": 1.1} if r == 1 else
                                     {"gemv": 1.1, "onednn": 1.0})) == ["gemv"] * len(CLASSES)


def test_a_product_takes_its_row_class():
    choices = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]
    assert [dispatch.choice_for_rows(choices, r) for r in (1, 2, 3, 4, 5, 64, 65, 512, 4096)] == \
        ["a", "b", "c", "c", "d", "g", "h", "j", "j"]


def test_row_block_follows_the_l2_and_never_splits_a_decode_step(monkeypatch):
    monkeypatch.setattr(dispatch, "cache_sizes", lambda: {"L2": 1 << 20})
    assert dispatch.row_block(896, 4) == 144  # 512 KiB / 3584 B = 146 rows, to a multiple of 8
    assert dispatch.row_block(4864, 4) == 64  # a wide x: still a decode step's 64 rows per pass
    monkeypatch.setattr(dispatch, "cache_sizes", lambda: {"L2": 2 << 20})
    assert dispatch.row_block(896, 4) == 288


def test_a_table_cached_for_another_machine_is_measured_again(tmp_path, monkeypatch):
    key = dispatch.machine_key()
    path = tmp_path / "dispatch.json"
    other = dict(key, cpu="Some Other CPU", detected=["avx2"])
    dispatch.save_table(path, dispatch.Table(other, {"float32": ["torch"] * len(CLASSES)}, {"float32": SDPA}))
    assert dispatch.load_table(path, key) is None
    assert dispatch.load_table(path, other).linear["float32"] == ["torch"] * len(CLASSES)
    assert dispatch.table_path(key) != dispatch.table_path(other)  # and it would not be looked up at all

    measured = []

    def measure(dtype, table):
        measured.append(dtype)
        table.linear["float32"], table.attention["float32"] = ["onednn"] * len(CLASSES), KERNEL
        return True  # settled: cached

    monkeypatch.setattr(dispatch, "table_path", lambda k: path)
    monkeypatch.setattr(dispatch, "measure", measure)
    monkeypatch.setattr(dispatch, "_TABLES", {})
    assert dispatch.table(torch.float32).linear["float32"] == ["onednn"] * len(CLASSES)
    assert measured == [torch.float32] and json.loads(path.read_text())["key"] == key
    monkeypatch.setattr(dispatch, "_TABLES", {})
    dispatch.table(torch.float32)  # now cached for this machine: read, not measured
    assert measured == [torch.float32]


def test_a_mask_is_another_machine(monkeypatch):
    monkeypatch.delenv("MINISERVE_CPU_FEATURES", raising=False)
    full = dispatch.machine_key()
    monkeypatch.setenv("MINISERVE_CPU_FEATURES", "none")
    masked = dispatch.machine_key()
    assert masked["allowed"] == [] and dispatch.table_path(masked) != dispatch.table_path(full)  # on any CPU


def test_a_table_measured_while_the_build_failed_is_another_machine(monkeypatch):
    """Measured without a compiler, a table timed no kernel (oneDNN, SDPA always run): reused once
    the kernels built, it kept the engine off them for good."""
    monkeypatch.setattr(dispatch.kernels, "built", lambda: True)
    built = dispatch.machine_key()
    monkeypatch.setattr(dispatch.kernels, "built", lambda: False)
    failed = dispatch.machine_key()
    assert built["kernels"] and not failed["kernels"] and dispatch.table_path(failed) != dispatch.table_path(built)


def test_a_cached_choice_that_cannot_run_here_now_is_measured_again(tmp_path, monkeypatch):
    """A shared cache, or a kernel build that failed since: the table named gemv, which is gone."""
    key = dispatch.machine_key()
    path = tmp_path / "dispatch.json"
    dispatch.save_table(path, dispatch.Table(key, {"float32": ["gemv"] * len(CLASSES)}, {"float32": KERNEL}))
    monkeypatch.setattr(dispatch, "table_path", lambda k: path)
    monkeypatch.setattr(dispatch, "_TABLES", {})
    monkeypatch.setattr(dispatch, "linear_candidates", lambda dtype: ["torch"])

    def measure(dtype, table):
        table.linear["float32"], table.attention["float32"] = ["torch"] * len(CLASSES), SDPA
        return True

    monkeypatch.setattr(dispatch, "measure", measure)
    assert dispatch.linear_choices(torch.float32) == ["torch"] * len(CLASSES)
    assert json.loads(path.read_text())["linear"]["float32"] == ["torch"] * len(CLASSES)  # the cache is mended


def test_forcing_a_candidate(monkeypatch):
    monkeypatch.setenv(dispatch.FORCE_ENV, "linear=torch,attention=sdpa")
    assert dispatch.forced("linear") == "torch"
    assert dispatch.forced("attention") == "sdpa"
    t = dispatch.Table({}, {"float32": ["gemv"] * len(CLASSES)}, {"float32": KERNEL})
    assert t.linear_choices(torch.float32) == ["torch"] * len(CLASSES)
    assert [t.attention_choice(torch.float32, p) for p in dispatch.PHASES] == ["sdpa", "sdpa"]
    monkeypatch.setenv(dispatch.FORCE_ENV, "attention=sdpa,decode_attention=kernel")  # one phase over both
    assert [t.attention_choice(torch.float32, p) for p in dispatch.PHASES] == ["kernel", "sdpa"]
    monkeypatch.setenv(dispatch.FORCE_ENV, "prefill_attention=sdpa")
    assert [t.attention_choice(torch.float32, p) for p in dispatch.PHASES] == ["kernel", "sdpa"]
    monkeypatch.setenv(dispatch.FORCE_ENV, "decode_attention=flash")
    with pytest.raises(ValueError, match=re.escape("decode_attention=kernel|sdpa")):
        t.attention_choice(torch.float32, "decode")
    monkeypatch.setenv(dispatch.FORCE_ENV, "linear=cublas")
    with pytest.raises(ValueError, match="linear=gemv|onednn|torch"):
        dispatch.forced("linear")


def _timings(winner: str) -> dict[int, dict[str, float]]:
    """Fake measurements in which ``winner`` is the fastest at every row class."""
    base = {"gemv": 1.0, "onednn": 1.2, "torch": 3.0}
    return {r: {c: (0.5 if c == winner else t) * r for c, t in base.items()} for r in dispatch.ROW_CLASSES}


def test_choices_are_kept_only_when_two_measurements_agree():
    calls = iter([_timings("gemv"), _timings("gemv"), _timings("torch")])
    choices, _, settled = dispatch.agreed_choices(lambda: next(calls))
    assert settled and choices[0] == "gemv"
    assert len(list(calls)) == 1  # two agreeing measurements were enough
    flips = iter([_timings("torch"), _timings("gemv"), _timings("gemv")])  # one disturbed measurement, outvoted
    choices, _, settled = dispatch.agreed_choices(lambda: next(flips))
    assert settled and choices[0] == "gemv"
    noisy = iter([_timings("torch"), _timings("gemv"), _timings("onednn")])  # never the same twice
    choices, _, settled = dispatch.agreed_choices(lambda: next(noisy))
    assert not settled and len(choices) == len(dispatch.ROW_CLASSES)


def test_attention_choices_are_kept_only_when_two_measurements_agree():
    def timed(decode: str, prefill: str) -> dict[str, dict[str, float]]:
        return {"decode": {"kernel": 1.0, "sdpa": 2.0} if decode == "kernel" else {"kernel": 2.0, "sdpa": 1.0},
                "prefill": {"kernel": 1.0, "sdpa": 2.0} if prefill == "kernel" else {"kernel": 2.0, "sdpa": 1.0}}

    disturbed = iter([timed("kernel", "sdpa"), timed("kernel", "kernel"), timed("kernel", "kernel")])
    choices, _, settled = dispatch.agreed_attention(lambda: next(disturbed))
    assert settled and choices == {"decode": "kernel", "prefill": "kernel"}  # the one slow prefill outvoted
    noisy = iter([timed("kernel", "sdpa"), timed("sdpa", "kernel"), timed("kernel", "kernel")])
    choices, _, settled = dispatch.agreed_attention(lambda: next(noisy))
    assert not settled and choices == {"decode": "kernel", "prefill": "kernel"}  # each phase's majority


def test_an_unsettled_measurement_is_used_but_not_cached(monkeypatch):
    winners = iter(["torch", "gemv", "onednn"])
    monkeypatch.setattr(dispatch, "linear_candidates", lambda dtype: ["gemv", "onednn", "torch"])
    monkeypatch.setattr(dispatch, "measure_linear", lambda *args: _timings(next(winners)))
    monkeypatch.setattr(dispatch.ProbeWeights, "build", lambda dtype, candidates: dispatch.ProbeWeights([], [], []))
    tuned = GemvTuning(prefetch_one=2048, prefetch=4096, prefetch_one_l2=True)
    monkeypatch.setattr(dispatch, "tune_gemv", lambda dtype, probe: (tuned, {}))
    table = dispatch.Table(dispatch.machine_key())
    assert dispatch.measure(torch.float32, table) is False  # table() then does not save it
    assert len(table.linear["float32"]) == len(dispatch.ROW_CLASSES)
    assert next(winners, None) is None  # measured three times
    assert table.gemv["float32"] == {**asdict(tuned), "amx_rows": 0}  # the tuning it measured
    # attention: one choice per phase of a step, each from its own timings
    assert set(table.attention["float32"]) == set(table.timings["float32"]["attention"]) == set(dispatch.PHASES)
    assert all(set(table.timings["float32"]["attention"][p]) <= set(dispatch.ATTENTION) for p in dispatch.PHASES)


def test_a_lone_candidate_is_taken_without_timing(monkeypatch):
    """A torch without oneDNN on a CPU without the kernels (macOS arm64) has only F.linear."""
    monkeypatch.setattr(dispatch, "linear_candidates", lambda dtype: ["torch"])
    monkeypatch.setattr(dispatch, "measure_linear", lambda *args: pytest.fail("timed a choice of one"))
    table = dispatch.Table(dispatch.machine_key())
    assert dispatch.measure(torch.float32, table) and table.linear["float32"] == ["torch"] * len(CLASSES)


def _with_amx(faster_from: set[int]) -> dict[int, dict[str, float]]:
    """Fake timings where the gemv on tiles beats its vector loop at the row classes given."""
    return {r: {"gemv": 1.0 * r, "gemv_amx": (0.5 if r in faster_from else 2.0) * r, "onednn": 0.9 * r}
            for r in CLASSES}


def test_the_tiles_take_over_from_the_row_class_where_they_win_every_larger_one():
    rows, folded = dispatch.fold_amx(_with_amx({r for r in CLASSES if r >= 16}))
    assert rows == 16
    assert all(folded[r]["gemv"] == (0.5 if r >= 16 else 1.0) * r and "gemv_amx" not in folded[r] for r in CLASSES)
    # a loss at 64 rows: the tiles only from 128, though they won 16 and 32 (one threshold, not a patchwork)
    assert dispatch.fold_amx(_with_amx({16, 32, 128, 256, 512}))[0] == 128
    assert dispatch.fold_amx(_with_amx(set(CLASSES) - {512}))[0] == 0  # losing at the largest: never
    assert dispatch.fold_amx(_with_amx(set(CLASSES)))[0] == 1
    plain = {r: {"gemv": 1.0, "onednn": 2.0} for r in CLASSES}
    assert dispatch.fold_amx(plain) == (0, plain)  # no tiles here: nothing to fold
    assert dispatch.fold_amx({}) == (0, {})  # one candidate, taken untimed


def test_forcing_the_tiles_on_or_off(monkeypatch):
    """On any CPU: the tiles' availability is set here, not read from this machine."""
    monkeypatch.setattr(kernels, "gemv_amx", lambda dtype: dtype == torch.bfloat16)  # a machine with bf16 tiles
    t = dispatch.Table({}, gemv={"bfloat16": {"amx_rows": 16, "prefetch_one": 0, "prefetch": 8192,
                                              "prefetch_l2": True}})
    assert t.gemv_tuning(torch.bfloat16) == GemvTuning(0, 8192, True, 16)
    monkeypatch.setenv(dispatch.FORCE_ENV, "amx=off")
    assert t.gemv_tuning(torch.bfloat16) == GemvTuning(0, 8192, True, 0)
    monkeypatch.setenv(dispatch.FORCE_ENV, "amx=on")
    assert t.gemv_tuning(torch.bfloat16) == GemvTuning(0, 8192, True, 1)
    with pytest.raises(ValueError, match="amx=on"):  # no fp32 tiles anywhere
        t.gemv_tuning(torch.float32)
    monkeypatch.setattr(kernels, "gemv_amx", lambda dtype: False)  # a machine without
    with pytest.raises(ValueError, match="amx=on"):
        t.gemv_tuning(torch.bfloat16)
    monkeypatch.setenv(dispatch.FORCE_ENV, "amx=maybe")
    with pytest.raises(ValueError, match="amx=on|off"):
        dispatch.forced("amx")
    monkeypatch.delenv(dispatch.FORCE_ENV)
    assert dispatch.Table({}).gemv_tuning(torch.float32) == GemvTuning()  # a table without a tuning: the defaults


def test_the_gemv_tuning_survives_the_cache(tmp_path):
    key = {"version": dispatch.VERSION, "cpu": "test"}
    t = dispatch.Table(key, {"bfloat16": ["gemv"] * len(CLASSES)}, {"bfloat16": "kernel"}, {},
                       {"bfloat16": asdict(GemvTuning(0, 4096, False, 0))})
    dispatch.save_table(tmp_path / "t.json", t)
    loaded = dispatch.load_table(tmp_path / "t.json", key)
    assert loaded.gemv == t.gemv and loaded.gemv_tuning(torch.bfloat16) == GemvTuning(0, 4096, False, 0)


def test_a_cached_amx_threshold_is_dropped_where_this_process_has_no_tiles(monkeypatch):
    """The key does not cover the OS's grant of the tiles: without it, the vector loop, not an error per call."""
    monkeypatch.setattr(kernels, "gemv_amx", lambda dtype: False)
    t = dispatch.Table({}, gemv={"bfloat16": asdict(GemvTuning(0, 4096, False, 2))})
    assert t.gemv_tuning(torch.bfloat16) == GemvTuning(0, 4096, False, 0)


def test_the_gemv_tuning_takes_each_row_counts_fastest_distance_apart(monkeypatch):
    """The one-row distance and the several-row one are chosen each at its own row count, levels
    included (a machine whose one row wants 2 KiB into L1 and whose 8 rows want 16 KiB into L2 gets
    both), then how many rows one sweep takes, at 12 and 16 rows (AVX2: 4 and 6), with those distances;
    where AVX2 chooses its 3-row sweep, the several-row distance again at 3 rows."""
    calls = []

    class Probe:
        def inputs(self, rows):
            return rows

        def gemv(self, rows, tuning):
            calls.append((rows, tuning))

    # 8 rows on all threads: 16 KiB into L2 fastest, 32 KiB into L2 5% behind; on one thread 32 KiB
    # fastest and 16 KiB 50% behind: the summed ratios choose 32 KiB (1.05 + 1 against 1 + 1.5)
    best = {1: "2048,0", 8: "16384,1", (8, 1): "32768,1", ("sweeps", 12): "16", ("sweeps", 16): "12"}
    slow = {("sweeps", 16): {"16": 1.5}, 8: {"32768,1": 1.05}, (8, 1): {"16384,1": 1.5}}
    threads_seen = []

    def fastest(fns, repeats):
        for fn in fns.values():
            fn()
        rows = calls[-1][0]
        threads_seen.append((rows, torch.get_num_threads()))
        at = (rows, 1) if rows == 8 and torch.get_num_threads() == 1 else rows
        if all("," not in name for name in fns):  # stream_rows candidates
            at = ("sweeps", rows)
        return {name: (1.0 if name == best[at] else slow.get(at, {}).get(name, 3.0)) for name in fns}

    monkeypatch.setattr(dispatch, "_fastest_alternating", fastest)
    monkeypatch.setattr(dispatch, "cpu_features", lambda: frozenset({"avx2", "avx512"}))
    with on_threads(2):
        tuning, timings = dispatch.tune_gemv(torch.float32, Probe())
        assert torch.get_num_threads() == 2  # given back after the one-thread timings
    assert tuning == GemvTuning(prefetch_one=2048, prefetch_one_l2=False, prefetch=32768, prefetch_l2=True,
                                stream_rows=16)  # summed ratios: 16 rows 1 + 1.5, 12 rows 3 + 1, 8 rows 3 + 3
    assert threads_seen == [(1, 2), (8, 2), (8, 1), (12, 2), (16, 2)]
    assert set(timings["1"]) == {f"{d},{int(l2)}" for d, l2 in dispatch.PREFETCH_ONE}
    assert set(timings["8"]) == set(timings["8" + dispatch.ONE_THREAD]) == {f"{d},{int(l2)}" for d, l2 in dispatch.PREFETCH}
    assert set(timings["12" + dispatch.SWEEPS]) == set(timings["16" + dispatch.SWEEPS]) == {str(n) for n in dispatch.STREAM_ROWS}
    assert {rows for rows, _ in calls} == {1, 8, 12, 16} and all(t.amx_rows == 0 for _, t in calls)  # the vector loop
    assert all(t.prefetch == 32768 and t.prefetch_one == 2048 for rows, t in calls if rows >= 12)

    # an AVX2-only CPU: the distance is timed at 6 rows, which its default sweep takes (at 8 its
    # rows go in blocks that ignore it), then its own sweeps (3 or 6 rows) at 4 and 6 rows: here
    # the blocks past 3 rows win at 4 rows and lose by less at 6 (1 + 1.2 against 3 + 1), so only
    # 2-3 rows still sweep, and the distance is timed again at 3 rows, where 2 KiB into L1 wins
    calls.clear()
    best.update({6: "4096,0", ("sweeps", 4): "3", ("sweeps", 6): "6", 3: "2048,0"})
    slow[("sweeps", 6)] = {"3": 1.2}
    monkeypatch.setattr(dispatch, "cpu_features", lambda: frozenset({"avx2"}))
    with on_threads(1):  # one thread: each row count is timed once, and decides alone
        tuning, timings = dispatch.tune_gemv(torch.float32, Probe())
    assert tuning.stream_rows == 3 and set(timings) == {"1", "6", "4" + dispatch.SWEEPS, "6" + dispatch.SWEEPS, "3"}
    assert set(timings["4" + dispatch.SWEEPS]) == {str(n) for n in dispatch.STREAM_ROWS_AVX2}
    assert set(timings["3"]) == {f"{d},{int(l2)}" for d, l2 in dispatch.PREFETCH}
    assert {rows for rows, _ in calls} == {1, 3, 4, 6}
    assert all(t.prefetch == 4096 for rows, t in calls if rows == 4)  # the sweeps ran at 6 rows' distance
    assert all(t.stream_rows == 3 for rows, t in calls if rows == 3)  # the distance, at the sweep chosen
    assert tuning.prefetch == 2048 and not tuning.prefetch_l2 and tuning.stream_rows == 3
    with on_threads(2):  # two threads: 6 rows and 3 rows on both and on one
        tuning, timings = dispatch.tune_gemv(torch.float32, Probe())
    assert set(timings) == {"1", "6", "6" + dispatch.ONE_THREAD, "4" + dispatch.SWEEPS, "6" + dispatch.SWEEPS,
                            "3", "3" + dispatch.ONE_THREAD}
    assert tuning.prefetch == 2048 and tuning.stream_rows == 3
    # where the 6-row sweep wins, 6 rows' distance stays: nothing is timed again
    best.update({("sweeps", 4): "6"})
    slow[("sweeps", 6)] = {}
    with on_threads(1):
        tuning, timings = dispatch.tune_gemv(torch.float32, Probe())
    assert tuning.stream_rows == 6 and tuning.prefetch == 4096 and "3" not in timings
