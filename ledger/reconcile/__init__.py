"""Reconciliation: every figure of a run as formula / inventory / measurement, with a verdict and an explanation.

    run.py            a run directory -> rows + what is missing; writes RUN/ledger/reconciliation.{json,csv}
    evidence.py       the run's events gathered per rank (through common.run_dir)
    rows.py           the Row and its verdict
    memory.py overlap.py pipeline.py comm.py throughput.py time_rows.py    the rows of each concern
    oversubscribed.py timings of CPU ranks that outnumber their cores: shown, not judged
    trace_groups.py   which group a traced collective ran on, where the trace does not say (gloo)
    bandwidth.py      predicted collective time from the run's bandwidth sweep
    intervals.py      interval union / subtraction / coverage
    steps.py          which steps measure steady-state time (not the first, not the profiler's)
    topology.py       which ranks share a group (pure rank arithmetic)
    hta.py            HolisticTraceAnalysis cross-check (optional), on a bounded subset of ranks
    hta_job.py        one rank's HTA run in a process of its own, under a memory cap and a time budget
    ingest_megatron.py  a Megatron-LM run directory as the same evidence (megatron_tensorboard.py reads its event
                      files and traces, megatron_arguments.py its argument text as our flags)
"""
