"""Bodies of the control routes: instance announcements and abort ids."""

from __future__ import annotations

import pytest

from coordinator.control_api import InstanceAnnouncement, plain_id
from services.protocol.errors import InvalidRequest
from services.protocol.parsing import validate_model


@pytest.mark.parametrize("address", ["10.0.0.7:50051", "encode-0.encode.svc:7000", "[fd00::1]:9000"])
def test_good_announcements(address):
    body = validate_model(InstanceAnnouncement, {"role": "encode", "grpc_address": address,
                                                 "http_url": "http://10.0.0.7:8001/"})
    assert body.grpc_address == address and body.http_url == "http://10.0.0.7:8001"


@pytest.mark.parametrize("body", [
    {"role": "oracle", "grpc_address": "a:1"},
    {"role": "encode", "grpc_address": "no-port"},
    {"role": "encode", "grpc_address": "a:0"},
    {"role": "encode", "grpc_address": "a:70000"},
    {"role": "encode", "grpc_address": "a b:1"},
    {"role": "encode", "grpc_address": "a:1", "http_url": "ftp://a:1"},
    {"role": "encode", "grpc_address": "a:1", "http_url": "http://a:1/admin"},
])
def test_bad_announcements_are_400(body):
    with pytest.raises(InvalidRequest):
        validate_model(InstanceAnnouncement, body)


def test_abort_ids_accept_the_response_prefixes():
    assert plain_id("chatcmpl-abc") == plain_id("cmpl-abc") == plain_id("generate-tokens-abc") == "abc"
    assert plain_id("abc") == "abc"
