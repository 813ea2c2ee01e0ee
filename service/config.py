"""`ServerConfig`: the one frozen config of the service, built from CLI flags (one flag per field).

Every flag `--foo-bar` can also be set as `SLUICE_FOO_BAR`; a flag on the command line wins, and
an empty variable counts as unset. The environment is read here and nowhere else in `service/`.
Engine fields left at `None` fall through to `EngineConfig`'s own defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# NOTE: these ServerConfig fields are passed to EngineConfig under the same name (see engine_kwargs).
ENGINE_FIELDS = (
    "model", "dtype", "device", "block_size", "num_kv_blocks", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "scheduling", "long_prefill_token_threshold",
    "max_num_partial_prefills", "itl_slo_ms", "seed", "kv_offload_gb", "kv_cache_dtype", "tensor_parallel_size",
    "speculative", "num_speculative_tokens", "ngram_prompt_lookup_max", "ngram_prompt_lookup_min",
    "speculative_disable_by_batch_size", "cudagraph_mode", "generation_config", "override_generation_config",
)


@dataclass(frozen=True)
class ServerConfig:
    # engine (EngineConfig fields)
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    scheduling: str | None = None
    prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None
    itl_slo_ms: float | None = None
    seed: int | None = None
    kv_offload_gb: float | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int | None = None
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative_adaptive: bool = True
    enforce_eager: bool = True
    cudagraph_mode: str | None = None
    async_output_proc: bool = False
    async_scheduling: bool = False
    prefix_store: bool = True
    pin_system_prompt: tuple[str, ...] = ()
    generation_config: str | None = None  # (vLLM's) requests' sampling defaults: auto (the model's), vllm (none), DIR
    override_generation_config: dict[str, Any] | None = None  # (vLLM's) generation config keys over those
    # HTTP / WebSocket surface
    host: str = "127.0.0.1"
    port: int = 8000
    ssl_keyfile: str | None = None  # (vLLM's) TLS: with ssl_certfile, the server speaks https:// and wss://
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # CAs that sign the client certificates ssl_cert_reqs asks for
    ssl_cert_reqs: int = 0  # the ssl module's CERT_NONE (0), CERT_OPTIONAL (1), CERT_REQUIRED (2)
    served_model_name: str | None = None
    enable_auto_tool_choice: bool = False  # (vLLM's) chat tool_choice "auto": the answer parsed for calls
    tool_call_parser: str | None = None  # how: `hermes` or `llama3_json` (service/openai_tools.py)
    chat_template: str | None = None  # (vLLM's) a Jinja chat template file, or the template itself, for the model's
    reasoning_parser: str | None = None  # (vLLM's) `deepseek_r1` or `qwen3`: the answer's reasoning apart
    responses_store_mb: float = 256.0  # the Responses API's stored responses (service/openai_responses.py); 0: none
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_connections: int | None = None
    max_connections_per_client: int | None = None  # of those, one client's; None: half (none without a limit)
    max_pending_auth: int = 64
    max_http_connections: int = 1024
    timeout_auth: float = 10.0
    timeout_headers: float = 10.0
    timeout_body: float = 30.0
    timeout_send: float = 30.0
    timeout_keep_alive: int = 5
    ws_ping_interval: float = 20.0
    ws_ping_timeout: float = 20.0
    max_inflight_per_connection: int = 16
    max_queued_requests: int = 1024
    max_queued_requests_per_client: int | None = None  # of those, one client's (an address); None: half
    max_message_bytes: int = 1 << 20
    timeout_graceful_shutdown: float = 20.0
    engine_iteration_timeout_s: float = 300.0  # a step running longer is stuck: its engine is replaced; 0: never
    engine_process: bool = True  # the engine in a process of its own, not a thread of the server's
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("max_inflight_per_connection", "max_queued_requests", "max_message_bytes", "max_pending_auth",
                     "max_http_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("timeout_auth", "timeout_headers", "timeout_body", "timeout_send", "timeout_keep_alive",
                     "ws_ping_interval", "ws_ping_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError("--max-connections-per-client must be >= 1")
        if self.max_queued_requests_per_client is not None and self.max_queued_requests_per_client < 1:
            raise ValueError("--max-queued-requests-per-client must be >= 1")
        if self.timeout_graceful_shutdown < 0:
            raise ValueError("--timeout-graceful-shutdown must be >= 0")
        if not self.engine_iteration_timeout_s >= 0:
            raise ValueError("--engine-iteration-timeout-s must be >= 0 (0: no watchdog)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.chat_template is not None:
            chat_template_text(self.chat_template)  # (a flag that names no file fails here, at once)
        if not self.responses_store_mb >= 0:
            raise ValueError("--responses-store-mb must be >= 0 (0: store no responses)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        self.tls_context()  # (a certificate that does not load fails here, at start)

    def tls_context(self) -> ssl.SSLContext | None:
        """The server's TLS context from the --ssl-* flags, or None without them; a ValueError names what is wrong.
        uvicorn builds its own from the same flags: this one checks them at start, and serves the healthcheck."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.ssl_certfile is None:
            if self.ssl_ca_certs is not None or self.ssl_cert_reqs:
                raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
            return None
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs, the CAs that sign client certificates")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        flag = "--ssl-certfile / --ssl-keyfile"
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs is not None:
                flag = "--ssl-ca-certs"
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:  # (a missing file, a key that is not the certificate's, not PEM)
            raise ValueError(f"{flag}: {e}") from None
        context.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return context

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `EngineConfig`; unset fields are omitted so the engine's defaults apply."""
        kwargs = {f: getattr(self, f) for f in ENGINE_FIELDS if getattr(self, f) is not None}
        kwargs["enable_prefix_caching"] = self.prefix_caching
        kwargs["prefix_store"] = self.prefix_store
        kwargs["speculative_adaptive"] = self.speculative_adaptive
        kwargs["enforce_eager"] = self.enforce_eager
        kwargs["async_output_proc"] = self.async_output_proc
        kwargs["async_scheduling"] = self.async_scheduling
        if self.chat_template is not None:
            kwargs["chat_template"] = chat_template_text(self.chat_template)
        return kwargs


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (`--override-generation-config`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(text) from None
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


json_object.__name__ = "JSON object"  # (argparse's and _env_value's errors name the type so)


def chat_template_text(value: str) -> str:
    """`--chat-template`: a file's text, or, as vLLM takes it, the template itself (Jinja, on one line)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENV_PREFIX = "SLUICE_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _csv(values: Sequence[str] | None) -> tuple[str, ...]:
    """Flags that take lists accept both repetition and commas: `--allowed-origins a,b --allowed-origins c`."""
    return tuple(v.strip() for item in values or () for v in item.split(",") if v.strip())


def env_var(action: argparse.Action) -> str:
    """The variable that sets a flag: `--max-num-seqs` -> `SLUICE_MAX_NUM_SEQS`; `--[no-]prefix-caching` -> `SLUICE_PREFIX_CACHING`."""
    return ENV_PREFIX + action.dest.upper()


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of `sluice serve` but `--help`, in --help order."""
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _env_value(action: argparse.Action, raw: str) -> Any:
    """A variable's text -> what its flag would have parsed to; ValueError says what was expected."""
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        return word in _TRUE
    if isinstance(action, argparse._AppendAction):  # list flags: comma-separated in one variable
        return list(_csv([raw]))
    try:
        value = action.type(raw.strip()) if action.type else raw
    except ValueError:
        raise ValueError(f"not a valid {action.type.__name__}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def _given_on_command_line(argv: list[str]) -> set[str]:
    """Dests of the flags present in `argv` (parsed again with every default suppressed)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice serve",
        description="Serve a model over WebSocket (/v1/ws) and OpenAI-compatible HTTP (/v1/*).",
        epilog="Every flag can also be set as an environment variable SLUICE_<FLAG>: SLUICE_MAX_NUM_SEQS=64 "
               "is --max-num-seqs 64, SLUICE_PREFIX_CACHING=0 is --no-prefix-caching (booleans: 1/0, true/false, "
               "yes/no, on/off), list flags take commas. An empty variable is unset; a flag on the command line wins.",
    )
    d = ServerConfig()
    e = p.add_argument_group("engine")
    e.add_argument("--model", help="local Hugging Face model directory (default: the embedded sluice-chat model)")
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    e.add_argument("--device", choices=["auto", "cpu", "cuda"])
    e.add_argument("--block-size", type=int, help="tokens per KV block")
    e.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool (default: sized from memory)")
    e.add_argument("--max-num-seqs", type=int, help="most sequences in one step")
    e.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    e.add_argument("--max-model-len", type=int, help="context length (prompt + completion)")
    e.add_argument("--scheduling", choices=["mixed", "prefill_first", "static"])
    e.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d.prefix_caching,
                   help="reuse the KV cache of shared prompt prefixes (default: on)")
    e.add_argument("--long-prefill-token-threshold", type=int, help="largest prefill chunk of one prompt")
    e.add_argument("--max-num-partial-prefills", type=int, help="most prompts left mid-prefill at once (chunked over steps); prompts a step finishes do not count")
    e.add_argument("--itl-slo-ms", type=float, metavar="MS",
                   help="mixed scheduling: size each step's prompt chunks to keep running streams' inter-token "
                        "latency under MS, from a cost model of the steps run (default: off, the fixed budget)")
    e.add_argument("--seed", type=int, help="engine RNG seed")
    e.add_argument("--kv-offload-gb", type=float, metavar="GB",
                   help="host memory (GiB) for a second KV tier: cached prefixes evicted from the KV pool are kept "
                        "there and copied back instead of recomputed (default: 0, none)")
    e.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"],
                   help="what the KV cache stores: the model's dtype (auto), another float, or int8 / fp8 (e4m3) with a "
                        "scale per token and KV head, ~2x the tokens of bf16 in the same memory (default: auto)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N",
                   help="shard the model over N ranks (processes the server starts; on CUDA one GPU each, "
                        "cuda:0..N-1): each reads and keeps 1/N of the weights and of the KV cache (default: 1)")
    e.add_argument("--speculative", metavar="ngram|draft:DIR",
                   help="speculative decoding: draft tokens and verify them in the step (greedy output unchanged, "
                        "sampled output keeps its distribution). ngram: the tokens that followed the request's last "
                        "tokens earlier in its own context (prompt, earlier turns, output); draft:DIR: a small model "
                        "with the same vocabulary, its KV beside the model's (default: off)")
    e.add_argument("--num-speculative-tokens", type=int, metavar="K", help="most draft tokens per request and step (default: 4)")
    e.add_argument("--ngram-prompt-lookup-max", type=int, metavar="N",
                   help="longest suffix of a request's tokens --speculative ngram looks up (default: 4)")
    e.add_argument("--ngram-prompt-lookup-min", type=int, metavar="N", help="shortest (default: 2)")
    e.add_argument("--speculative-disable-by-batch-size", type=int, metavar="N",
                   help="draft nothing in a step with N or more decoding requests (default: 16)")
    e.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=d.speculative_adaptive,
                   help="below that batch size, draft only where it pays: the draft length that yields the most tokens "
                        "per second by a step-time model fitted online and the acceptance rate seen, none where plain "
                        "decoding yields more (default: on)")
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                   help="run every step eagerly; --no-enforce-eager replays steps from CUDA graphs captured at "
                        "start-up per bucket (decode batch size; mixed steps' token count), on CUDA with one rank "
                        "(default: on, every step eager, until graphs have been measured on a GPU)")
    e.add_argument("--cudagraph-mode", choices=["full", "full_decode_only"], type=str.lower,
                   help="with --no-enforce-eager: graphs for decode and mixed steps (full), or for decode steps only, "
                        "mixed steps eager (full_decode_only); vLLM sets this in --compilation-config (default: full)")
    e.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=d.async_output_proc,
                   help="make each step's outputs (the text of requests without stop strings, the output messages) "
                        "while the next step's forward runs on a thread of its own: off the step's critical path, "
                        "reported one step later (default: off)")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule and prepare each step while the last one runs, its new tokens still unknown (they "
                        "reach the next forward on the device), and make the last step's outputs then too: the host's "
                        "work off the step's critical path; with --speculative only in steps of batches too large "
                        "to draft (--speculative-disable-by-batch-size), not with tensor parallelism (default: off)")
    e.add_argument("--prefix-store", action=argparse.BooleanOptionalAction, default=d.prefix_store,
                   help="keep the KV of pinned system prompts on disk under $SLUICE_HOME/prefix-store and load it on "
                        "start instead of computing it (default: on)")
    e.add_argument("--pin-system-prompt", action="append", metavar="FILE",
                   help="keep the KV cache of a system prompt (file content) forever; repeatable")
    e.add_argument("--generation-config", metavar="auto|vllm|DIR",
                   help="where requests' sampling defaults come from: the model's generation_config.json (auto), "
                        "none (vllm: temperature 1, top_p 1, no top_k...), or the one in a directory DIR. Its "
                        "temperature, top_p, top_k, min_p and repetition_penalty are the defaults of requests that "
                        "leave them out; its max_new_tokens caps every request's max_tokens (vLLM's flag; "
                        "default: auto)")
    e.add_argument("--override-generation-config", type=json_object, metavar="JSON",
                   help="generation config keys over those, e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}' "
                        "(vLLM's flag)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="interface to bind (default: %(default)s)")
    s.add_argument("--port", type=int, default=d.port, help="TCP port (default: %(default)s)")
    s.add_argument("--ssl-keyfile", metavar="FILE", help="TLS private key (PEM); with --ssl-certfile the server "
                   "serves https:// and wss:// instead of http:// and ws://")
    s.add_argument("--ssl-certfile", metavar="FILE", help="TLS certificate chain (PEM), the server's first")
    s.add_argument("--ssl-ca-certs", metavar="FILE", help="CA certificates (PEM) that sign client certificates")
    s.add_argument("--ssl-cert-reqs", type=int, default=d.ssl_cert_reqs, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for, 1 checked when sent, 2 required (mutual TLS) "
                        "(default: %(default)s)")
    s.add_argument("--served-model-name", help="model name in API responses (default: the model's)")
    s.add_argument("--enable-auto-tool-choice", action="store_true", default=d.enable_auto_tool_choice,
                   help="chat completions with tools may leave the choice to the model (tool_choice auto, the default "
                        "with tools): its answer is parsed for calls by --tool-call-parser")
    s.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=d.tool_call_parser,
                   help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Hermes) or "
                        "llama3_json (an answer of {\"name\", \"parameters\"} objects: Llama 3.1-3.3)")
    s.add_argument("--reasoning-parser", choices=("deepseek_r1", "qwen3"), default=d.reasoning_parser,
                   help="a reasoning model's <think> text apart from its content (chat completions' "
                        "reasoning_content, the Responses API's reasoning item, the WebSocket deltas' reasoning): "
                        "deepseek_r1 (the answer "
                        "starts in its reasoning: DeepSeek-R1, QwQ) or qwen3 (only an answer that opens <think>)")
    s.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the model's own: for a "
                        "model without one, or to show tools another way (vLLM's flag)")
    s.add_argument("--responses-store-mb", type=float, default=d.responses_store_mb, metavar="MB",
                   help="memory for the Responses API's stored responses (store: true, the default), which "
                        "previous_response_id continues; when full, the least recently used of the client holding the "
                        "most goes first; all lost on restart; 0: "
                        "none kept (default: %(default)s)")
    s.add_argument("--api-key", help="require this key on /v1/*, /tokenize, /detokenize and the WebSocket")
    s.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                   help="comma-separated Origins allowed to open WebSockets; repeatable (default: any)")
    s.add_argument("--max-connections", type=int,
                   help="most authenticated WebSocket connections; sockets still waiting to authenticate do not "
                        "count (default: no limit)")
    s.add_argument("--max-connections-per-client", type=int, default=d.max_connections_per_client, metavar="N",
                   help="of those, one client's (a peer address, or a trusted proxy's X-Forwarded-For), so one cannot "
                        "take every connection (default: half of --max-connections; no limit without it)")
    s.add_argument("--max-pending-auth", type=int, default=d.max_pending_auth,
                   help="most WebSockets waiting to send `hello` (with --api-key); one more closes the oldest "
                        "(default: %(default)s)")
    s.add_argument("--max-http-connections", type=int, default=d.max_http_connections,
                   help="most open HTTP connections; one more closes the oldest still sending its request, or gets 503 "
                        "(default: %(default)s)")
    s.add_argument("--timeout-auth", type=float, default=d.timeout_auth,
                   help="seconds a WebSocket has to send `hello` (with --api-key) (default: %(default)s)")
    s.add_argument("--timeout-headers", type=float, default=d.timeout_headers,
                   help="seconds an HTTP connection has to send a whole request head, 408 after (default: %(default)s)")
    s.add_argument("--timeout-body", type=float, default=d.timeout_body,
                   help="seconds an HTTP request body may pause between bytes, 408 after (default: %(default)s)")
    s.add_argument("--timeout-send", type=float, default=d.timeout_send,
                   help="seconds an HTTP response may wait on a client that takes none of it (its output over the "
                        "socket's buffer), then the connection is dropped (default: %(default)s)")
    s.add_argument("--timeout-keep-alive", type=int, default=d.timeout_keep_alive,
                   help="seconds an idle HTTP connection stays open waiting for a request (default: %(default)s)")
    s.add_argument("--ws-ping-interval", type=float, default=d.ws_ping_interval,
                   help="seconds between the server's keepalive pings on a WebSocket (default: %(default)s)")
    s.add_argument("--ws-ping-timeout", type=float, default=d.ws_ping_timeout,
                   help="seconds a keepalive ping may go unanswered before the socket is closed 1011, and dropped if "
                        "its output is still unsent (default: %(default)s)")
    s.add_argument("--max-inflight-per-connection", type=int, default=d.max_inflight_per_connection,
                   help="most concurrent chats on one WebSocket (default: %(default)s)")
    s.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting for the engine before new ones are refused as overloaded (default: %(default)s)")
    s.add_argument("--max-queued-requests-per-client", type=int, default=d.max_queued_requests_per_client,
                   metavar="N", help="of those, one client's (a peer address, WebSocket and HTTP together), so one "
                                     "cannot fill the queue for the others (default: half of --max-queued-requests)")
    s.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest WebSocket frame (close 1009) and HTTP request body (413) (default: %(default)s)")
    s.add_argument("--timeout-graceful-shutdown", type=float, default=d.timeout_graceful_shutdown,
                   help="seconds in-flight requests may run after SIGTERM before they are cancelled (default: %(default)s)")
    s.add_argument("--engine-iteration-timeout-s", type=float, default=d.engine_iteration_timeout_s, metavar="S",
                   help="an engine step running longer than this is stuck: a new engine resumes its requests "
                        "(0: no watchdog; default: %(default)s)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the engine in a process of its own: its host work runs beside the server's instead of "
                        "sharing one interpreter lock; a rebuild after a failure loads the model again "
                        "(default: %(default)s)")
    s.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s); request text is never logged at info")
    return p


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags (`serve` as first word is optional) over `SLUICE_*` variables over defaults -> `ServerConfig`.

    Variables that name no flag (`SLUICE_HOME`, `SLUICE_KERNELS`, ...) belong to others and are left alone.
    """
    argv = list(argv if argv is not None else ())
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    environ = os.environ if environ is None else environ
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    given = _given_on_command_line(argv)
    from_env: dict[str, str] = {}  # dest -> the variable that set it, for error messages
    for action in flag_actions(parser):
        name = env_var(action)
        raw = environ.get(name, "")
        if action.dest in given or not raw.strip():  # the flag wins; empty means unset (compose's `${VAR:-}`)
            continue
        try:
            ns[action.dest] = _env_value(action, raw)
        except ValueError as e:
            parser.error(f"{name}={raw!r}: {e} (it sets {action.option_strings[0]})")
        from_env[action.dest] = name

    def fail(message: str) -> None:
        sources = [f"{name} sets {_flag(dest)}" for dest, name in from_env.items() if _flag(dest) in message]
        parser.error(message + (f" ({'; '.join(sources)})" if sources else ""))

    ns["pin_system_prompt"] = tuple(ns["pin_system_prompt"] or ())
    ns["allowed_origins"] = _csv(ns["allowed_origins"])
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    assert set(ns) == fields, f"flags and ServerConfig fields differ: {set(ns) ^ fields}"
    for path in ns["pin_system_prompt"]:
        if not os.path.isfile(path):
            fail(f"--pin-system-prompt: no such file: {path}")
    try:
        return ServerConfig(**ns)
    except ValueError as e:
        fail(str(e))
        raise  # unreachable: parser.error exits


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
