"""`sluice serve` flags and `SLUICE_*` variables -> ServerConfig (service/config.py): names from docs/architecture.md §9."""
from __future__ import annotations

import dataclasses

import pytest
import trustme

from service.config import (
    ServerConfig,
    build_parser,
    env_var,
    flag_actions,
    parse_config,
)

DESIGN_FLAGS = [
    "--model", "--host", "--port", "--dtype", "--device", "--block-size", "--num-kv-blocks", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--scheduling", "--no-prefix-caching",
    "--long-prefill-token-threshold", "--max-num-partial-prefills", "--pin-system-prompt", "--served-model-name",
    "--api-key", "--allowed-origins", "--max-connections", "--max-inflight-per-connection",
]


def test_design_flags_exist_and_map_one_to_one() -> None:
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert set(DESIGN_FLAGS) <= options
    dests = {a.dest for a in build_parser()._actions} - {"help"}
    assert dests == {f.name for f in dataclasses.fields(ServerConfig)}


def test_defaults_and_serve_word() -> None:
    assert parse_config([], {}) == ServerConfig()
    assert parse_config(["serve"], {}) == ServerConfig()
    c = ServerConfig()
    assert (c.host, c.port, c.api_key, c.prefix_caching) == ("127.0.0.1", 8000, None, True)
    assert c.engine_kwargs() == {"enable_prefix_caching": True, "prefix_store": True,  # the engine keeps its defaults
                                 "speculative_adaptive": True, "enforce_eager": True, "async_output_proc": False,
                                 "async_scheduling": False}
    assert parse_config(["--no-enforce-eager"], {}).engine_kwargs()["enforce_eager"] is False
    assert parse_config([], {"SLUICE_ENFORCE_EAGER": "0"}).engine_kwargs()["enforce_eager"] is False


def test_flags(tmp_path) -> None:
    prompt = tmp_path / "system.txt"
    prompt.write_text("You are terse.")
    c = parse_config(["serve", "--port", "9000", "--no-prefix-caching", "--max-num-seqs", "8", "--dtype", "float32",
                      "--allowed-origins", "http://a.example, http://b.example", "--allowed-origins", "http://c.example",
                      "--pin-system-prompt", str(prompt), "--max-connections", "10", "--scheduling", "static"], {})
    assert c.port == 9000 and not c.prefix_caching and c.max_connections == 10
    assert c.allowed_origins == ("http://a.example", "http://b.example", "http://c.example")
    assert c.pin_system_prompt == (str(prompt),)
    assert c.engine_kwargs() == {"max_num_seqs": 8, "dtype": "float32", "scheduling": "static",
                                 "enable_prefix_caching": False, "prefix_store": True, "speculative_adaptive": True,
                                 "enforce_eager": True, "async_output_proc": False, "async_scheduling": False}


def test_api_key_from_env_and_flag_wins() -> None:
    assert parse_config([], {"SLUICE_API_KEY": "from-env"}).api_key == "from-env"
    assert parse_config(["--api-key", "flag"], {"SLUICE_API_KEY": "from-env"}).api_key == "flag"
    assert parse_config([], {"SLUICE_API_KEY": ""}).api_key is None


