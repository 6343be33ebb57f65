"""Flags declared once: environment twins, their errors, help text, forwarding and docs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cli import COMMANDS, build_parser, configuration_doc
from shoal.engine.cli import engine_options
from shoal.flags import Flag, FlagGroup, FlagParser, parse_bool
from shoal.runtime.cli import runtime_options
from shoal.runtime.net import ANY_ADDRESS, advertise_address
from shoal.serve import router_argv, worker_argv, worker_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_shoal_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SHOAL_")]:
        monkeypatch.delenv(name)


def parse(command: str, *argv: str):
    return build_parser(command).parse_args(list(argv))


def test_environment_fills_what_the_command_line_leaves_out(monkeypatch):
    monkeypatch.setenv("SHOAL_PORT", "9001")
    monkeypatch.setenv("SHOAL_MAX_NUM_SEQS", "12")
    monkeypatch.setenv("SHOAL_MODEL", "/models/m")
    args = parse("serve")
    assert (args.port, args.max_num_seqs, args.model) == (9001, 12, "/models/m")
    args = parse("serve", "--port", "9002", "--model", "x")
    assert (args.port, args.model) == (9002, "x")  # the command line wins
    monkeypatch.setenv("SHOAL_PORT", "")
    assert parse("frontend").port == 8000  # empty is unset


@pytest.mark.parametrize(
    ("word", "value"),
    [
        *[("1", True), ("TRUE", True), ("yes", True), ("On", True)],
        *[("0", False), ("false", False), ("NO", False), ("off", False)],
    ],
)
def test_boolean_twins_take_the_usual_spellings(monkeypatch, word, value):
    monkeypatch.setenv("SHOAL_NO_KV_EVENTS", word)
    monkeypatch.setenv("SHOAL_ENABLE_PREFIX_CACHING", word)
    monkeypatch.setenv("SHOAL_RESTART_WORKERS", word)
    args = parse("serve", "--model", "m")
    assert args.no_kv_events is value
    assert args.enable_prefix_caching is value
    assert args.restart_workers is value
    assert parse("serve", "--model", "m", "--no-restart-workers").restart_workers is False


def test_unset_switches_keep_their_defaults():
    args = parse("serve", "--model", "m")
    assert args.no_kv_events is False and args.restart_workers is True
    assert args.enable_prefix_caching is None  # left to the engine
    assert "enable_prefix_caching" not in engine_options(args)


@pytest.mark.parametrize(
    ("command", "var", "raw", "expected"),
    [
        ("frontend", "SHOAL_PORT", "abc", "expected an integer"),
        ("frontend", "SHOAL_BUSY_WAIT", "soon", "expected a number"),
        ("frontend", "SHOAL_NO_KV_EVENTS", "maybe", "expected 1/0, true/false, yes/no or on/off"),
        ("frontend", "SHOAL_ROUTER_MODE", "fastest", "expected one of round-robin, random"),
        ("serve", "SHOAL_LOG_LEVEL", "loud", "expected one of debug, info"),
        ("worker", "SHOAL_KEEP_WARM_MS", "-1", "expected a number of at least 0, got -1"),
        ("router", "SHOAL_KEEP_WARM_MS", "often", "expected a number, got 'often'"),
    ],
)
def test_malformed_environment_is_one_line_naming_the_variable(command, var, raw, expected):
    env = {**os.environ, var: raw, "SHOAL_MODEL": "m"}
    out = subprocess.run(
        [sys.executable, "-m", "shoal", command],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"shoal {command}: error: {var}={raw!r}: {expected}")


def test_help_names_every_environment_twin():
    for command in COMMANDS:
        parser = build_parser(command)
        text = parser.format_help().replace("\n", " ")
        text = " ".join(text.split())
        for flag in getattr(parser, "flags", list)():
            if flag.env_var:
                assert f"[env {flag.env_var}]" in text, (command, flag.name)


def test_no_two_flags_of_a_command_share_a_name_or_variable():
    for command in COMMANDS:
        flags = getattr(build_parser(command), "flags", list)()
        names = [f.name for f in flags]
        twins = [f.env_var for f in flags if f.env_var]
        assert len(set(names)) == len(names), command
        assert len(set(twins)) == len(twins), command


def test_serve_forwards_its_engine_flags_to_the_workers(monkeypatch):
    monkeypatch.setenv("SHOAL_ENABLE_CHUNKED_PREFILL", "off")
    args = parse(
        "serve", "--model", "m", "--max-num-seqs", "7", "--no-enable-prefix-caching",
        "--dtype", "float32", "--log-level", "debug",
    )  # fmt: skip
    argv = worker_argv(args, "file:///tmp/d")
    assert argv[1:4] == ["-m", "shoal", "worker"]
    worker = build_parser("worker").parse_args(argv[4:])
    assert (
        engine_options(worker)
        == engine_options(args)
        == {
            "dtype": "float32",
            "max_num_seqs": 7,
            "enable_prefix_caching": False,
            "enable_chunked_prefill": False,
        }
    )
    assert (worker.model, worker.discovery, worker.log_level) == ("m", "file:///tmp/d", "debug")


def test_serve_forwards_keep_warm_to_workers_and_router(monkeypatch):
    monkeypatch.setenv("SHOAL_KEEP_WARM_MS", "2.5")
    args = parse("serve", "--model", "m", "--router-mode", "remote")
    assert args.keep_warm_ms == 2.5
    worker = build_parser("worker").parse_args(worker_argv(args, "file:///tmp/d")[4:])
    router = build_parser("router").parse_args(router_argv(args, "file:///tmp/d")[4:])
    assert worker.keep_warm_ms == router.keep_warm_ms == 2.5
    monkeypatch.delenv("SHOAL_KEEP_WARM_MS")
    assert parse("worker", "--model", "m").keep_warm_ms == 1.0
    assert parse("worker", "--model", "m", "--keep-warm-ms", "0").keep_warm_ms == 0.0


def test_required_flag_may_come_from_its_twin(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("worker")
    assert exit_info.value.code == 2
    assert "required: --model (or SHOAL_MODEL)" in capsys.readouterr().err
    monkeypatch.setenv("SHOAL_MODEL", "m")
    assert parse("worker").model == "m"


def test_declarations_are_checked():
    assert parse_bool(" Off ") is False
    with pytest.raises(ValueError, match="kind"):
        Flag("x", "help", kind="list")
    with pytest.raises(ValueError, match="no environment twin"):
        Flag("x", "help", kind="append")
    parser = FlagParser(prog="t")
    parser.add_group(FlagGroup("g", (Flag("ratio", "a 100% ratio", float, 0.5, env=False),)))
    assert "a 100% ratio (default: 0.5)" in parser.format_help()
    assert parser.parse_args([]).ratio == 0.5


def test_full_parser_has_every_command():
    parser = build_parser()
    assert parser.parse_args(["worker", "--model", "m"]).command == "worker"
    assert parser.parse_args(["bench", "compare", "a", "b"]).command == "bench"


def test_top_level_help_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "shoal", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert all(command in out.stdout for command in COMMANDS)


def test_configuration_doc_is_current():
    path = ROOT / "docs" / "configuration.md"
    assert path.read_text() == configuration_doc(), (
        "docs/configuration.md is stale: regenerate it with "
        "`.venv/bin/python -c 'import shoal.cli as c; print(c.configuration_doc(), end=\"\")' "
        "> docs/configuration.md`"
    )


def test_serve_hands_the_plane_secret_to_workers_through_the_environment():
    args = parse("serve", "--model", "m", "--plane-secret", "s3cret", "--dead-after", "90")
    argv = worker_argv(args, "file:///tmp/d")
    assert "s3cret" not in " ".join(argv)  # command lines are visible to every local user
    assert worker_env(args)["SHOAL_PLANE_SECRET"] == "s3cret"
    worker = build_parser("worker").parse_args(argv[4:])
    assert worker.dead_after == 90.0 and worker.plane_secret is None
    assert "SHOAL_PLANE_SECRET" not in worker_env(parse("serve", "--model", "m"))


def test_frontend_flags_reach_their_keyword_arguments(monkeypatch):
    monkeypatch.setenv("SHOAL_ACCESS_LOG", "off")
    args = parse("frontend", "--migration-limit", "0", "--max-prompts-per-request", "8")
    assert (args.migration_limit, args.max_prompts_per_request) == (0, 8)
    assert args.access_log is False
    defaults = parse("frontend")
    assert (defaults.migration_limit, defaults.next_token_timeout) == (3, 120.0)
    assert defaults.max_request_body_bytes == 16 * 1024 * 1024
    assert runtime_options(defaults) == {}
    assert runtime_options(parse("frontend", "--plane-secret", "k")) == {"plane_secret": "k"}


def test_advertise_address_is_routable_when_binding_every_interface():
    assert advertise_address("10.1.2.3") == "10.1.2.3"
    address = advertise_address("0.0.0.0")
    assert address not in ANY_ADDRESS
    assert socket.inet_aton(address)  # an IPv4 address other hosts can dial


def test_serve_forwards_the_kv_events_format_and_checks_its_twin(monkeypatch, capsys):
    args = parse("serve", "--model", "m", "--kv-events-format", "vllm")
    worker = build_parser("worker").parse_args(worker_argv(args, "file:///tmp/d")[4:])
    assert worker.kv_events_format == "vllm"
    assert parse("worker", "--model", "m").kv_events_format == "shoal"
    monkeypatch.setenv("SHOAL_KV_EVENTS_FORMAT", "sglang")
    with pytest.raises(SystemExit):
        parse("worker", "--model", "m")
    assert "SHOAL_KV_EVENTS_FORMAT" in capsys.readouterr().err
