"""Errors of the provisioning tooling, under fedtier's one abstract base.

They are all operator errors (a wrong option, an existing fleet, an unknown node, a bad
CSR): the ``provision`` CLI turns each into a click error naming the option at fault.
"""

from __future__ import annotations

from fedtier.errors import FedtierError


class ProvisioningError(FedtierError):
    """Base of the provisioning errors; raised as is for an unusable broker identity or user."""


class FleetExistsError(ProvisioningError):
    """``init`` would overwrite an existing fleet (its CA and signing key) without ``force``."""


class FleetNotFoundError(ProvisioningError):
    """The fleet directory has no CA / inventory (not created with ``init``)."""


class UnknownNodeError(ProvisioningError):
    """No certificate was issued for this name (revoke, rotate)."""


class NameConflictError(ProvisioningError):
    """The name is already used by a node of another kind or cell.

    Names are MQTT usernames: a device called like a cell (or like the coordinator) would
    be granted that gateway's (or the coordinator's) ACL rights.
    """


class InvalidNameError(ProvisioningError):
    """A node, cell or broker name is not a valid fedtier id (``[A-Za-z0-9_.-]{1,64}``)."""


class CsrError(ProvisioningError):
    """A certificate signing request is forged, malformed, or for an unsupported key type."""


class BundleExistsError(ProvisioningError):
    """A bundle (or broker config) file already exists and ``force`` was not given."""
