"""Topic names, topic filters and the subscription tree (MQTT §4.7) for the embedded broker.

The structures themselves live in :mod:`fedtier.transport.topic_filters` (the in-memory transport routes
with the same tree); this module adds what only a broker needs.
"""

from __future__ import annotations

from fedtier.transport.topic_filters import SubscriptionTree, is_valid_topic_filter, is_valid_topic_name, topic_matches

SHARED_SUBSCRIPTION_PREFIX = "$share/"

__all__ = ["SHARED_SUBSCRIPTION_PREFIX", "SubscriptionTree", "is_valid_topic_filter", "is_valid_topic_name",
           "topic_matches"]
