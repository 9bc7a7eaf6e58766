"""``specrelay bench``: the edge-cloud benchmark from the command line.

Mounted by ``specrelay_cli`` (``from bench.cli import bench``). This module is the
option plumbing: options → :class:`bench.config.BenchConfig` → :func:`bench.harness.run_bench`
→ :func:`bench.console.print_summary`. Heavy imports happen inside the command so
``specrelay --help`` stays fast.
"""

from __future__ import annotations

import time

import click

from edge_sdk.defaults import DEFAULT_DEPTH
from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

_DEFAULTS = dict(modes="cloud-ar,standard-sd,specrelay,sr-ahead",
                 profiles="strong,medium,weak,cellular-edge", workloads="mtbench,humaneval",
                 sampling="greedy,sample", prompts=5, max_new_tokens=64)


def _csv(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def _cpus(value: str | None) -> list[int] | None:
    if not value:
        return None
    out = []
    for part in value.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="bench-out",
              show_default=True, help="Output folder: results.json, summary.md, *.png, "
              "requests.jsonl.")
@click.option("--quick", is_flag=True, help="A ~10-minute run (2 quiet cores) of 4 "
              "greedy HumanEval prompts x 32 tokens per cell: cloud-ar, standard-sd, the "
              "SDK's default (sr-paced) and the llama.cpp peers on medium; caac and "
              "stop-and-wait on medium and medium+slow (3x slower draft from 3 s into "
              "each run); fixed-3, ipdg, ipdg-skip and npdg on medium+slow; the pipeline and "
              "no-pipeline at 8 concurrent requests x 32 tokens, depth 1, on weak. "
              "Explicit options override these.")
@click.option("--modes", default=None, help="Comma list of modes "
              f"[default: {_DEFAULTS['modes']}]. See --list-modes.")
@click.option("--profiles", default=None,
              help=f"Comma list of network profiles [default: {_DEFAULTS['profiles']}].")
@click.option("--workloads", default=None,
              help=f"Comma list: mtbench, humaneval [default: {_DEFAULTS['workloads']}].")
@click.option("--sampling", default=None, help="Comma list of sampling variants: greedy, "
              f"sample (temperature 0.7, top-p 0.9) [default: {_DEFAULTS['sampling']}].")
@click.option("--prompts", type=click.IntRange(1), default=None,
              help=f"Prompts per workload [default: {_DEFAULTS['prompts']}].")
@click.option("--max-new-tokens", type=click.IntRange(1), default=None,
              help=f"Tokens generated per request [default: {_DEFAULTS['max_new_tokens']}].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Prompt selection and per-request sampling seeds.")
@click.option("--depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DEPTH,
              show_default=True,
              help="Draft depth for fixed-depth modes (tokens per block).")
@click.option("--siblings", type=click.IntRange(1, 4), default=None,
              help="Sibling width of the sr-tree mode (the draft's next-best tokens per "
              "uncertain position) [default: 2].")
@click.option("--proactive-min-hit", type=click.FloatRange(0.0, 1.0, max_open=True),
              default=None, help="Skip threshold of the modes that set one (ipdg-skip, "
              "sr-paced-skip: IPDG drafts ahead "
              "only after blocks whose predicted whole-block acceptance reaches it) "
              "[default: 0.3].")
@click.option("--concurrent-depth", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=None,
              help="Draft depth of the concurrent modes (default: --depth). The pipeline's "
              "best depth is lower than a single request's: the edge's one draft worker "
              "serves every request and the cloud batches the blocks.")
@click.option("--concurrency", default=None, help="Comma list of concurrency values, e.g. "
              "'1,4,8,16': each concurrent mode (pipeline, no-pipeline, runahead, "
              "standard-sd-concurrent, pipeline-standard) runs once per value, reported under the profile "
              "label <profile>@c<C>, with C*ceil(prompts/C) requests [default: 8]. "
              "Sequential modes ignore it.")
