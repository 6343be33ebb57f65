"""`shoal generate`: offline generation from the command line, plus the engine flags
shared by every command that runs an engine (each with a SHOAL_* environment twin)."""

from __future__ import annotations

import argparse
import json
import sys

from shoal.flags import Flag, FlagGroup, FlagParser, flag_argv, flag_values

MODEL = Flag(
    "model",
    "model folder (HF format) or Hugging Face model id",
    required=True,
    metavar="PATH_OR_ID",
)
ENGINE = FlagGroup(
    "engine",
    (
        Flag(
            "dtype",
            "weights and KV cache dtype: float32, bfloat16, float16",
            shown_default="the config's",
        ),
        Flag("device", "cpu or cuda", shown_default="cuda when available"),
        Flag("tokenizer", "tokenizer folder", shown_default="the model folder"),
        Flag(
            "max-model-len",
            "longest prompt + output in tokens",
            int,
            shown_default="the model's context",
        ),
        Flag("max-num-seqs", "most sequences in one batch", int, shown_default="256"),
        Flag(
            "max-num-batched-tokens",
            "token budget of one step",
            int,
            shown_default="8192; offline on GPUs of 70 GiB or more, 16384",
        ),
        Flag("block-size", "tokens per KV cache block", int, shown_default="16"),
        Flag(
            "num-gpu-blocks",
            "number of KV blocks, overriding memory-based sizing",
            int,
            shown_default="sized from memory",
        ),
        Flag(
            "kv-cache-memory-bytes", "KV cache size in bytes", int, shown_default="512 MiB on CPU"
        ),
        Flag(
            "gpu-memory-utilization",
            "fraction of GPU memory for weights + KV",
            float,
            shown_default="0.9",
        ),
        Flag("seed", "engine random seed", int, shown_default="0"),
        Flag(
            "load-format",
            "auto (safetensors) or dummy (random weights, for benchmarks)",
            shown_default="auto",
        ),
        Flag(
            "enable-prefix-caching", "automatic prefix caching", kind="toggle", shown_default="on"
        ),
        Flag(
            "enable-chunked-prefill",
            "split long prompts across steps",
            kind="toggle",
            shown_default="on",
        ),
        Flag(
            "enforce-eager",
            "GPU: run every step without CUDA graphs (decode and piecewise)",
            kind="toggle",
            shown_default="off",
        ),
        Flag(
            "async-scheduling",
            "schedule the next step while the GPU runs this one (see gpu.md)",
            kind="toggle",
            shown_default="on with CUDA, off on CPU",
        ),
        Flag(
            "tensor-parallel-size",
            "split the model over N ranks, one process (and GPU) each (see engine.md)",
            int,
            metavar="N",
            shown_default="1",
        ),
        Flag(
            "kv-offload-cpu-gb",
            "host-memory KV tier size in GiB: evicted prefixes are reloaded, not recomputed "
            "(see kv-offload.md)",
            float,
            shown_default="off",
        ),
        Flag(
            "kv-offload-disk-path",
            "folder of the disk KV tier under the host tier (its block files are deleted at start)",
            metavar="DIR",
            shown_default="off",
        ),
        Flag("kv-offload-disk-gb", "disk KV tier size in GiB", float, shown_default="off"),
    ),
    about="The engine's options: every command that runs an engine takes them (`shoal "
    "serve` passes them to its workers). Unset ones are left to the engine's defaults.",
)
GENERATE = FlagGroup(
    "generate",
    (
        Flag(
            "prompt",
            "a prompt (repeatable); default: one prompt per stdin line",
            kind="append",
            env=False,
        ),
        Flag("chat", "wrap each prompt as a user chat message", kind="switch", env=False),
        Flag("max-tokens", "tokens to generate", int, 64, env=False),
        Flag("temperature", "sampling temperature; 0 = greedy", float, 0.0, env=False),
        Flag("top-p", "nucleus sampling mass", float, 1.0, env=False),
        Flag("top-k", "keep the k likeliest tokens (0 = off)", int, 0, env=False),
        Flag("sampling-seed", "per-request sampling seed", int, env=False),
        Flag("json", "print one JSON object per prompt", kind="switch", env=False),
    ),
    about="Sampling options of `shoal generate`, which prints one completion per prompt.",
)


def add_engine_args(parser: FlagParser) -> None:
    """--model and the engine group."""
    parser.add_group(FlagGroup("model", (MODEL,), about="The model every engine loads."))
    parser.add_group(ENGINE)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keyword options given on the command line (unset ones left to defaults)."""
    return flag_values(args, ENGINE)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """--model and the engine flags given, as command-line words for a `shoal worker`."""
    return ["--model", args.model, *flag_argv(args, ENGINE)]


def configure(parser: FlagParser) -> None:
    """`shoal generate`: offline generation from the command line."""
    parser.description = "Generate completions for prompts with the offline engine and print them."
    add_engine_args(parser)
    parser.add_group(GENERATE)
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from shoal.engine.llm import LLM
    from shoal.protocol import SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt given (use --prompt or pipe lines on stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
        )
        llm = LLM(args.model, **engine_options(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        seq = out.outputs[0]
        if args.json:
            record = {
                "prompt": prompt,
                "text": seq.text,
                "token_ids": seq.token_ids,
                "finish_reason": seq.finish_reason,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt!r} -> {seq.text!r} ({seq.finish_reason})")
    return 0
