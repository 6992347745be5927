"""Run a function on N gloo ranks (CPU processes) and collect what each returns.

`run_distributed(fn, world_size, *args)` is the engine's own toy launcher (engine.toys.run_on_gloo_ranks): it spawns
world_size processes in one gloo group, calls fn(rank, world_size, *args) in each and returns the results by rank;
a failure on any rank raises with that rank's traceback. fn must be importable (module level).
"""
from engine.toys import run_on_gloo_ranks as run_distributed

__all__ = ["run_distributed"]
