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
        ({"global_batch_size": 2**40}, "global_batch_size"),
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


def test_the_starting_mode_is_checked_and_sent_in_the_hello() -> None:
    # Issue 39: RebalanceHook(mode=...) asks the backend to start a new job in that mode.
    from trainer_hook import RebalanceHook

    with pytest.raises(ValueError, match=r"^mode must be one of 'observe', 'approve', 'auto' or None \(the "
                                         r"backend's default\), got 'Auto'\.$"):
        HookConfig(global_batch_size=8, mode="Auto")
    hook = RebalanceHook(global_batch_size=8, mode="auto")
    assert hook._hello().mode == "auto"
    hook.close()
    hook = RebalanceHook(global_batch_size=8)
    assert hook._hello().mode == ""  # the backend's default
    hook.close()


def test_the_hook_says_at_start_where_it_reports_or_why_it_is_offline(capsys, caplog) -> None:
    # Issue 39: without a server the hook went offline silently.
    import logging

    from trainer_hook import RebalanceHook
    from trainer_hook._announce import start_line

    RebalanceHook(global_batch_size=8).close()
    err = capsys.readouterr().err  # no logging configured at INFO: on stderr, one line
    assert err == ("rebalancer: offline, nothing is reported (no server: pass RebalanceHook(server=...) or set "
                   "REBALANCER_SERVER); steps are still timed and request_placement() still changes the split\n")
    with caplog.at_level(logging.INFO, logger="trainer_hook"):
        RebalanceHook(global_batch_size=8).close()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("rebalancer:")] == [err.strip()]
    assert capsys.readouterr().err == ""
    cfg = HookConfig(server="http://10.0.0.5:8000/,http://10.0.0.6:8000", job="sft 7b", global_batch_size=8,
                     mode="auto")
    assert start_line(cfg, 4) == ("rebalancer: reporting to http://10.0.0.5:8000 as job 'sft 7b' (4 ranks, "
                                  "starting in mode auto); dashboard http://10.0.0.5:8000/job/sft%207b")
    cfg = HookConfig(server="http://h:8000", job="j", global_batch_size=8)
    assert start_line(cfg, 2).startswith("rebalancer: reporting to http://h:8000 as job 'j' (2 ranks, the backend's "
                                         "default mode)")
