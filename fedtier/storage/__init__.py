"""Local durable state: SQLite as every fedtier store uses it (one connection, WAL, transactions).

May import: ``fedtier.errors`` only.
"""
