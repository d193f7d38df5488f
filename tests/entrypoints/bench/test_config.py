"""Bad `kvtier bench` target flags: one line naming the flag, before any request is sent."""

from __future__ import annotations

import pytest

from kvtier.entrypoints import cli
from kvtier.entrypoints.bench.config import ServerTarget


@pytest.mark.parametrize("flags, message", [
    # Once an OverflowError deep in the HTTP client, as a 100-line ExceptionGroup.
    (["--url", "http://127.0.0.1:99999"],
     "ServerTarget.url (--url) 'http://127.0.0.1:99999' is not a valid URL (Port out of range"),
    (["--url", "http://[::1"], "(--url) 'http://[::1' is not a valid URL (Invalid IPv6 URL)"),
    (["--url", "ftp://x"], "(--url) 'ftp://x' is not an http(s) URL"),
    # A NaN passed `<= 0` and then bounded nothing.
    (["--request-timeout", "nan"], "ServerTarget.request_timeout_s must be a finite number of "
                                   "seconds > 0 (--request-timeout), got nan"),
    (["--run-timeout", "nan"], "must be a finite number of seconds > 0 (--run-timeout), got nan"),
    (["--run-timeout", "inf"], "must be a finite number of seconds > 0 (--run-timeout), got inf"),
    (["--think-time", "inf"], "MultiTurnConfig.think_time_s must be finite"),
])
def test_bad_target_flags_fail_in_one_line(capsys, flags, message):
    assert cli.main(["bench", "multi-turn", *flags]) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "https://bench.example/", "http://[::1]:80"])
def test_good_urls_pass(url):
    assert ServerTarget(url=url).base_url == url.rstrip("/")