def test_every_flag_has_a_variable(tmp_path) -> None:
    prompt_a, prompt_b = tmp_path / "a.txt", tmp_path / "b.txt"
    prompt_a.write_text("A")
    prompt_b.write_text("B")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_pem, cert_pem, ca_pem = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    ca.cert_pem.write_to_path(str(ca_pem))
    env = {
        "SLUICE_MODEL": "/models/m", "SLUICE_DTYPE": "bfloat16", "SLUICE_DEVICE": "cuda", "SLUICE_BLOCK_SIZE": "32",
        "SLUICE_NUM_KV_BLOCKS": "100", "SLUICE_MAX_NUM_SEQS": "8", "SLUICE_MAX_NUM_BATCHED_TOKENS": "512",
        "SLUICE_MAX_MODEL_LEN": "1024", "SLUICE_SCHEDULING": "static", "SLUICE_PREFIX_CACHING": "false",
        "SLUICE_LONG_PREFILL_TOKEN_THRESHOLD": "64", "SLUICE_MAX_NUM_PARTIAL_PREFILLS": "2", "SLUICE_SEED": "7",
        "SLUICE_ITL_SLO_MS": "150",
        "SLUICE_PIN_SYSTEM_PROMPT": f"{prompt_a},{prompt_b}", "SLUICE_HOST": "0.0.0.0", "SLUICE_PORT": "9000",
        "SLUICE_SERVED_MODEL_NAME": "m", "SLUICE_API_KEY": "k", "SLUICE_ALLOWED_ORIGINS": "http://a.example, http://b.example",
        "SLUICE_MAX_CONNECTIONS": "5", "SLUICE_MAX_CONNECTIONS_PER_CLIENT": "4", "SLUICE_MAX_INFLIGHT_PER_CONNECTION": "3", "SLUICE_MAX_QUEUED_REQUESTS": "9", "SLUICE_MAX_QUEUED_REQUESTS_PER_CLIENT": "3",
        "SLUICE_MAX_MESSAGE_BYTES": "4096", "SLUICE_TIMEOUT_GRACEFUL_SHUTDOWN": "2.5", "SLUICE_LOG_LEVEL": "debug",
        "SLUICE_MAX_PENDING_AUTH": "7", "SLUICE_MAX_HTTP_CONNECTIONS": "99", "SLUICE_TIMEOUT_AUTH": "1.5",
        "SLUICE_TIMEOUT_HEADERS": "2.5", "SLUICE_TIMEOUT_BODY": "3.5", "SLUICE_TIMEOUT_SEND": "4.5", "SLUICE_TIMEOUT_KEEP_ALIVE": "4",
        "SLUICE_WS_PING_INTERVAL": "6", "SLUICE_WS_PING_TIMEOUT": "7",
        "SLUICE_ENGINE_ITERATION_TIMEOUT_S": "0", "SLUICE_KV_OFFLOAD_GB": "1.5",
        "SLUICE_PREFIX_STORE": "off",
        "SLUICE_KV_CACHE_DTYPE": "int8",
        "SLUICE_TENSOR_PARALLEL_SIZE": "2",
        "SLUICE_SPECULATIVE": "ngram", "SLUICE_NUM_SPECULATIVE_TOKENS": "6", "SLUICE_NGRAM_PROMPT_LOOKUP_MAX": "3",
        "SLUICE_NGRAM_PROMPT_LOOKUP_MIN": "1", "SLUICE_SPECULATIVE_DISABLE_BY_BATCH_SIZE": "4",
        "SLUICE_SPECULATIVE_ADAPTIVE": "no", "SLUICE_ENFORCE_EAGER": "off", "SLUICE_ASYNC_OUTPUT_PROC": "1",
        "SLUICE_ASYNC_SCHEDULING": "yes", "SLUICE_CUDAGRAPH_MODE": "FULL_DECODE_ONLY", "SLUICE_ENGINE_PROCESS": "0",
        "SLUICE_ENABLE_AUTO_TOOL_CHOICE": "1", "SLUICE_TOOL_CALL_PARSER": "hermes",
        "SLUICE_RESPONSES_STORE_MB": "0.5", "SLUICE_CHAT_TEMPLATE": "{{ messages[0]['content'] }}",
        "SLUICE_REASONING_PARSER": "qwen3",
        "SLUICE_SSL_KEYFILE": str(key_pem), "SLUICE_SSL_CERTFILE": str(cert_pem), "SLUICE_SSL_CA_CERTS": str(ca_pem),
        "SLUICE_SSL_CERT_REQS": "1",
        "SLUICE_GENERATION_CONFIG": "vllm", "SLUICE_OVERRIDE_GENERATION_CONFIG": '{"temperature": 0.5}',
    }
    assert set(env) == {env_var(a) for a in flag_actions(build_parser())}  # this test covers every flag
    c = parse_config([], env)
    assert c == ServerConfig(
        model="/models/m", dtype="bfloat16", device="cuda", block_size=32, num_kv_blocks=100, max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=1024, scheduling="static", prefix_caching=False,
        long_prefill_token_threshold=64, max_num_partial_prefills=2, itl_slo_ms=150.0, seed=7, pin_system_prompt=(str(prompt_a), str(prompt_b)),
        host="0.0.0.0", port=9000, ssl_keyfile=str(key_pem), ssl_certfile=str(cert_pem), ssl_ca_certs=str(ca_pem),
        ssl_cert_reqs=1, served_model_name="m", generation_config="vllm", override_generation_config={"temperature": 0.5}, enable_auto_tool_choice=True, tool_call_parser="hermes", responses_store_mb=0.5,
        chat_template="{{ messages[0]['content'] }}", reasoning_parser="qwen3",
        api_key="k", allowed_origins=("http://a.example", "http://b.example"),
        max_connections=5, max_connections_per_client=4, max_inflight_per_connection=3, max_queued_requests=9, max_queued_requests_per_client=3, max_message_bytes=4096,
        timeout_graceful_shutdown=2.5, log_level="debug", max_pending_auth=7, max_http_connections=99,
        timeout_auth=1.5, timeout_headers=2.5, timeout_body=3.5, timeout_send=4.5, timeout_keep_alive=4, ws_ping_interval=6.0, ws_ping_timeout=7.0,
        engine_iteration_timeout_s=0.0,
        engine_process=False,
        kv_offload_gb=1.5, prefix_store=False, kv_cache_dtype="int8", tensor_parallel_size=2,
        speculative="ngram", num_speculative_tokens=6, ngram_prompt_lookup_max=3, ngram_prompt_lookup_min=1,
        speculative_disable_by_batch_size=4, speculative_adaptive=False, enforce_eager=False,
        cudagraph_mode="full_decode_only",
        async_output_proc=True, async_scheduling=True)


