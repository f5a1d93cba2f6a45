"""``python -m experiments.prefix`` on the tiny model: four runs, a table, a figure, and a report."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.prefix import PrefixApp, run_app, table_text
from experiments.report import ReportApp, build_report
from experiments.schema import to_object
from tests.test_sim_app import tiny_profile

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def composed(*overrides: str) -> PrefixApp:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return to_object(compose(config_name="prefix", overrides=list(overrides)))


def test_caching_off_and_on_real_and_simulated(tmp_path):
    app = composed("model=tiny", "model.num_threads=1", f"calibration.profile={tiny_profile(tmp_path / 'p.json')}",
                   "workload.num_requests=12", "workload.rate=20", "workload.turn_gap_s=0.1", "warmup=false")
    result = run_app(app, tmp_path / "out")
    table = result["table"]
    assert set(table) == {"off real", "off sim", "off sim error", "on real", "on sim", "on sim error"}
    for side in ("real", "sim"):
        off, on = table[f"off {side}"], table[f"on {side}"]
        assert off["hit_rate"] == 0 and on["hit_rate"] > 0.3  # turns resend their history
        assert on["prefill_tokens"] < off["prefill_tokens"]
    assert table["on sim"]["prefill_tokens"] == table["on real"]["prefill_tokens"]  # the same hits
    assert table["on sim error"]["prefill_tokens"] == 0
    for name in ("off", "on"):
        for side in ("real", "sim"):
            assert (tmp_path / "out" / name / side / "metrics.json").is_file()
    assert json.loads((tmp_path / "out" / "prefix.json").read_text())["table"]["on real"] == table["on real"]
    assert (tmp_path / "out" / "prefix.png").stat().st_size > 0
    text = table_text(table)
    assert "| on sim error |" in text and "nan" not in text  # no hits with caching off: n/a, not +nan%
    assert text.split("| off sim error |")[1].split("\n")[0].count("n/a") == 2
    summary = build_report(ReportApp(prefix_dir=str(tmp_path / "out")), tmp_path / "report")
    assert "Prefix caching" in summary.read_text() and (tmp_path / "report" / "prefix.png").is_file()
    assert text in summary.read_text()  # the app's table, n/a and all
