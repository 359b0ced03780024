"""Differential privacy on the uplinks (M2FDP, seed 004): trust, noise plan, mechanism, audit.

Everything here is numpy-only and runs on devices and edges; calibration and accounting
(Google's dp-accounting) live on the coordinator, in ``cloud_coordinator.privacy``.
"""
