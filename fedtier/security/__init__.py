"""Who may say what: keys and certificates, the rollout manifest, and its signature.

``pki`` creates and checks keys, CSRs and certificates (``cryptography`` only); ``manifest`` is
the rollout manifest as canonical JSON; ``signing`` signs and verifies it with Ed25519.

May import: ``fedtier.errors``, ``fedtier.training`` (layouts), ``fedtier.transport.topics``
(id rules).
"""