@click.option("--target", default="qwen2.5-coder-1.5b", show_default=True,
              help="Target model (preset, path, file.gguf; smollm2-135m: the small pair).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help="Weights/compute dtype of both models (auto: bfloat16 "
              "where the CPU has AMX/AVX512-BF16, else float32; in bfloat16 greedy identity "
              "holds up to near-ties, which are counted).")
@click.option("--max-wait-ms", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="Cloud batcher: ms to wait for more blocks after the first of a batch.")
@click.option("--early-exit", default="fit", show_default=True, metavar="auto|fit|LAYER",
              help="The cloud's early exit for the FSD modes (fsd, fsd+ipdg), as "
              "`specrelay serve --early-exit`: fit = the preset's calibrated layer, its head "
              "fitted once if not cached (about a minute).")
@click.option("--wisv-head", default="auto", show_default=True, metavar="auto|PATH",
              help="The cloud's WISV decision head for the `wisv` mode (semantic "
              "acceptance, greedy cells only), as `specrelay serve --wisv-head`.")
@click.option("--draft", default=None,
              help="Draft model: preset, path, or an ONNX export folder (OUT+onnx-int4: "
              "its int4 graph) (default: qwen2.5-coder-0.5b; for a smollm2 target its "
              "trained draft smollm2-135m-draft).")
@click.option("--edge-slowdown", type=click.FloatRange(1.0), default=1.0, show_default=True,
              help="Edge contention: each draft forward takes FACTOR times as long ... "
              "(with '<profile>+slow' profiles, e.g. 'medium,medium+slow', only those are "
              "contended, and FACTOR defaults to 3)")
@click.option("--slowdown-at", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="... from this many seconds after the start of each run.")
@click.option("--edge-load", type=click.IntRange(0), default=0, show_default=True,
              help="Busy-loop processes pinned to the edge CPUs from --slowdown-at on.")
@click.option("--cloud-cpus", default=None, help="CPU ids for the cloud process, e.g. '0' "
              "(default: the first available CPU).")
@click.option("--edge-cpus", default=None, help="CPU ids for the edge, e.g. '1' or '1-3' "
              "(default: the other CPUs).")
@click.option("--cloud-threads", type=click.IntRange(1), default=None,
              help="torch threads of the target (default: number of cloud CPUs).")
@click.option("--edge-threads", type=click.IntRange(1), default=None,
              help="torch threads of the draft (default: number of edge CPUs).")
@click.option("--peer-cpus", default=None, help="CPU ids for the peer engines (llamacpp-*, "
              "hf-*), e.g. '0,1' for both cores against our 1 cloud + 1 edge core "
              "(default: the cloud's CPUs).")
@click.option("--peer-threads", type=click.IntRange(1), default=None,
              help="Threads of the peer engines (default: number of --peer-cpus, else "
              "the cloud's).")
@click.option("--insecure-no-auth", is_flag=True,
              help="Serve without request signing (default: an ephemeral signed key).")
@click.option("--no-warmup", is_flag=True, help="Skip the unmeasured warm-up requests.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--memory-budget", default=None, help="Local modes (local-offload-ar, cats): "
              "comma list of budgets, fractions of the target's weights or bytes "
              "(0.5, 1.5GB) [default: 1.0,0.75,0.5].")
@click.option("--storage", default=None, help="Local modes: comma list of emulated storage "
              "profiles of the offloaded layers (nvme 2 GB/s, emmc 400 MB/s, <rate>MB/s) "
              "[default: nvme].")
@click.option("--list-modes", is_flag=True, help="List the registered modes and exit.")
@click.option("--chaos", is_flag=True, help="Run the link-fault matrix instead: drops, "
              "duplicates, reorders, delays past the client's timeout, resets mid-body and "
              "partitions (2 s, 30 s) of single HTTP requests (verify, session create, "
              "correction: sampling only) x greedy/seeded sampling x "
              "stop-and-wait/IPDG+ahead/pipeline of 8, each run compared with the "
              "fault-free one. Writes OUT/chaos.json and OUT/chaos.md; exits 1 when a "
              "token is lost or duplicated, an undocumented exception is raised or a "
              "row's fault never fired. "
              "Default pair: smollm2-135m, float32, depth 4. With --quick: <= 5 min, 1 "
              "prompt (32 tokens), 12 new tokens, the 30 s partition replaced by 5 s. "
              "Takes --target, --draft, --dtype, --prompts, --max-new-tokens, --depth, "
              "--sampling, --seed, --chaos-rows.")
@click.option("--chaos-rows", default=None, help="With --chaos: run only the rows whose "
              "fault name contains one of these comma-separated strings "
              "(case-insensitive), e.g. 'correction' or 'partition,drop-request'.")
@click.option("--scale-out", is_flag=True, help="Run the scale-out bench instead "
              "(bench.replicas; needs the [ray] extra): the embedded server vs the Ray "
              "ingress over 1 and 2 verifier replicas, C concurrent target-only clients "
              "(--concurrency, one value, default 16) x --max-new-tokens (default 24), "
              "outputs compared with the embedded server's. Target: `tiny` (a random "
              "model, seconds) unless --target is given. Writes OUT/replicas.json and "
              "OUT/replicas.png. On one small machine it shows the Ray path's overhead, "
              "not scaling.")
def bench(**o):
    """Benchmark modes x network profiles x workloads through the link emulator.

    The cloud (target) runs in its own process pinned to one core, the edge (draft +
    client) in this process on the other, and every HTTP byte crosses an emulated link.
    Writes OUT/results.json, OUT/summary.md (ratios against the baselines measured in the
    same run) and PNG plots.
    """
    if o["list_modes"]:
        _list_modes()
        return
    if o["chaos"]:
        _chaos(o)
        return
    if o["scale_out"]:
        _scale_out(o)
        return
    if o["chaos_rows"] is not None:
        raise click.UsageError("--chaos-rows applies to --chaos only")
    if _local_modes(o):
        _local(o)
        return
    if o["memory_budget"] is not None or o["storage"] is not None:
        raise click.UsageError("--memory-budget and --storage apply to the local modes "
                               "(local-offload-ar, cats) only")
    from bench.console import print_summary
    from bench.harness import run_bench

    cfg = _config(o)
    t0 = time.perf_counter()
    try:
        results = run_bench(cfg, o["out_dir"], progress=not o["no_progress"],
                            log=lambda s: click.echo(s, err=True))
    except (ValueError, ImportError) as e:      # ImportError: a peer engine not installed
        raise click.UsageError(str(e)) from None
    print_summary(results, o["out_dir"], time.perf_counter() - t0)


_CHAOS_IGNORES = ("modes", "profiles", "workloads", "concurrency", "concurrent_depth")
_CHAOS_DEFAULTS = {"target": "smollm2-135m", "dtype": "float32", "depth": 4}


def _chaos(o: dict) -> None:
    """``--chaos``: the link-fault matrix (:mod:`bench.chaos`). Raises click.UsageError
    for options that do not apply, click.ClickException (exit 1) when it fails."""
    from click.core import ParameterSource

    from bench.chaos.run import ChaosFailed, run_chaos

    given = [k for k in _CHAOS_IGNORES if o[k] is not None]
    if given:
        raise click.UsageError(f"--{given[0].replace('_', '-')} does not apply to --chaos")
    ctx = click.get_current_context()
    kw = {k: (v if ctx.get_parameter_source(k) == ParameterSource.DEFAULT else o[k])
          for k, v in _CHAOS_DEFAULTS.items()}
    try:
        run_chaos(o["out_dir"], quick=o["quick"], draft=o["draft"], prompts=o["prompts"],
                  max_new_tokens=o["max_new_tokens"], seed=o["seed"],
                  sampling=_csv(o["sampling"]) or ["greedy", "sample"],
                  only=_csv(o["chaos_rows"]) or (), log=lambda m: click.echo(m, err=True), **kw)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    except ChaosFailed as e:
        raise click.ClickException(str(e)) from None


def _scale_out(o: dict) -> None:
    """``--scale-out``: :mod:`bench.replicas`. Raises click.UsageError for more than one
    --concurrency value."""
    from click.core import ParameterSource

    from bench import replicas as R

    conc = _concurrency(o["concurrency"] or "16")
    if len(conc) != 1:
        raise click.UsageError("--scale-out takes one --concurrency value")
    given = click.get_current_context().get_parameter_source("target")
    name = o["target"] if given != ParameterSource.DEFAULT else "tiny"
    tokens = o["max_new_tokens"] or 24
    rows = R.run(R.tiny_pair if name == "tiny" else name, conc[0], tokens)
    R.print_table(rows)
    paths = R.write_report(rows, o["out_dir"], {"model": name, "concurrency": conc[0],
                                                "tokens": tokens})
    click.echo(f"wrote {', '.join(paths)}")
    if not all(r["identical"] for r in rows):
        raise click.ClickException("a replicated output differs from the embedded "
                                   "server's")


def _local_modes(o: dict) -> bool:
    """True when the run's modes are local ones (``--modes`` given and any is local)."""
    from bench.local.run import LOCAL_MODES

    return any(m in LOCAL_MODES for m in _csv(o["modes"] or ""))


def _local(o: dict) -> None:
    """The local-target bench (:mod:`bench.local.run`): no cloud, no link."""
    from bench.local.run import run_local_bench

    t0 = time.perf_counter()
    try:
        res = run_local_bench(
            _csv(o["modes"]), _csv(o["memory_budget"] or "1.0,0.75,0.5"),
            _csv(o["storage"] or "nvme"), _csv(o["workloads"] or "humaneval,mtbench"),
            _csv(o["sampling"] or "greedy"), o["prompts"] or 4, o["max_new_tokens"] or 32,
            o["seed"], o["target"], "bfloat16" if o["dtype"] == "auto" else o["dtype"],
            o["edge_threads"], o["out_dir"], log=lambda m: click.echo(m, err=True))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    for r in res["runs"]:
        m = r["metrics"]
        click.echo(f"{r['mode']:17s} {r['profile']:14s} {r['workload']:10s} "
                   f"{m['throughput_tok_s']:.3f} tok/s  acceptance {m['acceptance_rate']}  "
                   f"peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB")
    for q in res["ratios"]:
        click.echo(f"cats / local-offload-ar {q['profile']} {q['workload']}: {q['value']:.2f}x")
    click.echo(f"wrote {o['out_dir']}/results.json, summary.md, requests.jsonl in "
               f"{time.perf_counter() - t0:.0f} s")


def _list_modes() -> None:
    from bench import modes as M

    for name in M.mode_names():
        cls = M.MODES[name]
        tag = "(peer) " if getattr(cls, "peer", False) else ""
        click.echo(f"{name:14s} {tag}{'(baseline) ' if cls.baseline else ''}"
                   f"{cls.description}")


def _quick_kw(o: dict) -> dict:
    """The ``--quick`` settings that explicit options do not override: concurrency,
    per-mode profile/workload restrictions, the concurrent depth and the contention."""
    from bench.config import QUICK

    kw = dict(concurrency=QUICK["concurrency"],
              concurrent_max_new_tokens=(None if o["max_new_tokens"] is not None
                                         else QUICK["concurrent_max_new_tokens"]),
              concurrent_profiles=(None if o["profiles"] is not None
                                   else QUICK["concurrent_profiles"]),
              concurrent_workloads=(None if o["workloads"] is not None
                                    else QUICK["concurrent_workloads"]),
              mode_profiles=(None if o["profiles"] is not None or o["modes"] is not None
                             else QUICK["mode_profiles"]),
              mode_workloads=(None if o["workloads"] is not None or o["modes"] is not None
                              else QUICK["mode_workloads"]))
    if o["concurrent_depth"] is None:
        kw["concurrent_depth"] = QUICK["concurrent_depth"]
    if o["edge_slowdown"] == 1.0 and o["slowdown_at"] == 0.0:
        kw["edge_slowdown"], kw["slowdown_at_s"] = QUICK["edge_slowdown"], QUICK["slowdown_at_s"]
    return kw


def _listed(o: dict) -> dict:
    """The comma-list and count options, from the command line, else the ``--quick``
    preset (with ``--quick``), else the defaults."""
    from bench.config import QUICK

    preset = dict(_DEFAULTS)
    if o["quick"]:
        preset.update({k: (",".join(map(str, v)) if isinstance(v, list) else v)
                       for k, v in QUICK.items() if k in _DEFAULTS})
    return {k: (preset[k] if o[k] is None else o[k]) for k in _DEFAULTS}


def _concurrency(value: str) -> list[int]:
    vals = _csv(value)
    if not vals or not all(v.isdigit() and int(v) >= 1 for v in vals):
        raise ValueError(f"--concurrency takes a comma list of integers >= 1, got "
                         f"{value!r}")
    return [int(v) for v in vals]


def _config(o: dict):
    """The :class:`BenchConfig` of the command's options ``o``. Raises
    click.BadParameter (exit 2) for a bad list value or an unknown mode."""
    from bench import modes as M
    from bench.config import BenchConfig

    opts = _listed(o)
    kw = _quick_kw(o) if o["quick"] else {}
    run = {"edge_slowdown": o["edge_slowdown"], "slowdown_at_s": o["slowdown_at"],
           "concurrent_depth": o["concurrent_depth"]}
    run.update({k: kw.pop(k) for k in list(run) if k in kw})
    try:
        if o["concurrency"] is not None:
            kw["concurrency"] = _concurrency(o["concurrency"])
        cfg = BenchConfig(modes=_csv(opts["modes"]), profiles=_csv(opts["profiles"]),
                          workloads=_csv(opts["workloads"]), sampling=_csv(opts["sampling"]),
                          prompts=opts["prompts"], seed=o["seed"],
                          max_new_tokens=opts["max_new_tokens"], depth=o["depth"],
                          target=o["target"], draft=o["draft"],
                          cloud_cpus=_cpus(o["cloud_cpus"]), edge_cpus=_cpus(o["edge_cpus"]),
                          cloud_threads=o["cloud_threads"], edge_threads=o["edge_threads"],
                          peer_cpus=_cpus(o["peer_cpus"]), peer_threads=o["peer_threads"],
                          auth=not o["insecure_no_auth"], edge_load=o["edge_load"],
                          warmup=not o["no_warmup"], dtype=o["dtype"],
                          server_kw={"max_wait_s": o["max_wait_ms"] / 1000.0}, **run, **kw)
        for name in (cfg.modes if o.get("siblings") else ()):
            if name.split("@")[0] == "sr-tree":
                cfg.mode_options.setdefault(name, {}).setdefault(
                    "client", {})["siblings"] = o["siblings"]
        for name in (cfg.modes if o.get("proactive_min_hit") is not None else ()):
            if "proactive_min_hit" in (getattr(M.get_mode(name), "client_kw", None) or {}):
                cfg.mode_options.setdefault(name, {}).setdefault(
                    "client", {})["proactive_min_hit"] = o["proactive_min_hit"]
        if any(M.get_mode(m).early_exit for m in cfg.modes):
            cfg.server_kw["early_exit"] = o["early_exit"]
        if any(getattr(M.get_mode(m), "wisv", False) for m in cfg.modes):
            cfg.server_kw["wisv_head"] = o["wisv_head"]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return cfg
