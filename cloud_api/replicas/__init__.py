"""Verification beyond one machine: verifier replicas on Ray Serve behind the signed
ingress.

One idea per module:

* :mod:`~cloud_api.replicas.replica` — :class:`VerifierReplica`, one
  :class:`cloud_api.service.CloudService` (target, sessions with their KV caches,
  its own batching queue) in each replica of a Serve deployment; session ids name
  the replica's slot and generation;
* :mod:`~cloud_api.replicas.registry` — the actor that hands each replica a free slot
  and a new generation at start-up;
* :mod:`~cloud_api.replicas.router` — :class:`SessionRouter`, the deployment's Serve
  request router: session affinity by slot, new sessions to the least-loaded replica,
  a gone replica's sessions answered 404 ``session_evicted``;
* :mod:`~cloud_api.replicas.client` — the ingress's calls through the
  ``DeploymentHandle`` (routing keys, timeouts, a replica dying mid-call);
* :mod:`~cloud_api.replicas.shared_state` — the nonce (replay) cache and the rate-limit
  windows shared by every ingress worker, in one Ray actor (a ``limits`` storage);
* :mod:`~cloud_api.replicas.ingress` — the aiohttp app in front (same routes, auth,
  rate limits and metrics as :func:`cloud_api.app.create_app`);
* :mod:`~cloud_api.replicas.cluster` — connect to / start Ray and Serve, deploy (or
  find and check) the replicas.

Needs the ``[ray]`` extra; nothing under ``cloud_api.app`` imports this package.
"""
