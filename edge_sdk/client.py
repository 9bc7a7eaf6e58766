"""Edge client: the public entry point of the SDK.

:class:`EdgeClient` holds what requests share (transport, drafter, draft scheduler,
client options); each request is one :class:`edge_sdk.generation.Generation`: draft a
block, send it, apply the verdict, commit token by token. Each round's draft depth comes
from a depth controller (``edge_sdk.control``: fixed, heuristic, CAAC of RAPID,
UCB-SpecStop). Rounds are stop-and-wait, or proactive (``edge_sdk.proactive``: RAPID's
IPDG/NPDG) where the next block is drafted while the current one is being verified.
Output equals the target's: greedy token-for-token, sampling in distribution
(Leviathan et al. 2023 §2.3; AsymSpec §IV-B), whatever the controller or proactive mode
— unless a request asks for ``acceptance="semantic"`` (WISV, lossy, never the default).
"""

from __future__ import annotations

import copy
import numbers

from edge_sdk import correction as C
from edge_sdk.channel import ChannelEstimator
from edge_sdk.control import DepthController, FixedDepth, make_controller
from edge_sdk.control.siblings import SiblingPolicy
from edge_sdk.defaults import (DEFAULT_CONTROLLER, DEFAULT_DEPTH, DEFAULT_PROACTIVE,
                               DEFAULT_PROACTIVE_MIN_HIT, DEFAULT_SIBLINGS)
from edge_sdk.drafters.base import Drafter
from edge_sdk.generation import PREFILL_STEPS, Generation
from edge_sdk.offline import POLICIES as CLOUD_LOSS_POLICIES
from edge_sdk.preflight import check_url
from edge_sdk.proactive import MODES as PROACTIVE_MODES
from edge_sdk.proactive import SKIPPING_MODES
from edge_sdk.protocol.limits import MAX_PROACTIVE_ROOTS
from edge_sdk.protocol.wire import ACCEPTANCE
from edge_sdk.results import CloudUnreachable, GenerationResult, TokenEvent
from edge_sdk.scheduler import DraftScheduler
from edge_sdk.transport import Transport

__all__ = ["EdgeClient", "GenerationResult", "TokenEvent", "CloudUnreachable"]


