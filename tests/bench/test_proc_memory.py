"""The soak's per-process memory reading (batchserve/bench/proc_memory.py): each child of the tree is found under
the role it named itself, and the one that grows is the one whose figure grows."""

from __future__ import annotations

import math
import os

from batchserve.bench.proc_memory import ROOT_ROLE, process_tree, rss_by_role, slopes_by_role
from batchserve.host.channel import short_process_name, start_child
from tests.host import channel_peers


def test_a_growing_child_is_named_by_its_role_in_the_tree():
    child = start_child(channel_peers.hold_memory, name="batchserve-mem-probe")
    try:
        child.channel.send(1)
        pid = child.channel.recv(timeout=60)
        assert pid in process_tree(os.getpid())
        with open(f"/proc/{pid}/comm") as f:
            assert f.read().strip() == short_process_name("batchserve-mem-probe") == "bs-mem-probe"
        before = rss_by_role(os.getpid())
        child.channel.send(96)
        child.channel.recv(timeout=60)
        after = rss_by_role(os.getpid())
        assert ROOT_ROLE in before and "mem-probe" in before
        grown = after["mem-probe"][0] - before["mem-probe"][0]
        assert 90 <= grown <= 110, grown  # the 96 MB land in the child's figure ...
        assert after["mem-probe"][1] - before["mem-probe"][1] >= 90  # ... as anonymous memory
        assert abs(after[ROOT_ROLE][0] - before[ROOT_ROLE][0]) < 48  # ... not in this process's
    finally:
        child.stop(timeout=10)


def test_slopes_by_role_name_the_role_that_grows_over_the_second_half():
    timeline = [
        (sent, {"api-server": (100.0, 80.0), "engine-core": (2000.0 + sent / 250, 1800.0 + sent / 250)})
        for sent in range(0, 8001, 500)
    ]
    timeline[3][1]["grammar"] = (300.0, 200.0)  # a child seen only once, early
    slopes = slopes_by_role(timeline)
    assert slopes["engine-core"][0] == slopes["engine-core"][1] == 4.0  # MB per 1,000 requests
    assert slopes["api-server"] == (0.0, 0.0)
    assert all(math.isnan(value) for value in slopes["grammar"])  # too few points to call a slope


def test_the_soak_fails_on_a_process_that_keeps_growing_and_names_it():
    from batchserve.bench.soak import SoakOptions, SoakReport, check

    report = SoakReport(leaked_blocks=0, left_running=0, left_waiting=0, exit_code=0)
    report.rss_by_process_timeline = [
        (sent, {"api-server": (150.0, 120.0), "engine-core": (2000.0 + sent * 3.7 / 1000, 1900.0)})
        for sent in range(500, 8001, 500)
    ]
    assert check(report, SoakOptions()) == []  # not asked: a short soak's caches still fill
    failures = check(report, SoakOptions(max_slope_mb_per_1000=1.0))
    assert failures == ["RSS grew over the second half, MB per 1,000 requests: engine-core +3.70 (at most 1)"]
