"""The mocker's flags (speedup and timing coefficients), each with a SHOAL_MOCKER_* twin."""

from __future__ import annotations

import argparse
from dataclasses import fields

from shoal.engine.cli import _env_value, env_name
from shoal.mocker.timing import TimingModel

SPEEDUP_ENV = "SHOAL_MOCKER_SPEEDUP"
TIMING_HELP = {  # TimingModel field -> what it costs
    "base_ms": "fixed time of every step, in ms",
    "prefill_token_us": "time per new prompt token, in us",
    "prefill_attention_ns": "time per (prompt token, token it attends to) pair, in ns",
    "decode_seq_us": "time per decode sequence, in us",
    "decode_kv_ns": "time per context token a decode reads, in ns",
}


def _flag(name: str) -> str:
    return "mocker-" + name.replace("_", "-")


def add_mocker_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("mocker (with --engine mocker)")
    group.add_argument(
        "--speedup",
        type=float,
        metavar="X",
        default=_env_value(SPEEDUP_ENV, float),
        help=f"run the modelled step times this many times faster (default 1) [env {SPEEDUP_ENV}]",
    )
    defaults = TimingModel()
    for f in fields(TimingModel):
        flag = _flag(f.name)
        group.add_argument(
            f"--{flag}",
            type=float,
            metavar=f.name.rsplit("_", 1)[1].upper(),
            default=_env_value(env_name(flag), float),
            help=f"{TIMING_HELP[f.name]} (default {getattr(defaults, f.name)}) "
            f"[env {env_name(flag)}]",
        )


def _given(args: argparse.Namespace) -> dict[str, float]:
    """Flag name -> value of each mocker flag set on the command line or in the environment."""
    names = ["speedup", *(_flag(f.name) for f in fields(TimingModel))]
    return {n: v for n in names if (v := getattr(args, n.replace("-", "_"))) is not None}


def mocker_options(args: argparse.Namespace) -> dict:
    """MockEngine's keyword options (timing, and speedup when given) from the flags."""
    given = _given(args)
    timing = {f.name: given[_flag(f.name)] for f in fields(TimingModel) if _flag(f.name) in given}
    options: dict = {"timing": TimingModel(**timing)}
    if "speedup" in given:
        options["speedup"] = given["speedup"]
    return options


def mocker_argv(args: argparse.Namespace) -> list[str]:
    """The mocker flags given, as command-line words for a `shoal worker`."""
    return [word for flag, value in _given(args).items() for word in (f"--{flag}", str(value))]
