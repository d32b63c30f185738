"""Tests of cluster resolution: arguments, TF_CONFIG, launcher variables, resolvers."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from hostreduce.cluster import ClusterSpec, cluster_from_resolver, resolve_cluster
from hostreduce.errors import ClusterError, ConfigError


def tf_config(cluster: Any, task_type: Any = "worker", index: Any = 0, **extra: Any) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})}


def raw_tf_config(text: str) -> dict[str, str]:
    return {"TF_CONFIG": text}


OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}

W2 = ["h0:2222", "h1:2222"]


# ------------------------------------------------------------------- bad TF_CONFIG

BAD_TF_CONFIGS = [
    # (id, env, substrings the message must contain)
    ("bad-json", raw_tf_config('{"cluster": {"worker": ["a:1"]'), ["TF_CONFIG", "JSON", "line 1 column", "char", '{"cluster"']),
    ("bad-json-trailing-comma", raw_tf_config('{"cluster": {},}'), ["TF_CONFIG", "char 15"]),
    ("not-object-list", raw_tf_config("[1, 2]"), ["TF_CONFIG", "JSON object", "[1, 2]", "list"]),
    ("not-object-string", raw_tf_config('"worker"'), ["TF_CONFIG", "JSON object", "string"]),
    ("missing-cluster", raw_tf_config('{"task": {"type": "worker", "index": 0}}'), ["`cluster`", "['task']"]),
    ("missing-task", raw_tf_config('{"cluster": {"worker": ["a:1"]}}'), ["`task`", "['cluster']"]),
    ("task-not-object", raw_tf_config('{"cluster": {"worker": ["a:1"]}, "task": "worker"}'), ["`task`", "task='worker'"]),
    ("missing-task-type", raw_tf_config('{"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}'), ["`task.type`", "{'index': 0}"]),
    ("missing-task-index", raw_tf_config('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}'), ["`task.index`", "{'type': 'worker'}"]),
    ("index-string", tf_config({"worker": W2}, "worker", "1"), ["`task.index`", "integer", "task.index='1'"]),
    ("index-float", tf_config({"worker": W2}, "worker", 1.0), ["`task.index`", "integer", "task.index=1.0"]),
    ("index-bool", tf_config({"worker": W2}, "worker", True), ["`task.index`", "integer", "task.index=True"]),
    ("index-out-of-range", tf_config({"worker": W2}, "worker", 5), ["`task.index`", "[0, 2)", "'worker'", "task.index=5"]),
    ("index-negative", tf_config({"worker": W2}, "worker", -1), ["`task.index`", "[0, 2)", "task.index=-1"]),
    ("chief-index-1", tf_config({"chief": ["c:1"], "worker": W2}, "chief", 1), ["`task.index`", "[0, 1)", "'chief'", "task.index=1"]),
    ("type-master", tf_config({"worker": W2}, "master", 0), ["`task.type`", "chief", "task.type='master'"]),
    ("type-typo", tf_config({"worker": W2}, "wroker", 0), ["`task.type`", "Did you mean 'worker'", "task.type='wroker'"]),
    ("type-not-string", tf_config({"worker": W2}, 3, 0), ["`task.type`", "string", "task.type=3"]),
    ("type-not-in-cluster", tf_config({"worker": W2}, "chief", 0), ["`task.type`", "['worker']", "task.type='chief'"]),
    ("cluster-key-master", tf_config({"master": ["m:1"], "worker": W2}), ["`cluster`", "chief", "'master'"]),
    ("ps-joins", tf_config({"worker": W2, "ps": ["p:1"]}, "ps", 0), ["`task.type`", "all-reduce", "task.type='ps'"]),
    ("evaluator-joins", tf_config({"worker": W2, "evaluator": ["e:1"]}, "evaluator", 0), ["`task.type`", "all-reduce", "task.type='evaluator'"]),
    ("two-chiefs", tf_config({"chief": ["c:1", "c:2"], "worker": W2}, "chief", 0), ["`cluster.chief`", "at most one", "['c:1', 'c:2']"]),
    ("no-workers", tf_config({"ps": ["p:1"]}, "worker", 0), ["`cluster`", "at least one", "'ps'"]),
    ("empty-cluster", tf_config({}, "worker", 0), ["`cluster`", "at least one", "cluster={}"]),
    ("cluster-not-object", tf_config(["a:1"], "worker", 0), ["`cluster`", "cluster=['a:1']", "list"]),
    ("job-string", tf_config({"worker": "a:1,b:1"}), ["`cluster.worker`", "list", "cluster.worker='a:1,b:1'"]),
    ("job-element-int", tf_config({"worker": ["a:1", 2222]}), ["`cluster.worker`", "cluster.worker[1]=2222"]),
    ("job-sparse-mapping", tf_config({"worker": {"0": "a:1", "2": "b:1"}}), ["`cluster.worker`", "'2': 'b:1'"]),
    ("address-no-port", tf_config({"worker": ["a:1", "hostonly"]}, "worker", 0), ["`cluster.worker[1]`", "host:port", "cluster.worker[1]='hostonly'"]),
    ("address-no-host", tf_config({"worker": [":2222"]}), ["`cluster.worker[0]`", "host:port", "cluster.worker[0]=':2222'"]),
    ("address-bad-host", tf_config({"worker": ["a b:1"]}), ["`cluster.worker[0]`", "host", "cluster.worker[0]='a b:1'"]),
    ("address-ipv6-unbracketed", tf_config({"worker": ["::1:2222"]}), ["`cluster.worker[0]`", "brackets", "'::1:2222'"]),
    ("port-not-int", tf_config({"worker": ["a:http"]}), ["`cluster.worker[0]`", "[1, 65535]", "cluster.worker[0]='a:http'"]),
    ("port-zero", tf_config({"worker": ["a:0"]}), ["`cluster.worker[0]`", "[1, 65535]", "cluster.worker[0]='a:0'"]),
    ("port-too-big", tf_config({"worker": ["a:65536"]}), ["`cluster.worker[0]`", "[1, 65535]", "'a:65536'"]),
    ("port-negative", tf_config({"worker": ["a:-1"]}), ["`cluster.worker[0]`", "[1, 65535]", "'a:-1'"]),
    ("ps-bad-address", tf_config({"worker": W2, "ps": ["p"]}), ["`cluster.ps[0]`", "cluster.ps[0]='p'"]),
    ("duplicate-in-job", tf_config({"worker": ["a:1", "a:1"]}), ["`cluster.worker[1]`", "`cluster.worker[0]`", "'a:1'"]),
    ("duplicate-across-jobs", tf_config({"chief": ["a:1"], "worker": ["b:1"], "ps": ["A:1"]}), ["`cluster.ps[0]`", "`cluster.chief[0]`", "'A:1'"]),
]


@pytest.mark.parametrize("env, expected", [c[1:] for c in BAD_TF_CONFIGS], ids=[c[0] for c in BAD_TF_CONFIGS])
def test_bad_tf_config_raises_naming_field_and_value(env: dict[str, str], expected: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        resolve_cluster(env=env)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_cluster_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        resolve_cluster(env=raw_tf_config("{"))


def test_long_tf_config_is_shortened_in_message() -> None:
    text = "[" + ", ".join(["1"] * 2000) + "]"
    with pytest.raises(ClusterError) as info:
        resolve_cluster(env=raw_tf_config(text))
    assert len(str(info.value)) < 500


# ------------------------------------------------------------------- good TF_CONFIG


@pytest.mark.parametrize(
    "task_type, index, rank, local_rank, local_size",
    [
        ("chief", 0, 0, 0, 2),
        ("worker", 0, 1, 1, 2),
        ("worker", 1, 2, 0, 3),
        ("worker", 2, 3, 1, 3),
        ("worker", 3, 4, 2, 3),
    ],
)
def test_chief_and_workers(task_type: str, index: int, rank: int, local_rank: int, local_size: int) -> None:
    cluster = {
        "chief": ["h0:2000"],
        "worker": ["h0:2001", "h1:2000", "h1:2001", "h1:2002"],
        "ps": ["h2:2000"],
        "evaluator": ["h3:2000"],
    }
    spec = resolve_cluster(env=tf_config(cluster, task_type, index))
    assert spec == ClusterSpec(
        rank=rank,
        size=5,
        local_rank=local_rank,
        local_size=local_size,
        addresses=("h0:2000", "h0:2001", "h1:2000", "h1:2001", "h1:2002"),
        task_type=task_type,
        task_index=index,
        source="TF_CONFIG",
    )
    assert spec.is_chief == (task_type == "chief")


def test_workers_only_worker_zero_is_rank_zero() -> None:
    specs = [resolve_cluster(env=tf_config({"worker": W2}, "worker", i)) for i in range(2)]
    assert [s.rank for s in specs] == [0, 1]
    assert all(s.size == 2 and s.addresses == tuple(W2) for s in specs)
    assert [(s.local_rank, s.local_size) for s in specs] == [(0, 1), (0, 1)]
    assert [(s.task_type, s.task_index) for s in specs] == [("worker", 0), ("worker", 1)]


def test_chief_only() -> None:
    spec = resolve_cluster(env=tf_config({"chief": ["c:1"]}, "chief", 0))
    assert (spec.rank, spec.size, spec.task_type) == (0, 1, "chief")


def test_same_host_local_ranks_follow_rank_order() -> None:
    workers = ["a:1", "b:1", "a:2", "b:2", "a:3"]
    got = [resolve_cluster(env=tf_config({"worker": workers}, "worker", i)) for i in range(5)]
    assert [(s.local_rank, s.local_size) for s in got] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]


def test_loopback_names_count_as_one_host() -> None:
    workers = ["localhost:1", "127.0.0.1:2", "[::1]:3", "LOCALHOST:4"]
    got = [resolve_cluster(env=tf_config({"worker": workers}, "worker", i)) for i in range(4)]
    assert [(s.local_rank, s.local_size) for s in got] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_ipv6_and_extra_fields_accepted() -> None:
    env = tf_config({"worker": ["[fe80::1]:2222", "[fe80::2]:2222"]}, "worker", 1, environment="cloud", rpc_layer="grpc")
    spec = resolve_cluster(env=env)
    assert spec.rank == 1 and spec.hosts == ("[fe80::1]", "[fe80::2]")


def test_dense_index_mapping_job_accepted() -> None:
    spec = resolve_cluster(env=tf_config({"worker": {"1": "b:1", "0": "a:1"}}, "worker", 1))
    assert spec.addresses == ("a:1", "b:1") and spec.rank == 1


def test_blank_tf_config_is_ignored() -> None:
    assert resolve_cluster(env={"TF_CONFIG": "  "}).source == "single"


# ------------------------------------------------------------------- precedence


def test_arguments_beat_tf_config_and_mpirun() -> None:
    env = {**tf_config({"worker": W2}, "worker", 1), **OMPI}
    spec = resolve_cluster(rank=0, addresses=["x:1", "x:2", "y:1"], env=env)
    assert (spec.source, spec.rank, spec.size) == ("arguments", 0, 3)
    assert spec.addresses == ("x:1", "x:2", "y:1")
    assert (spec.local_rank, spec.local_size) == (0, 2)


def test_tf_config_beats_mpirun() -> None:
    env = {**tf_config({"worker": W2}, "worker", 1), **OMPI}
    spec = resolve_cluster(env=env)
    assert (spec.source, spec.rank, spec.size) == ("TF_CONFIG", 1, 2)


def test_mpirun_beats_single() -> None:
    spec = resolve_cluster(env=OMPI)
    assert (spec.source, spec.rank, spec.size) == ("mpirun", 3, 8)


def test_single_process_default() -> None:
    assert resolve_cluster(env={}) == ClusterSpec(source="single")
    spec = resolve_cluster(env={"PATH": "/bin"})
    assert (spec.rank, spec.size, spec.source, spec.addresses) == (0, 1, "single", ())


def test_env_defaults_to_os_environ_and_is_not_modified(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": W2}, "task": {"type": "worker", "index": 1}}))
    before = dict(os.environ)
    assert resolve_cluster().rank == 1
    assert dict(os.environ) == before


# ------------------------------------------------------------------- arguments


def test_arguments_rank_and_size_without_addresses() -> None:
    spec = resolve_cluster(rank=2, size=4, env={})
    assert spec == ClusterSpec(rank=2, size=4, task_index=2, source="arguments")


def test_arguments_single() -> None:
    assert resolve_cluster(size=1, env={}).source == "arguments"
    assert resolve_cluster(rank=0, env={}).size == 1
    assert resolve_cluster(addresses=["a:1"], env={}).addresses == ("a:1",)


def test_arguments_accept_index_like_ints() -> None:
    class Index:
        def __index__(self) -> int:
            return 1

    assert resolve_cluster(rank=Index(), size=2).rank == 1


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"rank": 2, "size": 2}, ["`rank`", "[0, 2)", "rank=2"]),
        ({"rank": -1, "size": 2}, ["`rank`", "rank=-1"]),
        ({"rank": 1}, ["`size`", "rank=1"]),
        ({"size": 3}, ["`rank`", "size=3"]),
        ({"rank": 0, "size": 0}, ["`size`", "size=0"]),
        ({"rank": "0", "size": 2}, ["`rank`", "integer", "rank='0'"]),
        ({"rank": True, "size": 2}, ["`rank`", "integer", "rank=True"]),
        ({"rank": 0, "size": 2.0}, ["`size`", "integer", "size=2.0"]),
        ({"rank": 0, "size": 3, "addresses": W2}, ["`size`", "(2)", "size=3"]),
        ({"rank": 0, "addresses": "a:1,b:1"}, ["`addresses`", "list", "addresses='a:1,b:1'"]),
        ({"rank": 0, "addresses": []}, ["`addresses`", "empty"]),
        ({"rank": 0, "addresses": ["a:1", "b"]}, ["`addresses[1]`", "host:port", "addresses[1]='b'"]),
        ({"rank": 0, "addresses": ["a:1", "a:99999"]}, ["`addresses[1]`", "65535", "'a:99999'"]),
        ({"rank": 0, "addresses": ["a:1", "a:1"]}, ["`addresses[1]`", "`addresses[0]`", "'a:1'"]),
        ({"rank": 0, "addresses": ["a:1", None]}, ["`addresses[1]`", "addresses[1]=None"]),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        resolve_cluster(env={}, **kwargs)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


# ------------------------------------------------------------------- launchers


def test_open_mpi() -> None:
    assert resolve_cluster(env=OMPI) == ClusterSpec(
        rank=3, size=8, local_rank=1, local_size=2, addresses=(), task_type="worker", task_index=3, source="mpirun"
    )


def test_mpich_hydra_with_and_without_local() -> None:
    spec = resolve_cluster(env={"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"})
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size, spec.source) == (5, 6, 2, 3, "mpirun")
    spec = resolve_cluster(env={"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size) == (1, 2, 0, 1)
    assert spec.task_index == 1 and spec.addresses == ()


def test_horovod_gloo() -> None:
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}
    spec = resolve_cluster(env=env)
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size, spec.source) == (1, 4, 1, 2, "mpirun")


def test_open_mpi_beats_horovod_variables() -> None:
    env = {**OMPI, "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}
    assert resolve_cluster(env=env).rank == 3


def test_horovod_variables_that_agree_with_tf_config_leave_the_job_to_it() -> None:
    # As `hostreduce run` starts a worker: TF_CONFIG plus the variables horovodrun sets.
    from hostreduce.cluster.mpi_env import horovod_env, spec_from_mpi_env

    cfg = tf_config({"worker": ["127.0.0.1:1", "127.0.0.1:2", "h2:3"]}, "worker", 1)
    env = {**cfg, **horovod_env(resolve_cluster(env=cfg))}
    assert {k: env[k] for k in sorted(env) if k.startswith("HOROVOD_")} == {
        "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"}
    assert spec_from_mpi_env(env) is None  # not an mpirun job
    spec = resolve_cluster(env=env)
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size, spec.source) == (1, 3, 1, 2, "TF_CONFIG")
    assert spec.addresses == ("127.0.0.1:1", "127.0.0.1:2", "h2:3")
    assert horovod_env(resolve_cluster(env=tf_config({"worker": W2}, "worker", 1)))["HOROVOD_CROSS_RANK"] == "1"
    assert horovod_env(ClusterSpec())["HOROVOD_CROSS_SIZE"] == "1"


def test_horovod_variables_that_disagree_with_tf_config_are_an_error() -> None:
    from hostreduce.cluster.mpi_env import spec_from_mpi_env

    env = {**tf_config({"worker": W2}, "worker", 1), "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}
    with pytest.raises(ClusterError, match=r"`HOROVOD_RANK` and `HOROVOD_SIZE` must agree with `TF_CONFIG`.*"
                                           r"HOROVOD_RANK=0, HOROVOD_SIZE=2, TF_CONFIG for rank 1 of 2"):
        spec_from_mpi_env(env)
    with pytest.raises(ClusterError, match="must agree with `TF_CONFIG`"):
        resolve_cluster(env=env)
    # Open MPI's variables are an mpirun job whatever TF_CONFIG says, as before.
    assert spec_from_mpi_env({**OMPI, **tf_config({"worker": W2})}).source == "mpirun"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({**OMPI, "OMPI_COMM_WORLD_RANK": "three"}, ["`OMPI_COMM_WORLD_RANK`", "integer", "'three'"]),
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": ""}, ["`OMPI_COMM_WORLD_SIZE`", "integer", "''"]),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "1.0"}, ["`OMPI_COMM_WORLD_LOCAL_RANK`", "'1.0'"]),
        ({**OMPI, "OMPI_COMM_WORLD_RANK": "8"}, ["`OMPI_COMM_WORLD_RANK`", "OMPI_COMM_WORLD_SIZE=8", "=8"]),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "9"}, ["`OMPI_COMM_WORLD_LOCAL_SIZE`", "=9"]),
        ({**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["`OMPI_COMM_WORLD_LOCAL_RANK`", "=2"]),
        ({"PMI_RANK": "0"}, ["`PMI_SIZE`", "unset"]),
        ({"PMI_RANK": "0", "PMI_SIZE": "x2"}, ["`PMI_SIZE`", "'x2'"]),
        ({"PMI_RANK": "0", "PMI_SIZE": "0"}, ["`PMI_SIZE`", "PMI_SIZE=0"]),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, ["`MPI_LOCALNRANKS`", "unset"]),
        ({"HOROVOD_RANK": "-1", "HOROVOD_SIZE": "2"}, ["`HOROVOD_RANK`", "HOROVOD_RANK=-1"]),
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "a", "HOROVOD_LOCAL_SIZE": "1"}, ["`HOROVOD_LOCAL_RANK`", "'a'"]),
    ],
)
def test_bad_launcher_variables(env: dict[str, str], expected: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        resolve_cluster(env=env)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


# ------------------------------------------------------------------- resolver


class FakeClusterSpec:
    def __init__(self, jobs: dict[str, Any]) -> None:
        self._jobs = jobs

    def as_dict(self) -> dict[str, Any]:
        return self._jobs


class FakeResolver:
    """Quacks like tf.distribute.cluster_resolver.TFConfigClusterResolver."""

    def __init__(self, jobs: dict[str, Any], task_type: str | None, task_id: int | None) -> None:
        self._jobs, self.task_type, self.task_id = jobs, task_type, task_id

    def cluster_spec(self) -> FakeClusterSpec:
        return FakeClusterSpec(self._jobs)


def test_resolver_duck_type() -> None:
    resolver = FakeResolver({"chief": ["c:1"], "worker": ["c:2", "w:1"], "ps": ["p:1"]}, "worker", 1)
    spec = cluster_from_resolver(resolver)
    assert spec == ClusterSpec(
        rank=2, size=3, local_rank=0, local_size=1, addresses=("c:1", "c:2", "w:1"),
        task_type="worker", task_index=1, source="TF_CONFIG",
    )


def test_resolver_sparse_as_dict_with_int_keys() -> None:
    spec = cluster_from_resolver(FakeResolver({"worker": {1: "b:1", 0: "a:1"}}, "worker", 0))
    assert spec.addresses == ("a:1", "b:1")


@pytest.mark.parametrize(
    "resolver, expected",
    [
        (FakeResolver({"worker": W2}, None, None), ["`resolver.task_type`", "task_type=None"]),
        (FakeResolver({"worker": W2}, "worker", 7), ["`resolver.task_id`", "[0, 2)", "task_id=7"]),
        (FakeResolver({"worker": W2, "ps": ["p:1"]}, "ps", 0), ["`resolver.task_type`", "all-reduce", "'ps'"]),
        (FakeResolver({"worker": ["a"]}, "worker", 0), ["resolver.cluster_spec().worker[0]", "'a'"]),
        (SimpleNamespace(task_type="worker", task_id=0), ["`resolver`", "cluster_spec"]),
    ],
)
def test_bad_resolver(resolver: Any, expected: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        cluster_from_resolver(resolver)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


def test_cluster_package_does_not_import_tensorflow() -> None:
    import subprocess

    code = "import sys, hostreduce.cluster; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_format_tf_config_round_trips_and_names_bad_arguments():
    from hostreduce.cluster import format_tf_config
    from hostreduce.cluster.tf_config import parse_tf_config

    addresses = ["127.0.0.1:2222", "[::1]:2223", "host-b:2224"]
    for index in range(3):
        spec = parse_tf_config(format_tf_config(addresses, index))
        assert (spec.rank, spec.size, spec.addresses) == (index, 3, tuple(addresses))
    assert parse_tf_config(format_tf_config(addresses[:1], 0, "chief")).task_type == "chief"
    with pytest.raises(ClusterError, match=r"`index` must be an integer in \[0, 3\). Received: index=3"):
        format_tf_config(addresses, 3)
    with pytest.raises(ClusterError, match="`task_type` must be one of .* Received: task_type='ps'"):
        format_tf_config(addresses, 0, "ps")
    with pytest.raises(ClusterError, match="repeats the address"):
        format_tf_config(["127.0.0.1:1", "localhost:1"], 0)


def test_format_tf_config_writes_every_task_type_of_a_ps_job():
    """The whole cluster (chief, workers, ps, evaluator) in, one task's TF_CONFIG out; an
    unknown task type, an address twice in the job and an index past the type's tasks are
    refused naming the argument."""
    from hostreduce.cluster import format_tf_config

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"], "ps": ["127.0.0.1:4"],
               "evaluator": ["127.0.0.1:5"]}
    for task_type, where in cluster.items():
        for index in range(len(where)):
            assert json.loads(format_tf_config(cluster, index, task_type)) == {
                "cluster": cluster, "task": {"type": task_type, "index": index}}
    with pytest.raises(ClusterError, match="`addresses` must map task types .* Received: task type 'master'"):
        format_tf_config({"master": ["127.0.0.1:1"]}, 0, "master")
    with pytest.raises(ClusterError, match="repeats the address"):
        format_tf_config({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:1"]}, 0)
    with pytest.raises(ClusterError, match=r"`index` must be an integer in \[0, 1\). Received: index=1"):
        format_tf_config(cluster, 1, "ps")
