"""`splitserve sim`: every scenario with every flag it accepts, in process and small.

The flags come from the real parser: a flag added without a case below fails
test_every_flag_has_a_case_and_every_setting_a_flag. Each case sets the flag to a valid value
unlike every scenario's own, runs the sim entry point (splitserve.cli.main) on a short trace at
a fixed rate, and checks the run completed, that it differs from the scenario's run without the
flag, and that the value reached what the flag sets (the runs' settings, their trace, the
report). A flag for a setting the scenario varies itself is refused: one sentence, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from splitserve.cli import main as cli_main
from splitserve.sim import SimSettings, TraceRequest
from splitserve.sim import cli as sim_cli
from splitserve.sim.costmodel import CALIBRATION_FILE
from splitserve.sim.scenarios import SCENARIOS, ScenarioConfig, flag_name, resolve

SMALL = ["--num-requests", "8"]  # short traces: every run takes well under a second
# the flag matrix's arrivals: a fixed rate spares each run the scenario's capacity measurement
# (a 150-request burst); each scenario's own load is checked once, without it
RATE = ["--request-rate", "5"]


@dataclass
class Observed:
    rc: int
    out: str
    err: str
    settings: list[SimSettings] = field(default_factory=list)
    traces: list[list[TraceRequest]] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)

    @property
    def shorts(self) -> list[TraceRequest]:
        """The trace's requests drawn from the trace flags (starvation adds its long prompts)."""
        return [r for r in self.traces[0] if not r.request_id.startswith("long")]

    def comparable(self):
        rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in self.rows]
        return ([repr(s) for s in self.settings], self.traces, rows)


def sim(scenario: str, argv: list[str], tmp: Path, rate: bool = False) -> Observed:
    """`splitserve sim --scenario S --num-requests 8 [--request-rate 5] ARGV --json F`, recording
    each simulation."""
    recorded: list[tuple[SimSettings, list[TraceRequest]]] = []
    real = sim_cli.simulate

    def recording(settings, trace, cost):
        recorded.append((settings, trace))
        return real(settings, trace, cost)

    out_json = tmp / f"{scenario}.json"
    out_json.unlink(missing_ok=True)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sim_cli, "simulate", recording)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            small = SMALL + (RATE if rate and "--request-rate" not in argv else [])
            rc = cli_main(["sim", "--scenario", scenario, *small, *argv, "--json", str(out_json)])
    obs = Observed(rc, out.getvalue(), err.getvalue())
    obs.settings = [s for s, _ in recorded]
    obs.traces = [t for _, t in recorded]
    if rc == 0:
        obs.rows = json.loads(out_json.read_text())
    return obs


def _calibration(tmp: Path, default: str, *names: str) -> Path:
    data = json.loads(CALIBRATION_FILE.read_text())
    values = data["profiles"][data["default"]]
    path = tmp / f"calibration-{default}.json"
    path.write_text(json.dumps({"default": default, "profiles": {n: values for n in names}}))
    return path


Check = Callable[[Observed, str, Path], None]


def every(attr: str, value) -> Check:
    """Every run's settings carry ``value``."""

    def check(obs: Observed, scenario: str, tmp: Path) -> None:
        assert [getattr(s, attr) for s in obs.settings] == [value] * len(obs.settings)

    return check


def option(name: str, value) -> Check:
    def check(obs: Observed, scenario: str, tmp: Path) -> None:
        assert [s.policy_options.get(name) for s in obs.settings] == [value] * len(obs.settings)

    return check


def _policies(obs: Observed, scenario: str, tmp: Path) -> None:
    if scenario == "goodput":  # both policies at every load, on its three traces
        assert [s.policy for s in obs.settings] == ["sjf", "fcfs"] * 12
        assert [r["label"].split()[0] for r in obs.rows] == ["sjf", "fcfs"] * 12
        return
    assert [s.policy for s in obs.settings] == ["sjf", "fcfs"]
    assert [r["label"] for r in obs.rows] == ["sjf", "fcfs"]


def _num_requests(obs: Observed, scenario: str, tmp: Path) -> None:
    assert len(obs.shorts) == 5 and obs.rows[0]["requests"] == len(obs.traces[0])


