"""What operators look at: Prometheus series of the coordinator (``prom``), the read-side status of
the rollouts in a store (``status``) that ``fedtier report`` (``plots``) and the dashboard (``web``) share."""
