"""The redis backend on a real 3-node Redis Cluster (redis+cluster://): entries spread over the slots, each whole
on one node, big ones read with pipelined GETRANGEs there; a node lost makes its entries typed misses while puts go
to the nodes that are up; readiness holds while any node answers."""

from __future__ import annotations

import uuid

import pytest
import torch

from services.connectors import EntryMissing, StoreConfig, create_store
from services.connectors.redis_nodes import cluster_addresses, is_cluster
from tests.services.connectors.helpers import assert_same, sample_tensors
from tests.support.redis_cluster import RedisClusterNodes


@pytest.fixture
def nodes():
    cluster = RedisClusterNodes(3).start()
    yield cluster
    cluster.cleanup()


def open_store(nodes: RedisClusterNodes, purpose: str = "ec", **kw):
    return create_store(StoreConfig("redis", purpose, "c" + uuid.uuid4().hex[:8], redis_url=nodes.url, **kw))


def test_the_url_names_a_cluster_by_its_scheme():
    assert is_cluster("redis+cluster://a:7000,b:7001") and not is_cluster("redis://a:6379/0")
    assert cluster_addresses("redis+cluster://:pw@a:7000,[::1]:7001,c") == [("a", 7000), ("::1", 7001), ("c", 6379)]


def test_entries_spread_over_the_nodes_each_whole_on_one(nodes):
    store = open_store(nodes, capacity_bytes=256 << 20)
    handles = {f"item-{i}": store.put(f"item-{i}", sample_tensors(i % 5 + 1)) for i in range(60)}
    per_node = nodes.keys_per_node()
    assert sum(per_node.values()) == 60 and min(per_node.values()) >= 10, per_node   # one key per entry
    for key, handle in handles.items():
        assert_same(store.get(handle), sample_tensors(int(key.split("-")[1]) % 5 + 1))
        assert store.lookup(key) == handle
    big = {"a": torch.randn(9 << 18), "b": torch.arange(7)}      # 9 MiB: three pipelined GETRANGEs on its node
    handle = store.put("big", big)
    assert_same(store.get(handle), big)
    store.close()
    assert sum(nodes.keys_per_node().values()) == 0              # deleted key by key on each node (no CROSSSLOT)


def test_a_lost_node_makes_its_entries_misses_and_puts_go_elsewhere(nodes):
    from services.connectors.redis_nodes import ClusterNodes

    store, reader = open_store(nodes), open_store(nodes)
    handles = {f"e{i}": store.put(f"e{i}", sample_tensors(3)) for i in range(30)}
    topology = ClusterNodes(nodes.url)
    lost_port = nodes.ports[1]
    on_lost = [k for k, h in handles.items() if topology._node(h["redis_key"])[1].endswith(f":{lost_port}")]
    assert on_lost and len(on_lost) < len(handles)
    nodes.kill(lost_port)
    for key, handle in handles.items():
        if key in on_lost:
            with pytest.raises(EntryMissing, match="node that is down"):
                reader.get(handle)
            assert reader.lookup(key) is None                     # a miss: encode again
        else:
            assert_same(reader.get(handle), sample_tensors(3))
    again = {key: store.put(key, sample_tensors(4)) for key in on_lost}   # re-encoded: lands on a live node
    for key, handle in again.items():
        assert handle["redis_key"].startswith(f"epd:ec:{key}#")
        assert_same(reader.get(handle), sample_tensors(4))
        assert reader.lookup(key) == handle                        # found where the put went
    topology.close()
    store.close()
    reader.close()


def test_readiness_holds_while_any_node_answers(nodes):
    from services.runtime.readiness import StoreCheck

    store = open_store(nodes)
    check = StoreCheck(store)
    assert check.problem() is None
    for port in nodes.ports[:-1]:
        nodes.kill(port)
    assert check.problem() is None
    nodes.kill(nodes.ports[-1])
    assert "no node of the Redis Cluster" in check.problem()
    check.close()
    store.close()
