"""Start and stop local vLLM CPU prefill/decode pairs (``agentkv up`` / ``agentkv down``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv import ConfigError
from agentkv.local._config import (
    ClusterRecord,
    LocalClusterConfig,
    PairRecord,
    PoolServerRecord,
    ServerRecord,
)
from agentkv.local._cpu import default_dtype, isa_env, read_cpu_info
from agentkv.local._model import prepare_model
from agentkv.local._procs import pid_alive, stop_group
from agentkv.local._quiet import quiet_env

Progress = Callable[[str], None]

# Measured: one server with a 1 GiB KV cache peaks near 2.5 GiB resident while compiling.
_SERVER_MEMORY_GIB = 2.5


# Servers outlive start_cluster() by design. Holding their Popen objects keeps Python from
# warning that a child is "still running" when they would be garbage-collected, and lets
# stop_cluster() reap the ones this process started instead of leaving zombies.
_LAUNCHED: dict[int, subprocess.Popen[bytes]] = {}


class StartupError(ConfigError):
    """A server of the local cluster could not be started; the message names the cause and log."""


@dataclass(frozen=True, kw_only=True)
class ServerPlan:
    """Everything needed to start one server: the command, its environment and its log."""

    role: str  # "prefill" or "decode"
    pair: str
    port: int
    side_channel_port: int
    core: int
    argv: tuple[str, ...]
    env: dict[str, str]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def kv_transfer_config(*, role: str, config: LocalClusterConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a server: vLLM's NixlConnector, bidirectional, on DRAM."""
    extra: dict[str, Any] = {
        "bidirectional_kv_xfer": True,
        "decoder_kv_blocks_ttl": config.decoder_kv_blocks_ttl,
        "kv_recompute_threshold": config.kv_recompute_threshold,
    }
    tier_dir = config.resolved_tier_dir
    if tier_dir is not None:
        extra["agentkv_tier_dir"] = str(tier_dir)
        extra["agentkv_tier_budget_bytes"] = config.tier_budget_bytes
    transfer: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
        # A pull that fails (the handle expired or was released) recomputes those tokens instead
        # of failing the request with a 500 (vLLM's default, "fail").
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    if config.agentkv_connector:
        transfer["kv_connector"] = "AgentKVConnector"
        transfer["kv_connector_module_path"] = "agentkv.connector"
    return transfer


def serving_dtype(config: LocalClusterConfig) -> str:
    """``config.dtype``, or the dtype that is fast and numerically safe on this CPU."""
    if config.dtype is not None:
        return config.dtype
    return default_dtype(read_cpu_info().limited_to(config.cpu_isa))


def _prepared_model(config: LocalClusterConfig, say: Progress) -> Path:
    return prepare_model(
        config.model,
        dtype=serving_dtype(config),
        cache_dir=config.model_cache_dir,
        progress=say,
    )


_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
_GIB = 1 << 30


def kv_cache_env(gib: float) -> dict[str, str]:
    """The environment that sizes a server's KV cache: whole GiB the way vLLM CPU documents
    (``VLLM_CPU_KVCACHE_SPACE``, an integer); a fraction goes by ``kv_cache_args`` instead."""
    return {_KV_CACHE_ENV: str(int(gib))} if float(gib).is_integer() else {}


def kv_cache_args(gib: float) -> tuple[str, ...]:
    """The server arguments that size a KV cache of a fraction of a GiB (none for whole GiB).

    >>> kv_cache_args(0.25), kv_cache_args(2)
    (('--kv-cache-memory-bytes', '268435456'), ())
    """
    if float(gib).is_integer():
        return ()
    return ("--kv-cache-memory-bytes", str(round(gib * _GIB)))


