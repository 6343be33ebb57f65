"""The mocker's flags (speedup, timing coefficients, KV tier bandwidths), each with a
SHOAL_MOCKER_* twin."""

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
TIER_HELP = {  # TierModel field -> what it sets (the tiers' sizes are the engine's flags)
    "host_gbps": "host<->GPU copy bandwidth of the KV tiers, in GB/s",
    "disk_gbps": "disk read bandwidth of the disk KV tier, in GB/s",
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
        Flag(
            "mocker-host-gbps",
            TIER_HELP["host_gbps"],
            float,
            metavar="GBPS",
            shown_default="44 (H100, block batches, see kv-offload.md)",
        ),
        Flag(
            "mocker-disk-gbps",
            TIER_HELP["disk_gbps"],
            float,
            metavar="GBPS",
            shown_default="5 (one NVMe drive)",
        ),
    ),
    about="The simulated engine's timing model and KV tier bandwidths ([mocker.md](mocker.md)); "
    "unset coefficients keep the model's defaults.",
)


def mocker_options(args: argparse.Namespace) -> dict:
    """MockEngine's keyword options (timing; tiers and speedup when given) from the flags."""
    from shoal.mocker.tiers import TierModel
    from shoal.mocker.timing import TimingModel

    given = flag_values(args, MOCKER)
    timing = {
        f.name: given[dest]
        for f in fields(TimingModel)
        if (dest := _flag(f.name).replace("-", "_")) in given
    }
    tiers = {f: given[dest] for f in TIER_HELP if (dest := _flag(f).replace("-", "_")) in given}
    options: dict = {"timing": TimingModel(**timing)}
    if tiers:
        options["tiers"] = TierModel(**tiers)
    if "speedup" in given:
        options["speedup"] = given["speedup"]
    return options


def mocker_argv(args: argparse.Namespace) -> list[str]:
    """The mocker flags given, as command-line words for a `shoal worker`."""
    return flag_argv(args, MOCKER)
