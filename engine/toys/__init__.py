"""Toys that run on the engine's real classes, small enough for CPU (`train-ledger buffer`)."""