def _request_rate(obs: Observed, scenario: str, tmp: Path) -> None:
    assert obs.shorts[-1].arrival < 0.1  # 1000/s: 7 gaps of ~1 ms (at 5/s: about 1.4 s)


def _prompt_median(obs: Observed, scenario: str, tmp: Path) -> None:
    assert statistics.median(r.prompt_len for r in obs.shorts) < 24


def _prompt_sigma(obs: Observed, scenario: str, tmp: Path) -> None:
    assert len({r.prompt_len for r in obs.shorts}) == 1  # sigma 0: every prompt the median


def _prompt_max(obs: Observed, scenario: str, tmp: Path) -> None:
    assert max(r.prompt_len for r in obs.shorts) <= 20


def _output_median(obs: Observed, scenario: str, tmp: Path) -> None:
    assert statistics.median(r.output_len for r in obs.shorts) < 10


def _output_sigma(obs: Observed, scenario: str, tmp: Path) -> None:
    assert len({r.output_len for r in obs.shorts}) == 1


def _output_max(obs: Observed, scenario: str, tmp: Path) -> None:
    assert max(r.output_len for r in obs.shorts) <= 5


def _tenants(obs: Observed, scenario: str, tmp: Path) -> None:
    assert {r.tenant for r in obs.shorts} == {"x", "y"}


def _priorities(obs: Observed, scenario: str, tmp: Path) -> None:
    assert {r.priority for r in obs.shorts} <= {3, 4}


def _seed(obs: Observed, scenario: str, tmp: Path) -> None:
    assert len(obs.shorts) == 8  # the same size, other draws (checked against the baseline)


def _max_num_batched_tokens(obs: Observed, scenario: str, tmp: Path) -> None:
    every("max_num_batched_tokens", 256)(obs, scenario, tmp)
    if scenario == "budget128":  # its labels name the budget
        assert all(r["label"].startswith("budget 256,") for r in obs.rows)


def _num_blocks(obs: Observed, scenario: str, tmp: Path) -> None:
    every("num_blocks", 1024)(obs, scenario, tmp)
    if scenario == "preemption":
        assert all(r["label"].startswith("1024 blocks,") for r in obs.rows)


def _num_host_blocks(obs: Observed, scenario: str, tmp: Path) -> None:
    # preemption's recompute run has no host pool by design; its swap and auto runs get it
    want = [
        0 if scenario == "preemption" and s.preemption_mode == "recompute" else 100
        for s in obs.settings
    ]
    assert [s.num_host_blocks for s in obs.settings] == want and 100 in want


def _preemption_mode(obs: Observed, scenario: str, tmp: Path) -> None:
    every("preemption_mode", "swap")(obs, scenario, tmp)
    assert {r["preemption_mode"] for r in obs.rows} == {"swap"}


def _calibration_name(obs: Observed, scenario: str, tmp: Path) -> None:
    assert {r["cost_model"] for r in obs.rows} == {"alt"} and "cost model alt" in obs.out


def _calibration_file(obs: Observed, scenario: str, tmp: Path) -> None:
    assert {r["cost_model"] for r in obs.rows} == {"filed"}


def _json(obs: Observed, scenario: str, tmp: Path) -> None:
    assert len(obs.rows) == len(obs.settings) and "json: " in obs.out


def _plot(obs: Observed, scenario: str, tmp: Path) -> None:
    png = tmp / f"{scenario}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in obs.out


