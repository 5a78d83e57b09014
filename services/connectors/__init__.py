"""Tensor stores that move encoder outputs (EC) and KV caches between roles; see base.py for the contract.

Importing this package does not import torch, numpy or redis: backends load on first use.
"""

from services.connectors.base import (
    BackendUnavailable,
    ConnectorError,
    EntryCorrupt,
    EntryMissing,
    StoreConfig,
    StoreStats,
    TensorStore,
)
from services.connectors.ec import ec_key
from services.connectors.kv import kv_key
from services.connectors.registry import create_store, supported_backends, sweep_stale_segments

__all__ = ["BackendUnavailable", "ConnectorError", "EntryCorrupt", "EntryMissing", "StoreConfig", "StoreStats",
           "TensorStore", "create_store", "ec_key", "kv_key", "supported_backends", "sweep_stale_segments"]
