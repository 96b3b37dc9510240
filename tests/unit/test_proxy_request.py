"""Request parsing, config, API keys, error mapping and metrics of the proxy: no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from agentkv import (
    BadRequestError,
    ConfigError,
    ConnectError,
    InvalidMessageError,
    NoHealthyPairError,
    RequestTimeoutError,
    ServerError,
)
from agentkv.proxy import ApiKeys, ProxyConfig
from agentkv.proxy._entry import split_key, store_key
from agentkv.proxy._errors import ProxyError
from agentkv.proxy._metrics import ProxyMetrics
from agentkv.proxy._request import parse_chat_request, session_id_from

MESSAGES = [{"role": "user", "content": "hi"}]


def parse(**body):
    return parse_chat_request(
        {"model": "m", "messages": MESSAGES, **body}, model="m", default_max_tokens=64
    )


def refusal(**body) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        parse(**body)
    return info.value


def test_client_kv_transfer_params_are_refused():
    """A client's kv_transfer_params could address KV blocks it does not own."""
    error = refusal(kv_transfer_params={"remote_block_ids": [[1, 2]]})
    assert error.status == 400
    assert error.param == "kv_transfer_params"
    assert error.code == "forbidden_parameter"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template", "{{ messages }}"),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("prompt_token_ids", [1, 2]),
        ("cache_salt", "x"),
        ("echo", True),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("add_special_tokens", True),
        ("truncate_prompt_tokens", 10),
        ("reasoning_effort", "low"),
        ("documents", [{"title": "t", "text": "x"}]),
        ("vllm_xargs", {"a": 1}),
        ("ec_transfer_params", {}),
        ("use_beam_search", True),
        ("n", 2),
    ],
)
def test_fields_that_change_the_prompt_or_address_kv_are_refused(field, value):
    """Before: chat_template etc. were "unsupported", n=2 "only 1"; now each says why."""
    error = refusal(**{field: value})
    assert (error.status, error.param, error.code) == (400, field, "forbidden_parameter")
    assert field in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", False), ("add_generation_prompt", True), ("n", 1), ("chat_template", None)],
)
def test_harmless_defaults_of_refused_fields_are_accepted(field, value):
    assert field not in parse(**{field: value}).extra


def test_every_field_vllm_accepts_is_passed_ignored_or_refused_never_unknown():
    """vLLM 0.32's ChatCompletionRequest fields: none gets 'unsupported parameter'."""
    passed = {
        "frequency_penalty": 0.1, "logit_bias": {"5": 1.0}, "presence_penalty": 0.1,
        "response_format": {"type": "text"}, "seed": 1, "stop": ["x"], "top_p": 0.9,
        "include_reasoning": True, "thinking_token_budget": 5, "top_k": 3, "min_p": 0.1,
        "repetition_penalty": 1.1, "watermarking": False, "length_penalty": 1.0,
        "stop_token_ids": [3], "include_stop_str_in_output": True, "ignore_eos": False,
        "min_tokens": 1, "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "allowed_token_ids": [1, 2], "bad_words": ["x"], "structured_outputs": {"json": {}},
        "priority": 0, "repetition_detection": None, "stream_interval": 1,
    }  # fmt: skip
    ignored = {
        "user": "u", "request_id": "r", "return_token_ids": True, "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True, "return_token_offsets": True,
        "return_prompt_text": True, "return_mm_kwargs": True, "routed_experts_prompt_start": 0,
        "logprob_token_ids": [1], "metadata": {}, "store": False, "service_tier": "auto",
        "safety_identifier": "s", "prompt_cache_retention": "24h", "modalities": ["text"],
        "some_future_field": 1,
    }  # fmt: skip
    request = parse(**passed, **ignored, conversation_id="c1", session_id="s1")
    assert dict(request.extra) == passed
    assert set(request.ignored) == set(ignored)


def test_sampling_fields_pass_to_decode_and_openai_only_fields_are_ignored_with_a_warning():
    with capture_logs() as logs:
        request = parse(top_p=0.9, seed=3, stop=["\n"], user="u1", store=False, metadata={})
    assert dict(request.extra) == {"top_p": 0.9, "seed": 3, "stop": ["\n"]}
    [event] = [e for e in logs if e["event"] == "agentkv.proxy.fields_ignored"]
    assert event["fields"] == ["metadata", "store", "user"]


def test_max_completion_tokens_wins_and_the_default_fills_in():
    assert parse().max_tokens == 64
    assert parse(max_tokens=10).max_tokens == 10
    assert parse(max_tokens=10, max_completion_tokens=20).max_tokens == 20


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"logprobs": True}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"prompt_cache_key": 3}, "prompt_cache_key"),
    ],
)
def test_bad_values_get_400_naming_the_parameter(body, param):
    error = refusal(**body)
    assert (error.status, error.param) == (400, param)


