"""The ``fedtier`` subcommands of the coordinator's host: thin click modules over library functions.

``fedtier.cli`` loads each one by name on first use (``LAZY_COMMANDS``), so ``fedtier --help``
imports none of them and ``fedtier agent ...`` never imports this package. The device's, the
edge's and provisioning's own commands stay in their packages (``device_agent.cli``,
``edge_broker.cli``, ``provisioning.cli``): a board or a gateway installs no more than it runs.
May import every package; nothing imports it but ``fedtier.cli``.
"""
