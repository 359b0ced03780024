"""The rollout file: what a training campaign is (model, data, topology, the algorithm's settings,
privacy, strategies), loaded and validated with messages that name the bad key.

Shared by everything that reads a rollout file: the coordinator, provisioning, the data tools,
the fleet runners and the commands. Plain data and checks: numpy and the standard library only.
"""
