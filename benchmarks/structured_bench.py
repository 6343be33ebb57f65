"""Grammar-mask overhead: decode throughput of JSON-schema-constrained batches against the same
batches unconstrained (issue 17's measure: batch 1, 64 and 256 on a Qwen3-0.6B shape).

The engine's model folder is generated (random weights, no tokenizer), so the grammar runs over
a real BPE vocabulary given with --vocab-file (a tiktoken ranks file, such as Qwen's), padded to
the model's size, or else over a synthetic one: the 256 single bytes, then pieces of JSON's
alphabet and words. SCHEMA's leaves are enums, booleans and bounded integers, so a random
model walks through the object's structure instead of staying in one free-text string, and
its unbounded last array keeps it inside the grammar until max_tokens. One JSON line per
batch size.

    python benchmarks/structured_bench.py --shape qwen3-0.6b --device cuda \\
        --vocab-file qwen.tiktoken
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import SHAPES, device_name, make_engine, prompt
from provenance import provenance

from shoal.engine.llm_engine import LLMEngine
from shoal.protocol import EngineRequest, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra"]},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 99},
        "address": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Lagos", "Lima", "Osaka"]},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}},
    },
    "required": ["name", "role", "active", "level", "address", "values"],
}
ALPHABET = [*'abcdefghijklmnopqrstuvwxyz0123456789{}[]":, ', "name", "values", "true"]


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """The 256 single bytes, then random pieces of JSON-ish text (duplicates allowed)."""
    rng = np.random.default_rng(seed)
    vocab = [bytes([b]) for b in range(256)]
    while len(vocab) < size:
        pieces = rng.choice(ALPHABET, rng.integers(1, 5))
        vocab.append("".join(pieces).encode())
    return vocab


def tiktoken_vocab(path: str, size: int) -> list[bytes]:
    """A real BPE vocabulary from a tiktoken ranks file (one `base64-token rank` a line),
    padded to the model's size with tokens the grammar never allows."""
    vocab = [base64.b64decode(line.split()[0]) for line in Path(path).read_text().splitlines()]
    return vocab[:size] + [f"<|pad{i}|>".encode() for i in range(len(vocab), size)]


def use_grammars_over(engine: LLMEngine, vocab_file: str | None) -> None:
    """Grammars over a real vocabulary from `vocab_file`, else over a synthetic one."""
    import xgrammar as xgr

    from shoal.engine.structured import GrammarCompilerPool

    size = engine.model_config.vocab_size
    vocab = tiktoken_vocab(vocab_file, size) if vocab_file else synthetic_vocab(size)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[0])
    engine._grammars = GrammarCompilerPool(info)


def decode_rate(engine: LLMEngine, batch: int, constrained: bool, args) -> dict:
    """Decode speed of `batch` requests run together: output tokens per second over the steps
    where the whole batch still runs (a constrained request may close its JSON early), the mean
    step time of those steps, and the totals. Sampling is unseeded (--temperature, 1 by
    default), so both sides draw every row in one batched call."""
    rng = np.random.default_rng(batch)
    vocab = engine.model_config.vocab_size
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
    for i in range(batch):
        sp = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            ignore_eos=not constrained,
            structured_outputs=so,
        )
        rid = f"{'c' if constrained else 'u'}{batch}-{i}"
        request = EngineRequest(
            request_id=rid, prompt_token_ids=prompt(rng, args.prompt_len, vocab), sampling=sp
        )
        engine.add_request(request)
    while (
        engine.scheduler.num_unfinished < batch
        or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # compile and prefill: not timed
    full_tokens, full_steps, full_time, tokens = 0, 0, 0.0, 0
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        made = sum(len(o.new_token_ids) for o in engine.step())
        now = time.perf_counter()
        if made == batch:
            full_tokens += made
            full_steps += 1
            full_time += now - last
        tokens += made
        last = now
    return {
        "tokens_per_s": full_tokens / full_time if full_time else 0.0,
        "step_ms": 1000 * full_time / max(full_steps, 1),
        "full_batch_steps": full_steps,
        "tokens": tokens,
        "wall_tokens_per_s": tokens / (last - start),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="both sides; 0 (greedy) makes every run take the same walk through the grammar",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument(
        "--vocab-file",
        default=None,
        help="tiktoken ranks file of a real BPE vocabulary (e.g. Qwen's qwen.tiktoken) for the "
        "grammar; default: a synthetic vocabulary",
    )
    parser.add_argument(
        "--mask-threads",
        default=None,
        help="threads filling the grammar bitmask at every batch size (an int, or auto); "
        "default: the engine's choice by batch size",
    )
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    engine = make_engine(args.shape, args)
    use_grammars_over(engine, args.vocab_file)
    if args.mask_threads is not None:
        from shoal.engine.structured import GrammarMask

        threads = args.mask_threads if args.mask_threads == "auto" else int(args.mask_threads)
        engine.runner.sampler._grammar_mask = GrammarMask(threads, threaded_from=1)
    for batch in (int(b) for b in args.batches.split(",")):
        decode_rate(engine, min(batch, 8), True, args)  # warm-up (kernels, compile cache)
        free = decode_rate(engine, batch, False, args)
        masked = decode_rate(engine, batch, True, args)
        record = {
            "bench": "structured_mask",
            "shape": args.shape,
            "device": device_name(engine),
            "batch": batch,
            "vocabulary": Path(args.vocab_file).name if args.vocab_file else "synthetic",
            "unconstrained": free,
            "json_schema": masked,
            "throughput_ratio": masked["tokens_per_s"] / free["tokens_per_s"],
            "async_scheduling": engine.async_scheduling,
            "mask_threads": args.mask_threads,
            "temperature": args.temperature,
            **provenance(),
        }
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
