"""How vLLM 0.32 keys prefix-cache blocks, and whether a tier keyed by those hashes is safe.

    .venv/bin/python benchmarks/kv_tier/block_hash.py

Evidence for the design study docs/design/kv-tier.md (issue 20). In-process (plus one child
process of this script), no server, no model, no files. With vLLM's default prefix-cache hash
(sha256 over pickle) and the CPU build's block size of 128 tokens, it shows:

- a ``vllm.v1.request.Request`` built with vLLM's own block hasher hashes only full blocks, and
  its ``block_hashes`` grow as output tokens are appended, so a finished turn's request holds
  hashes covering prompt + generated tokens (the tail of a partial block has none);
- the chain equals a six-line ``hashlib`` + ``pickle`` re-implementation;
- it is identical in another process (sha256's seed is fixed), but changes when
  ``PYTHONHASHSEED`` is set, which vLLM then uses as the seed;
- a request's ``cache_salt`` (agentkv's proxy sets one per principal) enters the first block
  only and, through the chain, changes every later hash: two principals never share a key.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

BLOCK = 128
PROMPT = list(range(1000, 1300))  # 300 tokens: 2 full blocks and a 44-token tail
GENERATED = list(range(5000, 5100))  # 100 generated tokens complete block 3


def vllm_chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """Block hashes vLLM computes for a request with these prompt tokens."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    request = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=salt,
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, sha256),
    )
    return [bytes(h) for h in request.block_hashes]


def reimplemented_chain(tokens: list[int]) -> list[bytes]:
    """The same chain without vLLM: sha256(pickle((parent, block tokens, extra keys)))."""

    def digest(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, chain = digest("vllm-none-hash"), []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = digest((parent, tuple(tokens[start : start + BLOCK]), None))
        chain.append(parent)
    return chain


def chain_in_child(env: dict[str, str]) -> list[bytes]:
    out = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True
    )
    return [bytes.fromhex(h) for h in out.stdout.split()]


def main() -> None:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    kv_cache_utils.init_none_hash(sha256)
    request = Request(
        request_id="turn",
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(max_tokens=len(GENERATED)),
        pooling_params=None,
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, sha256),
    )
    print(f"prompt {len(PROMPT)} tokens -> {len(request.block_hashes)} block hashes")
    request.append_output_token_ids(GENERATED)
    n_tokens = len(PROMPT) + len(GENERATED)
    print(
        f"after {len(GENERATED)} generated tokens ({n_tokens} in all) -> "
        f"{len(request.block_hashes)} block hashes; {n_tokens % BLOCK} tail tokens unhashed"
    )
    whole = [bytes(h) for h in request.block_hashes]
    print(
        "  equal to the chain of a prompt of all those tokens:",
        whole == vllm_chain(PROMPT + GENERATED),
    )

    chain = vllm_chain(PROMPT)
    print("vLLM chain == hashlib+pickle re-implementation:", chain == reimplemented_chain(PROMPT))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    print("same chain in another process:", chain_in_child(env) == chain)
    print(
        "another process with PYTHONHASHSEED=0 differs:",
        chain_in_child({**env, "PYTHONHASHSEED": "0"}) != chain,
    )
    salted = vllm_chain(PROMPT, salt="principal-a")
    other = vllm_chain(PROMPT, salt="principal-b")
    print(
        "cache_salt: every block differs from the unsalted chain:",
        all(a != b for a, b in zip(salted, chain, strict=True)),
        "; and between two salts:",
        all(a != b for a, b in zip(salted, other, strict=True)),
    )
    print("first hash (unsalted):", chain[0].hex()[:16])


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        print(" ".join(h.hex() for h in vllm_chain(PROMPT)))
    else:
        main()
