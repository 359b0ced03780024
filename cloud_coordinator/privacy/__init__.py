"""Differential privacy on the coordinator: calibration, accounting, ledger, budget (seed 004)."""
