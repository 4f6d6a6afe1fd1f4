"""`batchserve serve --replicas`: the dispatch, the flags, and the options the Ray app is built from."""

from __future__ import annotations

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
