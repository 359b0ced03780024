"""The coordinator process and what operates it: the cloud node that drives a rollout's rounds, its
store (SQLite or PostgreSQL), preparing a rollout (artifacts, manifest, noise plan), the long-running
service, canary promotion and rollback, the operator's read side (status, export, presence), the
privacy ledger and accountants (``privacy/``) and what operators watch (``observe/``).

May import ``fedtier``, ``models``, ``device_agent`` (its trainers evaluate the global model) and
``fleet_data`` (the central test set); never the fleet runners (``local_fleet``) or the commands.
Imports torch (through ``models``) lazily.
"""