# flag dest -> (argv for a valid value unlike every scenario's own, its check). Paths: {tmp}.
CASES: dict[str, tuple[list[str], Check]] = {
    "policies": (["--policies", "sjf,fcfs"], _policies),
    "num_requests": (["--num-requests", "5"], _num_requests),
    "request_rate": (["--request-rate", "1000"], _request_rate),
    "prompt_median": (["--prompt-median", "8"], _prompt_median),
    "prompt_sigma": (["--prompt-sigma", "0"], _prompt_sigma),
    "prompt_max": (["--prompt-max", "20"], _prompt_max),
    "output_median": (["--output-median", "3"], _output_median),
    "output_sigma": (["--output-sigma", "0"], _output_sigma),
    "output_max": (["--output-max", "5"], _output_max),
    "tenants": (["--tenants", "x:1,y=3"], _tenants),
    "priorities": (["--priorities", "3,4"], _priorities),
    "shared_prefix_len": (["--shared-prefix-len", "32"], every("shared_prefix_len", 32)),
    "seed": (["--seed", "5"], _seed),
    "workers": (["--workers", "2"], every("num_workers", 2)),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "256"], _max_num_batched_tokens),
    "max_num_seqs": (["--max-num-seqs", "8"], every("max_num_seqs", 8)),
    "block_size": (["--block-size", "32"], every("block_size", 32)),
    "num_blocks": (["--num-blocks", "1024"], _num_blocks),
    "num_host_blocks": (["--num-host-blocks", "100"], _num_host_blocks),
    "preemption_mode": (["--preemption-mode", "swap"], _preemption_mode),
    "enable_chunked_prefill": (
        ["--no-enable-chunked-prefill"],
        every("enable_chunked_prefill", False),
    ),
    "enable_prefix_caching": (
        ["--no-enable-prefix-caching"],
        every("enable_prefix_caching", False),
    ),
    "max_model_len": (["--max-model-len", "900"], every("max_model_len", 900)),
    "aging_rate": (["--aging-rate", "123"], option("aging_rate", 123.0)),
    "weights": (["--weights", "a:1,b:5"], option("weights", {"a": 1.0, "b": 5.0})),
    "shed_hopeless": (["--shed-hopeless"], option("shed_hopeless", True)),
    "ttft_slo_ms": (["--ttft-slo-ms", "5000"], every("ttft_slo_ms", 5000.0)),
    "thrash_threshold": (["--thrash-threshold", "0.5"], every("thrash_threshold", 0.5)),
    "thrash_window_s": (["--thrash-window-s", "5"], every("thrash_window_s", 5.0)),
    "thrash_backpressure": (["--thrash-backpressure"], every("thrash_backpressure", True)),
    "calibration": (
        ["--calibration", "alt", "--calibration-file", "{tmp}/calibration-base.json"],
        _calibration_name,
    ),
    "calibration_file": (["--calibration-file", "{tmp}/calibration-filed.json"], _calibration_file),
    "json": ([], _json),  # every run writes --json; its check reads it
    "plot": (["--plot", "{tmp}/{scenario}.png"], _plot),
}
OUTPUT_ONLY = {"json", "plot"}  # the runs are the baseline's


def sim_flags() -> list[str]:
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    return [a.dest for a in p._actions if a.dest not in ("help", "scenario")]


def accepted(scenario: str) -> list[str]:
    return [f for f in sim_flags() if f not in SCENARIOS[scenario].refuses]


MATRIX = [(s, f) for s in SCENARIOS for f in accepted(s)]
REFUSED = [(s, f) for s in SCENARIOS for f in SCENARIOS[s].refuses]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sim")
    _calibration(path, "smollm2-cpu-fp32", "smollm2-cpu-fp32", "alt").rename(
        path / "calibration-base.json"
    )
    _calibration(path, "filed", "filed")
    return path


_BASELINES: dict[tuple[str, bool], Observed] = {}


def baseline(scenario: str, tmp: Path, rate: bool = False) -> Observed:
    """The scenario's run without a flag (at the matrix's rate, or at the scenario's load)."""
    if (scenario, rate) not in _BASELINES:
        _BASELINES[scenario, rate] = sim(scenario, [], tmp, rate)
    return _BASELINES[scenario, rate]


