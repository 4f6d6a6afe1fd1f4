"""`batchserve serve --replicas`: the dispatch, the flags, and the options the Ray app is built from."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from batchserve.distributed.options import RayAppOptions
from batchserve.entrypoints.openai.launch import make_parser, wants_scale_out


def test_serve_dispatches_to_ray_only_with_a_scale_out_flag():
    assert wants_scale_out(["--replicas", "2"]) and wants_scale_out(["--ray-address=auto"])
    assert wants_scale_out(["--port", "9000", "--max-replicas", "4"])
    assert not wants_scale_out(["--port", "9000", "--max-batch-size", "8"])


def test_serve_help_lists_the_scale_out_flags():
    text = make_parser().format_help()
    for flag in (
        "--replicas",
        "--max-replicas",
        "--ray-address",
        "--router",
        "--target-ongoing-requests",
        "--ray-proxy",
    ):
        assert flag in text


def test_options_from_serve_run_strings_are_checked():
    """`serve run batchserve.distributed.app:build replicas=2 ...` passes strings; pydantic converts and checks."""
    options = RayAppOptions.model_validate({"replicas": "3", "max_replicas": "5", "router": "power-of-two"})
    assert (options.replicas, options.max_replicas, options.autoscaling) == (3, 5, True)
    assert not RayAppOptions(replicas=2).autoscaling
    with pytest.raises(ValidationError, match="below replicas"):
        RayAppOptions(replicas=4, max_replicas=2)
    with pytest.raises(ValidationError, match="router"):
        RayAppOptions(router="round-robin")
    with pytest.raises(ValidationError, match="replica"):
        RayAppOptions.model_validate({"replica": 2})  # a typo is an error, not ignored


def test_bad_engine_options_fail_before_any_replica_starts():
    from batchserve.config import ConfigError
    from batchserve.distributed.app import build_application

    with pytest.raises(ConfigError, match="block_size"):
        build_application(RayAppOptions(engine={"block_size": 4}))


def test_a_local_ray_instance_starts_with_the_periodic_work_turned_down(monkeypatch):
    # The processes Ray starts inherit the environment at ray.init: the settings must be there by then, and a value
    # the user exported must be left as it is. Joining a running instance changes nothing.
    import ray

    from batchserve.distributed import launch

    for name in launch.LOCAL_RAY_ENVIRONMENT:  # set, then deleted: monkeypatch restores what was there before
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    seen = []

    def fake_init(address=None, **kwargs):
        if address == "auto":
            raise ConnectionError("no Ray instance here")
        seen.append({name: os.environ.get(name) for name in launch.LOCAL_RAY_ENVIRONMENT})

    monkeypatch.setattr(ray, "init", fake_init)
    options = RayAppOptions(engine={"dtype": "float32"}, replicas=1)
    assert launch._connect(options, None) is False
    assert seen == [{**launch.LOCAL_RAY_ENVIRONMENT, "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2"}]

    for name in launch.LOCAL_RAY_ENVIRONMENT:
        monkeypatch.delenv(name)
    monkeypatch.setattr(ray, "init", lambda address=None, **kwargs: None)  # an instance is running: joined
    assert launch._connect(options, None) is True
    assert not any(name in os.environ for name in launch.LOCAL_RAY_ENVIRONMENT)


def test_adapters_loaded_at_run_time_are_refused_with_replicas():
    with pytest.raises(ValidationError, match="allow_runtime_lora_updating"):
        RayAppOptions(engine={"enable_lora": True, "allow_runtime_lora_updating": True})
    RayAppOptions(engine={"enable_lora": True, "lora_modules": "sql=/adapters/sql"})
