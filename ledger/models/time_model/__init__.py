"""The time model: a training step's time predicted from the run's config and the machine's calibration only, never
from the step times of the run it is judged against. Torch-free.

    cal = Calibration.from_records(compute_records, bandwidth_records)   # a run's `compute` and `bandwidth` events
    prediction = predict_step(cfg, cal)     # StepPrediction: step time, tokens/s, per stage (StagePrediction:
                                            # forward / backward per micro-batch, bubble, exposed comm per group,
                                            # optimizer), per DP bucket (BucketComm), the critical stage's terms
    stage_time(cfg, cal, pp_rank)           # StageTime: one stage's forward / backward per micro-batch alone

Both raise CalibrationMissing naming what the calibration lacks. One concept a module: ops (the work of a pass, op
by op; an MoE layer's router, permutes, experts at their uniform-routing rows and all-to-alls included), calibration
(measured kernel times, rates, link fits, the host's costs), comm (latency + size / bandwidth), compute (a pass's
time and its parameter marks), buckets (DP issue points and exposure), host_costs (the host primitives' prices),
host_recipe (the primitives each entry costs the engine's host), host_timeline (two clocks, one program), host (a
stage's step on both clocks), step (the replay). docs/formulas.md, "Time model" and "Host timeline", derives each and
lists the tolerances its rows are judged with.
"""
from ledger.models.time_model.buckets import BucketComm
from ledger.models.time_model.calibration import Calibration, oversubscription
from ledger.models.time_model.comm import CommModel, LinkFit
from ledger.models.time_model.compute import StageTime, stage_time
from ledger.models.time_model.missing import CalibrationMissing
from ledger.models.time_model.prediction import StagePrediction, StepPrediction
from ledger.models.time_model.step import predict_step

__all__ = ["BucketComm", "Calibration", "CalibrationMissing", "CommModel", "LinkFit", "StagePrediction", "StageTime",
           "StepPrediction", "oversubscription", "predict_step", "stage_time"]
