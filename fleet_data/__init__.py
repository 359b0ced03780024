"""Users' data and the built-in datasets, as per-device shards: the datasets and their non-iid
partitions over a fleet (``datasets``), HSGD's hybrid (row- and column-split) data (``hybrid``),
reading a user's CSV or .npz table (``tables``), splitting it into one shard per device
(``split``), and writing each device's shard where its agent reads it (``shards``).

May import ``fedtier`` and ``device_agent`` (the shard format is the agent's); nothing above.
scikit-learn (the bundled datasets) is imported lazily.
"""
