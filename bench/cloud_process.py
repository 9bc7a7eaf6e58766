"""The target server process of a bench run (the cloud core) and its counters.

* The **cloud** runs in a separate process (``multiprocessing`` *spawn*), pinned to its
  own CPU(s) with ``os.sched_setaffinity`` and a fixed torch thread count. It loads the
  target once, creates an ephemeral API key in an in-memory key store
  (``SQLiteKeyStore(":memory:")``) and hands the raw key and its port to the bench over
  the process pipe (``auth=False`` serves without authentication instead). The same
  pipe carries one control command: the verification max batch.
* :func:`scrape_server` reads the cloud's own counters from ``GET /metrics``
  (``specrelay_target_passes_total``: a batched pass counts once;
  ``specrelay_target_seconds_total``; the ``specrelay_batch_size`` histogram);
  :func:`process_cpu_s` the CPU seconds of a process.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
import traceback
import urllib.request
from typing import Sequence

__all__ = ["load_source", "split_cpus", "CloudServerProcess", "process_cpu_s",
           "parse_prometheus", "scrape_server"]


def load_source(src, dtype: str = "float32", threads: int | None = None):
    """Load ``(model, tokenizer)`` from a spec string or a zero-argument callable."""
    if callable(src):
        return src()
    from edge_sdk.models import load_model

    from edge_sdk.packed import packed_default
    return load_model(src, dtype=dtype, threads=threads, packed=packed_default())


def split_cpus(cloud: Sequence[int] | None = None,
               edge: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """CPU ids for (cloud, edge): the given ones, else the first available CPU for the
    cloud and the rest for the edge (both share everything on a 1-CPU machine)."""
    avail = sorted(os.sched_getaffinity(0))
    if cloud is None and edge is None:
        if len(avail) < 2:
            return avail, avail
        return avail[:1], avail[1:]
    if cloud is None:
        cloud = [c for c in avail if c not in set(edge)] or avail
    if edge is None:
        edge = [c for c in avail if c not in set(cloud)] or avail
    return list(cloud), list(edge)


def _server_main(conn, target, dtype: str, cpus, threads: int, auth: bool,
                 server_kw: dict) -> None:
    """Entry of the spawned cloud process: pin, load, serve, handshake, wait for stop."""
    try:
        if cpus:
            os.sched_setaffinity(0, set(cpus))
        import torch

        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        model, tok = load_source(target, dtype, threads)
        load_s = time.perf_counter() - t0
        from edge_sdk.kvmodel import KVModel

        KVModel(model).forward([0, 1, 2, 3])                 # warm the kernels
        store, raw_key = None, None
        if auth:
            from cloud_api.local import ephemeral_key_store

            store, raw_key = ephemeral_key_store("bench-ephemeral", rpm=10**9, tpm=10**12)
        if "early_exit" in server_kw and isinstance(target, str):
            server_kw = {"early_exit_preset": target, **server_kw}
        if "wisv_head" in server_kw and isinstance(target, str):
            server_kw = {"wisv_preset": target, **server_kw}
        asyncio.run(_serve(conn, model, tok, store, raw_key, threads, load_s, server_kw))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        try:
            conn.send({"error": traceback.format_exc()})
        except Exception:  # noqa: BLE001
            pass


async def _serve(conn, model, tok, store, raw_key, threads, load_s, server_kw) -> None:
    from aiohttp import web

    from cloud_api.app import SERVICE, create_app

    server_kw = dict(server_kw)
    if "early_exit" in server_kw:             # FSD modes: the preset's exit head
        from cloud_api.exit_select import early_head_for

        server_kw["early_head"] = early_head_for(model, tok, server_kw.pop("early_exit"),
                                                 server_kw.pop("early_exit_preset", None))
    from cloud_api.wisv.serving import take_options

    # WISV: wisv_head (PATH|auto|off), wisv_strict, wisv_relaxed, wisv_max_per_block,
    # wisv_guard
    server_kw = take_options(server_kw, model, server_kw.pop("wisv_preset", None))
    app = create_app(model, tok, key_store=store, threads=threads, **server_kw)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    queue = app[SERVICE].queue
    from edge_sdk.packed import PackedLinear

    conn.send({"port": port, "raw_key": raw_key, "load_s": load_s, "pid": os.getpid(),
               "vocab_size": int(model.config.vocab_size), "max_batch": queue.max_batch,
               "packed_linears": any(isinstance(m, PackedLinear) for m in model.modules()),
               "row_invariant": getattr(app[SERVICE].verifier, "row_invariant", None)})
    loop = asyncio.get_running_loop()
    while True:
        try:
            msg = await loop.run_in_executor(None, conn.recv)   # "stop", a command, or EOF
        except (EOFError, OSError):
            break
        if isinstance(msg, dict) and "max_batch" in msg:     # bench control: batching
            queue.max_batch = max(1, int(msg["max_batch"]))   # read by the next batch
            conn.send({"max_batch": queue.max_batch})
            continue
        break
    await runner.cleanup()


class CloudServerProcess:
    """The verification API in a spawned process pinned to ``cpus``.

    Args:
        target: model source (spec string or picklable callable → (model, tokenizer)).
        cpus: CPU ids for the process (None: not pinned).
        threads: torch threads (default: number of CPUs, else 1).
        auth: create an ephemeral signed key (see :attr:`raw_key`); False serves
            without authentication.
        dtype: torch dtype name. server_kw: ``create_app`` options.
        startup_timeout_s: seconds to wait for the model load and the handshake.

    ``with CloudServerProcess("smollm2-135m", cpus=[0]) as cloud: cloud.url``.
    """

    def __init__(self, target, cpus: Sequence[int] | None = None, threads: int | None = None,
                 auth: bool = True, dtype: str = "float32", server_kw: dict | None = None,
                 startup_timeout_s: float = 900.0):
        self.cpus = list(cpus) if cpus else None
        self.threads = threads or (len(self.cpus) if self.cpus else 1)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, name="specrelay-bench-cloud",
                                args=(child, target, dtype, self.cpus, self.threads, auth,
                                      dict(server_kw or {})), daemon=True)
        self._child = child
        self.timeout = startup_timeout_s
        self.info: dict | None = None

    def launch(self) -> "CloudServerProcess":
        """Start the process without waiting (see :meth:`wait_ready`)."""
        self.proc.start()
        self._child.close()
        return self

    def wait_ready(self) -> dict:
        """Block until the server listens; returns the handshake dict
        (``port``, ``raw_key``, ``load_s``, ``pid``, ``vocab_size``).
        Raises RuntimeError (with the child's traceback) on failure or timeout."""
        if self.info is None:
            if not self._conn.poll(self.timeout):
                self.stop()
                raise RuntimeError(f"cloud server did not start within {self.timeout} s")
            try:
                msg = self._conn.recv()
            except EOFError:
                raise RuntimeError("cloud server process died during startup") from None
            if "error" in msg:
                self.stop()
                raise RuntimeError("cloud server failed to start:\n" + msg["error"])
            self.info = msg
        return self.info

    def start(self) -> "CloudServerProcess":
        self.launch()
        self.wait_ready()
        return self

    @property
    def port(self) -> int:
        return self.wait_ready()["port"]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (direct, not through an emulator)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def raw_key(self) -> str | None:
        """The ephemeral API key (None without auth). Never logged or written out."""
        return self.wait_ready()["raw_key"]

    def signer(self):
        """A :class:`Signer` for the ephemeral key, or None without auth."""
        from edge_sdk.protocol.signing import Signer

        return Signer.from_api_key(self.raw_key) if self.raw_key else None

    def set_max_batch(self, n: int, timeout: float = 30.0) -> int:
        """Set the server's verification max batch (blocks per target pass) from the
        next batch on; returns the value in force. Raises RuntimeError without an
        answer within ``timeout`` s."""
        self.wait_ready()
        self._conn.send({"max_batch": int(n)})
        if not self._conn.poll(timeout):
            raise RuntimeError("cloud server did not answer the max_batch command")
        return int(self._conn.recv()["max_batch"])

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the server to shut down; kill it if it does not within ``timeout`` s."""
        if self.proc.pid is None:
            return
        try:
            self._conn.send("stop")
        except (OSError, ValueError, BrokenPipeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()

    def __enter__(self) -> "CloudServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def process_cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of process ``pid`` (None: this one);
    None when it cannot be read (no ``/proc``)."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


_SERVER_SERIES = {
    "specrelay_target_passes_total": "passes",
    "specrelay_target_seconds_total": "target_s",
    "specrelay_batch_size_sum": "batch_blocks",
    "specrelay_batch_size_count": "batches",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: ``{sample name: value}``
    (``prometheus_client``'s parser; counters keep their ``_total`` suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: float(s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def scrape_server(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The cloud's verification counters from ``{url}/metrics`` (public, unsigned):
    ``passes`` (target passes, a batch once), ``target_s`` (target seconds),
    ``batch_blocks`` and ``batches`` (batch-size histogram sum and count)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        samples = parse_prometheus(r.read().decode("utf-8", "replace"))
    return {k: samples.get(series, 0.0) for series, k in _SERVER_SERIES.items()}
