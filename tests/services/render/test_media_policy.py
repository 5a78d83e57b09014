"""MediaPolicy validation and the pure URL/address checks of services/render/media_policy.py."""

from __future__ import annotations

import ipaddress

import pytest
from PIL import Image
from yarl import URL

from services.protocol.errors import InvalidRequest
from services.render.media_policy import (
    MediaPolicy,
    check_http_target,
    check_scheme,
    describe,
    embedded_ipv4,
    forbidden_reason,
)


def test_defaults() -> None:
    policy = MediaPolicy()
    assert policy.allowed_domains == () and not policy.allow_private_networks and not policy.allow_file_urls
    assert policy.timeout_s == 10.0 and policy.max_bytes == 20 * 1024 * 1024 and policy.max_redirects == 3
    assert policy.max_image_pixels == 16_777_216
    assert policy.allowed_schemes == ("http", "https", "data")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout_s": 0}, {"timeout_s": float("inf")}, {"timeout_s": True},
        {"max_bytes": 0}, {"max_bytes": 1.5}, {"max_redirects": -1},
        {"max_image_pixels": 0}, {"max_image_pixels": "big"}, {"max_image_pixels": True},
        {"allowed_schemes": ("http", "file")}, {"allowed_schemes": ("ftp",)},
        {"allowed_domains": ("*.example.com",)}, {"allowed_domains": ("example.com/path",)},
        {"allowed_private_networks": ("10.0.0.1/8",)}, {"allowed_private_networks": ("nope",)},
        {"allowed_image_formats": ()}, {"allowed_image_formats": ("EPS",)},
        {"allowed_image_formats": ("NOPE",)},
        {"allow_private_networks": "yes"}, {"allow_file_urls": 1},
        {"allowed_domains": "localhost"}, {"allowed_schemes": "https"},
    ],
)
def test_invalid_policies_fail_at_construction(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="MediaPolicy"):
        MediaPolicy(**kwargs)


def test_pixel_limit_cannot_exceed_pils_backstop() -> None:
    assert Image.MAX_IMAGE_PIXELS is not None
    MediaPolicy(max_image_pixels=Image.MAX_IMAGE_PIXELS)
    with pytest.raises(ValueError, match="MAX_IMAGE_PIXELS"):
        MediaPolicy(max_image_pixels=Image.MAX_IMAGE_PIXELS + 1)


def test_normalization_and_equality() -> None:
    policy = MediaPolicy(allowed_domains=["Example.COM.", "bücher.de", "10.0.0.5"],  # type: ignore[arg-type]
                         allowed_schemes=("HTTPS",), allowed_image_formats=("png",))
    assert policy.allowed_domains == ("example.com", "xn--bcher-kva.de", "10.0.0.5")
    assert policy.allowed_schemes == ("https",) and policy.allowed_image_formats == ("PNG",)
    assert policy == MediaPolicy(allowed_domains=("example.com", "xn--bcher-kva.de", "10.0.0.5"),
                                 allowed_schemes=("https",), allowed_image_formats=("PNG",))
    hash(policy)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.255.0.1", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0",
     "0.1.2.3", "100.64.0.1", "224.0.0.1", "239.255.255.250", "255.255.255.255", "240.0.0.1", "198.18.0.1",
     "192.0.0.8", "::1", "::", "fe80::1", "fc00::1", "fd12::1", "fec0::1", "ff02::1", "ff0e::1",
     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::127.0.0.1", "2002:7f00:1::", "2002:a9fe:a9fe::",
     "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b:1::1", "2001::1", "2001:db8::1"],
)
def test_non_public_addresses_are_forbidden(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert forbidden_reason(ipaddress.ip_address(address)) is None


def test_embedded_ipv4_forms() -> None:
    def embedded(text: str) -> str:
        return str(embedded_ipv4(ipaddress.ip_address(text)))

    assert embedded("::ffff:127.0.0.1") == "127.0.0.1"
    assert embedded("2002:7f00:1::") == "127.0.0.1"
    assert embedded("64:ff9b::a00:1") == "10.0.0.1"
    assert embedded("::a00:1") == "10.0.0.1"
    assert embedded_ipv4(ipaddress.ip_address("::1")) is None
    assert "IPv6 form of 127.0.0.1" in (forbidden_reason(ipaddress.ip_address("2002:7f00:1::")) or "")


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1/", "http://10.0.0.1/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data",
     "http://[::1]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:7f00:1]/", "http://0.0.0.0/",
     "http://2130706433/", "http://0177.0.0.1/", "http://127.1/", "http://0x7f.1/", "http://0x7f000001/",
     "http://017700000001/", "http://127.0.0.1./", "http://10.1/", "http://[fe80::1%25eth0]/"],
)
def test_literal_hosts_refused_in_every_spelling(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_http_target(URL(url), MediaPolicy())
    assert info.value.code == "media_url_forbidden" and info.value.status == 400


def test_bad_host_syntax() -> None:
    for url in ("http://a b/", "http://[zz::1]/"):
        with pytest.raises(InvalidRequest) as info:
            check_http_target(URL(url), MediaPolicy())
        assert info.value.code == "invalid_media_url"


def test_domain_allow_list() -> None:
    policy = MediaPolicy(allowed_domains=("example.com",))
    assert check_http_target(URL("https://example.com/a.png"), policy) is None
    assert check_http_target(URL("https://cdn.Example.com./a.png"), policy) is None
    for url in ("https://example.com.evil.net/", "https://notexample.com/", "https://com/", "http://93.184.216.34/"):
        with pytest.raises(InvalidRequest, match="allowed domains"):
            check_http_target(URL(url), policy)


def test_private_exemptions() -> None:
    lifted = MediaPolicy(allow_private_networks=True)
    assert str(check_http_target(URL("http://10.0.0.1/"), lifted)) == "10.0.0.1"
    one = MediaPolicy(allowed_private_networks=("127.0.0.1/32",))
    assert str(check_http_target(URL("http://127.0.0.1:8080/"), one)) == "127.0.0.1"
    for url in ("http://127.0.0.2/", "http://[::ffff:127.0.0.1]/", "http://10.0.0.1/"):
        with pytest.raises(InvalidRequest, match="not allowed"):
            check_http_target(URL(url), one)
    # Lifting the address check never lifts the domain list, nor the refusal of odd spellings.
    both = MediaPolicy(allowed_domains=("example.com",), allow_private_networks=True)
    with pytest.raises(InvalidRequest, match="allowed domains"):
        check_http_target(URL("http://127.0.0.1/"), both)
    with pytest.raises(InvalidRequest, match="non-canonical"):
        check_http_target(URL("http://2130706433/"), lifted)


def test_schemes() -> None:
    policy = MediaPolicy()
    for scheme in ("http", "https", "data"):
        check_scheme(scheme, policy)
    for scheme in ("file", "ftp", "gopher", "javascript"):
        with pytest.raises(InvalidRequest, match="not allowed"):
            check_scheme(scheme, policy)
    with pytest.raises(InvalidRequest):
        check_scheme("data", policy, redirect=True)
    check_scheme("file", MediaPolicy(allow_file_urls=True))
    with pytest.raises(InvalidRequest):
        check_scheme("file", MediaPolicy(allow_file_urls=True), redirect=True)
    with pytest.raises(InvalidRequest):
        check_scheme("data", MediaPolicy(allowed_schemes=("https",)))


def test_describe_hides_credentials_and_query() -> None:
    text = describe(URL("https://user:secret@example.com/a.png?sig=TOKEN#frag"))
    assert text == "https://example.com/a.png"
    assert len(describe(URL("https://example.com/" + "a" * 500))) == 120
