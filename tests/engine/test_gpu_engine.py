"""The GPU engine against the CPU reference engine on the tiny models (needs CUDA)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_no_leaks, assert_same, greedy, outputs, random_prompts, token_ids
from tiny_models import write_model

from shoal import LLM as _LLM
from shoal import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def LLM(model: str, **options) -> _LLM:
    """Engines share the GPU inside one test process: give each a fixed, small KV cache."""
    if options.get("device") == "cuda" and "num_gpu_blocks" not in options:
        options.setdefault("kv_cache_memory_bytes", 64 * 2**20)
    return _LLM(model, **options)


SHARED = random_prompts([40], seed=50)[0]
PROMPTS = [SHARED + t for t in random_prompts([3, 30, 11, 70], seed=51)] + random_prompts(
    [1, 200], seed=52
)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("eager", [False, True])
def test_float32_greedy_equals_cpu(model_dirs, arch, eager):
    cpu = LLM(str(model_dirs[arch]), device="cpu", block_size=8)
    gpu = LLM(str(model_dirs[arch]), device="cuda", block_size=8, enforce_eager=eager)
    assert token_ids(gpu, PROMPTS, greedy(20)) == token_ids(cpu, PROMPTS, greedy(20))
    assert_no_leaks(gpu)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_chunked_prefill_prefix_cache_and_preemption_on_gpu(llama_dir, async_scheduling):
    cpu = LLM(str(llama_dir), device="cpu", enable_prefix_caching=False)
    expected = token_ids(cpu, PROMPTS, greedy(24))
    gpu = LLM(
        str(llama_dir),
        device="cuda",
        block_size=8,
        num_gpu_blocks=40,
        max_num_batched_tokens=13,
        async_scheduling=async_scheduling,
    )
    assert token_ids(gpu, PROMPTS, greedy(24)) == expected
    assert gpu.engine.scheduler.num_preemptions > 0
    assert gpu.engine.kv.stats.hits > 0
    assert_no_leaks(gpu)


def test_bfloat16_logprobs_close_to_float32_cpu(llama_dir):
    cpu = LLM(str(llama_dir), device="cpu")
    gpu = LLM(str(llama_dir), device="cuda", dtype="bfloat16")
    params = greedy(1, prompt_logprobs=0)
    for prompt in PROMPTS[:3]:
        ref = cpu.generate([prompt], params)[0].prompt_logprobs[1:]
        got = gpu.generate([prompt], params)[0].prompt_logprobs[1:]
        diffs = [abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(ref, got, strict=True)]
        assert max(diffs) < 0.15, max(diffs)


def test_seeded_sampling_on_gpu_is_batch_independent(llama_dir):
    gpu = LLM(str(llama_dir), device="cuda")
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    alone = token_ids(gpu, [PROMPTS[0]], seeded)
    batch = token_ids(gpu, PROMPTS[:3], [seeded, greedy(16), SamplingParams(temperature=0.5)])
    assert alone[0] == batch[0]


def test_async_scheduling_sampling_equals_sync_on_gpu(llama_dir):
    """Seeds, top-k/p, logprobs, min_tokens, penalties and stop ids, overlapped on the GPU."""
    sync = LLM(str(llama_dir), device="cuda", async_scheduling=False)
    overlapped = LLM(str(llama_dir), device="cuda", async_scheduling=True)
    for params in [
        SamplingParams(temperature=0.8, top_k=20, seed=5, n=2, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, min_p=0.05),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[7, 99, 200]),
    ]:
        assert_same(outputs(overlapped, PROMPTS, params), outputs(sync, PROMPTS, params))
    assert_no_leaks(overlapped)


def wide_model(tmp_path, vocab_size: int):
    """A model wider than the tiny ones (cuBLAS picks among several kernels for it)."""
    return write_model(
        tmp_path / "wide",
        "llama",
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab_size,
    )


def test_a_context_shorter_than_the_whole_graphs_a_prompt_alone_replays(llama_dir):
    """With max_model_len under the largest whole graph (a prompt alone, up to 1,024
    tokens), each whole graph is still captured over a prompt of its own size, longer than
    a sequence's block table: the capture must not read past the table (it did, and the
    engine failed to start with an illegal memory access)."""
    prompts = [prompt[:100] for prompt in PROMPTS]
    cpu = LLM(str(llama_dir), device="cpu", max_model_len=128)
    gpu = LLM(str(llama_dir), device="cuda", block_size=8, max_model_len=128)
    assert max(gpu.engine.runner.mixed_graphs.whole) > 128  # whole graphs past the context
    assert token_ids(gpu, prompts, greedy(20)) == token_ids(cpu, prompts, greedy(20))


def test_a_fresh_engine_has_loaded_the_lm_head_kernel_of_every_row_count(tmp_path):
    """CUDA loads a kernel on its first launch, and the load waits for the device: a step
    sampling a row count not seen before stalled in the LM head until the step in flight
    ended. A fresh engine has run the LM head at every count a step may sample, so none
    loads a kernel afterwards (CUPTI reports each load). In a process of its own: kernels
    loaded by other tests would hide a missing load. A wider model than the tiny ones, so
    that cuBLAS picks among several kernels."""
    model = wide_model(tmp_path, vocab_size=32768)
    script = f"""
        import torch
        from torch.profiler import ProfilerActivity, profile
        from shoal import LLM
        llm = LLM({str(model)!r}, device="cuda", dtype="bfloat16", max_num_seqs=128,
                  kv_cache_memory_bytes=64 * 2**20)
        runner = llm.engine.runner
        hidden = torch.ones(128, 512, dtype=torch.bfloat16, device="cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for rows in range(1, 129):
                runner.model.compute_logits(hidden[:rows])
            torch.cuda.synchronize()
        print(sum(e.name == "Lazy Function Loading" for e in prof.events()))
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"


def test_a_fresh_engine_has_loaded_the_sampler_kernels_of_every_row_count(tmp_path):
    """The sampler's sorts and top-k load their kernels by row count, in ranges (1 row, 2
    to about 100, more); the memory profile samples with every filter and logprobs at 1
    row, 2 and max_num_seqs, so no sampled step of a fresh engine loads one (CUPTI reports
    each load; those inside the sampler are counted). In a process of its own."""
    model = wide_model(tmp_path, vocab_size=32768)
    script = f"""
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
        from shoal import LLM, SamplingParams
        llm = LLM({str(model)!r}, device="cuda", dtype="bfloat16", max_num_seqs=256,
                  max_model_len=256, gpu_memory_utilization=0.3)
        runner = llm.engine.runner
        sample = runner.sampler.__call__
        def marked(logits, requests):
            with record_function("sampler"):
                return sample(logits, requests)
        runner.sampler = marked
        kinds = [
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=2, ignore_eos=True),
            SamplingParams(temperature=0.7, logprobs=5, max_tokens=2, ignore_eos=True),
        ]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for rows in (1, 2, 3, 60, 127, 128, 256):
                for params in kinds:
                    llm.generate([[7 + i % 300] * 9 for i in range(rows)], params)
            torch.cuda.synchronize()
        events = list(prof.events())
        spans = [e.time_range for e in events if e.name == "sampler"]
        loads = [e.time_range.start for e in events if e.name == "Lazy Function Loading"]
        print(sum(any(s.start <= t <= s.end for s in spans) for t in loads))
    """
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"


def test_loading_the_lm_head_kernels_leaves_one_block_of_logits_in_the_pool(tmp_path):
    """The LM head runs at every row count as the engine starts; the caching allocator
    must not keep a block per count (going up, each count's logits outgrew every block it
    held): the pool grows by about the largest count's logits, not by their sum. Logits
    of over 10 MiB (a vocabulary of 64k at 256 rows), which the allocator gives a segment
    each, rounded to 2 MiB (smaller ones share 20 MiB segments and hide the growth)."""
    model = wide_model(tmp_path, vocab_size=65536)
    llm = LLM(str(model), device="cuda", dtype="bfloat16", max_num_seqs=256)
    runner = llm.engine.runner
    largest = runner.model.compute_logits(
        torch.ones(256, 512, dtype=torch.bfloat16, device="cuda")
    ).nbytes
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    runner._load_logit_kernels()
    grown = torch.cuda.memory_reserved() - before
    assert grown <= 2 * largest + 2**21, (grown, largest)
