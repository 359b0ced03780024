"""Whole fleets on one machine: the in-process simulator (``simulate``, its Ray backend
``simulate_ray``), the fleet emulator (``emulator``: real agents multiplexed in worker processes, ``mux``,
``probe``), fleets as threads of one process (``threads``), ``fedtier demo`` (``demo``,
``hsgd_demo``, HSGD's in-process loop ``hsgd_loop`` and its numpy reference), writing every node's
config for a fleet (``configs``) and the reaper that stops a demo's children.

Stands above every role: may import ``fedtier``, ``models``, ``device_agent``, ``edge_broker``,
``fleet_data``, ``cloud_coordinator`` and ``provisioning``; never the commands.
"""
