"""ledger.evidence.layout: Megatron Core's rank-group rule, derived without the engine, and agreeing with it by test.

Specification: with sizes ordered by the order string (first axis fastest), rank = sum(coordinate x prefix product);
the group of a set of axes is every rank reached by moving along those axes, groups enumerated with the first fixed
axis fastest (Megatron's generate_masked_orthogonal_rank_groups). docs/engine.md's 8-GPU
example (TP2 x PP2 x DP2) is the oracle.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from common.errors import ConfigError
from ledger.evidence.layout import (
    AXES,
    Layout,
    coordinates,
    expert_coordinates,
    expert_group_lists,
    expert_layout,
    group_lists,
    normalize_order,
    rank_groups,
    rank_groups_of,
)


def test_reference_eight_gpu_layout():
    lists = group_lists(Layout.of(8, tp=2, pp=2))
    assert lists["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lists["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["position"] == [[0], [1], [2], [3]]
    assert lists["cp"] == [[r] for r in range(8)]
    assert lists["dp_cp"] == lists["dp"]


def test_reference_rank3():
    layout = Layout.of(8, tp=2, pp=2)
    assert coordinates(layout, 3) == {"tp": 1, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    mine = rank_groups_of(layout, 3)
    assert (mine["tp"], mine["dp"], mine["pp"]) == ([2, 3], [1, 3], [3, 7])


def test_order_tp_pp_dp_with_cp_ep_omitted():
    layout = Layout.of(8, tp=2, pp=2, order="tp-pp-dp")
    assert layout.order == "tp-pp-dp-cp-ep"
    rank = {(t, p, d): t + 2 * p + 4 * d for t, p, d in itertools.product(range(2), repeat=3)}
    # groups enumerated over the fixed coordinates, the first fixed axis (in order) fastest
    expected_tp = [[rank[t, p, d] for t in range(2)] for d in range(2) for p in range(2)]
    expected_pp = [[rank[t, p, d] for p in range(2)] for d in range(2) for t in range(2)]
    expected_dp = [[rank[t, p, d] for d in range(2)] for p in range(2) for t in range(2)]
    assert expected_tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expected_pp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert expected_dp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    lists = group_lists(layout)
    assert (lists["tp"], lists["pp"], lists["dp"]) == (expected_tp, expected_pp, expected_dp)
    for (t, p, d), r in rank.items():
        assert coordinates(layout, r) == {"tp": t, "cp": 0, "ep": 0, "dp": d, "pp": p}


def test_order_omitting_an_axis_larger_than_one_is_rejected():
    with pytest.raises(ConfigError, match=r"order 'tp-pp' omits dp of size 2"):
        Layout.of(8, tp=2, pp=2, order="tp-pp")
    with pytest.raises(ConfigError, match="omits dp of size 2"):
        normalize_order("tp-pp", {"tp": 2, "cp": 1, "ep": 1, "dp": 2, "pp": 2})


def test_order_names():
    sizes = {a: 1 for a in AXES}
    assert normalize_order("PP-TP", sizes) == ["pp", "tp", "cp", "ep", "dp"]
    with pytest.raises(ConfigError, match="must name axes among tp-cp-ep-dp-pp, each at most once"):
        normalize_order("tp-xp", sizes)
    with pytest.raises(ConfigError, match="each at most once"):
        normalize_order("tp-tp-dp", sizes)
    with pytest.raises(ConfigError, match="group token 'tp-xp'"):
        rank_groups(Layout.of(4, tp=2), "tp-xp")


def test_layout_of_divisibility_and_sizes():
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp 4 x pp 1 x cp 1 = 4"):
        Layout.of(6, tp=4)
    with pytest.raises(ConfigError, match="ep 4"):
        Layout.of(8, tp=1, ep=4, cp=4)
    for bad in ({"tp": 0}, {"pp": -1}, {"cp": 0}, {"vpp": 0}):
        with pytest.raises(ConfigError, match=">= 1"):
            Layout.of(8, **bad)
    with pytest.raises(ConfigError, match=">= 1"):
        Layout.of(0)
    with pytest.raises(ConfigError, match="world size 8 !="):
        Layout(8, tp=2, cp=1, ep=1, dp=2, pp=1)  # direct construction is checked too
    assert Layout.of(24, tp=2, pp=3, cp=2).dp == 2
    assert Layout.of(16, tp=2, ep=2).sizes == {"tp": 2, "cp": 1, "ep": 2, "dp": 4, "pp": 1}


def test_a_runs_layout_comes_from_its_config():
    """The evidence derives one Layout from the run's RunConfig (the manifest's config, read once), and none
    without a config: no groups are guessed for a run that does not say its layout."""
    from common.arguments import parse_args
    from ledger.evidence.run import RunEvidence, layout_of

    cfg = parse_args("--model tiny --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                     "--context-parallel-size 2 --global-batch-size 4".split(), world_size=16)
    layout = layout_of(cfg)
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.vpp) == (2, 2, 2, 2, 1)
    assert layout.order == "tp-cp-ep-dp-pp"
    bare = RunEvidence(run_dir=Path("."), manifest={"world_size": 4}, config=None, ranks={}, traces=[])
    assert bare.layout is None and bare.groups(0) == {} and bare.coords(0) == {}


def test_coordinates_range():
    layout = Layout.of(8, tp=2, pp=2)
    for rank in (-1, 8):
        with pytest.raises(ConfigError, match="outside the world of 8"):
            coordinates(layout, rank)


def test_middle_stage_is_in_no_embedding_group():
    layout = Layout.of(4, pp=4)
    assert "embedding" not in rank_groups_of(layout, 1)
    assert rank_groups_of(layout, 3)["embedding"] == [0, 3]
    assert rank_groups_of(layout, 0)["position"] == [0]


def test_every_kind_partitions_the_world():
    layout = Layout.of(48, tp=2, pp=3, cp=2, order="pp-dp-tp-cp-ep")
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp-ep-dp-pp"):
        groups = rank_groups(layout, token)
        assert sorted(r for g in groups for r in g) == list(range(48)), token


WORLDS = [*range(1, 17), 18, 20, 24, 30, 32, 36, 48, 60, 64]
ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "pp-dp-tp-ep-cp", "dp-tp-cp-pp-ep", "cp-ep-pp-tp-dp"]


def _layouts():
    for world in WORLDS:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        for tp, pp, cp in itertools.product(divisors, repeat=3):
            if world % (tp * pp * cp) == 0:
                yield world, tp, pp, cp


def test_agrees_with_the_engine():
    """Group lists and coordinates equal the engine's, for every divisor layout (tp, pp, cp) of the worlds above,
    in the default order and in one permuted order (the four taken in turn). The engine is imported here only,
    never by the ledger."""
    from engine.parallel_state import group_lists as engine_group_lists
    from engine.parallel_state import rank_generator_for

    checked = 0
    for i, (world, tp, pp, cp) in enumerate(_layouts()):
        for order in (ORDERS[0], ORDERS[1 + i % (len(ORDERS) - 1)]):
            layout = Layout.of(world, tp=tp, pp=pp, cp=cp, order=order)
            gen = rank_generator_for(world, tp, pp, cp, order)
            assert group_lists(layout) == engine_group_lists(gen), (world, tp, pp, cp, order)
            assert ([coordinates(layout, r) for r in range(world)]
                    == [gen.coordinates(r) for r in range(world)]), (world, tp, pp, cp, order)
            checked += 1
    assert checked == 2 * 968


@pytest.mark.parametrize("token", ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp", "cp-pp", "pp-tp"])
def test_rank_groups_agree_with_engine_get_ranks(token):
    from engine.parallel_state import rank_generator_for

    for world, tp, pp, cp in [(8, 2, 2, 1), (16, 2, 2, 2), (48, 2, 3, 2), (64, 4, 2, 2), (12, 3, 2, 1)]:
        for order in ORDERS:
            assert (rank_groups(Layout.of(world, tp=tp, pp=pp, cp=cp, order=order), token)
                    == rank_generator_for(world, tp, pp, cp, order).get_ranks(token))


# --- the expert grid (Megatron's second rank generator) -----------------------------------------------------------
def test_expert_groups_of_world_4_ep_2_by_hand():
    """rank = ep + 2 x expt_dp (tp 1, pp 1): an EP group varies ep, an expert-DP group varies expt_dp."""
    lists = expert_group_lists(expert_layout(4, ep=2))
    assert lists["ep"] == [[0, 1], [2, 3]]
    assert lists["expt_dp"] == [[0, 2], [1, 3]]
    assert lists["expt_mp"] == [[0, 1], [2, 3]]  # tp-ep-pp: here the EP groups


def test_expert_groups_of_world_8_tp_2_ep_2_by_hand():
    """rank = tp + 2 x (ep + 2 x expt_dp): EP neighbours are 2 apart, expert-DP neighbours 4 apart."""
    layout = expert_layout(8, tp=2, ep=2)
    lists = expert_group_lists(layout)
    assert lists["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["expt_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["expt_mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert_coordinates(layout, 6) == {"ep": 1, "expt_dp": 1}


EXPERT_LAYOUTS = [(4, 1, 1, 2), (8, 2, 1, 2), (8, 1, 2, 2), (16, 2, 2, 4), (16, 2, 2, 2), (16, 1, 1, 8),
                  (24, 2, 3, 2), (32, 2, 2, 4)]


def test_expert_groups_agree_with_the_engine():
    """The ledger's expert lists equal engine.parallel_state.expert_group_lists (world, tp, pp, ep), in every order;
    cp plays no part (world 16 tp 2 pp 2 ep 4 is also cp 2's expert grid: cp folds into expert-dp)."""
    from engine.parallel_state import expert_group_lists as engine_expert_group_lists
    from engine.parallel_state import expert_rank_generator_for

    for world, tp, pp, ep in EXPERT_LAYOUTS:
        for order in ORDERS:
            gen = expert_rank_generator_for(world, tp, pp, ep, order)
            layout = expert_layout(world, tp=tp, pp=pp, ep=ep, order=order)
            assert expert_group_lists(layout) == engine_expert_group_lists(gen), (world, tp, pp, ep, order)
            assert ([coordinates(layout, r) for r in range(world)]
                    == [gen.coordinates(r) for r in range(world)]), (world, tp, pp, ep, order)


def test_expert_pp_groups_are_the_dense_grids():
    """A rank holds the same layers on both grids."""
    for world, tp, pp, ep in EXPERT_LAYOUTS:
        dense = Layout.of(world, tp=tp, pp=pp)
        assert rank_groups(expert_layout(world, tp=tp, pp=pp, ep=ep), "pp") == rank_groups(dense, "pp")


def test_expert_layout_refuses_what_does_not_divide():
    with pytest.raises(ConfigError, match="ep must be >= 1"):
        expert_layout(8, ep=0)
    with pytest.raises(ConfigError, match="not divisible by tp 2 x ep 3 x pp 1 = 6"):
        expert_layout(8, tp=2, ep=3)


def _groups_cli(argv: list[str]) -> tuple[int, str, str]:
    from tests.support.cli import run

    return run(["groups", *argv])


def test_groups_cli_prints_the_expert_groups_and_a_ranks_expert_coordinates():
    import json

    status, out, _ = _groups_cli(["--world-size", "16", "--tp", "2", "--pp", "2", "--cp", "2", "--ep", "4",
                                  "--rank", "5", "--json"])
    data = json.loads(out)
    experts = expert_group_lists(expert_layout(16, tp=2, pp=2, ep=4))
    assert status == 0 and (data["ep"], data["expt_dp"]) == (experts["ep"], experts["expt_dp"])
    assert data["cp"] == rank_groups(Layout.of(16, tp=2, pp=2, cp=2), "cp")
    # rank 5 = tp 1 + 2 x (ep 2 + 4 x (expt_dp 0 + 1 x pp 0))
    assert data["rank"]["expert_coordinates"] == {"ep": 2, "expt_dp": 0}
    assert data["rank"]["groups"]["ep"] == [1, 3, 5, 7]
    status, out, _ = _groups_cli(["--world-size", "4", "--ep", "2"])
    assert status == 0 and "EP: [[0, 1], [2, 3]]" in out and "EXPT_DP: [[0, 2], [1, 3]]" in out


@pytest.mark.parametrize("argv, message", [(["--ep", "0"], "ep must be >= 1"),
                                           (["--ep", "3"], "not divisible by tp 1 x ep 3 x pp 1"),
                                           (["--tp", "2", "--ep", "8"], "not divisible by tp 2 x ep 8 x pp 1"),
                                           (["--ep", "2", "--order", "tp-cp-dp-pp"], "omits ep of size 2")])
def test_groups_cli_refuses_a_bad_ep_in_one_line(argv, message):
    status, out, err = _groups_cli(["--world-size", "8", *argv])
    assert (status, out) == (2, "") and len(err.strip().splitlines()) == 1 and message in err
