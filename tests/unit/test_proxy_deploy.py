"""The Kubernetes manifests in deploy/k8s run vLLM the way ``agentkv up`` does, and the proxy the
way its CLI parses: a change to either side that is not made to the other fails here."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentkv._client.cluster_spec import parse_spec
from agentkv.connector._plugin import plugin_env
from agentkv.local._config import LocalClusterConfig
from agentkv.local._launch import kv_transfer_config, plan_servers
from agentkv.proxy._cli import add_parser, config_from_args

yaml = pytest.importorskip("yaml")

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# Flags whose values belong to a deployment (which model, where it listens, how long a context,
# which dtype: the local pair picks bf16 or fp32 by the CPU it runs on, see local/_cpu.py).
DEPLOYMENT_FLAGS = {
    "--model", "--served-model-name", "--host", "--port", "--max-model-len", "--dtype"
}
# The local pair's tool calls go through structured outputs (no tool parser) with a 135M model,
# which pads free-whitespace JSON past max_tokens; GPU deployments parse tool calls natively and
# keep vLLM's "auto" backend (docs/proxy.md, "Tool calls").
LOCAL_ONLY_FLAGS = {"--structured-outputs-config"}
# What only the local CPU stack needs: vLLM's CPU backend, and an offline model cache.
LOCAL_ONLY_ENV = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE"}
# NIXL stages KV through host memory on the CPU build only; on GPUs it moves device memory.
LOCAL_ONLY_TRANSFER = {"kv_buffer_device"}
# Where the file tier lives and how big it may grow belong to a deployment: checked below to be
# one volume every prefill and decode server mounts at that path.
DEPLOYMENT_TIER = ("agentkv_tier_dir", "agentkv_tier_budget_bytes")
# A GPU recomputes a missing tail in well under the round trip of a pull, so deployments keep vLLM's
# default threshold; a CPU pair pulls whatever it lacks (docs/operations.md, "Recompute threshold").
GPU_RECOMPUTE_THRESHOLD = 64


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _workload(kind: str, component: str) -> dict[str, Any]:
    found = [
        doc
        for doc in _documents()
        if doc["kind"] == kind
        and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, (kind, component)
    return found[0]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs and bare ``--switch``es of a command line."""
    flags: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else None
            flags[arg] = None if following is None or following.startswith("--") else following
    return flags


