"""The router flags: defaults, SHOAL_* twins and errors naming the flag."""

from __future__ import annotations

import pytest

from shoal.cli import build_parser
from shoal.flags import FlagParser
from shoal.frontend.cli import frontend_router_options
from shoal.router.cli import KV_ROUTING, ROUTER, router_options
from shoal.router.selector import KvRouterConfig


def parse(argv: list[str]) -> dict:
    parser = FlagParser()
    parser.add_group(ROUTER)
    parser.add_group(KV_ROUTING)
    return router_options(parser.parse_args(argv))


ENV = (
    "SHOAL_KV_OVERLAP_CREDIT",
    "SHOAL_KV_QUEUE_WEIGHT",
    "SHOAL_KV_PREFILL_LOAD_SCALE",
    "SHOAL_ROUTER_TEMPERATURE",
    "SHOAL_BUSY_THRESHOLD",
    "SHOAL_BUSY_MAX_WAITING",
    "SHOAL_KV_APPROX_TTL",
    "SHOAL_ROUTER_REPLICA_SYNC",
    "SHOAL_ROUTER_SYNC_WINDOW_MS",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_flag_defaults_are_the_configs():
    assert parse([])["kv_config"] == KvRouterConfig()


def test_queue_weight_flag_and_env(monkeypatch):
    assert parse(["--kv-queue-weight", "0.5"])["kv_config"].queue_weight == 0.5
    monkeypatch.setenv("SHOAL_KV_QUEUE_WEIGHT", "3")
    monkeypatch.setenv("SHOAL_KV_OVERLAP_CREDIT", "1")
    config = parse([])["kv_config"]
    assert (config.queue_weight, config.overlap_credit) == (3.0, 1.0)
    assert parse(["--kv-queue-weight", "0"])["kv_config"].queue_weight == 0.0  # flag wins


def test_out_of_range_values_name_their_flag():
    with pytest.raises(SystemExit, match="--kv-queue-weight: queue_weight must be"):
        parse(["--kv-queue-weight", "-1"])
    with pytest.raises(SystemExit, match="--kv-overlap-credit: overlap_credit must be"):
        parse(["--kv-overlap-credit", "nan"])


def test_replica_sync_flag_and_env(monkeypatch):
    assert parse([])["replica_sync"] is True
    assert parse(["--no-router-replica-sync"])["replica_sync"] is False
    monkeypatch.setenv("SHOAL_ROUTER_REPLICA_SYNC", "off")
    assert parse([])["replica_sync"] is False
    assert parse(["--router-replica-sync"])["replica_sync"] is True  # the flag wins


def test_sync_window_flag_env_and_errors(monkeypatch):
    assert parse([])["sync_window"] == 0.02
    assert parse(["--router-sync-window-ms", "0"])["sync_window"] == 0.0
    monkeypatch.setenv("SHOAL_ROUTER_SYNC_WINDOW_MS", "5")
    assert parse([])["sync_window"] == 0.005
    for bad in ("-1", "inf", "nan"):
        with pytest.raises(SystemExit, match="--router-sync-window-ms must be finite and >= 0"):
            parse(["--router-sync-window-ms", bad])


def test_frontend_publishes_replica_sync_on_its_host(monkeypatch):
    monkeypatch.delenv("SHOAL_HOST", raising=False)
    monkeypatch.delenv("SHOAL_ADVERTISE_HOST", raising=False)
    options = frontend_router_options(build_parser("frontend").parse_args([]))
    assert (options["sync_host"], options["sync_advertise_host"]) == ("127.0.0.1", "127.0.0.1")
    argv = ["--host", "0.0.0.0", "--advertise-host", "10.1.2.3"]
    args = build_parser("frontend").parse_args(argv)
    options = frontend_router_options(args)
    assert (options["sync_host"], options["sync_advertise_host"]) == ("0.0.0.0", "10.1.2.3")
    args = build_parser("serve").parse_args(["--model", "m", "--host", "0.0.0.0"])
    advertised = frontend_router_options(args)["sync_advertise_host"]
    assert advertised not in ("0.0.0.0", "") and advertised.count(".") == 3
