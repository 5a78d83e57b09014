"""What render may fetch: the media policy and the pure (no I/O) URL and address checks.

Threat model: media URLs come from untrusted clients.  Render must never become
a proxy into the cluster (SSRF: cloud metadata at 169.254.169.254, Redis,
other roles' gRPC ports, loopback admin endpoints), whatever spelling the
client uses for an address (decimal "2130706433", octal "0177.0.0.1", short
"127.1", IPv4-mapped IPv6, 6to4, NAT64, ...).  These checks run on every hop
before any connection; `media_fetch` resolves names once and connects only to
the addresses checked here.

Called by: `media_fetch` (every hop of every fetch) and `image_decode` (limits).
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field
from urllib.parse import unquote

from PIL import Image
from yarl import URL

from services.protocol.errors import InvalidRequest

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

FORBIDDEN = "media_url_forbidden"
INVALID_URL = "invalid_media_url"
HTTP_SCHEMES = frozenset({"http", "https"})
_KNOWN_SCHEMES = frozenset({"http", "https", "data"})
# Ghostscript runs on EPS input: never decode it, whatever an operator configures.
_NEVER_DECODE = frozenset({"EPS", "PS"})
_HOST_CHARS = re.compile(r"^[a-z0-9_.-]+$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")
# Ranges that Python's is_global/is_private miss or misfile on some versions.
_NON_PUBLIC = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "240.0.0.0/4",
              "64:ff9b:1::/48", "fec0::/10")
)
_LIST_FIELDS = ("allowed_domains", "allowed_private_networks", "allowed_schemes", "allowed_image_formats")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


@dataclass(frozen=True)
class MediaPolicy:
    """Limits and allow-lists for fetching and decoding client media; validated at construction."""

    allowed_domains: tuple[str, ...] = ()
    """Empty: any public host.  Else only these hosts and their subdomains (IP literals match exactly)."""
    allow_private_networks: bool = False
    """Lift the address check entirely (tests, trusted in-cluster media).  The domain list still applies."""
    allowed_private_networks: tuple[str, ...] = ()
    """CIDRs exempt from the address check (e.g. one in-cluster media server), the rest stays refused."""
    timeout_s: float = 10.0
    """Whole fetch, all hops: DNS, connect, headers and body."""
    max_bytes: int = 20 * 1024 * 1024
    """Encoded media size: Content-Length above it is refused unread, bodies are cut while streaming."""
    max_redirects: int = 3
    """Redirects followed by hand, each hop re-checked against the whole policy."""
    max_image_pixels: int = 16_777_216
    """width*height, checked from the header before decoding; must not exceed PIL's MAX_IMAGE_PIXELS."""
    allowed_schemes: tuple[str, ...] = ("http", "https", "data")
    allow_file_urls: bool = False
    """file:// reads render's own disk: keep False outside tests."""
    allowed_image_formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
    """PIL format names tried by decode_image; every other decoder stays unreachable."""
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        self._check_scalars()
        self._check_pixels()
        self._normalize_lists()

    def _check_scalars(self) -> None:
        _require(isinstance(self.allow_private_networks, bool), "allow_private_networks must be a bool")
        _require(isinstance(self.allow_file_urls, bool), "allow_file_urls must be a bool")
        _require(_is_number(self.timeout_s) and 0 < self.timeout_s < math.inf, "timeout_s must be > 0")
        _require(_is_int(self.max_bytes) and self.max_bytes >= 1, "max_bytes must be an int >= 1")
        _require(_is_int(self.max_redirects) and self.max_redirects >= 0, "max_redirects must be an int >= 0")

    def _normalize_lists(self) -> None:
        for name in _LIST_FIELDS:
            # A bare string would be split into one-letter "domains": demand a real sequence.
            _require(isinstance(getattr(self, name), tuple | list), f"{name} must be a tuple of strings")
        schemes = tuple(s.lower() for s in self.allowed_schemes)
        _require(set(schemes) <= _KNOWN_SCHEMES, f"allowed_schemes must be within {sorted(_KNOWN_SCHEMES)}"
                 " (file:// is enabled by allow_file_urls only)")
        object.__setattr__(self, "allowed_schemes", schemes)
        object.__setattr__(self, "allowed_domains", tuple(_normalize_domain(d) for d in self.allowed_domains))
        networks = tuple(_parse_network(n) for n in self.allowed_private_networks)
        object.__setattr__(self, "allowed_private_networks", tuple(str(n) for n in networks))
        object.__setattr__(self, "_networks", networks)
        object.__setattr__(self, "allowed_image_formats", _check_formats(self.allowed_image_formats))

    def _check_pixels(self) -> None:
        _require(_is_int(self.max_image_pixels) and self.max_image_pixels >= 1,
                 "max_image_pixels must be an int >= 1")
        # PIL's global limit stays the backstop (we never mutate it); ours must be the one that binds,
        # so PIL's DecompressionBombWarning can only fire on images we refuse anyway.
        pil_limit = Image.MAX_IMAGE_PIXELS
        _require(pil_limit is None or self.max_image_pixels <= pil_limit,
                 f"max_image_pixels {self.max_image_pixels} exceeds PIL.Image.MAX_IMAGE_PIXELS {pil_limit}")

    def is_exempt(self, ip: IPAddress) -> bool:
        """Whether the address check is lifted for this address."""
        return self.allow_private_networks or any(ip in n for n in self._networks)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"MediaPolicy: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _normalize_domain(domain: str) -> str:
    name = domain.strip().rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    name = name.encode("idna").decode("ascii") if not name.isascii() else name
    _require(bool(_HOST_CHARS.match(name)) and not name.startswith("."),
             f"allowed_domains entry {domain!r} is not a host name (subdomains are included automatically)")
    return name