def context_args(config: LocalClusterConfig, *, model_path: Path) -> tuple[str, ...]:
    """The server arguments of ``config.max_model_len``: none within the model's own context;
    beyond it, YaRN rope scaling by the factor that reaches it (``--hf-overrides``).

    vLLM 0.32 reads a YaRN model's ``max_position_embeddings`` as already scaled (as
    Transformers does), so it is raised too, and ``rope_theta`` is kept: overriding the rope
    parameters replaces them whole, and a lost theta would quietly change every position.
    """
    args: tuple[str, ...] = ("--max-model-len", str(config.max_model_len))
    try:
        hf = json.loads((model_path / "config.json").read_text())
        native = int(hf["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return args  # not a prepared model folder: vLLM reads (and checks) it itself
    if config.max_model_len <= native:
        return args
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    overrides = {
        "max_position_embeddings": config.max_model_len,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": config.max_model_len / native,
            "original_max_position_embeddings": native,
            **({"rope_theta": theta} if theta is not None else {}),
        },
    }
    return (*args, "--hf-overrides", json.dumps(overrides, separators=(",", ":")))


STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
"""The local pair's ``--structured-outputs-config`` (see ``plan_servers``)."""


def plan_servers(config: LocalClusterConfig, *, model_path: Path) -> list[ServerPlan]:
    """Ports, cores, commands and environments for every server of the cluster."""
    cores = os.cpu_count() or 1
    dtype = serving_dtype(config)
    context = context_args(config, model_path=model_path)
    plans = []
    for name, role, index in config.servers:
        ports = config.server_ports(index)
        channels = config.side_channel_ports(index)
        offset = 0 if role == "prefill" else 1
        core = (2 * index + offset) % cores
        argv = (
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_path),
            "--served-model-name", config.model,
            "--host", config.host,
            "--port", str(ports[offset]),
            *context,
            "--dtype", dtype,
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(kv_transfer_config(role=role, config=config)),
            # Structured outputs without free whitespace: under a JSON schema SmolLM2 pads
            # with newlines and indentation (a one-call tool reply took 32 tokens, not 17,
            # and ran out of max_tokens). vLLM reads this from the server config only (the
            # request field of that name is ignored) and only for a named backend: xgrammar,
            # what "auto" picks for every schema agentkv sends.
            "--structured-outputs-config",
            json.dumps(STRUCTURED_OUTPUTS, separators=(",", ":")),
            *kv_cache_args(config.kv_cache_gib_of(role)),
            *config.extra_args,
        )
        env = dict(os.environ)
        # vLLM's CPU platform lets this variable override --kv-cache-memory-bytes: one of the
        # two, never both (and never the caller's own).
        env.pop(_KV_CACHE_ENV, None)
        env.update(kv_cache_env(config.kv_cache_gib_of(role)))
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(core),
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(channels[offset]),
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            # Agents pause between turns; keep their connections (uvicorn's default is 5 s).
            VLLM_HTTP_TIMEOUT_KEEP_ALIVE="75",
        )
        if config.quiet:
            env.update(quiet_env())
        if config.cpu_isa is not None:
            env.update(isa_env(config.cpu_isa, environ=env))
        plans.append(
            ServerPlan(
                role=role, pair=name, port=ports[offset], side_channel_port=channels[offset],
                core=core, argv=argv, env=env,
                log=config.log_dir / (f"{name}.log" if config.pool else f"{name}-{role}.log"),
            )
        )
    return plans


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _available_memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")


def check_preconditions(plans: list[ServerPlan], config: LocalClusterConfig) -> None:
    """Fail before starting anything: busy ports and too little memory get one clear line."""
    for plan in plans:
        for port, what in ((plan.port, "HTTP"), (plan.side_channel_port, "NIXL side-channel")):
            if not _port_free(config.host, port):
                raise StartupError(
                    f"{what} port {port} for {plan.pair} {plan.role} is already in use; "
                    "stop what holds it or pass --base-port / --base-side-channel-port"
                )
    needed = sum(_SERVER_MEMORY_GIB + config.kv_cache_gib_of(plan.role) for plan in plans)
    available = _available_memory_gib()
    if available < needed:
        raise StartupError(
            f"too little memory: {len(plans)} servers need about {needed:.1f} GiB, "
            f"{available:.1f} GiB available; start fewer pairs (--pairs) or lower --kv-cache-gib"
        )


