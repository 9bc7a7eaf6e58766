"""Reliability under link faults: ``specrelay bench --chaos``.

Every fault of :func:`bench.chaos.faults.fault_matrix` (per direction: drop a request
or a response, duplicate, reorder two blocks, delay past the client's timeout, reset
mid-body; a 2 s and a 30 s partition; drops and duplicates of session creation; every
kind on correction requests, sampling only) x {greedy, seeded sampling} x
{stop-and-wait, IPDG with blocks sent ahead, a pipeline of 8 requests on one client}:
each run's output is compared with the same request without faults. A run must end identical to it, or fail with a documented error
(``CloudUnreachable``, ``RemoteError``); no token may be lost or duplicated.

* :mod:`bench.chaos.faults` — the faults and the plan deciding which request each hits;
* :mod:`bench.chaos.proxy` — the HTTP-message-level fault proxy;
* :mod:`bench.chaos.matrix` — running the matrix (client modes, references);
* :mod:`bench.chaos.score` — what identical / lost / duplicated / errors mean;
* :mod:`bench.chaos.report` — ``chaos.json``, ``chaos.md``, the console table;
* :mod:`bench.chaos.run` — the presets and :func:`~bench.chaos.run.run_chaos`.
"""
