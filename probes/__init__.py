"""Instrumentation the engine calls; everything is written into a crash-safe run directory.

The engine talks to one object, `probes.probe_set.ProbeSet`; a disabled probe costs nothing on the hot path.
The run-directory contract itself is `common.run_dir` (torch-free): the probes write through it, the ledger reads
through it.
"""
