"""Instrumentation the engine calls; everything is written into a crash-safe run directory.

The engine talks to one object, `probes.probe_set.ProbeSet`; a disabled probe costs nothing on the hot path.
`probes.run_dir` is torch-free so that the ledger can read run directories through the same module.
"""
