"""On a GPU: the tensor-parallel group shoal builds uses NCCL, and an all-reduce over it can be
captured in a CUDA graph and replayed (what the decode graphs do at TP > 1). One rank, so it
runs on one GPU; the many-GPU runs belong to the multi-GPU issue."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shoal.engine.parallel.group import init_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_all_reduce_captured_in_a_cuda_graph():
    group = init_group(torch.device("cuda", 0), 0, 1, dist.HashStore())
    try:
        assert dist.get_backend(group.group) == "nccl"
        x = torch.ones(1024, device="cuda")
        dist.all_reduce(x, group=group.group)  # NCCL sets up its communicator outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
            y = x * 2
            dist.all_reduce(y, group=group.group)
        x.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert bool((y == 6.0).all())
    finally:
        dist.destroy_process_group()
