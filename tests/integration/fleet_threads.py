"""The tests' name for ``cloud_coordinator.thread_fleet`` (a fleet's nodes as threads over a real broker)."""

from cloud_coordinator.thread_fleet import Running, ThreadFleet

__all__ = ["Running", "ThreadFleet"]
