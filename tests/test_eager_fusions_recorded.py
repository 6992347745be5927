"""TRAIN_LEDGER_COMPILE=0 runs engine/jit.py's fusions as eager chains: a run's config records the choice
(implementation.jit_fuser_compile), and the ledger, whose formulas and time model describe the compiled fusions,
says so for a GPU run instead of leaving its off rows unexplained (on CPU the fusions always run eager)."""
from __future__ import annotations

import dataclasses

import pytest

from cli.main import main as cli
from common.arguments import parse_args
from common.config import RunConfig, jit_fuser_compile_from_environment
from common.errors import ConfigError
from ledger.evidence.read import read_run
from ledger.reconcile.run import EAGER_FUSIONS, reconcile_evidence
from tests.support.recorded_runs import FIXTURES, WITHOUT_HTA


@pytest.mark.parametrize("value, compiled", [(None, True), ("1", True), ("0", False)])
def test_the_environment_decides_and_the_config_records_it(monkeypatch, value, compiled):
    if value is None:
        monkeypatch.delenv("TRAIN_LEDGER_COMPILE", raising=False)
    else:
        monkeypatch.setenv("TRAIN_LEDGER_COMPILE", value)
    assert jit_fuser_compile_from_environment() is compiled
    cfg = parse_args(["--model", "tiny"], world_size=1)
    assert cfg.implementation.jit_fuser_compile is compiled
    assert RunConfig.from_dict(cfg.to_dict()).implementation.jit_fuser_compile is compiled


def test_a_manifest_from_before_the_field_was_compiled():
    cfg = parse_args(["--model", "tiny"], world_size=1).to_dict()
    del cfg["implementation"]["jit_fuser_compile"]
    assert RunConfig.from_dict(cfg).implementation.jit_fuser_compile is True


def test_a_value_that_is_neither_0_nor_1_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("TRAIN_LEDGER_COMPILE", "false")
    with pytest.raises(ConfigError, match="TRAIN_LEDGER_COMPILE='false'"):
        jit_fuser_compile_from_environment()
    assert cli(["plan", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TRAIN_LEDGER_COMPILE='false'" in err, err


def _missing(run: str, compiled: bool) -> list[str]:
    ev = read_run(FIXTURES / run)
    ev.config.implementation = dataclasses.replace(ev.config.implementation, jit_fuser_compile=compiled)
    return reconcile_evidence(ev, WITHOUT_HTA).missing


def test_a_gpu_run_with_eager_fusions_says_the_ledger_prices_them_compiled():
    assert EAGER_FUSIONS in _missing("gpu_h200_llama1b_l2", compiled=False)
    assert EAGER_FUSIONS not in _missing("gpu_h200_llama1b_l2", compiled=True)


def test_a_cpu_run_is_eager_as_modelled_and_says_nothing():
    assert EAGER_FUSIONS not in _missing("gloo_dp2_sweeps", compiled=False)


def test_simulate_validate_says_an_eager_run_is_priced_compiled(tmp_path, capsys):
    """A copy of a real one-H200 run whose manifest says its fusions ran eager (plumbing: the run itself was
    compiled): the validation's table is the same, with a line saying what the simulator priced."""
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gpu_h200_llama1b_l2", run, ignore=shutil.ignore_patterns("ledger"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"].setdefault("implementation", {})["jit_fuser_compile"] = False
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert cli(["simulate", "--validate", str(run)]) == 0
    out = capsys.readouterr().out
    said = f"{run} ran engine/jit.py's fusions eager (TRAIN_LEDGER_COMPILE=0): the simulator prices them compiled"
    assert said in out
    assert cli(["simulate", "--validate", str(FIXTURES / "gpu_h200_llama1b_l2")]) == 0
    assert "eager" not in capsys.readouterr().out
