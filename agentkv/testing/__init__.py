"""Test helpers shipped with agentkv: a protocol-faithful fake of vLLM prefill/decode pairs.

:class:`FakeCluster` runs N pairs of fake vLLM 0.32 servers in-process (NixlConnector, pull
mode, ``bidirectional_kv_xfer``), served through an httpx2 transport (``fake.transport``) or over
real HTTP (``fake.serve()``). Use it to test agents and clients without a model.

What is faithful (each module cites the vLLM code it follows):

* HTTP/JSON: request validation, status codes, error bodies, response and chunk shapes,
  ``kv_transfer_params`` key sets, ``prompt_token_ids`` forwarding, ``return_token_ids``,
  ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``; ``/metrics`` is vLLM's own metric
  definitions rendered by vLLM's library (``prometheus_client``).
* KV reuse: block-granular prefix caching, positional pulls of ``min(remote_num_tokens,
  prompt_len) - local_hit`` tokens, ``kv_recompute_threshold``, single-use handles, TTLs, the
  5 s expiry margin, load failures answered with 500, ``kv_cache_usage_perc`` from a block pool.
* agentkv's extension (on by default, as ``agentkv up`` runs vLLM): pin hints, lease
  acknowledgements, ``/v1/agentkv/info`` and the release/extend routes, decided by the
  connector's own ``LeaseBook``; ``leases=False, stream_handles=False`` is stock vLLM.
* The file tier (``tier=True``, ``_fake_tier``): offload and delete routes, tier usage in
  ``/v1/agentkv/info``, prefill's token-exact, checksum-checked load of at most ``prompt - 1``
  tokens, a byte budget with LRU eviction.
* Wrong KV: the model's output is a function of the KV it holds, so a handle sent with a
  history that is not its prefix changes the answer; ``wrong_reuse_events`` counts such pulls.
* Stop strings (``stop``, ``include_stop_str_in_output``) as vLLM's front end checks them: the
  text cut, the ids kept up to the completing token, the request aborted (nothing pinned,
  ``kv_transfer_params: null``), streams holding back a stop string's length less one.

What is simplified: greedy only (other sampling parameters, ``logprobs`` and ``n > 1`` are
ignored or refused), one KV cache group, whole responses computed at once (streams are replayed
one chunk per token), a full KV cache answers 500 instead of queueing, and only the metrics
listed in ``_fake_metrics`` are exposed.

Example:
    >>> import httpx2
    >>> from agentkv.testing import FakeCluster, ManualClock
    >>> fake = FakeCluster(pairs=1, clock=ManualClock())
    >>> async_client = httpx2.AsyncClient(transport=fake.transport)
    >>> fake.cluster_spec["pairs"][0]["decode"]
    'http://fake-d0.test:8000'
"""

from agentkv.testing._coding_agents import (
    CODING_AGENT_PACKAGES,
    CodingAgents,
    CodingAgentsUnavailableError,
    install_coding_agents,
)
from agentkv.testing._drift import DriftReport, logprob_drift, teacher_forced_logprobs, tie_gap
from agentkv.testing._fake_clock import ManualClock
from agentkv.testing._fake_cluster import FakeCluster
from agentkv.testing._fake_http import ServedCluster
from agentkv.testing._fake_reply import FaultKind
from agentkv.testing._fake_server import FakeServer
from agentkv.testing._fake_template import ChatTemplate, render_chat
from agentkv.testing._fake_tier import FakeTier
from agentkv.testing._fake_tokenizer import FakeTokenizer
from agentkv.testing._fake_transport import FakeTransport

__all__ = [
    "CODING_AGENT_PACKAGES",
    "ChatTemplate",
    "CodingAgents",
    "CodingAgentsUnavailableError",
    "DriftReport",
    "FakeCluster",
    "FakeServer",
    "FakeTier",
    "FakeTokenizer",
    "FakeTransport",
    "FaultKind",
    "ManualClock",
    "ServedCluster",
    "install_coding_agents",
    "logprob_drift",
    "render_chat",
    "teacher_forced_logprobs",
    "tie_gap",
]
