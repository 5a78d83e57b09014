"""Container HEALTHCHECK: exit 0 when this container's epd process answers GET /health with 200.

The port comes from the environment, in this order: EPD_HEALTH_PORT (explicit), EPD_HTTP_PORT (a role
process), EPD_PORT (the coordinator, or `epd serve`, whose coordinator fronts the whole cluster).
Standard library only: the image has no curl.
"""

from __future__ import annotations

import os
import sys
import urllib.request


def health_port(environ: dict[str, str]) -> int:
    for name in ("EPD_HEALTH_PORT", "EPD_HTTP_PORT"):
        value = environ.get(name, "").strip()
        if value and value != "0":  # 0 means "pick a free port": unknowable from outside the process
            return int(value)
    return int(environ.get("EPD_PORT", "8000") or "8000")


def main() -> int:
    url = f"http://127.0.0.1:{health_port(dict(os.environ))}/health"
    try:
        with urllib.request.urlopen(url, timeout=4) as reply:
            return 0 if reply.status == 200 else 1
    except OSError as exc:
        print(f"healthcheck {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