def test_a_developer_message_is_the_system_message_vllm_renders_for_it():
    """Before: 400 ("unknown role 'developer'"), where OpenAI and vLLM accept it. vLLM renders
    it as a system message for a template without a developer role."""
    developer = [{"role": "developer", "content": "Be terse."}, *MESSAGES]
    system = [{"role": "system", "content": "Be terse."}, *MESSAGES]
    assert parse(messages=developer).messages == parse(messages=system).messages


def test_developer_and_system_messages_merge_into_one_first_as_vllm_merges_them():
    messages = [
        {"role": "system", "content": "You are a bot."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
    ]
    request = parse(messages=messages)
    assert [m.to_openai() for m in request.messages] == [
        {"role": "system", "content": "You are a bot.\n\nBe terse."},
        {"role": "user", "content": "hi"},
    ]
    # Without a developer message vLLM merges nothing, and neither does the proxy.
    plain = [messages[0], messages[1], {"role": "system", "content": "Be terse."}]
    assert [m.role for m in parse(messages=plain).messages] == ["system", "user", "system"]


def test_a_prompt_cache_key_past_openai_s_64_characters_is_a_400_as_openai_says_it():
    """Before: any length was taken (it names a placement and an index entry per request)."""
    assert parse(prompt_cache_key="k" * 64).prompt_cache_key == "k" * 64
    error = refusal(prompt_cache_key="k" * 65)
    assert (error.status, error.param, error.code) == (
        400,
        "prompt_cache_key",
        "string_above_max_length",
    )
    assert "maximum length 64, but got a string with length 65" in error.message


def test_another_model_is_404_and_no_model_means_the_served_one():
    assert refusal(model="gpt-4o").status == 404
    request = parse_chat_request({"messages": MESSAGES}, model="m", default_max_tokens=5)
    assert request.max_tokens == 5


def test_streams_read_include_usage():
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse(stream=True).include_usage


def test_the_session_id_comes_from_the_header_then_conversation_id_then_session_id():
    """prompt_cache_key names a shared prefix, not a conversation: it is no session key."""
    request = parse(prompt_cache_key="pck", conversation_id="conv", session_id="sid")
    assert session_id_from("from-header", request) == "from-header"
    assert session_id_from(None, request) == "conv"
    assert session_id_from(None, parse(session_id="sid", prompt_cache_key="pck")) == "sid"
    assert session_id_from(None, parse(prompt_cache_key="pck")) is None
    assert session_id_from(None, parse()) is None
    for bad in ("", "   ", "x" * 257, "a\nb"):
        with pytest.raises(ProxyError):
            session_id_from(bad, request)


def test_api_keys_map_keys_to_principals():
    keys = ApiKeys.parse("alice sk-a\n\n# comment\nsk-b  # trailing comment\n")
    assert keys.principal("sk-a") == "alice"
    assert keys.principal(
        "sk-b",
    ).startswith("key-")
    assert keys.principal("sk-c") is None


@pytest.mark.parametrize("text", ["", "# only comments\n", "a b c\n", "k1\nk1\n", "x k1\nx k2\n"])
def test_bad_api_key_files_are_config_errors(text):
    with pytest.raises(ConfigError):
        ApiKeys.parse(text)


def test_api_key_file_from_disk(tmp_path):
    path = tmp_path / "keys"
    path.write_text("bob sk-bob\n")
    assert ApiKeys.from_file(path).principal("sk-bob") == "bob"
    with pytest.raises(ConfigError):
        ApiKeys.from_file(tmp_path / "missing")


@pytest.mark.parametrize(
    "bad",
    [
        {"port": -1},
        {"session_idle_timeout_s": 0},
        {"max_sessions": 0},
        {"max_body_bytes": 10},
        {"default_max_tokens": 0},
        {"sweep_interval_s": 0},
    ],
)
def test_config_values_are_checked(bad):
    with pytest.raises(ConfigError):
        ProxyConfig(**bad)


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (InvalidMessageError("empty"), 400),
        (
            BadRequestError(
                "x", status_code=400, response_body='{"error": {"message": "too long"}}'
            ),
            400,
        ),
        (ServerError("x", status_code=503, url="http://10.0.0.1:8000"), 502),
        (RequestTimeoutError("x", url="http://10.0.0.1:8000"), 504),
        (ConnectError("x", url="http://10.0.0.1:8000"), 502),
        (NoHealthyPairError("none"), 503),
        (RuntimeError("bug"), 500),
    ],
)
def test_errors_map_to_statuses_without_internal_urls(exc, status):
    error = ProxyError.from_exception(exc)
    assert error.status == status
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert "10.0.0.1" not in body["message"]


