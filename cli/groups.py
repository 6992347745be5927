"""`train-ledger groups`: the rank lists of a layout, as Megatron Core builds them (the ledger's derivation,
ledger/rank_groups.py, which tests hold equal to the groups the engine creates)."""
from __future__ import annotations

import json

from cli.args import CommandParser


def main(argv: list[str]) -> int:
    from ledger.rank_groups import Layout, coordinates, group_lists, rank_groups_of

    p = CommandParser("groups")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--order", default="tp-cp-ep-dp-pp")
    p.add_argument("--rank", type=int)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    layout = Layout.of(a.world_size, tp=a.tp, pp=a.pp, cp=a.cp, order=a.order)
    lists = group_lists(layout)
    out = {kind: lists[kind] for kind in ("tp", "cp", "dp", "pp")}
    if a.rank is not None:
        coords = coordinates(layout, a.rank)
        out["rank"] = {"rank": a.rank, "coordinates": {k: coords[k] for k in ("tp", "cp", "dp", "pp")},
                       "groups": rank_groups_of(layout, a.rank)}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"world {a.world_size} = tp {a.tp} x cp {a.cp} x dp {layout.dp} x pp {a.pp}  (order {a.order})")
    for kind in ("tp", "cp", "dp", "pp"):
        print(f"{kind.upper()}: {out[kind]}")
    if a.rank is not None:
        r = out["rank"]
        print(f"rank {a.rank}: " + " ".join(f"{k}={v}" for k, v in r["coordinates"].items()))
        for kind, ranks in r["groups"].items():
            print(f"  {kind}: {ranks}")
    return 0
