"""Fleet provisioning: the CA, node identities, enrollment bundles, revocation and broker configs.

* :mod:`provisioning.ca` — pure X.509: the fleet CA, client (clientAuth) and server
  (serverAuth + SAN) certificates, CSR checks, CRLs.
* :mod:`provisioning.fleet` — the fleet directory (``ca.key``, ``signing.key``, ``crl.pem``,
  ``inventory.json``): issue, revoke, list, with name-aliasing checks.
* :mod:`provisioning.bundles` — enrollment bundles (cert, key, CA, trusted manifest keys,
  a config that loads with the node's config class), the CSR flow, rotation.
* :mod:`provisioning.broker_config` — Mosquitto 2.0 configs: mutual TLS, CRL, per-role ACLs
  for a cell's broker or one combined broker (``combined_broker_config``).
* :mod:`provisioning.cli` — ``fedtier provision ...``.

Key and certificate primitives shared with the devices live in :mod:`fedtier.security.pki`.
"""
