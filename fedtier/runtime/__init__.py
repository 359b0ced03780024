"""What every node process shares: config files, logging, metrics, the node plumbing, the service loop.

``config`` turns TOML into validated frozen sections whose errors name the bad key;
``node_base`` is the message plumbing every runtime shell (device, edge, cloud) shares, in a
process or in the simulator: decode, check, reject-and-count, the run loop; ``mqtt_service``
runs such a node as a long-lived OS process over MQTT (start, signals, stop); ``metrics`` and
``logs`` are what a service exposes about itself.

May import every other ``fedtier`` sub-package; nothing below imports it.
"""
