"""The mocker's flags (speedup and timing coefficients), each with a SHOAL_MOCKER_* twin."""

from __future__ import annotations

import argparse
from dataclasses import fields

from shoal.flags import Flag, FlagGroup, flag_argv, flag_values

TIMING_HELP = {  # TimingModel field -> what it costs
    "base_ms": "fixed time of every step, in ms",
    "prefill_token_us": "time per new prompt token, in us",
    "prefill_attention_ns": "time per (prompt token, token it attends to) pair, in ns",
    "decode_seq_us": "time per decode sequence, in us",
    "decode_kv_ns": "time per context token a decode reads, in ns",
}


def _flag(field: str) -> str:
    return "mocker-" + field.replace("_", "-")


MOCKER = FlagGroup(
    "mocker (with --engine mocker)",
    (
        Flag(
            "speedup",
            "run the modelled step times this many times faster",
            float,
            env="SHOAL_MOCKER_SPEEDUP",
            metavar="X",
            shown_default="1",
        ),
        *(
            Flag(
                _flag(field),
                text,
                float,
                metavar=field.rsplit("_", 1)[1].upper(),
                shown_default="Llama-3.1-8B on an H100, see mocker.md",
            )
            for field, text in TIMING_HELP.items()
        ),
    ),
    about="The simulated engine's timing model ([mocker.md](mocker.md)); unset coefficients "
    "keep the model's defaults.",
)


def mocker_options(args: argparse.Namespace) -> dict:
    """MockEngine's keyword options (timing, and speedup when given) from the flags."""
    from shoal.mocker.timing import TimingModel

    given = flag_values(args, MOCKER)
    timing = {
        f.name: given[dest]
        for f in fields(TimingModel)
        if (dest := _flag(f.name).replace("-", "_")) in given
    }
    options: dict = {"timing": TimingModel(**timing)}
    if "speedup" in given:
        options["speedup"] = given["speedup"]
    return options


def mocker_argv(args: argparse.Namespace) -> list[str]:
    """The mocker flags given, as command-line words for a `shoal worker`."""
    return flag_argv(args, MOCKER)
