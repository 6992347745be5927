"""ledger.rank_groups: Megatron Core's rank-group rule, derived without the engine, and agreeing with it by test.

Specification: with sizes ordered by the order string (first axis fastest), rank = sum(coordinate x prefix product);
the group of a set of axes is every rank reached by moving along those axes, groups enumerated with the first fixed
axis fastest (Megatron's generate_masked_orthogonal_rank_groups). The seed's 8-GPU example is the oracle.
"""
from __future__ import annotations

import itertools

import pytest

from common.errors import ConfigError
from ledger.rank_groups import AXES, Layout, coordinates, group_lists, normalize_order, rank_groups, rank_groups_of


def test_seed_eight_gpu_layout():
    lists = group_lists(Layout.of(8, tp=2, pp=2))
    assert lists["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lists["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["position"] == [[0], [1], [2], [3]]
    assert lists["cp"] == [[r] for r in range(8)]
    assert lists["dp_cp"] == lists["dp"]


def test_seed_rank3():
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


def test_layout_from_manifest():
    assert Layout.from_manifest({"world_size": 4}) == Layout(4, tp=1, cp=1, ep=1, dp=4, pp=1)
    manifest = {"world_size": 16, "config": {"parallel": {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": None, "order": "tp-cp-dp-pp"}}}
    layout = Layout.from_manifest(manifest)
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.vpp) == (2, 2, 2, 2, 1)
    assert layout.order == "tp-cp-dp-pp-ep"
    manifest["config"]["parallel"]["virtual_pipeline_model_parallel_size"] = 3
    assert Layout.from_manifest(manifest).vpp == 3
    with pytest.raises(ConfigError, match="no world_size"):
        Layout.from_manifest({"config": {}})


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
