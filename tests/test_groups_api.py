"""The collectives beyond all-reduce through the TensorFlow surfaces (Horovod's process
sets, ``reducescatter``, ``alltoall``, ``Product``; HCCL's groups and ops through
``hostreduce.hccl`` and ``hostreduce.distribute``), eagerly and in ``tf.function``,
against numpy on ring workers (``tests/hvd_workers/groups_api.py``, written once for
every world size)."""
from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from tests.hvd_workers import groups_api  # noqa: E402

pytestmark = [pytest.mark.tf]

SIZES = [1, 2, 4]


@pytest.mark.parametrize("size", SIZES)
def test_groups_and_new_collectives_match_numpy_on_every_rank(size: int) -> None:
    from hostreduce.testing import run_ranks

    results = run_ranks(groups_api.rank_main, size, timeout=240)
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
        assert result["checks"] >= (24 if rank in (0, size - 1) else 12)
        errors = result["errors"]
        assert "is not registered: pass it to hvd.init(process_sets=...) or hvd.add_process_set() first" in errors[0]
        assert "`group` must be 'hccl_world_group' or a group made by create_group. Received: group='nope'" in errors[1]
        assert "`reduction` must be one of ['sum', 'prod', 'max', 'min']. Received: reduction='mean'" in errors[2]


def test_hccl_groups_end_with_the_job() -> None:
    """A group made by ``hccl.create_group`` is forgotten by ``hvd.shutdown()``: its name
    does not outlive the engine it was made on."""
    from hostreduce.testing import run_ranks

    outcome = run_ranks(_group_then_shutdown, 1, timeout=120)
    assert outcome == ["1 ConfigError"], outcome


def _group_then_shutdown(rank: int, size: int) -> str:
    import hostreduce.hccl as hccl
    import hostreduce.horovod as hvd
    from hostreduce.errors import ConfigError

    hvd.init()
    hccl.create_group("pair", 1, [0])
    made = hccl.get_rank_size("pair")
    hvd.shutdown()
    try:
        hccl.get_rank_size("pair")
    except ConfigError as exc:
        return f"{made} {type(exc).__name__}"
    return f"{made} still known"
