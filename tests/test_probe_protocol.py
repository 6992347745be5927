"""The probe interface (probes.protocol.ProbeSetProtocol): the live ProbeSet and the disabled NullProbeSet both provide
it, every call it allows is one both accept, and every engine signature that takes probes names it."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.arguments import parse_args
from probes.probe_set import NullProbeSet, ProbeSet
from probes.protocol import ProbeSetProtocol

REPO = Path(__file__).resolve().parent.parent
METHODS = [name for name, member in vars(ProbeSetProtocol).items()
           if inspect.isfunction(member) and not name.startswith("_")]


@pytest.fixture
def live(tmp_path: Path):
    """A ProbeSet writing a run directory, for one rank outside torch.distributed (a synthetic parallel state: the
    probe set reads only rank, world size, coordinates and group ranks from it)."""
    run_dir = tmp_path / "run"
    cfg = parse_args(["--model", "tiny", "--global-batch-size", "1", "--run-dir", str(run_dir)])
    parallel_state = SimpleNamespace(rank=0, world_size=1, coordinates={}, ranks={})
    probes = ProbeSet(cfg, parallel_state, argv=[])
    yield probes
    probes.close()


def test_the_protocol_names_every_call_of_the_engine():
    assert sorted(METHODS) == sorted(["memory_point", "inventory", "range", "comm_issue", "comm_end",
                                      "collective_sweep", "compute_sweep", "host_sweep", "checkpoint", "step_begin",
                                      "step_end", "close"])
    assert "enabled" in ProbeSetProtocol.__annotations__


def test_both_probe_sets_are_probe_set_protocols(live: ProbeSet):
    assert isinstance(NullProbeSet(), ProbeSetProtocol)
    assert isinstance(live, ProbeSetProtocol)
    assert (NullProbeSet.enabled, live.enabled) == (False, True)


def test_an_object_lacking_a_call_is_not_one():
    class NoClose(NullProbeSet):
        close = None  # type: ignore[assignment]

    assert not isinstance(NoClose(), ProbeSetProtocol)


def _calls(signature: inspect.Signature) -> list[tuple[tuple, dict]]:
    """Two calls the protocol's signature allows (without self): the required parameters only, and every one named
    (an extra keyword where it takes **kwargs)."""
    required: tuple[list, dict] = ([], {})
    full: tuple[list, dict] = ([], {})
    for p in list(signature.parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            full[1]["extra_attr"] = 1
        elif p.kind is p.VAR_POSITIONAL:
            continue
        elif p.kind is p.KEYWORD_ONLY:
            full[1][p.name] = object()
            if p.default is p.empty:
                required[1][p.name] = object()
        else:
            full[0].append(object())
            if p.default is p.empty:
                required[0].append(object())
    return [(tuple(required[0]), required[1]), (tuple(full[0]), full[1])]


@pytest.mark.parametrize("implementation", [NullProbeSet, ProbeSet], ids=["null", "live"])
@pytest.mark.parametrize("method", METHODS)
def test_every_call_the_protocol_allows_binds_to_each_implementation(implementation: type, method: str):
    wanted = inspect.signature(getattr(ProbeSetProtocol, method))
    have = inspect.signature(getattr(implementation, method))
    assert list(have.parameters)[:1] == ["self"]
    for args, kwargs in _calls(wanted):
        have.bind(None, *args, **kwargs)  # raises TypeError when the implementation refuses the call
    positional = [p.name for p in wanted.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in have.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional


def test_every_engine_signature_that_takes_probes_names_the_protocol():
    """Parameters and dataclass fields called probes, in every engine module."""
    untyped = []
    for path in sorted((REPO / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                named = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                named = [(node.target.id, node.annotation)]
            else:
                continue
            untyped += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name, annotation in named
                        if name == "probes" and "ProbeSetProtocol" not in ast.unparse(annotation or ast.Constant(""))]
    assert untyped == []
