"""`batchserve simulate --find-layout`: how many hosts for this model at this load. Layouts (tensor-parallel ranks x
pipeline stages x replicas) are tried from the fewest hosts up, each simulated on the workload with the parallel step
model and each rank's memory; the first whose weights fit and whose run meets the target is the answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchserve.bench.metrics import SLO, summarize
from batchserve.config import EngineConfig
from batchserve.simulator.analytic import Shapes
from batchserve.simulator.build import make_cluster
from batchserve.simulator.parallel import Collective, GiB, Layout, check_split, parallel_profile
from batchserve.simulator.profile_file import Profile


@dataclass(frozen=True)
class Target:
    """What a layout must reach at the workload's load: output tokens/s, and/or the share of requests within the
    SLO (which then must be given)."""

    output_throughput: float | None = None
    slo_attainment: float | None = None
    slo: SLO | None = None

    def __post_init__(self) -> None:
        if self.output_throughput is None and self.slo_attainment is None:
            raise ValueError("--find-layout needs a target: --target-throughput TOK_S and/or --target-slo-attainment F")
        if self.slo_attainment is not None and (self.slo is None or not 0 < self.slo_attainment <= 1):
            raise ValueError("--target-slo-attainment takes a share in (0, 1] with --slo-ttft-ms and/or --slo-tpot-ms")

    def misses(self, summary: dict[str, Any]) -> list[str]:
        out = []
        if self.output_throughput is not None and not summary["output_throughput"] >= self.output_throughput:
            out.append(f"{summary['output_throughput']:.1f} tok/s < {self.output_throughput:g}")
        if self.slo_attainment is not None and not summary["slo_attainment"] >= self.slo_attainment:
            out.append(f"SLO attainment {100 * summary['slo_attainment']:.1f}% < {100 * self.slo_attainment:g}%")
        return out


@dataclass
class LayoutRow:
    layout: Layout
    hosts: int
    verdict: str  # "meets", "misses: ...", "does not fit: ..."
    summary: dict[str, Any] = field(default_factory=dict)
    collective_share: float = 0.0  # of the run's step time: all-reduces, the logits' gather, stage hand-overs

    @property
    def meets(self) -> bool:
        return self.verdict == "meets"


def candidate_layouts(shapes: Shapes, max_hosts: int, ranks_per_host: int = 1) -> list[Layout]:
    """Every split the engine accepts on at most `max_hosts` hosts, fewest hosts first, then fewest
    pipeline stages (they add no throughput), then fewest tensor-parallel ranks (collectives cost): at equal hosts
    replicas come before a split, which only memory or a step's latency calls for."""
    if max_hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"--max-hosts and --ranks-per-host must be >= 1 (got {max_hosts}, {ranks_per_host})")
    sizes = range(1, max_hosts * ranks_per_host + 1)
    splits = []
    for tp in sizes:
        for pp in sizes:
            try:
                check_split(shapes, tp, pp)
            except ValueError:
                continue
            splits.append((tp, pp))
    layouts = [Layout(tp, pp, r) for tp, pp in splits for r in range(1, max_hosts + 1)]
    layouts = [lay for lay in layouts if lay.hosts(ranks_per_host) <= max_hosts]
    return sorted(layouts, key=lambda x: (x.hosts(ranks_per_host), x.pipeline_parallel, x.tensor_parallel, x.replicas))


def find_layout(config: EngineConfig, profile: Profile, shapes: Shapes, requests: list, arrivals: Any, target: Target,
                max_hosts: int, host_memory_bytes: float | None = None, ranks_per_host: int = 1,
                collective: Collective | None = None, router: str = "round-robin", seed: int = 0) -> list[LayoutRow]:  # fmt: skip
    """Rows for the layouts tried, in order; the last meets the target when one does. `host_memory_bytes`: what
    each host gives the model, shared by its ranks (default: the profile's machine's memory for each rank)."""
    rows: list[LayoutRow] = []
    rank_bytes = None if host_memory_bytes is None else host_memory_bytes / ranks_per_host
    fraction = config.cache.kv_cache_memory_fraction
    for layout in candidate_layouts(shapes, max_hosts, ranks_per_host):
        hosts = layout.hosts(ranks_per_host)
        try:
            prof = parallel_profile(profile, shapes, layout.tensor_parallel, layout.pipeline_parallel, collective,
                                    rank_bytes, fraction)  # fmt: skip
        except ValueError as exc:
            rows.append(LayoutRow(layout, hosts, f"does not fit: {exc}"))
            continue
        result = make_cluster(config, prof, layout.replicas, router).run(requests, arrivals, seed, layout.describe())
        t = result.trace
        summary = summarize(t.requests, t.meta["duration_s"], target.slo, t.steps)
        misses = target.misses(summary)
        verdict = "meets" if not misses else "misses: " + "; ".join(misses)
        rows.append(LayoutRow(layout, hosts, verdict, summary, prof.step_model.spent_share))
        if not misses:
            break
    return rows


def format_rows(rows: list[LayoutRow]) -> str:
    head = f"{'hosts':>5} {'TP':>3} {'PP':>3} {'rep':>3} {'out tok/s':>9} {'SLO %':>6} {'TPOT p50':>9} {'coll %':>6}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        s, lay = r.summary, r.layout
        out = f"{s['output_throughput']:>9.1f}" if s else f"{'-':>9}"
        slo = f"{100 * s['slo_attainment']:>6.1f}" if "slo_attainment" in s else f"{'-':>6}"
        tpot = f"{s['tpot_ms']['p50']:>9.1f}" if s else f"{'-':>9}"
        coll = f"{100 * r.collective_share:>6.1f}" if s else f"{'-':>6}"
        lines.append(f"{r.hosts:>5} {lay.tensor_parallel:>3} {lay.pipeline_parallel:>3} {lay.replicas:>3} {out} "
                     f"{slo} {tpot} {coll}  {r.verdict}")  # fmt: skip
    return "\n".join(lines)


def host_memory(gib: float | None) -> float | None:
    if gib is None:
        return None
    if not gib > 0:
        raise ValueError(f"--host-memory-gib must be > 0 (got {gib})")
    return gib * GiB
