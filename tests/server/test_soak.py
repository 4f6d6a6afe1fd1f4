"""The short soak of the real server (SmolLM2 in its own process, a 64-block pool): streaming and non-streaming
clients, a quarter of the streams dropped mid-way, bad requests mixed in. The full soak (10,000 requests) is
`python benchmarks/soak.py --num-requests 10000 --duration-s 3600`; its figures are in docs/BENCHMARKS.md."""

from __future__ import annotations

import pytest

from batchserve.bench.soak import SoakOptions, format_report, run_soak


@pytest.mark.slow
def test_a_short_soak_leaves_nothing_behind():
    # a gross leak check only (benchmarks/soak.py runs the hour): this early RSS is still filling (allocator, oneDNN
    # and kernel caches; docs/BENCHMARKS.md has the hour's figures). A count of requests, not a duration, so that a
    # busy host stretches the soak instead of thinning it below what the counts below need.
    # Replies of at most 24 tokens: the checks below count requests, aborts and blocks, not the length of the replies.
    options = SoakOptions(
        num_requests=40, rounds=2, duration_s=300, seed=7, max_rss_growth_mb=400, rss_sample_every=20, max_tokens=24
    )
    report = run_soak(options)
    print(format_report(report))
    assert report.failures == []
    counts = report.counts
    assert counts["finished"] >= 30 and counts["client_aborted"] >= 5 and counts["bad_rejected"] >= 2
    assert report.leaked_blocks == 0 and report.exit_code == 0
    assert [point[0] for point in report.rss_timeline] == [20, 40, 60, 80]  # counted across both rounds
    assert len(report.rss_rounds) == 2 and report.rss_rounds[1][0] == pytest.approx(report.rss_rounds[0][1], abs=64)
    for _, _, rss, anon, file_backed in report.rss_timeline:  # the parts add up to the whole (shared memory aside)
        assert anon > 0 and file_backed > 0 and anon + file_backed == pytest.approx(rss, abs=64)
    # the tree by role: the engine core is found by the name it gave itself, and the roles add up to the tree
    assert len(report.rss_by_process_timeline) == len(report.rss_tree_timeline) == 4
    for (sent, by_role), (tree_sent, tree_mb) in zip(report.rss_by_process_timeline, report.rss_tree_timeline):
        assert sent == tree_sent and {"api-server", "engine-core"} <= set(by_role)
        assert by_role["engine-core"][0] > by_role["api-server"][0]  # the model's weights are there
        assert sum(rss for rss, _ in by_role.values()) == pytest.approx(tree_mb, abs=1)
    assert "engine-core" in format_report(report)
