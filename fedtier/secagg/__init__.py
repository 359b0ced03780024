"""Secure aggregation per cell (SecAgg+, Bell et al. 2020): the edge learns only its cell's sum.

``shamir`` (secret sharing), ``crypto`` (X25519, HKDF, ChaCha20-Poly1305, the mask PRG), ``ring``
(clip, scale and stochastically round into Z_{2^k}), ``graph`` (the cell's sparse sharing graph),
``protocol`` (the sans-I/O device and edge sessions) and ``messages`` (their wire types).
May import: errors, rng, wire (docs/architecture.md).
"""
