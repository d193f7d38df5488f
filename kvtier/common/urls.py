"""URLs of servers given on the command line, checked before any work: a bad one otherwise
fails deep inside an HTTP client, as a traceback that names no flag."""

from __future__ import annotations

from urllib.parse import urlsplit


def check_http_url(url: str, flag: str) -> None:
    """ValueError naming `flag` unless `url` is http(s)://HOST[:PORT], PORT in 1..65535."""
    example = "use e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        port = parts.port  # a port out of range or not a number raises here
    except ValueError as error:
        raise ValueError(f"{flag} {url!r} is not a valid URL ({error}); {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL; {example}")
    if port == 0:
        raise ValueError(f"{flag} {url!r}: port 0 is no server's port; {example}")
