"""The local CPU prefill/decode pair that ``agentkv up`` starts, stops and describes."""