def _parse_network(cidr: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(cidr.strip(), strict=True)
    except ValueError as exc:
        raise ValueError(f"MediaPolicy: allowed_private_networks entry {cidr!r}: {exc}") from None


def _check_formats(formats: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(f.upper() for f in formats)
    Image.init()
    _require(bool(names), "allowed_image_formats must not be empty")
    _require(not set(names) & _NEVER_DECODE, "EPS/PS are never decoded (they run Ghostscript)")
    unknown = [n for n in names if n not in Image.OPEN]
    _require(not unknown, f"unknown image formats {unknown}; PIL knows {sorted(Image.OPEN)}")
    return names


def describe(url: URL) -> str:
    """A URL for error messages: no credentials, no query (signed URLs carry tokens there)."""
    bare = url.with_query(None).with_fragment(None)
    text = str(bare.with_user(None) if bare.absolute else bare)
    return text if len(text) <= 120 else text[:117] + "..."


def check_scheme(scheme: str, policy: MediaPolicy, *, redirect: bool = False) -> None:
    """Refuse schemes the policy does not allow; a redirect may only lead to http(s)."""
    if scheme == "file" and policy.allow_file_urls and not redirect:
        return
    allowed = set(policy.allowed_schemes) & (HTTP_SCHEMES if redirect else _KNOWN_SCHEMES)
    if scheme not in allowed:
        raise InvalidRequest(f"media URL scheme {scheme!r} not allowed (allowed: {sorted(allowed)})",
                             code=FORBIDDEN)


def check_http_target(url: URL, policy: MediaPolicy) -> IPAddress | None:
    """Check host syntax, the domain allow-list and literal addresses; return the literal IP if any.

    A host name still has to be resolved and each address passed to `check_address`.
    """
    host = (url.raw_host or "").lower()
    if not host:
        raise InvalidRequest(f"media URL {describe(url)} has no host", code=INVALID_URL)
    ip = literal_ip(host)
    name = str(ip) if ip is not None else host.rstrip(".")
    if ip is None and not _HOST_CHARS.match(name):
        raise InvalidRequest(f"media URL host {host!r} is not a valid host name", code=INVALID_URL)
    if not is_allowed_domain(name, policy, is_ip=ip is not None):
        raise InvalidRequest(f"media host {name!r} is not in the allowed domains", code=FORBIDDEN)
    if ip is not None:
        check_address(ip, policy, host=name)
    return ip


def literal_ip(host: str) -> IPAddress | None:
    """The address a literal host denotes, None for a name; refuse legacy numeric spellings."""
    if ":" in host:
        try:
            return ipaddress.IPv6Address(unquote(host))
        except ValueError:
            message = f"media URL host {host!r} is not a valid IPv6 address"
            raise InvalidRequest(message, code=INVALID_URL) from None
    try:
        return ipaddress.IPv4Address(host)
    except ValueError:
        pass
    # As in the WHATWG URL spec, a numeric last label means an IPv4 literal; anything but the canonical
    # dotted quad ("127.1", "0177.0.0.1", "0x7f.1", "2130706433", "127.0.0.1.") is refused outright.
    if _NUMERIC_LABEL.match(host.rstrip(".").rsplit(".", 1)[-1]):
        raise InvalidRequest(f"media URL host {host!r} is a non-canonical IP address", code=FORBIDDEN)
    return None


def is_allowed_domain(name: str, policy: MediaPolicy, *, is_ip: bool) -> bool:
    if not policy.allowed_domains:
        return True
    if is_ip:
        return name in policy.allowed_domains
    return any(name == d or name.endswith("." + d) for d in policy.allowed_domains)


def check_address(ip: IPAddress, policy: MediaPolicy, *, host: str) -> None:
    """Refuse an address that is not public, unless the policy exempts it."""
    if policy.is_exempt(ip):
        return
    reason = forbidden_reason(ip)
    if reason is not None:
        shown = f"{host!r}" if host == str(ip) else f"{host!r} resolves to {ip}, which"
        raise InvalidRequest(f"media host {shown} is {reason}: not allowed", code=FORBIDDEN)


def forbidden_reason(ip: IPAddress) -> str | None:
    """Why an address must not be contacted, or None for a public unicast address."""
    embedded = embedded_ipv4(ip)
    if embedded is not None and (inner := forbidden_reason(embedded)) is not None:
        return f"an IPv6 form of {embedded} ({inner})"
    checks = (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
              ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
              ("private", ip.is_private), ("reserved", ip.is_reserved),
              ("non-public", any(ip in n for n in _NON_PUBLIC)), ("not globally routable", not ip.is_global))
    return next((name for name, hit in checks if hit), None)


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address tunnels to (mapped, compatible, 6to4, NAT64, Teredo), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None
