"""The one failure of a time prediction: a figure the calibration does not hold."""
from __future__ import annotations


class CalibrationMissing(LookupError):
    """A kernel, rate or collective the prediction needs and the calibration lacks; the message names it and the
    probe that would record it, so a caller can put it in a reconciliation's `missing` or a user error."""

