"""HookConfig validation, environment fallbacks and the websocket URL."""

from __future__ import annotations

import pytest

from trainer_hook.config import HookConfig


def test_defaults_work_untouched() -> None:
    cfg = HookConfig(global_batch_size=64)
    assert cfg.offline and cfg.job_name == "local"
    assert cfg.exchange_lag < cfg.exchange_every
    # Measured from the loader at the first step (issue 10): 1 without workers, so a
    # placement reaching rank 0 starts within K + L + 1 batches; workers add their prefetch.
    assert cfg.lookahead == "measured"
    assert cfg.exchange_every + cfg.exchange_lag + 1 <= 14


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": 8.0}, "global_batch_size"),
        ({"global_batch_size": 8, "exchange_every": 0}, "exchange_every"),
        ({"global_batch_size": 8, "exchange_every": 2, "exchange_lag": 2}, "exchange_lag"),
        ({"global_batch_size": 8, "lookahead": -1}, "lookahead"),
        ({"global_batch_size": 8, "lookahead": "auto"}, "lookahead"),
        ({"global_batch_size": 8, "probe_interval_s": 0}, "probe_interval_s"),
        ({"global_batch_size": 8, "probe_interval_s": float("nan")}, "probe_interval_s"),
        ({"global_batch_size": 8, "max_queue": True}, "max_queue"),
        ({"global_batch_size": 8, "server": "http://h:1"}, "job"),
        ({"global_batch_size": 8, "server": "ftp://h:1", "job": "a"}, "server"),
        ({"global_batch_size": 8, "job": "a/b"}, "job"),
        ({"global_batch_size": 8, "startup_wait_s": -1}, "startup_wait_s"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        HookConfig(**kwargs)


def test_env_fills_server_job_token_and_arguments_win() -> None:
    env = {"REBALANCER_SERVER": "http://127.0.0.1:9", "REBALANCER_JOB": "envjob", "REBALANCER_TOKEN": "t0k"}
    cfg = HookConfig.from_env(env=env, global_batch_size=8)
    assert (cfg.server, cfg.job, cfg.token) == ("http://127.0.0.1:9", "envjob", "t0k")
    cfg = HookConfig.from_env(env=env, global_batch_size=8, job="mine")
    assert cfg.job == "mine" and not cfg.offline


def test_unknown_setting_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown hook setting\(s\) \['exchange_evry'\].*exchange_every"):
        HookConfig.from_env(env={}, global_batch_size=8, exchange_evry=3)


def test_missing_global_batch_size_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size is required"):
        HookConfig.from_env(env={})


def test_server_must_be_a_url() -> None:
    with pytest.raises(ValueError, match="server must be a URL like 'http://127.0.0.1:8000'"):
        HookConfig(global_batch_size=8, server="127.0.0.1:8000", job="a")
