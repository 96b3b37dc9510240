"""The ``agentkv proxy`` subcommand: flags mapped onto ``ProxyConfig``, then ``serve``.

Wired into ``agentkv.cli.build_parser`` with ``add_parser(sub)``. The cluster file defaults to
``$AGENTKV_CLUSTER`` or ``.agentkv/cluster.json``, as for the other subcommands.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentkv.local._config import default_cluster_file
from agentkv.proxy._config import ApiKeys, ProxyConfig
from agentkv.proxy._messages_system import DEFAULT_DROPS

__all__ = ["add_parser", "cmd_proxy", "config_from_args"]

_DEFAULTS = ProxyConfig()


class _DeprecatedFlag(argparse.Action):
    """An old flag's name: sets its new flag's value and says so on stderr (for one release)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any
    ) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        print(
            f"agentkv proxy: {option_string} is deprecated; use {self.new}", file=sys.stderr
        )
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _deprecated(parser: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """Register ``old`` as a hidden, deprecated name of the flag ``new`` (same destination)."""
    dest = new.removeprefix("--").replace("-", "_")
    parser.add_argument(
        old, dest=dest, action=_DeprecatedFlag, new=new, help=argparse.SUPPRESS, **kwargs
    )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``proxy`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "proxy",
        help="serve an OpenAI-compatible, session-aware proxy in front of the cluster",
        description="OpenAI-compatible chat completions with KV reuse per X-Session-ID "
        "(or prompt_cache_key). See docs/proxy.md.",
    )
    parser.add_argument(
        "--cluster-file",
        help="cluster file (default $AGENTKV_CLUSTER or .agentkv/cluster.json)",
    )
    parser.add_argument("--host", default=_DEFAULTS.host, help=f"default {_DEFAULTS.host}")
    parser.add_argument(
        "--port", type=int, default=_DEFAULTS.port, help=f"default {_DEFAULTS.port}"
    )
    parser.add_argument(
        "--api-keys",
        metavar="FILE",
        help="accepted API keys, one a line ('KEY' or 'NAME KEY'); without it any key is "
        "accepted (sessions are still scoped by the key presented)",
    )
    parser.add_argument(
        "--session-idle-timeout",
        type=float,
        default=_DEFAULTS.session_idle_timeout_s,
        metavar="SECONDS",
        help=f"close sessions unused this long (default {_DEFAULTS.session_idle_timeout_s:g})",
    )
    parser.add_argument(
        "--offload-idle",
        type=float,
        default=_DEFAULTS.offload_idle_s,
        metavar="SECONDS",
        help="offload a session's pinned KV to decode's file tier once it is unused this long "
        f"(default {_DEFAULTS.offload_idle_s:g}; 0: never)",
    )
    _deprecated(parser, "--persist-idle", "--offload-idle", type=float)
    parser.add_argument(
        "--relieve-kv-usage",
        type=float,
        default=_DEFAULTS.relieve_kv_usage,
        metavar="FRACTION",
        help="when a decode's KV memory in use reaches this fraction, free the pins of idle "
        "sessions on it, the longest idle first: offloaded to its file tier, else released "
        f"(default {_DEFAULTS.relieve_kv_usage:g}; 0: never)",
    )
    parser.add_argument(
        "--allow-client-offload",
        action="store_true",
        help="honour clients' X-AgentKV-Offload: always (a write to decode's file tier that every "
        "tenant shares); by default it is ignored and the answer says so",
    )
    _deprecated(parser, "--allow-client-persist", "--allow-client-offload", nargs=0, const=True)
    parser.add_argument(
        "--client-offload-rate",
        type=float,
        default=_DEFAULTS.client_offload_per_minute,
        metavar="PER_MINUTE",
        help="with --allow-client-offload, the offloads one API key may ask for a minute "
        f"(default {_DEFAULTS.client_offload_per_minute:g}; more are ignored)",
    )
    _deprecated(parser, "--client-persist-rate", "--client-offload-rate", type=float)
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=_DEFAULTS.max_sessions,
        help="open sessions at most (per replica with --state); past it an idle one of the "
        f"key holding the most is closed (default {_DEFAULTS.max_sessions})",
    )
    parser.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=None,
        metavar="N",
        help="open sessions one API key may hold at most (429 past it; default: no cap "
        "beyond its fair share of --max-sessions)",
    )
    parser.add_argument(
        "--max-stored-sessions",
        type=int,
        default=None,
        metavar="N",
        help="with --state: sessions the store holds at most, all replicas together (a new "
        "one past it gets 503; default: --max-sessions)",
    )
    parser.add_argument(
        "--responses-max-bytes",
        type=int,
        default=_DEFAULTS.responses_max_bytes,
        metavar="BYTES",
        help="memory for stored Responses API responses (previous_response_id), oldest "
        f"dropped first; not used with --state (default {_DEFAULTS.responses_max_bytes})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=_DEFAULTS.max_body_bytes,
        help=f"larger request bodies get 413 (default {_DEFAULTS.max_body_bytes})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=_DEFAULTS.body_timeout_s,
        metavar="SECONDS",
        help="a request body may pause this long, and has this long plus a second per "
        "--body-min-rate bytes to arrive; else 408 and the connection is closed "
        f"(default {_DEFAULTS.body_timeout_s:g}; 0: no deadline)",
    )
    parser.add_argument(
        "--body-min-rate",
        type=int,
        default=_DEFAULTS.body_min_rate,
        metavar="BYTES_PER_S",
        help="bytes a second that earn a slow upload more time "
        f"(default {_DEFAULTS.body_min_rate}; 0: the whole body within --body-timeout)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=_DEFAULTS.header_timeout_s,
        metavar="SECONDS",
        help="close connections that take longer to send a request's headers "
        f"(default {_DEFAULTS.header_timeout_s:g}; 0: no deadline)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=_DEFAULTS.max_connections,
        help="client connections (or requests in flight) at most; past it uvicorn answers 503 "
        f"(default {_DEFAULTS.max_connections}; 0: no limit)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=_DEFAULTS.default_max_tokens,
        help=f"generation limit of requests that set none (default {_DEFAULTS.default_max_tokens})",
    )
    parser.add_argument(
        "--refuse-oversized-max-tokens",
        action="store_true",
        help="answer 400 context_length_exceeded to a max_tokens above what the prompt leaves "
        "of the model's context, instead of clamping it (X-AgentKV-Max-Tokens-Clamped)",
    )
    parser.add_argument(
        "--tool-calling",
        default=_DEFAULTS.tool_calling,
        choices=["auto", "native", "json"],
        help="how tool calls are served: the backend's parser (native), agentkv's structured "
        "outputs (json), or probe the backend once (auto, the default)",
    )
    parser.add_argument(
        "--state",
        default=None,
        metavar="redis://HOST:PORT/DB",
        help="keep sessions in Redis, shared by every proxy replica that names it (default: in "
        "this process's memory)",
    )
    parser.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="let requests of different API keys share vLLM's prefix cache (by default each "
        "key gets its own cache_salt: no timing side channel across keys)",
    )
    parser.add_argument(
        "--metrics-need-key",
        action="store_true",
        help="GET /metrics asks for an API key like the API routes (needs --api-keys)",
    )
    parser.add_argument(
        "--drop-system-block",
        action="append",
        default=[],
        metavar="REGEX",
        help="leave out Messages API system blocks this regular expression matches (searched in "
        "each block; repeatable; added to the default, Claude Code's per-session "
        "x-anthropic-billing-header line)",
    )
    parser.add_argument(
        "--no-default-system-drops",
        action="store_true",
        help="keep the x-anthropic-billing-header system block (drop only --drop-system-block's)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )
    parser.set_defaults(func=cmd_proxy)


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The ``ProxyConfig`` the flags describe (``ConfigError`` for bad values or key files)."""
    return ProxyConfig(
        host=args.host,
        port=args.port,
        api_keys=ApiKeys.from_file(args.api_keys) if args.api_keys else None,
        session_idle_timeout_s=args.session_idle_timeout,
        offload_idle_s=args.offload_idle or None,
        relieve_kv_usage=args.relieve_kv_usage or None,
        allow_client_offload=args.allow_client_offload,
        client_offload_per_minute=args.client_offload_rate,
        max_sessions=args.max_sessions,
        max_sessions_per_key=args.max_sessions_per_key,
        max_stored_sessions=args.max_stored_sessions,
        max_body_bytes=args.max_body_bytes,
        responses_max_bytes=args.responses_max_bytes,
        body_timeout_s=args.body_timeout or None,
        body_min_rate=args.body_min_rate or None,
        header_timeout_s=args.header_timeout or None,
        max_connections=args.max_connections or None,
        default_max_tokens=args.default_max_tokens,
        refuse_oversized_max_tokens=args.refuse_oversized_max_tokens,
        tool_calling=args.tool_calling,
        state=args.state,
        isolate_prefix_caches=not args.shared_prefix_cache,
        cache_salt_secret=os.environ.get("AGENTKV_PROXY_CACHE_SALT_SECRET") or None,
        metrics_need_key=args.metrics_need_key,
        drop_system_blocks=(
            *(() if args.no_default_system_drops else DEFAULT_DROPS),
            *args.drop_system_block,
        ),
    )


def cmd_proxy(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C exits with 130 through the CLI's handler)."""
    from agentkv.proxy._server import run

    config = config_from_args(args)
    cluster_file = Path(args.cluster_file) if args.cluster_file else default_cluster_file()
    run(cluster_file, config, log_level=args.log_level)
    return 0