def _local_plan(role: str):
    plans = plan_servers(LocalClusterConfig(), model_path=Path("/models/m"))
    return next(plan for plan in plans if plan.role == role)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_flags_match_agentkv_up(role):
    container = _container(_workload("StatefulSet", role))
    module = "vllm.entrypoints.openai.api_server"
    assert container["command"][-1] == module
    local = _flags(list(_local_plan(role).argv))
    deployed = _flags(container["args"])
    shared = set(local) - DEPLOYMENT_FLAGS - LOCAL_ONLY_FLAGS - {"--kv-transfer-config"}
    assert set(deployed) - DEPLOYMENT_FLAGS - {"--kv-transfer-config"} == shared
    for flag in shared:
        assert deployed[flag] == local[flag], flag
    assert set(deployed) >= DEPLOYMENT_FLAGS


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_transfer_config_matches_agentkv_up(role):
    container = _container(_workload("StatefulSet", role))
    deployed = json.loads(_flags(container["args"])["--kv-transfer-config"])
    local = kv_transfer_config(role=role, config=LocalClusterConfig())
    for key in LOCAL_ONLY_TRANSFER:
        local.pop(key, None)
    extra = deployed["kv_connector_extra_config"]
    for key in DEPLOYMENT_TIER:
        assert key in local["kv_connector_extra_config"], key
        local["kv_connector_extra_config"][key] = extra[key]
    assert local["kv_connector_extra_config"]["kv_recompute_threshold"] == 1
    local["kv_connector_extra_config"]["kv_recompute_threshold"] = GPU_RECOMPUTE_THRESHOLD
    assert deployed == local
    assert deployed["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")
    assert deployed["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True


def test_every_vllm_server_mounts_the_one_shared_tier_volume_at_its_tier_dir():
    """A prefill loads what any decode persisted: the same ReadWriteMany claim, at the path the
    connector is told, in both pools."""
    (claim,) = [d for d in _documents() if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for role in ("prefill", "decode"):
        workload = _workload("StatefulSet", role)
        container = _container(workload)
        config = json.loads(_flags(container["args"])["--kv-transfer-config"])
        tier_dir = config["kv_connector_extra_config"]["agentkv_tier_dir"]
        (volume,) = [
            v for v in workload["spec"]["template"]["spec"]["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]
        ]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts[volume["name"]] == tier_dir


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_environment_matches_agentkv_up(role):
    env = {e["name"]: e for e in _container(_workload("StatefulSet", role))["env"]}
    plan = _local_plan(role)
    set_by_agentkv = {k for k, v in plan.env.items() if os.environ.get(k) != v}
    for name in set_by_agentkv - LOCAL_ONLY_ENV:
        assert name in env, f"{name} is set by `agentkv up` but not in the {role} manifest"
    for name, value in plugin_env({}).items():
        assert env[name]["value"] == value
    # Each server advertises its own pod IP in the handles and params it hands out.
    host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert host == "status.podIP"


def test_the_cluster_file_names_every_server_of_the_pools():
    prefill = _workload("StatefulSet", "prefill")
    decode = _workload("StatefulSet", "decode")
    config_map = next(d for d in _documents() if d["kind"] == "ConfigMap")
    spec = json.loads(config_map["data"]["cluster.json"])
    pairs, model, extra = parse_spec(spec, "cluster.json")
    served = _flags(_container(prefill)["args"])["--served-model-name"]
    assert model == served == _flags(_container(decode)["args"])["--served-model-name"]
    namespace = prefill["metadata"]["namespace"]

    def urls(workload):
        service = workload["spec"]["serviceName"]
        port = _flags(_container(workload)["args"])["--port"]
        return [
            f"http://{service}-{i}.{service}.{namespace}.svc.cluster.local:{port}"
            for i in range(workload["spec"]["replicas"])
        ]

    # A pool, scaled separately: every prefill pod in the prefill list, every decode pod a "pair".
    assert list(extra["prefill_pool"].values()) == urls(prefill)
    assert [pair.decode for pair in pairs] == urls(decode)
    assert prefill["spec"]["replicas"] != decode["spec"]["replicas"]


def _proxy_args():
    container = _container(_workload("Deployment", "proxy"))
    parser = argparse.ArgumentParser(prog="agentkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return container, parser.parse_args(container["args"])


def test_the_proxy_replicas_share_sessions_in_the_deployed_redis():
    proxy = _workload("Deployment", "proxy")
    assert proxy["spec"]["replicas"] == 3
    _, args = _proxy_args()
    args.api_keys = None  # the key file exists only in the cluster
    config = config_from_args(args)
    redis = _workload("Deployment", "redis")
    service = next(
        d
        for d in _documents()
        if d["kind"] == "Service"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    )
    port = service["spec"]["ports"][0]["port"]
    namespace = redis["metadata"]["namespace"]
    host = f"{service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert config.state is not None
    assert config.state.startswith(f"redis://{host}:{port}/")
    assert _container(redis)["ports"][0]["containerPort"] == service["spec"]["ports"][0][
        "targetPort"
    ]
    assert redis["spec"]["replicas"] == 1  # the store's scripts need one primary


@pytest.mark.parametrize("component", ["proxy", "redis"])
def test_every_deployment_has_readiness_and_liveness_probes(component):
    container = _container(_workload("Deployment", component))
    assert container["readinessProbe"]
    assert container["livenessProbe"]


def test_the_proxy_manifest_parses_with_the_proxy_cli():
    container, args = _proxy_args()
    assert args.command == "proxy"
    assert args.cluster_file == "/etc/agentkv/cluster.json"
    assert args.api_keys, "a deployed proxy authenticates its clients"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(args.cluster_file).parent) in mounts
    assert str(Path(args.api_keys).parent) in mounts
    args.api_keys = None  # the key file exists only in the cluster
    config = config_from_args(args)
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert (config.host, config.port) == ("0.0.0.0", port)
