from __future__ import annotations

import subprocess
import sys

import pytest

from services.connectors import StoreConfig, create_store, ec_key, kv_key, supported_backends
from tests.services.connectors.helpers import ROOT


def test_unknown_backend_lists_supported_names():
    with pytest.raises(ValueError, match="supported: redis, shm"):
        create_store(StoreConfig("memcached", "ec", "x"))
    assert supported_backends() == ["redis", "shm"]


@pytest.mark.parametrize("kwargs, match", [
    ({"purpose": "pixels"}, "purpose"),
    ({"instance_id": "a/b"}, "instance_id"),
    ({"instance_id": ""}, "instance_id"),
    ({"namespace": "e-p"}, "namespace"),
    ({"capacity_bytes": 0}, "capacity"),
    ({"ttl_s": 0}, "ttl"),
    ({"backend": "redis"}, "redis_url"),
])
def test_config_is_validated(kwargs, match):
    base = {"backend": "shm", "purpose": "ec", "instance_id": "i1"}
    with pytest.raises(ValueError, match=match):
        StoreConfig(**{**base, **kwargs})


def test_keys_are_scoped():
    assert ec_key("m1", "h") != ec_key("m2", "h")
    assert kv_key("r1") != kv_key("r2")
    with pytest.raises(ValueError):
        ec_key("", "h")


def test_keys_are_scoped_by_weight_version():
    from services.connectors.ec import ec_key_version

    assert ec_key("m", "h", "base") != ec_key("m", "h", "step-1") != ec_key("m", "h")
    assert [ec_key_version(ec_key("m", "h", v)) for v in ("base", "step-1", "")] == ["base", "step-1", ""]
    assert "|step-1|" in kv_key("r", "step-1") and kv_key("r", "step-1") != kv_key("r", "step-1")


def test_package_import_is_light():
    code = ("import sys, services.connectors; "
            "print(sorted(m for m in ('torch', 'numpy', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr



@pytest.mark.parametrize("backend", ["shm", "redis"])
def test_put_into_stores_what_fill_wrote(backend, make_store):
    import torch

    store = make_store(backend, "kv")
    source = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)

    def fill(views):
        views["kv"].copy_(source)
        views["n"].fill_(7)

    handle = store.put_into("req|a", {"kv": (torch.float32, (2, 3, 4)), "n": (torch.int64, (1,))}, fill)
    got = store.get(handle)
    assert torch.equal(got["kv"], source) and got["n"].tolist() == [7]


def test_kv_keys_are_unique_per_prefill_even_for_one_request_id():
    from services.connectors.kv import kv_key

    keys = {kv_key("same-id") for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("req|same-id|") for k in keys)
