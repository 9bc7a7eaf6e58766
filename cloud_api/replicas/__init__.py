"""Verification beyond one machine: verifier replicas on Ray behind the signed ingress.

One idea per module:

* :mod:`~cloud_api.replicas.replica` — :class:`VerifierReplica`, one
  :class:`cloud_api.service.CloudService` (target, sessions with their KV caches,
  its own batching queue) inside a Ray actor;
* :mod:`~cloud_api.replicas.router` — :class:`ReplicaRouter`: session affinity
  (a session id names its replica), new sessions to the least-loaded replica,
  a dead replica's sessions answered 404 ``session_evicted``;
* :mod:`~cloud_api.replicas.shared_state` — the nonce (replay) cache and the rate-limit
  windows shared by every ingress worker, in one Ray actor (a ``limits`` storage);
* :mod:`~cloud_api.replicas.ingress` — the aiohttp app in front (same routes, auth,
  rate limits and metrics as :func:`cloud_api.app.create_app`);
* :mod:`~cloud_api.replicas.cluster` — connect to / start Ray, spawn the replicas.

Needs the ``[ray]`` extra; nothing under ``cloud_api.app`` imports this package.
"""
