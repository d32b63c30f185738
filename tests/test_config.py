"""The validated config object: precedence, env coercion, rejection of unknown keys."""
from __future__ import annotations

import pytest

from hostreduce.config import Config
from hostreduce.errors import ConfigError


def test_defaults_are_sane():
    c = Config.from_env({})
    assert c.reducer == "ring" and c.transport == "auto" and 0 < c.timeout_s <= 30


def test_explicit_argument_beats_environment_beats_default():
    env = {"HOSTREDUCE_TIMEOUT_S": "7", "HOSTREDUCE_TRANSPORT": "grpc"}
    c = Config.from_env(env, timeout_s=3.0)
    assert c.timeout_s == 3.0 and c.transport == "grpc"
    assert Config.from_env(env, timeout_s=None).timeout_s == 7.0


@pytest.mark.parametrize("env,fragment", [
    ({"HOSTREDUCE_TIMEOUTS": "5"}, "Unknown environment variable HOSTREDUCE_TIMEOUTS"),
    ({"HOSTREDUCE_TIMEOUT_S": "soon"}, "HOSTREDUCE_TIMEOUT_S='soon'"),
    ({"HOSTREDUCE_TIMEOUT_S": "-1"}, "timeout_s=-1.0"),
    ({"HOSTREDUCE_TRANSPORT": "udp"}, "transport='udp'"),
    ({"HOSTREDUCE_CHUNK_BYTES": "10"}, "chunk_bytes=10"),
    ({"HOSTREDUCE_TUNE_MALLOC": "maybe"}, "HOSTREDUCE_TUNE_MALLOC='maybe'"),
])
def test_bad_environment_names_the_variable_and_value(env, fragment):
    with pytest.raises(ConfigError) as e:
        Config.from_env(env)
    assert fragment in str(e.value)


def test_unknown_keys_are_rejected():
    with pytest.raises(ConfigError, match="Unknown config key"):
        Config.from_env({}, timeout=3)
    with pytest.raises(ConfigError, match="Unknown config key"):
        Config().replace(chunk=3)


def test_secret_is_not_shown_in_repr():
    assert "hunter2" not in repr(Config(secret="hunter2"))


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().timeout_s = 1.0  # type: ignore[misc]


def test_an_engine_registered_by_name_is_chosen_by_hostreduce_reducer():
    """``HOSTREDUCE_REDUCER`` names any registered engine; an unknown name is refused by
    the registry, naming the engines there are."""
    from hostreduce.reducers import create_reducer, register_reducer
    from hostreduce.reducers.local import LocalReducer

    @register_reducer("local_for_config_test")
    class Named(LocalReducer):
        pass

    config = Config.from_env({"HOSTREDUCE_REDUCER": "local_for_config_test"})
    reducer = create_reducer(config=config)
    try:
        assert isinstance(reducer, Named) and reducer.name == "local_for_config_test"
    finally:
        reducer.close()
    with pytest.raises(ConfigError, match=r"`reducer` must be one of \[.*'local_for_config_test'.*\]. "
                                          r"Received: reducer='nope'"):
        create_reducer(config=Config.from_env({"HOSTREDUCE_REDUCER": "nope"}))


def test_ps_max_message_bytes_is_bounded_by_one_mib_and_grpcs_limit():
    assert Config.from_env({}).ps_max_message_bytes == 1 << 30
    assert Config.from_env({"HOSTREDUCE_PS_MAX_MESSAGE_BYTES": str(16 << 20)}).ps_max_message_bytes == 16 << 20
    for bad in (1000, 1 << 31, True, 2.5):
        with pytest.raises(ConfigError, match="ps_max_message_bytes"):
            Config(ps_max_message_bytes=bad)
