"""Resident memory of a server and of each process under it, read from /proc (Linux), by role: the API server (the
root), the engine core, the body parser, the grammar compiler, rank workers (each names itself "bs-<role>" in its
/proc comm, host/process.py name_process) and multiprocessing's resource tracker. The soak's per-process timeline
is built from these, so that a growing tree names the process that grows."""

from __future__ import annotations

import statistics
from pathlib import Path

ROOT_ROLE = "api-server"


def rss_mb(pid: int, field_name: str = "VmRSS") -> float:
    """A process's resident memory in MB: VmRSS, or its anonymous (RssAnon) or file-backed (RssFile) part."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it (children first met, then theirs), as they are now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    tree, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tree.append(current)
        todo += sorted(children.get(current, []))
    return tree


def role_of(pid: int, root: int) -> str:
    """What a process of the tree under `root` is: "api-server" for the root, the name a batchserve child gave
    itself less its "bs-" prefix, "resource-tracker", or else its command name."""
    if pid == root:
        return ROOT_ROLE
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    if comm.startswith("bs-"):
        return comm[3:]
    if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
        return "resource-tracker"
    return comm


def tree_rss_mb(pid: int) -> float:
    """RSS of `pid` and every process under it, in MB."""
    return sum(rss for rss, _anon in rss_by_role(pid).values())


def rss_by_role(pid: int) -> dict[str, tuple[float, float]]:
    """(RSS, its anonymous part) in MB of each role in the tree under `pid`, summed over the processes of one role
    (a grammar compiler killed and replaced is still the one role)."""
    roles: dict[str, tuple[float, float]] = {}
    for member in process_tree(pid):
        try:
            role = role_of(member, pid)
            rss, anon = rss_mb(member), rss_mb(member, "RssAnon")
        except OSError:
            continue  # exited meanwhile
        before = roles.get(role, (0.0, 0.0))
        roles[role] = (round(before[0] + rss, 1), round(before[1] + anon, 1))
    return roles


def late_slope(points: list[tuple[int, float]]) -> float:
    """MB per 1,000 requests over the second half of (requests, MB) points (least squares)."""
    late = points[len(points) // 2 :]
    if len(late) < 3 or late[-1][0] == late[0][0]:
        return float("nan")
    xs, ys = [p[0] for p in late], [p[1] for p in late]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    return 1000 * cov / sum((x - mean_x) ** 2 for x in xs)


def slopes_by_role(timeline: list[tuple[int, dict[str, tuple[float, float]]]]) -> dict[str, tuple[float, float]]:
    """Each role's (RSS, anonymous) slope over the timeline's second half, MB per 1,000 requests; a role missing
    from some points (a child not started yet, or between a kill and its replacement) counts where it was seen."""
    roles = sorted({role for _, by_role in timeline for role in by_role})
    return {
        role: tuple(  # type: ignore[misc]
            late_slope([(sent, by_role[role][part]) for sent, by_role in timeline if role in by_role])
            for part in (0, 1)
        )
        for role in roles
    }
