"""`sluice serve` flags -> ServerConfig (service/config.py): names from DESIGN §9, env in one place."""
from __future__ import annotations

import dataclasses

import pytest

from service.config import ServerConfig, build_parser, parse_config

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
    assert c.engine_kwargs() == {"enable_prefix_caching": True}  # the engine keeps its own defaults


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
                                 "enable_prefix_caching": False}


def test_api_key_from_env_and_flag_wins() -> None:
    assert parse_config([], {"SLUICE_API_KEY": "from-env"}).api_key == "from-env"
    assert parse_config(["--api-key", "flag"], {"SLUICE_API_KEY": "from-env"}).api_key == "flag"
    assert parse_config([], {"SLUICE_API_KEY": ""}).api_key is None


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-connections", "0"], ["--dtype", "float64"],
                                  ["--pin-system-prompt", "/no/such/file"], ["--api-key", ""], ["--bogus"]])
def test_bad_flags_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_config(argv, {})
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
