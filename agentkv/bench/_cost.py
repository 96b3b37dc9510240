"""A first-order cost model of a turn's TTFT, with and without pulling decode's KV back.

For a turn whose prompt has ``L`` tokens, ``a`` of them new since the previous turn's prompt and
output (tool result, instruction, template tokens)::

    ttft_cold = fixed + F(new=L, cached=0) / R
    ttft_pull = fixed + pull_setup + (L - a) * kv_bytes_per_token / B + F(new=a, cached=L-a) / R

``F`` is prefill FLOPs: ``2 * non_embedding_params`` per new token for the linear layers (vLLM
computes logits for the last position only) plus causal attention, ``4 * layers * q_width`` per
(new token, earlier token) pair. ``R`` is the prefill instance's effective FLOP rate, ``B`` the
link's effective bandwidth, ``fixed`` what every turn pays (scheduling, the P->D handoff, decode's
first step) and ``pull_setup`` what a pull adds besides moving bytes. The model ignores overlap of
the pull with compute and decode-side prefix hits, both of which only shrink the D leg.

>>> qwen = QWEN3_32B
>>> qwen.kv_bytes_per_token  # bf16 K and V, 64 layers, 8 KV heads of 128
262144
>>> round(qwen.prefill_flops(new=1, cached=0) / 1e9, 1)  # ~2 x 31.2B
62.4
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "P5EN_AS_PUBLISHED",
    "P5EN_EFA_HALF_RATE",
    "P5EN_EFA_LINE_RATE",
    "QWEN3_32B",
    "SMOLLM2_135M",
    "Link",
    "ModelSpec",
    "Prediction",
    "predict",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What prefill cost and KV size depend on (from the model's config)."""

    name: str
    non_embedding_params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    def prefill_flops(self, *, new: int, cached: int) -> float:
        """FLOPs to prefill ``new`` tokens after ``cached`` tokens whose KV is already present."""
        linear = 2.0 * self.non_embedding_params * new
        pairs = new * cached + new * (new + 1) / 2  # causal: token i attends to i earlier ones
        attention = 4.0 * self.layers * self.q_heads * self.head_dim * pairs
        return linear + attention


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A prefill instance and its link to decode, as the model sees them."""

    name: str
    flops_per_s: float
    """Effective prefill FLOP rate (peak x utilization)."""
    bytes_per_s: float
    """Effective bandwidth of a decode -> prefill KV read."""
    fixed_s: float
    """Paid by every turn: routing, scheduling, the P->D handoff, decode's first step."""
    pull_setup_s: float
    """Added by a pull besides moving bytes (request bookkeeping, the read's completion)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Prediction:
    prompt_tokens: int
    new_tokens: int
    ttft_cold_s: float
    ttft_pull_s: float

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_pull_s


def predict(model: ModelSpec, link: Link, *, prompt_tokens: int, new_tokens: int) -> Prediction:
    """TTFT of one turn with prefill cold and with decode's KV pulled back."""
    if not 0 < new_tokens <= prompt_tokens:
        raise ValueError("need 0 < new_tokens <= prompt_tokens")
    reused = prompt_tokens - new_tokens
    cold = link.fixed_s + model.prefill_flops(new=prompt_tokens, cached=0) / link.flops_per_s
    pull = (
        link.fixed_s
        + link.pull_setup_s
        + reused * model.kv_bytes_per_token / link.bytes_per_s
        + model.prefill_flops(new=new_tokens, cached=reused) / link.flops_per_s
    )
    return Prediction(
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, ttft_cold_s=cold, ttft_pull_s=pull
    )


# Qwen3-32B (model card / config.json): 32.8B parameters, 31.2B without embeddings, 64 layers,
# 64 query heads and 8 KV heads (GQA) of 128.
QWEN3_32B = ModelSpec(
    name="Qwen3-32B", non_embedding_params=31.2e9, layers=64, q_heads=64, kv_heads=8, head_dim=128
)
# SmolLM2-135M (the local model's config.json): 30 layers of 576 wide, 9 query / 3 KV heads of
# 64, MLP 1536, tied embeddings: 30 x (576 x 1536 attention + 3 x 576 x 1536 MLP) = 106.2M.
SMOLLM2_135M = ModelSpec(
    name="SmolLM2-135M", non_embedding_params=106.2e6, layers=30, q_heads=9, kv_heads=3, head_dim=64
)

_H200_BF16_DENSE = 989e12  # FLOP/s per GPU
_P5EN_GPUS = 8

# One p5en.48xlarge per role (8x H200, TP8), 16 EFA NICs of 200 Gb/s = 400 GB/s per instance.
#
# Fitted to the published Qwen3-32B run (vLLM blog 2026-10-12, 1P1D p5en, prefix caching off on P):
# cold prefill 153 ms at 2k and 744 ms at 24k give R = 3.44 PFLOP/s (43% MFU) and 115 ms of
# per-request prefill overhead; TTFT adds ~20 ms to prefill. Prefill with the pull, 128 ms at 2k
# and 414 ms at 24k, then gives ~21 GB/s for the whole D->P read path (5% of EFA's line rate:
# vLLM's small KV blocks make many small reads) and no further per-pull cost.
P5EN_AS_PUBLISHED = Link(
    name="p5en 1P1D, EFA, as published",
    flops_per_s=3.44e15,
    bytes_per_s=20.8e9,
    fixed_s=0.135,
    pull_setup_s=0.0,
)
# The same prefill, the pull at half of EFA's line rate (larger blocks or batched descriptors).
P5EN_EFA_HALF_RATE = Link(
    name="p5en 1P1D, EFA at 50% of line rate",
    flops_per_s=3.44e15,
    bytes_per_s=200e9,
    fixed_s=0.135,
    pull_setup_s=0.0,
)
# An upper bound: EFA at line rate, 40% MFU, no per-request overhead at all.
P5EN_EFA_LINE_RATE = Link(
    name="p5en 1P1D, EFA at line rate, no overhead",
    flops_per_s=0.40 * _P5EN_GPUS * _H200_BF16_DENSE,
    bytes_per_s=400e9,
    fixed_s=0.0,
    pull_setup_s=0.0,
)
