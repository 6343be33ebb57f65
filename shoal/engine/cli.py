"""`shoal generate`: offline generation from the command line, plus the engine flags
shared by every command that runs an engine (each with a SHOAL_* environment twin)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from shoal.protocol import SamplingParams

ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("dtype", str, "weights and KV cache dtype: float32, bfloat16, float16 (default: config's)"),
    ("device", str, "cpu or cuda (default: cuda when available)"),
    ("tokenizer", str, "tokenizer folder (default: the model folder)"),
    ("max-model-len", int, "longest prompt + output in tokens (default: model's context)"),
    ("max-num-seqs", int, "most sequences in one batch (default 256)"),
    ("max-num-batched-tokens", int, "token budget of one step (default 8192)"),
    ("block-size", int, "tokens per KV cache block (default 16)"),
    ("num-gpu-blocks", int, "number of KV blocks, overriding memory-based sizing"),
    ("kv-cache-memory-bytes", int, "KV cache size in bytes (default: 512 MiB on CPU)"),
    ("gpu-memory-utilization", float, "fraction of GPU memory for weights + KV (default 0.9)"),
    ("seed", int, "engine random seed (default 0)"),
    ("load-format", str, "auto (safetensors) or dummy (random weights, for benchmarks)"),
]
ENGINE_SWITCHES = [
    ("prefix-caching", "automatic prefix caching (default on)"),
    ("chunked-prefill", "split long prompts across steps (default on)"),
]
PLAIN_SWITCHES = [
    ("enforce-eager", "GPU: run decode without CUDA graphs (default off)"),
    (
        "async-scheduling",
        "schedule the next step while the GPU runs this one (default: on with CUDA, off on CPU)",
    ),
]


def env_name(flag: str) -> str:
    return "SHOAL_" + flag.upper().replace("-", "_")


def _env_bool(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"{name}={value!r}: expected true or false")


def _env_value(name: str, kind: type):
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r}: expected {kind.__name__}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=os.environ.get("SHOAL_MODEL"),
        required="SHOAL_MODEL" not in os.environ,
        help="model folder (HF format) or Hugging Face model id [env SHOAL_MODEL]",
    )
    for flag, kind, text in ENGINE_FLAGS:
        env = env_name(flag)
        group.add_argument(
            f"--{flag}",
            type=kind,
            default=_env_value(env, kind),
            help=f"{text} [env {env}]",
        )
    switches = [("enable-" + f, t) for f, t in ENGINE_SWITCHES] + PLAIN_SWITCHES
    for flag, text in switches:
        env = env_name(flag)
        group.add_argument(
            f"--{flag}",
            action=argparse.BooleanOptionalAction,
            default=_env_bool(env),
            help=f"{text} [env {env}]",
        )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine keyword options given on the command line (unset ones left to defaults)."""
    names = [f.replace("-", "_") for f, _, _ in ENGINE_FLAGS]
    names += ["enable_" + f.replace("-", "_") for f, _ in ENGINE_SWITCHES]
    names += [f.replace("-", "_") for f, _ in PLAIN_SWITCHES]
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text offline (no server)",
        description="Generate completions for prompts with the offline engine and print them.",
    )
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin lines")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from shoal.engine.llm import LLM

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
