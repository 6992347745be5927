"""Every command answers --help with its help (exit 0, nothing on stderr), whatever it requires otherwise, and
`train-ledger --version` says the version. Nothing is started: a command's --help must not reach its work."""
from __future__ import annotations

import importlib.metadata

import pytest

from cli.main import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_the_help(capsys, command, flag):
    assert main([command, flag]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith(f"usage: train-ledger {command}"), captured.out[:200]


@pytest.mark.parametrize("command", ["simulate", "search", "train"])
def test_commands_that_take_megatron_flags_list_them_under_their_own(capsys, command):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    own, megatron = out.split("\nMegatron flags (model, batch, parallelism, ...):\n")
    assert "--model" in megatron and "--global-batch-size" in megatron and "usage:" not in megatron
    assert out.count("-h, --help") <= 1


@pytest.mark.parametrize("command, megatron_defaults", [("simulate", True), ("search", True), ("train", False)])
def test_the_model_group_says_whose_defaults_an_explicit_shape_takes(capsys, command, megatron_defaults):
    """simulate and search read a shape as Megatron-LM does (no --swiglu: a GeLU MLP); train builds this engine's
    Llama layer, so its help does not say so."""
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("An explicit shape takes Megatron-LM's defaults: a GeLU MLP of 4h unless --swiglu" in out) \
        == megatron_defaults


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"train-ledger {importlib.metadata.version('train-ledger')}\n"
