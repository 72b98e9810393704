"""One gloo rank per simulated node, each a real Python process (torch.distributed over 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Callable

from cachefeed._testing.local_s3 import free_port


def run_one_rank_per_node(code: Callable[[int, int], str], *, nodes: int = 2, timeout_s: float = 240) -> None:
    """Run ``code(rank, port)`` (Python source) as rank ``rank`` of ``nodes``, one rank per node (torchrun's
    variables set so), and wait for every rank to exit 0."""
    from tests.trainer.test_distributed import python

    port = free_port()
    ranks = [
        python(
            code(rank, port),
            extra_env={
                "RANK": str(rank),
                "WORLD_SIZE": str(nodes),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            },
        )
        for rank in range(nodes)
    ]
    for proc in ranks:
        assert proc.wait(timeout=timeout_s) == 0, "a rank failed (its traceback is above)"