def test_every_flag_has_a_case_and_every_setting_a_flag():
    assert set(sim_flags()) == set(CASES)
    settings = set(sim_flags()) - {"calibration", "calibration_file", "json", "plot"}
    assert settings == set(ScenarioConfig.__slots__)  # ScenarioConfig: one field per flag
    assert len(MATRIX) > 150 and REFUSED


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_scenario_runs_small_by_its_own_settings(scenario, tmp):
    base = baseline(scenario, tmp)
    assert base.rc == 0, base.err
    assert base.settings and len(base.rows) == len(base.settings)
    # one trace, compared across runs (goodput: one per load and trace kind)
    traces = {id(t) for t in base.traces}
    assert len(traces) == (12 if scenario == "goodput" else 1)
    assert len(base.shorts) == 8
    assert all(r["finished"] + sum(r["refused"].values()) == r["requests"] for r in base.rows)
    cfg = resolve(scenario)
    for name, value in SCENARIOS[scenario].defaults.items():
        assert getattr(cfg, name) == value  # the scenario's own settings are the defaults
    if scenario != "starvation":  # its long prompts arrive at 0.5, 1.5, 2.5 s
        assert base.shorts[-1].arrival > 0.1  # the scenario's load, from the cost model


@pytest.mark.parametrize(("scenario", "flag"), MATRIX, ids=[f"{s}-{f}" for s, f in MATRIX])
def test_every_scenario_takes_every_flag_it_accepts(scenario, flag, tmp):
    argv, check = CASES[flag]
    argv = [a.format(tmp=tmp, scenario=scenario) for a in argv]
    obs = sim(scenario, argv, tmp, rate=True)
    assert obs.rc == 0, obs.err
    assert obs.settings and len(obs.rows) == len(obs.settings)
    if flag not in OUTPUT_ONLY:
        base = baseline(scenario, tmp, rate=True)
        assert obs.comparable() != base.comparable(), "the flag changed nothing"
    check(obs, scenario, tmp)


@pytest.mark.parametrize(("scenario", "flag"), REFUSED, ids=[f"{s}-{f}" for s, f in REFUSED])
def test_a_flag_the_scenario_sets_itself_is_one_sentence_and_exit_2(scenario, flag, tmp):
    obs = sim(scenario, CASES[flag][0], tmp)
    assert obs.rc == 2 and not obs.settings and "Traceback" not in obs.err
    reason = SCENARIOS[scenario].refuses[flag]
    assert obs.err.strip() == (
        f"splitserve sim: error: --scenario {scenario} does not take {flag_name(flag)}: {reason}"
    )


def test_the_old_crash_policies_with_weights_runs_with_the_users_weights(tmp):
    # the scenario used to pass weights a second time: TypeError (so did sjf with --aging-rate)
    obs = sim("policies", ["--weights", "a=3,b=1", "--policies", "fair,fcfs"], tmp)
    assert obs.rc == 0, obs.err
    assert [s.policy_options["weights"] for s in obs.settings] == [{"a": 3.0, "b": 1.0}] * 2
    obs = sim("policies", ["--weights", "a:1,b:9", "--policies", "fair"], tmp)
    assert obs.settings[0].policy_options["weights"] == {"a": 1.0, "b": 9.0}
    obs = sim("sjf", ["--aging-rate", "7", "--policies", "sjf-aging"], tmp)
    assert obs.rc == 0 and obs.settings[0].policy_options["aging_rate"] == 7.0


def test_a_flag_wins_over_the_scenario_which_wins_over_the_generic_default():
    generic = ScenarioConfig()
    assert resolve("budget128").max_num_batched_tokens == 128 != generic.max_num_batched_tokens
    assert resolve("budget128", {"max_num_batched_tokens": 64}).max_num_batched_tokens == 64
    assert resolve("budget128").max_num_seqs == generic.max_num_seqs
    assert resolve("policies", {"priorities": (1,)}).priorities == (1,)  # no longer overridden
    a, b = resolve("policies"), resolve("policies")
    a.tenants["z"] = 1.0  # a resolved config is its own copy
    assert "z" not in b.tenants and "z" not in SCENARIOS["policies"].defaults["tenants"]


def test_other_bad_input_is_one_sentence_and_exit_2(tmp):
    obs = sim("sjf", ["--num-blocks", "0"], tmp)
    assert obs.rc == 2 and "num_blocks must be an integer >= 1" in obs.err
    obs = sim("sjf", ["--calibration", "nope"], tmp)
    assert obs.rc == 2 and "no calibration profile 'nope'" in obs.err
    for argv in (["--policies", "nope"], ["--weights", "a:0"], ["--priorities", "x"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
            cli_main(["sim", *argv])
        assert exc.value.code == 2 and "error: argument" in err.getvalue()
