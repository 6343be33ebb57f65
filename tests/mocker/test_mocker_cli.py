"""--engine and the mocker flags: parsed from flags or SHOAL_* variables, forwarded by serve."""

from __future__ import annotations

from dataclasses import fields

import pytest

from shoal.cli import build_parser
from shoal.mocker.cli import mocker_options
from shoal.mocker.timing import TimingModel
from shoal.serve import worker_argv


def test_defaults_are_the_shoal_engine_and_the_default_timing():
    args = build_parser().parse_args(["worker", "--model", "m"])
    assert args.engine == "shoal"
    assert mocker_options(args) == {"timing": TimingModel()}


def test_flags_and_environment_twins(monkeypatch):
    monkeypatch.setenv("SHOAL_ENGINE", "mocker")
    monkeypatch.setenv("SHOAL_MOCKER_SPEEDUP", "50")
    monkeypatch.setenv("SHOAL_MOCKER_DECODE_KV_NS", "20")
    argv = ["worker", "--model", "m", "--speedup", "100", "--mocker-base-ms", "2.5"]
    args = build_parser().parse_args(argv)
    assert args.engine == "mocker"
    assert mocker_options(args) == {
        "timing": TimingModel(base_ms=2.5, decode_kv_ns=20.0),
        "speedup": 100.0,  # the flag wins over the environment
    }


def test_bad_engine_name_in_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("SHOAL_ENGINE", "vllm")
    with pytest.raises(SystemExit) as exit_info:
        build_parser("worker").parse_args(["--model", "m"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "shoal worker: error: SHOAL_ENGINE='vllm': expected one of shoal, mocker\n"
    )


def test_mocker_flags_cover_every_timing_coefficient():
    args = build_parser("worker").parse_args(["--model", "m"])
    assert {f.name for f in fields(TimingModel)} <= {
        name.removeprefix("mocker_") for name in vars(args)
    }


def test_serve_forwards_engine_and_mocker_flags_to_its_workers():
    parser = build_parser()
    serve = ["serve", "--model", "m", "--engine", "mocker", "--speedup", "100"]
    args = parser.parse_args([*serve, "--mocker-prefill-token-us", "11", "--num-gpu-blocks", "9"])
    argv = worker_argv(args, "file:///tmp/d")
    assert argv[argv.index("--engine") + 1] == "mocker"
    worker = parser.parse_args(argv[3:])  # past `python -m shoal`
    assert worker.command == "worker" and worker.engine == "mocker"
    assert worker.num_gpu_blocks == 9
    assert mocker_options(worker) == mocker_options(args)
    assert mocker_options(worker)["timing"].prefill_token_us == 11.0