def test_an_upstream_400_keeps_vllms_message():
    exc = BadRequestError(
        "prefill leg failed",
        status_code=400,
        url="http://p:8000/v1/chat/completions",
        response_body='{"error": {"message": "maximum context length is 8192 tokens"}}',
    )
    assert ProxyError.from_exception(exc).message == "maximum context length is 8192 tokens"


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_render_in_prometheus_text_format():
    metrics = ProxyMetrics()
    metrics.bind(
        sessions=lambda: 3,
        pair_sessions=lambda: {"pair-0": 2},
        prefill_tokens=lambda: {"p1": 4096},
    )
    metrics.requests.labels("chat", "200").inc()
    metrics.request_seconds.labels("false").observe(0.02)
    metrics.reused_tokens.inc(128)
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    samples = _samples(text)
    assert (
        samples["agentkv_proxy_requests_total", frozenset({("endpoint", "chat"), ("code", "200")})]
        == 1
    )
    duration = "agentkv_proxy_request_duration_seconds"
    assert samples[f"{duration}_bucket", frozenset({("stream", "false"), ("le", "0.025")})] == 1
    assert samples[f"{duration}_bucket", frozenset({("stream", "false"), ("le", "0.01")})] == 0
    assert samples[f"{duration}_count", frozenset({("stream", "false")})] == 1
    assert samples["agentkv_proxy_reused_tokens_total", frozenset()] == 128
    assert samples["agentkv_proxy_sessions", frozenset()] == 3
    assert samples["agentkv_proxy_pair_sessions", frozenset({("pair", "pair-0")})] == 2
    assert (
        samples["agentkv_proxy_prefill_outstanding_tokens", frozenset({("prefill", "p1")})] == 4096
    )
    assert "# TYPE agentkv_proxy_ttft_seconds histogram" in text
    assert metrics.value("agentkv_proxy_reused_tokens_total") == 128
    assert metrics.value("agentkv_proxy_sessions_closed_total", reason="idle") == 0


def test_metrics_keep_every_name_the_proxy_has_always_exported():
    metrics = ProxyMetrics()
    metrics.bind(sessions=lambda: 0, pair_sessions=dict)
    names = {family.name for family in text_string_to_metric_families(metrics.render()[0].decode())}
    assert {
        "agentkv_proxy_requests",
        "agentkv_proxy_request_duration_seconds",
        "agentkv_proxy_overhead_seconds",
        "agentkv_proxy_ttft_seconds",
        "agentkv_proxy_turns",
        "agentkv_proxy_forks",
        "agentkv_proxy_echo_matches",
        "agentkv_proxy_prompt_tokens",
        "agentkv_proxy_reused_tokens",
        "agentkv_proxy_ideal_reused_tokens",
        "agentkv_proxy_generated_tokens",
        "agentkv_proxy_sessions_opened",
        "agentkv_proxy_sessions_closed",
        "agentkv_proxy_sessions",
        "agentkv_proxy_pair_sessions",
        "agentkv_proxy_prefill_outstanding_tokens",
    } <= names


def test_two_apps_in_one_process_never_share_metrics():
    first, second = ProxyMetrics(), ProxyMetrics()
    first.forks.inc()
    first.sessions_closed.labels("idle").inc()
    assert first.value("agentkv_proxy_forks_total") == 1
    assert second.value("agentkv_proxy_forks_total") == 0
    assert second.value("agentkv_proxy_sessions_closed_total", reason="idle") == 0


def test_metrics_speak_openmetrics_to_a_scraper_that_asks_for_it():
    metrics = ProxyMetrics()
    metrics.forks.inc()
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    assert b"agentkv_proxy_forks_total 1.0" in body


@given(st.text(), st.text())
def test_store_keys_are_unambiguous_whatever_the_principal_and_session_id_hold(principal, sid):
    key = store_key(principal, sid)
    assert split_key(key) == (principal, sid)


def test_agents_known_fields_are_quiet_and_unknown_ones_warned_about_once():
    """Codex sends client_metadata on every request: no warning; an unknown field is warned
    about the first time only."""
    from agentkv.proxy._ignored import IgnoredFields

    fields = IgnoredFields()
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "client_metadata": {"x": 1}, "user": "u", "metadata": {}, "store": False,
    }
    with capture_logs() as logs:
        for _ in range(2):
            parse_chat_request(body, model="m", default_max_tokens=8, ignored_fields=fields)
            parse_chat_request(
                {**body, "frobnicate": 1}, model="m", default_max_tokens=8, ignored_fields=fields
            )
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["fields"] for e in warnings] == [["frobnicate"]]
