"""Every default of the SDK in one place, each with why it is what it is.

The modules that use a default import it from here; a setting a caller can change is an argument
(or a field of a policy) whose default is one of these.
"""

from __future__ import annotations

import httpx2

# --- HTTP to the servers -------------------------------------------------------------------------

# Long reads on purpose: a cold multi-thousand-token prefill on CPU takes minutes.
TIMEOUT = httpx2.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)
# vLLM's API server (uvicorn) closes idle connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by
# default; keeping ours for less means we never send on a connection the server is closing (a
# failed P leg costs the turn its handle). The limits apply to each server.
LIMITS = httpx2.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0)
# A health probe (GET /health) answers at once on a live server.
HEALTH_TIMEOUT_S = 2.0
# How long a pair marked down waits before it is probed again.
HEALTH_RECHECK_S = 5.0
# Lease calls answer in milliseconds; a decode that takes longer is in trouble, and a close must
# not hang on it.
LEASE_CALL_TIMEOUT_S = 5.0
# An offload waits for decode to write the handle's KV to the tier and fsync it: GiBs at GPU
# sizes, seconds on a CPU (decode keeps serving others meanwhile, connector/_tier_writer.py). A
# client that gave up sooner would keep a handle whose pin the commit then frees.
OFFLOAD_CALL_TIMEOUT_S = 120.0
# How long closing a cluster waits for its lease calls still in flight (releases, tier deletes:
# each bounded by the timeout above) before it cancels them and closes the client under them.
CLOSE_SETTLE_S = LEASE_CALL_TIMEOUT_S
# How long a decode found without agentkv's extension is taken at its word before it is asked
# again (cluster clock).
RECHECK_UNSUPPORTED_S = 60.0
# Error messages keep the start of a server's answer, which is where vLLM puts the reason.
ERROR_BODY_LIMIT = 2000

# --- turns ---------------------------------------------------------------------------------------

# Per model turn, when neither the session nor the turn says otherwise.
MAX_TOKENS = 256
# Greedy by default: with greedy sampling, answers with KV reuse equal answers without it.
TEMPERATURE = 0.0
# How long a loaded handle's lease is extended when decode confirms it: past prefill's 5 s expiry
# margin, with room for the P leg to reach prefill.
CONFIRM_TTL_S = 30.0
# A template's anchor renders are kept per tools list; agents use a handful.
TEMPLATE_CACHE_LIMIT = 64

# --- the cache policy ----------------------------------------------------------------------------

# vLLM's decoder_kv_blocks_ttl default (VLLM_NIXL_ABORT_REQUEST_TIMEOUT): how long decode keeps a
# finished request's blocks for a pull.
SERVER_TTL_S = 480.0
# Handles are given up this long before the server's deadline: clocks drift and a P leg takes time.
TTL_MARGIN_S = 30.0
# vLLM's own NIXL connector recomputes rather than pulls fewer tokens than this (its
# kv_recompute_threshold); a cluster file may say what its servers use (the local pair: 1).
RECOMPUTE_THRESHOLD = 64
# Tool-call durations are estimates: a wait is extended when it ends less than this before the
# deadline, and by this much more than the estimate.
EXTEND_SLACK_S = 30.0

# --- retries -------------------------------------------------------------------------------------

RETRY_ATTEMPTS = 3
RETRY_INITIAL_BACKOFF_S = 0.05
RETRY_MAX_BACKOFF_S = 1.0
RETRY_JITTER_S = 0.05

# --- placement -----------------------------------------------------------------------------------

# Bounded-load hashing: no decode holds more than ceil(LOAD_FACTOR * average) sessions.
LOAD_FACTOR = 1.25
# A warm prefill (holding the session's prefix) is kept while it is at most this many tokens, or
# this share of the load, behind the least loaded (see PrefillWeights).
PREFILL_SLACK_TOKENS = 512
PREFILL_SLACK_RATIO = 0.1
# Prefix homes (``_placement.PrefixHomes``): the chunk a prompt prefix is recorded in, and how
# many chunks a pool remembers (64 x 65,536 tokens: a few hundred long prompts).
PREFIX_HOME_CHUNK_TOKENS = 64
PREFIX_HOME_MAX_CHUNKS = 65_536

# --- agents --------------------------------------------------------------------------------------

AGENT_MAX_STEPS = 8
AGENT_TOOL_TIMEOUT_S = 60.0
# Tool outputs longer than this are cut before the model sees them.
AGENT_MAX_OUTPUT_CHARS = 4000
# Tool calls one reply of the JSON protocol may make.
JSON_TOOL_MAX_CALLS = 4
