"""``agentkv up --long-context`` / ``--max-model-len``: YaRN rope scaling past the model's own
window, recorded in the cluster file, read back by the SDK."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv import ConfigError
from agentkv.cli import _local_config, build_parser
from agentkv.local._config import ClusterRecord, LocalClusterConfig, PairRecord, ServerRecord
from agentkv.local._launch import plan_servers

# SmolLM2-135M's own config, as prepared: an 8k window, theta 100000.
_HF_CONFIG = {
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_HF_CONFIG))
    return folder


def _argv(config: LocalClusterConfig, model: Path) -> list[str]:
    plans = plan_servers(config, model_path=model)
    windows = {p.argv[p.argv.index("--max-model-len") : p.argv.index("--dtype")] for p in plans}
    assert len(windows) == 1  # prefill and decode alike
    return list(plans[0].argv)


def test_the_models_own_window_needs_no_rope_scaling(model: Path, tmp_path: Path) -> None:
    argv = _argv(LocalClusterConfig(cluster_file=tmp_path / "c.json"), model)
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert "--hf-overrides" not in argv


def test_a_longer_window_scales_rope_with_yarn_and_keeps_theta(model: Path, tmp_path: Path) -> None:
    """vLLM 0.32 takes a YaRN model's max_position_embeddings as already scaled; a rope
    override without the model's theta would silently fall back to another."""
    argv = _argv(LocalClusterConfig(cluster_file=tmp_path / "c.json", max_model_len=32768), model)
    assert argv[argv.index("--max-model-len") + 1] == "32768"
    overrides = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert overrides == {
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 100000.0,
        },
    }


def test_long_context_is_a_32k_window_with_room_for_its_kv(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    args = parse(["up", "--long-context", "--cluster-file", str(tmp_path / "c.json")])
    config = _local_config(args)
    assert (config.max_model_len, config.kv_cache_gib) == (32768, 2)
    args = parse(["up", "--long-context", "--kv-cache-gib", "3"])
    assert _local_config(args).kv_cache_gib == 3
    with pytest.raises(ConfigError, match="not both"):
        _local_config(parse(["up", "--long-context", "--max-model-len", "16384"]))


def test_the_cluster_file_records_the_window_and_the_sdk_reads_it(tmp_path: Path) -> None:
    server = ServerRecord(url="http://127.0.0.1:1", pid=1, log="")
    record = ClusterRecord(
        model="m", pairs=(PairRecord(name="p", prefill=server, decode=server),),
        max_model_len=32768,
    )
    path = tmp_path / "c.json"
    record.write(path)
    assert json.loads(path.read_text())["max_model_len"] == 32768
    assert ClusterRecord.read(path).max_model_len == 32768
    from agentkv import Cluster

    with Cluster.from_file(path) as cluster:
        assert cluster._pool.max_model_len == 32768
