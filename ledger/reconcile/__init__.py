"""Reconciliation: every figure of a run as formula / inventory / measurement, with a verdict and an explanation.

`run.py` turns a run's evidence into rows (`rows.py`) and writes RUN/ledger/reconciliation.{json,csv}; each other
module builds the rows of one concern (memory, overlap, pipeline, comm, throughput, time, checkpoint, MoE, ...).
Where it sits among the ledger's folders: docs/architecture.md.
"""
