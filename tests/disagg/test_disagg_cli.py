"""`shoal serve --prefill-workers N --decode-workers M` starts workers with those roles and
hands them its KV transfer flags."""

from __future__ import annotations

from shoal.cli import build_parser
from shoal.serve import worker_argvs


def parse(*argv: str):
    return build_parser("serve").parse_args(["--model", "m", *argv])


def roles(*argv: str) -> list[str]:
    out = []
    for words in worker_argvs(parse(*argv), "file:///tmp/d"):
        worker = build_parser("worker").parse_args(words[4:])
        out.append(worker.role)
        assert worker.kv_pin_timeout == 7.5
    return out


def test_serve_starts_prefill_and_decode_workers():
    assert roles("--workers", "2", "--kv-pin-timeout", "7.5") == ["both", "both"]
    got = roles("--prefill-workers", "2", "--decode-workers", "3", "--kv-pin-timeout", "7.5")
    assert got == ["prefill", "prefill", "decode", "decode", "decode"]
    got = roles("--prefill-workers", "1", "--workers", "2", "--kv-pin-timeout", "7.5")
    assert got == ["prefill", "decode", "decode"]


def test_serve_takes_the_local_prefill_threshold():
    assert parse().max_local_prefill_length == 1000
    assert parse("--max-local-prefill-length", "4096").max_local_prefill_length == 4096
