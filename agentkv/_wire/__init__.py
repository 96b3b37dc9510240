"""Bytes on the wire, no session state: JSON, the kv_transfer_params handoff, the hints
and lease routes agentkv's connector understands, the request-field table, HTTP helpers."""
