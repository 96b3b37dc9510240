"""Let vLLM CPU servers load their own compile cache instead of compiling again at every start.

vLLM 0.32 saves the model's AOT-compiled forward after the first start
(``~/.cache/vllm/torch_compile_cache/torch_aot_compile/<hash>/rank_0_0/model``) and tries to load
it at the next. On the CPU backend the load always fails and the model is compiled again (about
40-90 s of every start on 2 cores), with this warning in the server log::

    Compiling model again due to a load failure from .../rank_0_0/model,
    reason: 'function' object has no attribute 'finalize_loading'

The cause is in ``vllm/compilation/decorators.py`` (``_try_load_aot_compiled_fn``): after loading
it calls ``loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)``, a method of vLLM's
own ``VllmSerializableFunction`` (what the ``VLLM_COMPILE`` mode of GPU servers produces). The CPU
platform switches to ``DYNAMO_TRACE_ONCE`` with torch's plain ``"inductor"`` backend
(``platforms/cpu.py``), whose compiled artifact is a plain function: it needs no finalizing (its
inductor kernels load from ``TORCHINDUCTOR_CACHE_DIR``, which vLLM points into the same cache
folder), but it lacks the method, so the load raises and vLLM falls back to compiling.

The fix gives such an artifact a no-op ``finalize_loading``. Everything else about the load stays
vLLM's: the cache key, the check that no traced source file changed, the fallback to compiling
when anything else goes wrong. Artifacts that have the method (every ``VllmSerializableFunction``)
are untouched, so the patch is a no-op on GPU servers.
"""

from __future__ import annotations

import functools
from typing import Any

_applied = False


def _no_finalizing_needed(_vllm_config: Any) -> None:
    """A plain inductor artifact is complete once loaded."""


def apply() -> None:
    """Wrap ``torch.compiler.load_compiled_function`` once per process."""
    global _applied  # noqa: PLW0603 - a process-wide, idempotent switch
    if _applied:
        return
    _applied = True
    import torch.compiler

    original = torch.compiler.load_compiled_function

    @functools.wraps(original)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = original(*args, **kwargs)
        complete_artifact(loaded)
        return loaded

    torch.compiler.load_compiled_function = load_compiled_function


def complete_artifact(loaded: Any) -> None:
    """Give ``loaded``'s compiled artifact the no-op ``finalize_loading`` vLLM calls, if missing.

    >>> class Artifact: ...
    >>> class Loaded:
    ...     class _artifacts:
    ...         compiled_fn = Artifact()
    >>> loaded = Loaded()
    >>> complete_artifact(loaded)
    >>> loaded._artifacts.compiled_fn.finalize_loading(None) is None
    True
    """
    artifacts = getattr(loaded, "_artifacts", None)
    compiled = getattr(artifacts, "compiled_fn", None)
    if compiled is not None and not hasattr(compiled, "finalize_loading"):
        compiled.finalize_loading = _no_finalizing_needed