def test_flags_win_over_variables_and_empty_means_unset(tmp_path) -> None:
    env = {"SLUICE_PORT": "9000", "SLUICE_PREFIX_CACHING": "0", "SLUICE_ALLOWED_ORIGINS": "http://env.example",
           "SLUICE_MODEL": "/from/env"}
    c = parse_config(["--port", "9001", "--prefix-caching", "--allowed-origins", "http://flag.example", "--model=/flag"], env)
    assert (c.port, c.prefix_caching, c.allowed_origins, c.model) == (9001, True, ("http://flag.example",), "/flag")
    assert parse_config(["--no-prefix-caching"], {"SLUICE_PREFIX_CACHING": "yes"}).prefix_caching is False
    assert parse_config([], {"SLUICE_PREFIX_CACHING": "ON"}).prefix_caching is True
    # compose passes `${SLUICE_MODEL:-}` through: empty (or blank) is "not set", never model "" or port ""
    assert parse_config([], {"SLUICE_MODEL": "", "SLUICE_PORT": " ", "SLUICE_API_KEY": ""}) == ServerConfig()


def test_variables_that_name_no_flag_are_left_alone() -> None:
    env = {"SLUICE_HOME": "/data", "SLUICE_KERNELS": "nonsense",
           "SLUICE_UPDATE_DOCS": "1", "SLUICE_QUIET": "1", "SLUICE_MODELS_DIR": "./models"}
    assert parse_config([], env) == ServerConfig()


@pytest.mark.parametrize(("env", "says"), [
    ({"SLUICE_PORT": "eighty"}, "SLUICE_PORT='eighty': not a valid int (it sets --port)"),
    ({"SLUICE_PORT": "70000"}, "--port must be in 0..65535, got 70000 (SLUICE_PORT sets --port)"),
    ({"SLUICE_TIMEOUT_GRACEFUL_SHUTDOWN": "soon"}, "SLUICE_TIMEOUT_GRACEFUL_SHUTDOWN='soon': not a valid float"),
    ({"SLUICE_MAX_CONNECTIONS": "0"}, "--max-connections must be >= 1 (SLUICE_MAX_CONNECTIONS sets --max-connections)"),
    ({"SLUICE_MAX_QUEUED_REQUESTS_PER_CLIENT": "0"}, "--max-queued-requests-per-client must be >= 1"),
    ({"SLUICE_ENGINE_ITERATION_TIMEOUT_S": "-1"}, "--engine-iteration-timeout-s must be >= 0 (0: no watchdog) "
                                                   "(SLUICE_ENGINE_ITERATION_TIMEOUT_S sets"),
    ({"SLUICE_DEVICE": "gpu"}, "SLUICE_DEVICE='gpu': expected one of auto, cpu, cuda"),
    ({"SLUICE_PREFIX_CACHING": "maybe"}, "SLUICE_PREFIX_CACHING='maybe': expected 1/0, true/false"),
    ({"SLUICE_PIN_SYSTEM_PROMPT": "/no/such/file"}, "no such file: /no/such/file (SLUICE_PIN_SYSTEM_PROMPT sets"),
])
def test_bad_variables_name_the_variable(env: dict[str, str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_config([], env)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_flag_hides_a_bad_variable() -> None:
    assert parse_config(["--port", "1"], {"SLUICE_PORT": "eighty"}).port == 1


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-connections", "0"], ["--dtype", "float64"],
                                  ["--pin-system-prompt", "/no/such/file"], ["--api-key", ""], ["--bogus"],
                                  ["--max-pending-auth", "0"], ["--max-http-connections", "0"], ["--timeout-auth", "0"],
                                  ["--timeout-headers", "-1"], ["--timeout-body", "0"], ["--timeout-send", "0"],
                                  ["--timeout-keep-alive", "0"]])
def test_bad_flags_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_config(argv, {})
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_speculative_flags_reach_the_engine() -> None:
    from engine import EngineConfig

    c = parse_config(["serve", "--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max",
                      "5", "--ngram-prompt-lookup-min", "1", "--speculative-disable-by-batch-size", "8"], {})
    kwargs = c.engine_kwargs()
    assert {k: kwargs[k] for k in ("speculative", "num_speculative_tokens", "ngram_prompt_lookup_max",
                                   "ngram_prompt_lookup_min", "speculative_disable_by_batch_size")} == {
        "speculative": "ngram", "num_speculative_tokens": 3, "ngram_prompt_lookup_max": 5,
        "ngram_prompt_lookup_min": 1, "speculative_disable_by_batch_size": 8}
    EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="ngram_prompt_lookup_min"):
        EngineConfig(speculative="ngram", ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative must be ngram or draft:DIR"):
        EngineConfig(speculative="medusa")
    assert EngineConfig(speculative="draft:/models/small").draft_model == "/models/small"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative="draft:/models/small", tensor_parallel_size=2)
