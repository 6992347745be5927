"""Rank groups follow Megatron Core's generate_masked_orthogonal_rank_groups (docs/engine.md, "Rank groups")."""
import json
import subprocess
import sys

import pytest

from common.errors import ConfigError
from engine.parallel_state import RankGenerator, group_lists, rank_generator_for


def test_reference_run_eight_gpu_example():
    # rank = tp + 2*dp + 4*pp for TP2 x DP2 x PP2 (docs/engine.md)
    lists = group_lists(rank_generator_for(8, tp=2, pp=2))
    assert lists["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lists["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lists["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_reference_run_rank3():
    gen = rank_generator_for(8, tp=2, pp=2)
    coords = gen.coordinates(3)
    assert (coords["tp"], coords["dp"], coords["pp"]) == (1, 1, 0)
    mine = {kind: next(g for g in groups if 3 in g) for kind, groups in group_lists(gen).items()}
    assert (mine["tp"], mine["dp"], mine["pp"]) == ([2, 3], [1, 3], [3, 7])


def _oracle(world, sizes, order, token):
    """Brute force from the definition: rank = sum(coord_a * stride_a), strides = prefix products in `order`."""
    axes = order.split("-")
    strides, s = {}, 1
    for a in axes:
        strides[a], s = s, s * sizes[a]
    coords = {r: {a: (r // strides[a]) % sizes[a] for a in axes} for r in range(world)}
    varying = token.split("-")
    groups = {}
    for r in range(world):
        key = tuple(coords[r][a] for a in axes if a not in varying)
        groups.setdefault(key, []).append(r)
    # groups enumerated with the first fixed axis fastest
    fixed = [a for a in axes if a not in varying]
    return [groups[k] for k in sorted(groups, key=lambda k: k[::-1])] if fixed else list(groups.values())


@pytest.mark.parametrize("world,tp,cp,pp,order", [
    (8, 2, 1, 2, "tp-cp-ep-dp-pp"), (16, 2, 2, 2, "tp-cp-ep-dp-pp"), (12, 3, 1, 2, "tp-cp-ep-dp-pp"),
    (8, 2, 1, 2, "tp-dp-pp-cp-ep"), (32, 4, 2, 2, "tp-pp-dp-cp-ep"), (6, 1, 1, 3, "tp-cp-ep-dp-pp"),
])
def test_groups_match_definition(world, tp, cp, pp, order):
    gen = rank_generator_for(world, tp, pp, cp, order)
    sizes = dict(gen.sizes)
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp"):
        groups = gen.get_ranks(token)
        assert groups == _oracle(world, sizes, order, token), token
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the world


def test_an_order_may_leave_out_only_axes_of_size_one():
    """As Megatron's RankGenerator: cp and ep of size 1 may be left out (appended at the end, they move no rank)."""
    short = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp")
    full = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp-cp-ep")
    assert group_lists(short) == group_lists(full)
    with pytest.raises(ConfigError, match="leaves out cp, whose size is 2"):
        RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=2, order="tp-dp-pp")
    with pytest.raises(ConfigError, match="each at most once"):
        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-dp-pp")


def test_groups_cli_text_and_json():
    out = subprocess.run([sys.executable, "-m", "cli.main", "groups", "--world-size", "8", "--tp", "2", "--pp",
                          "2"], capture_output=True, text=True, check=True).stdout
    assert "TP: [[0, 1], [2, 3], [4, 5], [6, 7]]" in out
    assert "DP: [[0, 2], [1, 3], [4, 6], [5, 7]]" in out
    assert "PP: [[0, 4], [1, 5], [2, 6], [3, 7]]" in out
    js = json.loads(subprocess.run([sys.executable, "-m", "cli.main", "groups", "--world-size", "8", "--tp", "2",
                                    "--pp", "2", "--rank", "3", "--json"], capture_output=True, text=True,
                                   check=True).stdout)
    assert js["rank"]["groups"]["pp"] == [3, 7] and js["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_groups_accepts_an_order_that_leaves_out_axes_of_size_one():
    """--order tp-pp-dp with cp = ep = 1 (Megatron appends the missing axes): rank = tp + 2 pp + 4 dp."""
    js = json.loads(subprocess.run([sys.executable, "-m", "cli.main", "groups", "--world-size", "8", "--tp", "2",
                                    "--pp", "2", "--order", "tp-pp-dp", "--json"], capture_output=True, text=True,
                                   check=True).stdout)
    assert js["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert js["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert js["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("args", [["--world-size", "6", "--tp", "4"], ["--world-size", "8", "--bogus"],
                                  ["--world-size", "8", "--rank", "9"],
                                  ["--world-size", "8", "--tp", "2", "--pp", "2", "--order", "tp-dp"]])
def test_groups_bad_input(args):
    r = subprocess.run([sys.executable, "-m", "cli.main", "groups", *args], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "error" in r.stderr


def _created_groups(rank: int, world_size: int, layout: dict) -> dict:
    """ParallelState.initialize on this gloo rank, counting the torch.distributed groups it creates."""
    import torch.distributed as dist

    from engine.parallel_state import LayoutGroup, ParallelState

    created = []
    new_group = dist.new_group

    def counting(ranks, *args, **kwargs):
        created.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = counting
    try:
        state = ParallelState.initialize(**layout)
    finally:
        dist.new_group = new_group
    return {"created": created, "ranks": state.ranks,
            "handles": {kind: (type(g).__name__, g.size(), g.rank()) for kind, g in state.groups.items()},
            "no_communicator": sorted(k for k, g in state.groups.items() if isinstance(g, LayoutGroup))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2, pp=2), dict(pp=2, ep=2, moe=True)], ids=["tp2-pp2", "pp2-ep2-moe"])
def test_the_engine_creates_a_group_only_where_a_collective_can_run(layout):
    """World 4 on gloo: every rank creates exactly the groups of more than one rank of Megatron's lists (dense and,
    for MoE, expert), in the same order; a kind whose group is the rank alone gets a LayoutGroup (size 1, rank 0),
    and ParallelState.ranks still records every kind the rank is in (the manifest's groups, checked by reconcile; a
    last stage is in no position group)."""
    from engine.parallel_state import expert_group_lists, expert_rank_generator_for
    from tests.support.gloo import run_distributed

    results = run_distributed(_created_groups, 4, layout)
    tp, pp, ep = layout.get("tp", 1), layout["pp"], layout.get("ep", 1)
    lists = group_lists(rank_generator_for(4, tp, pp))
    if layout.get("moe"):
        lists.update(expert_group_lists(expert_rank_generator_for(4, tp, pp, ep)))
    expected = [group for groups in lists.values() for group in groups if len(group) > 1]
    for rank, res in enumerate(results):
        assert res["created"] == expected, rank
        assert all(len(group) > 1 for group in res["created"])
        assert res["ranks"].keys() == {kind for kind, groups in lists.items() if any(rank in g for g in groups)}
        alone = sorted(kind for kind, ranks in res["ranks"].items() if len(ranks) == 1)
        assert res["no_communicator"] == alone and alone  # each layout has kinds of one rank
        assert all(res["handles"][kind] == ("LayoutGroup", 1, 0) for kind in alone)
        assert all(res["handles"][kind][1:] == (len(ranks), ranks.index(rank))
                   for kind, ranks in res["ranks"].items())


def test_a_world_of_one_creates_no_group_at_all():
    """One process: every kind is the rank alone, so initialize creates no torch.distributed group (on a GPU: no
    communicator beyond the default group's, docs/engine.md "Rank groups")."""
    from tests.support.gloo import world_of_one

    with world_of_one():
        res = _created_groups(0, 1, dict(moe=True))
    assert res["created"] == []
    assert len(res["ranks"]) == 11 and res["no_communicator"] == sorted(res["ranks"])
