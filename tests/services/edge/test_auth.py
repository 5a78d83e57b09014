"""API key parsing and matching (services.edge.auth); the middleware runs on real processes in
tests/e2e/test_auth.py."""

from __future__ import annotations

import pytest

from services.config import ConfigError, EpdConfig
from services.edge.auth import KeySet, bearer_token, parse_keys


def test_keys_from_a_list_and_from_files(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# tenant keys\nsk-file-one\n\n  sk-file-two  \n")
    assert parse_keys("sk-a, sk-b,,") == ["sk-a", "sk-b"]
    assert parse_keys("sk-a\nsk-b\n") == ["sk-a", "sk-b"]  # a Secret holding one key per line, as a variable
    assert parse_keys(f"sk-a,@{keyfile}") == ["sk-a", "sk-file-one", "sk-file-two"]
    assert parse_keys("") == []


@pytest.mark.parametrize("value, message", [
    ("sk a", "printable ASCII characters without spaces"),
    ("sk-\u00e9", "printable ASCII"),
    ("k" * 513, "1-512"),
    ("@/nonexistent/keys", "cannot read the api key file /nonexistent/keys: FileNotFoundError"),
    ("REPLACE-ME-with-one-api-key-per-line", "still the placeholder of deploy/"),
])
def test_bad_keys_are_refused_without_echoing_them(value, message):
    with pytest.raises(ValueError, match=message) as caught:
        parse_keys(value)
    assert "sk a" not in str(caught.value) and "kkkk" not in str(caught.value)


def test_config_checks_keys_at_start_and_epd_config_hides_them(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match=r"--role-api-key: the role api key file .* holds no key"):
        EpdConfig.of(role_api_key=f"@{empty}")
    config = EpdConfig.of(api_key="sk-public", role_api_key="")
    assert config.security.role_api_keys().accepts("sk-public")  # roles default to the public keys
    separate = EpdConfig.of(api_key="sk-public", role_api_key="sk-role")
    keys = separate.security.role_api_keys()
    assert keys.accepts("sk-role") and not keys.accepts("sk-public")
    import argparse

    from services.config.report import effective

    rows = effective(argparse.Namespace(), {"EPD_API_KEY": "sk-public", "EPD_ROLE_API_KEY": "sk-role",
                                            "EPD_ADMIN_TOKEN": "tok-admin"})
    shown = {r["flag"]: r["value"] for r in rows}
    assert shown["--api-key"] == shown["--role-api-key"] == shown["--admin-token"] == "***"
    assert "sk-" not in repr(rows) and "tok-admin" not in repr(rows)


def test_keyset_accepts_only_its_keys():
    keys = KeySet.of(["sk-one", "sk-two"])
    assert keys and keys.accepts("sk-two") and keys.accepts(b"sk-one")
    assert not keys.accepts("sk-one ") and not keys.accepts("") and not keys.accepts("sk-on")
    assert not KeySet() and not KeySet().accepts("sk-one")
    assert "sk-one" not in repr(keys)


@pytest.mark.parametrize("header, token", [
    (b"Bearer sk-1", b"sk-1"), (b"bearer   sk-1 ", b"sk-1"), (b"Basic c2s6MQ==", None), (b"Bearer ", None),
    (b"sk-1", None),
])
def test_bearer_token(header, token):
    assert bearer_token({"headers": [(b"authorization", header)]}) == token
    assert bearer_token({"headers": []}) is None
