"""Every numeric flag of every command, at 0, negative, huge and non-numeric values: one line on stderr naming the
problem, exit status 2, nothing on stdout, nothing started (a property-based test with hypothesis).

The flags are read off the commands' own parsers, so a flag added later is covered without editing this file.
Commands run in this process; what a valid value would start (torchrun, the Streamlit server, the demo's training)
is replaced by a tripwire that fails the test. Meanings that are not errors are stated where they apply:
--train-iters has no upper bound (a long run is a user's choice), so "huge" is not drawn for it when a command would
start on it; a global batch is bounded (2^24 sequences), and simulate and search walk a bounded step.
"""
from __future__ import annotations

import argparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli import demo, train
from cli.train import launcher_parser
from common.arguments import build_parser
from tests.support.cli import run

# Values that are never a valid count, size, rate or port.
ZERO = st.just("0")
NEGATIVE = st.integers(max_value=-1).map(str)
HUGE = st.integers(min_value=10**9, max_value=10**30).map(str)
NON_NUMERIC = st.sampled_from(["abc", "1.5.2", "", "0x", "--", "1e", "twelve", "nan", "inf", "-inf"])
BAD = st.one_of(ZERO, NEGATIVE, HUGE, NON_NUMERIC)
UNBOUNDED_COUNTS = {"--train-iters", "--lr-decay-iters", "--log-interval", "--seed",
                    "--profile-step-start", "--profile-step-end", "--lr-warmup-iters", "--ddp-bucket-size",
                    "--recompute-num-layers",
                    "--save-interval"}  # longer than the run: never saves, as runs/megatron/run.sh uses it (Megatron)
BOUNDED_RATES = {"--adam-beta1", "--adam-beta2", "--attention-dropout", "--hidden-dropout"}
# Flags where 0 is a meaning, not an error: no warm-up, no weight decay, no clipping, no NVML sampling, a zero init
# for the tests' toys, seed 0, the first rank, no dropout (the only dropout accepted), no load-balancing loss.
ZERO_IS_VALID = {"--lr-warmup-iters", "--weight-decay", "--clip-grad", "--nvml-interval", "--init-method-std",
                 "--seed", "--node-rank", "--rank", "--lr", "--min-lr", "--adam-beta1", "--adam-beta2",
                 "--attention-dropout", "--hidden-dropout", "--profile-ranks", "--moe-aux-loss-coeff"}


def numeric_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(a.option_strings[0] for a in parser._actions
                  if a.option_strings and a.type in (int, float))


class Started(AssertionError):
    """A command got past its checks and would have started something."""


def tripwire(*_args, **_kwargs):
    raise Started("the command would have started (a bad value got through)")


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    monkeypatch.setattr(train, "supervise", tripwire)
    monkeypatch.setattr(demo, "train_phase", tripwire)
    monkeypatch.setattr("os.execve", tripwire)


def assert_refused(argv: list[str]) -> None:
    status, out, err = run(argv)
    lines = err.strip().splitlines()
    assert (status, out) == (2, ""), (argv, status, out, err)
    assert len(lines) == 1 and "error" in lines[0], (argv, err)


MEGATRON_FLAGS = numeric_flags(build_parser())
# A huge rate, coefficient or step count is a user's choice, not an error (a float flag has no upper bound but
# Adam's betas and the dropouts); a huge size is refused (common.config bounds sizes).
UNBOUNDED = UNBOUNDED_COUNTS | {a.option_strings[0] for a in build_parser()._actions
                                if a.option_strings and a.type is float} - BOUNDED_RATES
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("command", [["plan", "--model", "tiny"],
                                     ["simulate", "--model", "tiny", "--world-size", "1", "--hardware", "H200"]],
                         ids=["plan", "simulate"])
@SETTINGS
@given(flag=st.sampled_from(MEGATRON_FLAGS), value=BAD)
def test_plan_and_simulate_refuse_every_bad_number(command, flag, value):
    if value == "0" and flag in ZERO_IS_VALID:
        return
    if flag in UNBOUNDED and value.isdigit() and value != "0":
        return  # huge but meaningful: the plan of a very long run, a large learning rate, ...
    assert_refused([*command, flag, value])


@SETTINGS
@given(flag=st.sampled_from(MEGATRON_FLAGS + ["--gpus", "--top"]), value=BAD)
def test_search_refuses_every_bad_number(flag, value):
    if value == "0" and flag in ZERO_IS_VALID:
        return
    if (flag in UNBOUNDED or flag == "--top") and value.isdigit() and value != "0":
        return  # huge but meaningful (the top billion layouts: all of them)
    args = {"--gpus": "8", "--top": "3"}
    args[flag] = value
    assert_refused(["search", "--model", "tiny", "--hardware", "H200", *[x for pair in args.items() for x in pair]])


@SETTINGS
@given(flag=st.sampled_from(MEGATRON_FLAGS + numeric_flags(launcher_parser())), value=BAD)
def test_train_refuses_every_bad_number_before_starting_a_rank(flag, value):
    if value == "0" and flag in ZERO_IS_VALID:
        return
    if flag in UNBOUNDED and value.isdigit() and value != "0":
        return  # huge but meaningful (a very long run): starting it is the documented meaning
    if flag == "--world-size":
        return  # `train` takes its world from the launcher and ignores --world-size (documented in --help)
    assert_refused(["train", "--model", "tiny", flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--world-size", "--tp", "--pp", "--cp", "--ep", "--rank"]), value=BAD)
def test_groups_refuses_every_bad_number(flag, value):
    if value == "0" and flag == "--rank":
        return
    base = ["--world-size", "8"] if flag != "--world-size" else []
    assert_refused(["groups", *base, flag, value])


@SETTINGS
@given(flag=st.sampled_from(["--pp", "--microbatches", "--vpp"]), value=BAD)
def test_schedule_refuses_every_bad_number(flag, value):
    args = {"--pp": "2", "--microbatches": "8", "--vpp": "1"}
    args[flag] = value
    assert_refused(["schedule", *[x for pair in args.items() for x in pair]])


@SETTINGS
@given(value=BAD)
def test_dashboard_refuses_every_bad_port(value, tmp_path_factory):
    assert_refused(["dashboard", "--runs-root", str(tmp_path_factory.getbasetemp()), "--port", value])


@SETTINGS
@given(value=BAD)
def test_demo_refuses_every_bad_step_count(value):
    assert_refused(["demo", "--train-iters", value])


@SETTINGS
@given(steps=st.one_of(BAD, st.tuples(BAD, BAD).map("-".join)),
       ranks=st.one_of(BAD.filter(lambda v: v != "0"), st.just("1-0"), HUGE.map("0-{}".format)))
def test_export_trace_refuses_bad_steps_and_ranks(steps, ranks, tmp_path_factory):
    out = tmp_path_factory.getbasetemp() / "merged.json.gz"
    run_dir = "tests/fixtures/gpu_h200_llama1b_l2"
    assert_refused(["export-trace", run_dir, "--out", str(out), "--steps", steps])
    assert_refused(["export-trace", run_dir, "--out", str(out), "--ranks", ranks])
    assert not out.exists()


def test_the_flags_under_test_are_the_parsers_own():
    """The property tests cover what the parsers accept; a new numeric flag joins them by itself."""
    assert {"--seq-length", "--hidden-size", "--num-attention-heads", "--lr", "--adam-eps"} <= set(MEGATRON_FLAGS)
    assert {"--nproc-per-node", "--nnodes", "--node-rank", "--master-port"} <= set(numeric_flags(launcher_parser()))
