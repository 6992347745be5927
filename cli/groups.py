"""`train-ledger groups`: the rank lists of a layout, as Megatron Core builds them (the ledger's derivation,
ledger/evidence/layout.py, which tests hold equal to the groups the engine creates): the dense grid's tp, cp, dp and pp
groups, and the expert grid's ep and expt_dp groups (Megatron's second rank generator: tp x ep x expert-dp x pp,
expert-dp = world / (tp x ep x pp); --ep 1 gives the groups a dense model never uses, as Megatron still builds them)."""
from __future__ import annotations

import json

from cli.args import CommandParser

DENSE_KINDS = ("tp", "cp", "dp", "pp")
EXPERT_KINDS = ("ep", "expt_dp")


def main(argv: list[str]) -> int:
    from ledger.evidence.layout import (
        Layout,
        coordinates,
        expert_coordinates,
        expert_group_lists,
        expert_layout,
        group_lists,
        rank_groups_of,
    )

    p = CommandParser("groups")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (Megatron's --expert-model-parallel-size)")
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.add_argument("--rank", type=int)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    layout = Layout.of(a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, order=a.order)
    experts = expert_layout(a.world_size, tp=a.tp, pp=a.pp, ep=a.ep, order=a.order)
    lists = {**group_lists(layout), **expert_group_lists(experts)}
    out = {kind: lists[kind] for kind in DENSE_KINDS + EXPERT_KINDS}
    if a.rank is not None:
        coords = coordinates(layout, a.rank)
        expert_groups = {kind: g for kind, groups in expert_group_lists(experts).items() for g in groups
                         if a.rank in g}
        out["rank"] = {"rank": a.rank, "coordinates": {k: coords[k] for k in DENSE_KINDS},
                       "expert_coordinates": expert_coordinates(experts, a.rank),
                       "groups": {**rank_groups_of(layout, a.rank), **expert_groups}}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"world {a.world_size} = tp {a.tp} x cp {a.cp} x dp {layout.dp} x pp {a.pp}  (order {a.order})")
    print(f"experts: world {a.world_size} = tp {a.tp} x ep {a.ep} x expt_dp {experts.dp} x pp {a.pp}  "
          "(Megatron's expert rank generator)")
    for kind in DENSE_KINDS + EXPERT_KINDS:
        print(f"{kind.upper()}: {out[kind]}")
    if a.rank is not None:
        r = out["rank"]
        print(f"rank {a.rank}: " + " ".join(f"{k}={v}" for k, v in r["coordinates"].items()) + "  experts: "
              + " ".join(f"{k}={v}" for k, v in r["expert_coordinates"].items()))
        for kind, ranks in r["groups"].items():
            print(f"  {kind}: {ranks}")
    return 0
