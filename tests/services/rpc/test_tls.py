"""TLS settings of the internal gRPC hops are checked at start-up; credentials are built from real PEM files."""

from __future__ import annotations

import grpc
import pytest

from services.config import ConfigError, EpdConfig
from services.rpc.tls import channel_credentials, channel_options, server_credentials
from tests.support.certs import make_tls_files


def test_plaintext_by_default():
    config = EpdConfig()
    assert server_credentials(config) is None and channel_credentials(config) is None
    assert channel_options(config) == []


def test_files_are_checked_at_start(tmp_path):
    files = make_tls_files(tmp_path)
    with pytest.raises(ConfigError, match="--grpc-tls-cert and --grpc-tls-key go together"):
        EpdConfig.of(grpc_tls_cert=str(files["cert"]))
    with pytest.raises(ConfigError, match="cannot read the gRPC TLS CA bundle /nonexistent/ca.pem"):
        EpdConfig.of(grpc_tls_ca="/nonexistent/ca.pem")


def test_credentials_from_real_files(tmp_path):
    files = make_tls_files(tmp_path)
    config = EpdConfig.of(grpc_tls_cert=str(files["cert"]), grpc_tls_key=str(files["key"]),
                       grpc_tls_ca=str(files["ca"]), grpc_tls_server_name="epd-roles")
    assert isinstance(server_credentials(config), grpc.ServerCredentials)
    assert isinstance(channel_credentials(config), grpc.ChannelCredentials)
    assert channel_options(config) == [("grpc.ssl_target_name_override", "epd-roles")]