def server_healthy(url: str, *, timeout_s: float = 2.0) -> bool:
    """Whether the vLLM server at ``url`` answers its ``/health`` with 200 (``agentkv status``)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:160] for line in text[-lines:])


def _servers(record: ClusterRecord) -> list[tuple[str, str, ServerRecord]]:
    return record.servers


def _read_record(config: LocalClusterConfig) -> ClusterRecord | None:
    if not config.cluster_file.exists():
        return None
    try:
        return ClusterRecord.read(config.cluster_file)
    except ConfigError:
        return None


def existing_cluster(config: LocalClusterConfig) -> ClusterRecord | None:
    """The cluster of an earlier ``up`` if all its servers are alive and healthy."""
    record = _read_record(config)
    if record is None:
        return None
    servers = _servers(record)
    if servers and all(pid_alive(s.pid) and server_healthy(s.url) for _, _, s in servers):
        return record
    return None


def start_cluster(config: LocalClusterConfig, *, progress: Progress | None = None) -> ClusterRecord:
    """Start every server, wait until all answer, write the cluster file.

    The cluster in ``config.cluster_file`` is reused when its servers are alive and healthy. When
    only some of them died (a crash, a test that killed one by pid), only those are started
    again, on their own ports, and the file is rewritten with their new pids; the live servers
    keep their caches and pinned KV. A restarted decode has lost its pins, so handles into it
    fail and the SDK recomputes; a restarted prefill pulls decode's pins as before.

    On any failure every process started here is stopped before the error is raised.
    """
    say = progress or (lambda _msg: None)
    record = _read_record(config)
    if record is not None:
        servers = _servers(record)
        dead = [(pair, role) for pair, role, server in servers if not pid_alive(server.pid)]
        if len(dead) < len(servers):
            return _heal(config, record, dead, say)
    model_path = _prepared_model(config, say)
    plans = plan_servers(config, model_path=model_path)
    check_preconditions(plans, config)
    say(f"serving {config.model} in {serving_dtype(config)} on {read_cpu_info().model}"
        + (f", limited to {config.cpu_isa}" if config.cpu_isa else ""))
    started = _launch(plans, config, say)
    if config.pool:
        record = ClusterRecord(
            model=config.model,
            dtype=serving_dtype(config),
            cpu_isa=config.cpu_isa,
            kv_recompute_threshold=config.kv_recompute_threshold,
            kv_cache_gib=config.kv_cache_gib,
            decode_kv_cache_gib=config.kv_cache_gib_of("decode"),
            max_model_len=config.max_model_len,
            **_tier_record(config),
            pool=tuple(
                PoolServerRecord(
                    name=plan.pair,
                    role=plan.role,
                    server=ServerRecord(url=plan.url, pid=process.pid, log=str(plan.log)),
                )
                for plan, process in started
            ),
        )
        record.write(config.cluster_file)
        return record
    record = ClusterRecord(
        model=config.model,
        dtype=serving_dtype(config),
        cpu_isa=config.cpu_isa,
        kv_recompute_threshold=config.kv_recompute_threshold,
        kv_cache_gib=config.kv_cache_gib,
        decode_kv_cache_gib=config.kv_cache_gib_of("decode"),
        max_model_len=config.max_model_len,
        **_tier_record(config),
        pairs=tuple(
            PairRecord(
                name=prefill.pair,
                prefill=ServerRecord(url=prefill.url, pid=p_proc.pid, log=str(prefill.log)),
                decode=ServerRecord(url=decode.url, pid=d_proc.pid, log=str(decode.log)),
            )
            for (prefill, p_proc), (decode, d_proc) in zip(started[::2], started[1::2], strict=True)
        ),
    )
    record.write(config.cluster_file)
    return record


def _launch(
    plans: list[ServerPlan], config: LocalClusterConfig, say: Progress
) -> list[tuple[ServerPlan, subprocess.Popen[bytes]]]:
    """Start ``plans`` and wait until all answer; stop them all if any fails."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    started: list[tuple[ServerPlan, subprocess.Popen[bytes]]] = []
    try:
        for plan in plans:
            with plan.log.open("wb") as log:
                process = subprocess.Popen(
                    plan.argv, env=plan.env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
            started.append((plan, process))
            _LAUNCHED[process.pid] = process
            say(f"started {plan.pair} {plan.role} pid {process.pid} on {plan.url} "
                f"(core {plan.core}, log {plan.log})")
        _wait_ready(started, config.startup_timeout_s, say)
    except BaseException:
        for _, process in started:
            _stop(process.pid)
        raise
    return started


def restart_plans(
    record: ClusterRecord, dead: list[tuple[str, str]], plans: list[ServerPlan], *, source: Path
) -> list[ServerPlan]:
    """The plans that start the ``dead`` (pair, role) servers of ``record`` again, same ports.

    A server the current configuration would not start at the same address (the cluster was
    started with other pairs or ports) is an error: healing must not change the cluster's shape.
    """
    by_role = {(plan.pair, plan.role): plan for plan in plans}
    urls = {(pair, role): server.url for pair, role, server in _servers(record)}
    chosen = []
    for key in dead:
        plan = by_role.get(key)
        if plan is None or plan.url != urls[key]:
            raise StartupError(
                f"{key[0]} {key[1]} in {source} ({urls[key]}) is not a server of this "
                "configuration (other --pairs or ports?); stop the cluster with `agentkv down` "
                "and start it again"
            )
        chosen.append(plan)
    return chosen


def _heal(
    config: LocalClusterConfig, record: ClusterRecord, dead: list[tuple[str, str]], say: Progress
) -> ClusterRecord:
    """Reuse ``record``'s live servers and start its ``dead`` ones again."""
    if not dead:
        sick = [
            f"{pair} {role} (pid {server.pid}, log {server.log})"
            for pair, role, server in _servers(record)
            if not server_healthy(server.url)
        ]
        if sick:
            raise StartupError(
                f"servers of {config.cluster_file} are running but not answering /health: "
                f"{', '.join(sick)}; wait for them to finish starting or run `agentkv down`"
            )
        say(f"reusing the running cluster in {config.cluster_file} "
            f"({len(record.servers)} servers)")
        return record
    for pair, role, server in _servers(record):
        if (pair, role) in dead:
            _reap(server.pid)
    model_path = _prepared_model(config, say)
    plans = restart_plans(
        record, dead, plan_servers(config, model_path=model_path), source=config.cluster_file
    )
    check_preconditions(plans, config)
    say(f"{len(plans)} server(s) of {config.cluster_file} died: "
        + ", ".join(f"{plan.pair} {plan.role}" for plan in plans) + "; starting them again")
    for plan in plans:  # keep the dead server's log: it says why it died
        if plan.log.exists():
            plan.log.replace(plan.log.with_suffix(".log.1"))
    pids = {(plan.pair, plan.role): process.pid for plan, process in _launch(plans, config, say)}
    record = record.with_pids(pids)
    record.write(config.cluster_file)
    return record


def _wait_ready(
    started: list[tuple[ServerPlan, subprocess.Popen[bytes]]], timeout_s: float, say: Progress
) -> None:
    begin = time.monotonic()
    pending = list(started)
    last_report = 0.0
    while pending:
        elapsed = time.monotonic() - begin
        for plan, process in list(pending):
            if process.poll() is not None:
                raise StartupError(
                    f"{plan.pair} {plan.role} exited with code {process.returncode} while "
                    f"starting; see {plan.log}: {_log_tail(plan.log, 3)}"
                )
            if server_healthy(plan.url, timeout_s=1.0):
                say(f"{plan.pair} {plan.role} ready after {elapsed:.0f} s")
                pending.remove((plan, process))
        if elapsed > timeout_s:
            names = ", ".join(f"{p.pair} {p.role} ({p.log})" for p, _ in pending)
            raise StartupError(f"servers not ready after {timeout_s:.0f} s: {names}")
        if pending and elapsed - last_report >= 15:
            last_report = elapsed
            plan = pending[0][0]
            say(f"waiting for {len(pending)} server(s), {elapsed:.0f} s: {_log_tail(plan.log)}")
        time.sleep(1.0)


def stop_cluster(config: LocalClusterConfig, *, progress: Progress | None = None) -> int:
    """Stop exactly the processes the cluster file names (by pid); return how many were alive."""
    say = progress or (lambda _msg: None)
    if not config.cluster_file.exists():
        say(f"no cluster file at {config.cluster_file}: nothing to stop")
        return 0
    record = ClusterRecord.read(config.cluster_file)
    stopped = 0
    for pair, role, server in _servers(record):
        if pid_alive(server.pid):
            stopped += 1
            ok = _stop(server.pid)
            say(f"stopped {pair} {role} pid {server.pid}" + ("" if ok else " (KILLED)"))
        else:
            _reap(server.pid)  # killed earlier (by pid, as the fault tests do)
    config.cluster_file.unlink(missing_ok=True)
    return stopped


def _stop(pid: int) -> bool:
    """Stop a server's process group by its pid; reap it if this process started it."""
    ok = stop_group(pid)
    _reap(pid)
    return ok


def _reap(pid: int) -> None:
    """Collect the exit of a server this process started and that is gone (stopped, or killed
    by pid as the fault tests do), so that no ``Popen`` outlives its process."""
    process = _LAUNCHED.pop(pid, None)
    if process is not None:
        process.wait()


def _tier_record(config: LocalClusterConfig) -> dict[str, Any]:
    tier_dir = config.resolved_tier_dir
    if tier_dir is None:
        return {}
    return {"tier_dir": str(tier_dir), "tier_budget_bytes": config.tier_budget_bytes}
