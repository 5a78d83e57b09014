"""What a role instance announces to the coordinator."""

from __future__ import annotations

from services.config import EpdConfig
from services.runtime.announce import announcement


def test_announcement_uses_the_advertised_host():
    config = EpdConfig.of(host="0.0.0.0", advertise_host="10.1.2.3")
    assert announcement(config, "prefill", 7001, 8001) == {
        "role": "prefill", "grpc_address": "10.1.2.3:7001", "http_url": "http://10.1.2.3:8001"}


def test_an_ipv6_host_is_bracketed():
    body = announcement(EpdConfig.of(host="fd00::5"), "decode", 1, 2)
    assert body["grpc_address"] == "[fd00::5]:1" and body["http_url"] == "http://[fd00::5]:2"


def test_the_announcer_sends_the_first_admin_token(tmp_path):
    import asyncio

    from services.runtime.announce import start_announcing

    async def started():
        config = EpdConfig.of(coordinator_url="http://127.0.0.1:9", admin_token="tok-new,tok-old")
        announcer = start_announcing(config, "encode", 1, 2)
        assert announcer is not None and announcer._token == "tok-new"
        announcer._task.cancel()

    asyncio.run(started())
