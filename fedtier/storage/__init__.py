"""Local durable state of devices and edges: SQLite (one connection, WAL, transactions).

May import: ``fedtier.errors`` only.
"""