class EdgeClient:
    """Speculative decoding against a specrelay verification API.

    Args:
        base_url: the API, e.g. ``http://127.0.0.1:8000``.
        drafter: a :class:`Drafter` (None allows only ``target_only`` generation).
        tokenizer: shared by draft and target (checked by fingerprint at session create).
        depth: draft depth per block when no ``controller`` is given (fixed; clamped
            to 1..max_block of the server and to the tokens left). Default
            :data:`edge_sdk.defaults.DEFAULT_DEPTH` (8).
        mode: ``asym`` (token, q pairs on the uplink; staged correction) or ``standard``
            (baseline: full q per position uploaded, cloud draws corrections; its
            blocks stop at the drafts whose distributions fit one request body,
            :func:`edge_sdk.protocol.wire.max_full_rows`: 6 for a 151,936-token vocabulary).
        eps_req: request TV budget for bounded corrections (0 = exact).
        correction: ``auto`` or a forced stage ``bounded``/``proposal``/``full`` (tests).
        support_k, n_proposals: correction stage sizes requested from the cloud.
        signer: request signer (see ``edge_sdk.protocol.signing``) or None.
        chat: wrap text prompts in the tokenizer's chat template.
        scheduler: the :class:`DraftScheduler` granting draft compute to concurrent
            requests (one is made per client when None). Concurrent ``generate`` calls
            on one client form the confirmed-prefix pipeline: while one request waits
            for verification, another drafts.
        controller: draft-depth policy: a registry name (``fixed|heuristic|caac|
            ucb-specstop``, one controller per request; ``controller_kw`` go to its
            constructor), a :class:`DepthController` (shared by every request of this
            client), or a zero-argument factory returning one. None (default): a
            greedy request paces its depth to the verification round trip, at most
            ``depth`` (``paced``, :data:`edge_sdk.defaults.DEFAULT_CONTROLLER`), a
            sampled one drafts the fixed ``depth`` (its seed then replays its output
            whatever the timing).
        carry_controller: a registry-named controller of a new request starts from a
            copy of the one the client's last finished request left (its draft-latency,
            response-time and acceptance estimates describe the device, the link and
            the pair, not the request; a short request would otherwise spend most of
            its rounds warming up). False: every request starts cold. Depth only:
            the output is the target's either way.
        proactive: default ``ipdg`` (:data:`edge_sdk.defaults.DEFAULT_PROACTIVE`).
            ``off`` (stop-and-wait), ``ipdg`` (RAPID's interruptible proactive
            drafting: draft the next block while the current one is verified, stop at the
            first expansion step after the verdict), ``npdg`` (the non-interruptible
            baseline), ``fsd`` (the FSD review: draft the next block from the early
            verdict the cloud streams from an early exit of the target, before the final
            one; needs a server started with an early exit, else it drafts nothing
            ahead) or ``fsd+ipdg`` (IPDG's guesses, pruned or redirected by the early
            verdict). The final verdict alone decides. Proactive steps share the scheduler's draft worker but are not
            confirmed-prefix grants (they draft a descendant of an unresolved block).
        proactive_roots: b, the number of guessed bonus tokens (b > 1: a tree of b
            branches, each on its own drafter fork).
        proactive_min_hit: in [0, 1), default
            :data:`edge_sdk.defaults.DEFAULT_PROACTIVE_MIN_HIT`. ``ipdg`` skips the
            proactive branch of a block whose predicted
            whole-block acceptance (:func:`edge_sdk.proactive.hit_chance`: the product
            of the draft's probabilities of its tokens) is below it: the branch would
            only be kept if the whole block were accepted. 0: never skip. Speed and
            edge work only; the output is the target's either way. Raises
            ValueError: above 0 with another ``proactive`` mode (NPDG, the baseline,
            never skips; the FSD modes draft from the early verdict).
        send_ahead: pipelined verification (needs ``proactive``; chains only, b = 1;
            None, the default: on unless ``proactive="off"``):
            a proactive block completed while the previous block is still in flight is
            sent at once, marked with its assumed bonus (``expect_last``), so the cloud
            verifies it right after the previous block instead of one network round
            trip and a draft later. The cloud verifies it only if the previous block was
            fully accepted with that bonus (exactly the client's proactive hit); else
            it answers 409 ``stale_block``, changes nothing, and the edge drafts from
            the true prefix. At most two blocks of a request are in flight. The
            acceptance rule and the draws are unchanged (PipeSpec-style asynchronous
            pipelining of draft and verify stages; output identical to stop-and-wait).
        on_cloud_loss: what to do when the cloud cannot be reached (connection refused,
            timeouts) after the transport's retries. ``wait`` (default): keep retrying
            with backoff for up to ``offline_timeout_s`` seconds, then raise
            ``CloudUnreachable``; no unverified token is ever produced. ``draft_only``:
            continue with the draft alone, every such token flagged ``verified=False``
            (TokenEvent, GenerationResult.verified, the OpenAI endpoint), probing the
            cloud every ``probe_interval_s`` seconds; once it answers the request
            resumes from its full prefix (nothing lost or repeated) under verification.
            ``local``: continue exactly with ``local_target`` (the device's own target
            under a memory budget, CATS; tokens stay ``verified=True``, counted in
            ``metrics["local_tokens"]``), handing back to the cloud the same way.
        local_target: an ``edge_sdk.local_target.LocalSession`` (``build_local``) for
            ``on_cloud_loss="local"`` (its ``step(ids, max_tokens, cfg, seed)`` is called
            once per round while the cloud is lost).
        siblings: greedy sibling trees (SpecInfer / Sequoia token-tree verification):
            the draft's next-best tokens at each position it is least sure of, verified
            in the same target pass; a hit commits the sibling and its bonus token.
            Default ``"auto"`` (:data:`edge_sdk.defaults.DEFAULT_SIBLINGS`): width 2
            within the rows the server advertises as free (``free_rows``: 16 for a
            bf16 target on an AMX CPU, 0 elsewhere, where it drafts chains); a
            :class:`edge_sdk.control.siblings.SiblingPolicy` or an int width: trees up
            to the policy's ``max_rows`` whatever they cost. None or 0: chains only.
            Only used for greedy requests with exact acceptance on a server advertising
            ``max_tree_rows``; the output stays the target's greedy output.
        ssl_context: TLS context trusting the server's CA for ``https://`` (when no
            ``transport`` is given). A certificate error is raised at once
            (``edge_sdk.transport.TLSVerifyError``), never waited out.
        acceptance: the requests' default acceptance (a request may override it):
            ``exact`` (default: the target's output) or ``semantic`` (WISV §III, lossy:
            the cloud's decision head may accept a draft token the target would not
            have chosen; greedy sampling only, and the server needs a head loaded, else
            the create is refused with 422 naming ``acceptance``). A semantic request
            sends its channel state with each block (:mod:`edge_sdk.channel`), marks
            the tokens accepted that way (``TokenEvent.semantic``) and reports them
            (``GenerationResult.semantic_accepted_tokens``, ``exact_target_output``,
            ``metrics["semantic_accepted_tokens"]``).
        prefill_steps: when the cloud session is open before the draft model has
            prefilled the prompt (a busy or slow device, a long prompt: the draft's
            prefill can outlast the target's), take target steps (an empty block: the
            cloud commits its own next token, one per round) until the draft is
            ready, then speculate; the TTFT is then the target's own, not the draft's
            prefill. ``greedy`` (default): greedy requests only; ``always``: sampled
            ones too; ``off``: wait for the draft. Greedy output is the target's either
            way; a sampled one is drawn from the target's distribution either way, but
            its draws depend on where its blocks start, so with steps (their number
            depends on timing) a seed no longer reproduces it run to run.
        link: the link the semantic channel report describes: anything with
            ``rtt_s`` (seconds) and ``uplink_bps`` (bits per second), e.g. a benchmark
            network profile; None: measured (:class:`edge_sdk.channel.ChannelEstimator`).
    """

    def __init__(self, base_url: str, drafter: Drafter | None, tokenizer, *,
                 depth: int = DEFAULT_DEPTH,
                 mode: str = "asym", eps_req: float = 0.0, correction: str = "auto",
                 support_k: int = 32, n_proposals: int = 4, signer=None, chat: bool = True,
                 transport: Transport | None = None, scheduler: DraftScheduler | None = None,
                 controller: str | DepthController | None = None,
                 controller_kw: dict | None = None, proactive: str = DEFAULT_PROACTIVE,
                 proactive_roots: int = 1, send_ahead: bool | None = None,
                 proactive_min_hit: float = DEFAULT_PROACTIVE_MIN_HIT,
                 on_cloud_loss: str = "wait",
                 offline_timeout_s: float = 300.0, probe_interval_s: float = 1.0,
                 ssl_context=None, local_target=None, acceptance: str = "exact",
                 link=None, siblings=DEFAULT_SIBLINGS, carry_controller: bool = True,
                 prefill_steps: str = "greedy"):
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, not {depth!r}")
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}")
        ChannelEstimator(link)                      # validate early
        self.acceptance, self.link = acceptance, link
        if mode not in ("asym", "standard"):
            raise ValueError("mode must be 'asym' or 'standard'")
        if correction not in C.MODES:
            raise ValueError(f"correction must be one of {C.MODES}")
        if proactive not in PROACTIVE_MODES:
            raise ValueError(f"proactive must be one of {PROACTIVE_MODES}")
        if not 1 <= int(proactive_roots) <= MAX_PROACTIVE_ROOTS:
            raise ValueError(f"proactive_roots must be in 1..{MAX_PROACTIVE_ROOTS}")
        if not 0.0 <= float(proactive_min_hit) < 1.0:
            raise ValueError(f"proactive_min_hit must be in [0, 1), not {proactive_min_hit!r}")
        if proactive_min_hit and proactive not in SKIPPING_MODES:
            raise ValueError(f"proactive_min_hit needs proactive in {SKIPPING_MODES}, "
                             f"not {proactive!r}")
        if send_ahead is None:                      # default: on with proactive drafting
            send_ahead = proactive != "off"
        if send_ahead and proactive == "off":
            raise ValueError("send_ahead needs proactive='ipdg', 'npdg', 'fsd' or "
                             "'fsd+ipdg'")
        if on_cloud_loss not in CLOUD_LOSS_POLICIES:
            raise ValueError(f"on_cloud_loss must be one of {CLOUD_LOSS_POLICIES}")
        if on_cloud_loss == "local" and local_target is None:
            raise ValueError('on_cloud_loss="local" needs local_target=')
        self.local_target = local_target
        if siblings == "auto":
            siblings = SiblingPolicy.auto()
        elif isinstance(siblings, int) and not isinstance(siblings, bool):
            siblings = SiblingPolicy(width=siblings) if siblings else None
        if siblings is not None and not isinstance(siblings, SiblingPolicy):
            raise ValueError("siblings must be 'auto', a SiblingPolicy, an int width or "
                             "None")
        self.siblings = siblings
        self.on_cloud_loss, self.offline_timeout_s = on_cloud_loss, offline_timeout_s
        self.probe_interval_s = probe_interval_s
        if isinstance(controller, str):
            make_controller(controller, **(controller_kw or {}))    # validate early
        self.controller, self.controller_kw = controller, dict(controller_kw or {})
        self.carry_controller = bool(carry_controller)
        self._warm: dict[str, DepthController] = {}     # registry name -> last state
        self.proactive, self.proactive_roots = proactive, int(proactive_roots)
        self.proactive_min_hit = float(proactive_min_hit)
        self.send_ahead = bool(send_ahead)
        if prefill_steps not in PREFILL_STEPS:
            raise ValueError(f"prefill_steps must be one of {PREFILL_STEPS}")
        self.prefill_steps = prefill_steps
        self.drafter, self.tokenizer = drafter, tokenizer
        self.depth, self.mode, self.eps_req, self.correction = depth, mode, eps_req, correction
        self.support_k, self.n_proposals, self.chat = support_k, n_proposals, chat
        if transport is None:
            check_url(base_url)
        self.transport = transport or Transport(base_url, signer=signer,
                                                ssl_context=ssl_context)
        self.closed = False
        self.scheduler = scheduler or DraftScheduler()
        self._own_scheduler = scheduler is None
        self._drafter_in_use = False

    def _lease_drafter(self) -> Drafter:
        """The client's drafter for the first active request; concurrent requests get
        forks (own KV cache, shared weights)."""
        if self._drafter_in_use:
            return self.drafter.fork()
        self._drafter_in_use = True
        return self.drafter

    def _return_drafter(self, d: Drafter | None) -> None:
        if d is self.drafter:
            self._drafter_in_use = False

    async def close(self) -> None:
        self.closed = True
        await self.transport.close()
        if self._own_scheduler:
            self.scheduler.shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    def _request_controller(self, spec, depth: int | None, greedy: bool = False
                            ) -> tuple[DepthController, str | None]:
        """A request's depth controller: a fixed ``depth`` of the request, else its
        ``controller`` (as in the constructor), else the client's, else the default
        (``greedy``: :data:`DEFAULT_CONTROLLER`, else fixed); and the registry name it
        is carried under (:meth:`_keep_controller`), None when not carried."""
        if depth is not None:
            return FixedDepth(depth), None
        spec = spec if spec is not None else self.controller
        if spec is None:
            if not greedy:
                return FixedDepth(self.depth), None
            spec = DEFAULT_CONTROLLER
        if isinstance(spec, DepthController):
            return spec, None
        if isinstance(spec, str):
            warm = self._warm.get(spec) if self.carry_controller else None
            if warm is not None:
                return copy.deepcopy(warm), spec
            return make_controller(spec, default_depth=self.depth,
                                   **self.controller_kw), spec
        ctrl = spec()
        if not isinstance(ctrl, DepthController):
            raise TypeError("controller factory must return a DepthController")
        return ctrl, None

    def _keep_controller(self, key: str | None, ctrl: DepthController) -> None:
        """Remember a finished request's controller as the start of the next request's
        (``carry_controller``; the most recently finished request wins). Kept as is:
        the request is done with it, and :meth:`_request_controller` hands out copies."""
        if key is not None and self.carry_controller:
            self._warm[key] = ctrl

    def stream(self, prompt: str | None = None, **kw) -> Generation:
        """An async iterable of :class:`TokenEvent`; ``.result()`` afterwards. Takes the
        arguments of :meth:`generate`."""
        return Generation(self, prompt, **kw)

    async def generate(self, prompt: str | None = None, **kw) -> GenerationResult:
        """Generate a completion.

        Args:
            prompt: text (chat-templated when ``chat``; not blank), or pass
                ``prompt_ids=[...]`` (at least one id).
            sampling: :class:`SamplingConfig` or a dict of its fields (default greedy);
            max_new_tokens: tokens to generate, 1..32,768 (the server caps prompt + new
                tokens at its context);
            stop: a stop string or a list of them;
            seed: RNG seed of every edge and cloud draw (``edge_sdk.protocol.rng``);
                None (default): a fresh one, reported as ``GenerationResult.seed``;
            target_only: generate with the target alone (blocks of depth 0);
            depth: fixed draft depth for this request (overrides the controller);
            controller: depth controller for this request (as in :class:`EdgeClient`).
            acceptance: ``exact`` or ``semantic`` for this request (default: the
                client's; see :class:`EdgeClient`).
            on_round: ``(record: dict) -> None`` called after every verification round
                with its record (round, depth, planned, accepted, proactive_block,
                t_send / t_response / t_ready in seconds since the request started,
                proactive_steps, proactive_plan, hit); for tracing and benchmarks.
        Raises:
            ValueError: a bad request option, named with its range, before anything is
                sent (``acceptance="semantic"`` with sampling included).
            RemoteError: the API refused a request (4xx) after retries.
            CloudUnreachable: the cloud stayed unreachable for ``offline_timeout_s``
                (``on_cloud_loss="wait"``).
            RuntimeError: the client is closed.
        """
        gen = self.stream(prompt, **kw)
        async for _ in gen:
            pass
        return gen.result()
