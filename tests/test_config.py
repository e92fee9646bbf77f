"""The operator config: validation messages with key paths, ${ENV} references, secrets, core mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.config import AppConfig, ConfigError, is_loopback_host, load_config
from core.settings import CoreSettings


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "chatbridge.toml"
    path.write_text(text, encoding="utf-8")
    return path


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env=env or {})
    return info.value.problems


# ---- defaults ------------------------------------------------------------------------------------------


def test_embedded_default_is_local_web_chat_on_loopback() -> None:
    cfg = load_config(None, env={})
    assert cfg.llm.provider == "local"
    assert (cfg.web.enabled, cfg.web.host, cfg.web.port) == (True, "127.0.0.1", 8765)
    assert cfg.enabled_channels() == []
    assert cfg.bridge.dedupe_ttl_hours == 48
    assert cfg.llm.retry_delays == [2, 4, 8, 16, 30]


def test_empty_file_equals_embedded_default(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == load_config(None, env={})


# ---- pydantic errors → dotted paths ---------------------------------------------------------------------


def test_unknown_key_names_its_path_and_suggests(tmp_path: Path) -> None:
    found = problems(tmp_path, '[llm]\nmodle = "gpt-4o-mini"\n')
    assert found == ["llm.modle: unknown key (did you mean 'model'?)"]


def test_unknown_nested_key_and_misplaced_channel_table(tmp_path: Path) -> None:
    found = problems(tmp_path, "[channels.telegram]\ntokn = 'x'\n[telegram]\nenabled = true\n")
    assert "channels.telegram.tokn: unknown key (did you mean 'token'?)" in found
    assert "telegram: unknown key (did you mean [channels.telegram]?)" in found


def test_unknown_key_never_echoes_its_value(tmp_path: Path) -> None:
    found = problems(tmp_path, '[llm]\napi_kye = "sk-very-secret"\n')
    assert found == ["llm.api_kye: unknown key (did you mean 'api_key'?)"]


def test_wrong_type_names_path_expected_and_got(tmp_path: Path) -> None:
    found = problems(tmp_path, '[web]\nport = "eighty"\n[agent]\nmax_turns = true\n')
    assert "web.port: expected an integer (got 'eighty')" in found
    assert "agent.max_turns: expected an integer (got true)" in found


def test_wrong_type_for_a_table_and_a_list(tmp_path: Path) -> None:
    found = problems(tmp_path, 'llm = "openai"\n[channels.slack]\nallow_from = "*"\n')
    assert "llm: expected a table (got 'openai')" in found
    assert "channels.slack.allow_from: expected a list (got '*')" in found


def test_bad_literal_lists_the_choices(tmp_path: Path) -> None:
    found = problems(tmp_path, '[channels.telegram]\ngroup_policy = "sometimes"\n')
    assert found == ["channels.telegram.group_policy: expected one of mention, all, off (got 'sometimes')"]


def test_bounds_and_list_items(tmp_path: Path) -> None:
    text = "[bridge]\ndedupe_ttl_hours = 12\n[llm]\nretry_delays = [1, -2]\n[web]\nport = 70000\n"
    found = problems(tmp_path, text)
    assert "bridge.dedupe_ttl_hours: expected a value >= 24 (got 12)" in found
    assert "llm.retry_delays[1]: expected a value >= 0 (got -2)" in found
    assert "web.port: expected a value <= 65535 (got 70000)" in found


def test_wrong_type_of_a_secret_does_not_echo_it(tmp_path: Path) -> None:
    found = problems(tmp_path, "[web]\nauth_token = 123456789\n")
    assert found == ["web.auth_token: expected a string"]


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[web]\nport = 8765\nhost "0.0.0.0"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}, line 3, column")
    assert "invalid TOML" in problem
    assert info.value.source == str(path)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.problems == [f"{path}: file not found (create one with `chatbridge init {path}`)"]


def test_str_joins_problems_one_per_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[llm]\na = 1\nb = 2\n"), env={})
    assert str(info.value).splitlines() == info.value.problems
    assert len(info.value.problems) == 2


# ---- ${ENV} --------------------------------------------------------------------------------------------


def test_env_reference_and_default(tmp_path: Path) -> None:
    text = (
        "[web]\nport = \"${PORT:-9000}\"\nhost = \"${HOST:-localhost}\"\n"
        "[agent]\nsystem_prompt = \"Hi ${WHO}, price $5 and ${WHO:-x}\"\n"
    )
    cfg = load_config(write(tmp_path, text), env={"WHO": "Ann", "HOST": ""})
    assert cfg.web.port == 9000
    assert cfg.web.host == "localhost"  # :- also applies when the variable is empty
    assert cfg.agent.system_prompt == "Hi Ann, price $5 and Ann"
    assert load_config(write(tmp_path, text), env={"PORT": "9100"}).web.port == 9100


def test_env_substitution_reaches_lists(tmp_path: Path) -> None:
    text = '[channels.telegram]\nallow_from = ["${ADMIN}", 42]\n'
    cfg = load_config(write(tmp_path, text), env={"ADMIN": "@root"})
    assert cfg.channels.telegram.allow_from == ["@root", "42"]


def test_enabled_channel_with_unset_env_names_key_and_variable(tmp_path: Path) -> None:
    text = '[channels.telegram]\nenabled = true\ntoken = "${TELEGRAM_BOT_TOKEN}"\n'
    assert problems(tmp_path, text) == [
        "channels.telegram.token: environment variable TELEGRAM_BOT_TOKEN is not set"
    ]


def test_enabled_channel_without_token_key_reads_the_design_default_variable(tmp_path: Path) -> None:
    text = "[channels.slack]\nenabled = true\n"
    assert problems(tmp_path, text) == [
        "channels.slack.bot_token: environment variable SLACK_BOT_TOKEN is not set",
        "channels.slack.app_token: environment variable SLACK_APP_TOKEN is not set",
    ]
    cfg = load_config(write(tmp_path, text), env={"SLACK_BOT_TOKEN": "xoxb-1", "SLACK_APP_TOKEN": "xapp-1"})
    assert (cfg.channels.slack.bot_token, cfg.channels.slack.app_token) == ("xoxb-1", "xapp-1")


def test_disabled_channel_with_unset_env_is_fine(tmp_path: Path) -> None:
    text = (
        '[channels.telegram]\nenabled = false\ntoken = "${TELEGRAM_BOT_TOKEN}"\n'
        '[channels.feishu]\napp_secret = "${FEISHU_APP_SECRET}"\n'
    )
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.channels.telegram.token == ""
    assert cfg.channels.feishu.app_secret == ""


def test_required_secret_given_literally_but_empty(tmp_path: Path) -> None:
    found = problems(tmp_path, '[channels.feishu]\nenabled = true\napp_id = "cli_1"\napp_secret = ""\n')
    assert found == ["channels.feishu.app_secret: required when channels.feishu.enabled = true (got empty)"]


def test_unset_env_in_a_typed_key_mentions_the_variable(tmp_path: Path) -> None:
    assert problems(tmp_path, '[web]\nport = "${PORT}"\n') == [
        "web.port: environment variable PORT is not set (expected an integer)"
    ]


def test_mode_specific_secrets(tmp_path: Path) -> None:
    text = (
        '[channels.slack]\nenabled = true\nbot_token = "xoxb-b"\nmode = "http"\n'
        '[channels.feishu]\nenabled = true\napp_id = "a"\napp_secret = "s"\nmode = "webhook"\n'
    )
    found = problems(tmp_path, text)
    assert found == [
        "channels.slack.signing_secret: required in http mode (got empty)",
        "channels.feishu.verification_token: required in webhook mode (got empty)",
        "channels.feishu.encrypt_key: required in webhook mode: set an Encrypt Key on the Encryption Strategy "
        "page of the app, so that Feishu signs every request (got empty)",
    ]


@pytest.mark.parametrize(("domain", "problem"), [
    ("feishu", None),
    ("lark", None),
    ("https://open.larksuite.com", None),
    ("http://127.0.0.1:8080", None),
    ("http://open.feishu.cn", "http:// is accepted only for a loopback address; use https://"),
    ("https://open.feishu.cn/open-apis", 'expected an origin without a path (such as "https://open.feishu.cn")'),
    ("feishu.cn", 'expected "feishu", "lark" or an https:// origin such as "https://open.feishu.cn"'),
])
def test_the_feishu_domain_is_feishu_lark_or_an_origin(tmp_path: Path, domain: str, problem: str | None) -> None:
    text = f'[channels.feishu]\nenabled = true\napp_id = "a"\napp_secret = "app-secret"\ndomain = "{domain}"\n'
    if problem is None:
        assert load_config(write(tmp_path, text), env={}).channels.feishu.domain == domain
    else:
        assert problems(tmp_path, text) == [f"channels.feishu.domain: {problem}"]


def test_feishu_domain_names_resolve_to_their_open_platform() -> None:
    from channels.feishu.settings import FeishuConfig
    assert FeishuConfig(domain="lark").base_url() == "https://open.larksuite.com"
    assert FeishuConfig(domain="Feishu").base_url() == "https://open.feishu.cn"
    assert FeishuConfig(domain="https://example.test/").base_url() == "https://example.test"


# ---- cross-field rules ---------------------------------------------------------------------------------


WEBHOOK = 'webhook_url = "https://bot.example.com/telegram/webhook"\nwebhook_secret = "s3cret"\n'


def test_webhook_mode_without_web_server(tmp_path: Path) -> None:
    text = f'[web]\nenabled = false\n[channels.telegram]\nenabled = true\ntoken = "t"\nmode = "webhook"\n{WEBHOOK}'
    found = problems(tmp_path, text)
    assert len(found) == 1
    assert found[0].startswith("channels.telegram.mode: mode 'webhook' is served by the web server")
    # the same channel in polling mode is fine without the web server
    cfg = load_config(write(tmp_path, text.replace('"webhook"', '"polling"')), env={})
    assert cfg.enabled_channels() == ["telegram"]


def test_telegram_webhook_mode_needs_url_and_secret(tmp_path: Path) -> None:
    found = problems(tmp_path, '[channels.telegram]\nenabled = true\ntoken = "t"\nmode = "webhook"\n')
    assert [line.split(":", 1)[0] for line in found] == ["channels.telegram.webhook_url",
                                                        "channels.telegram.webhook_secret"]
    assert all("required in webhook mode" in line for line in found)
    assert load_config(write(tmp_path, f'[channels.telegram]\nenabled = true\ntoken = "t"\nmode = "webhook"\n'
                                       f'{WEBHOOK}'), env={}).channels.telegram.mode == "webhook"


def test_telegram_webhook_url_must_be_https_and_secret_in_telegrams_alphabet(tmp_path: Path) -> None:
    found = problems(tmp_path, '[channels.telegram]\nenabled = true\ntoken = "t"\nmode = "webhook"\n'
                               'webhook_url = "http://bot.example.com/telegram/webhook"\n'
                               'webhook_secret = "has spaces and $ymbols"\n')
    assert found[0].startswith("channels.telegram.webhook_url: Telegram posts webhooks only to https://")
    assert found[1].startswith("channels.telegram.webhook_secret: expected 1 to 256 characters")
    assert not any("$ymbols" in line for line in found)


def test_non_loopback_web_needs_a_token(tmp_path: Path) -> None:
    found = problems(tmp_path, '[web]\nhost = "0.0.0.0"\n')
    assert found == [
        "web.auth_token: required when web.host is not a loopback address (host is '0.0.0.0') (got empty)"
    ]
    assert load_config(write(tmp_path, '[web]\nhost = "0.0.0.0"\nauth_token = "t"\n'), env={}).web.auth_token
    assert load_config(write(tmp_path, '[web]\nhost = "::1"\n'), env={}).web.host == "::1"


def test_web_access_keys_are_validated_by_name(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[web]\nallowed_hosts = ["Chat.Example.com.", "[::1]", "10.1.2.3"]\n'
                                      'trusted_proxies = ["127.0.0.1", "10.0.0.0/8", "fd00::1"]\n'
                                      "max_streams = 50\nmax_streams_per_client = 5\n"), env={})
    assert cfg.web.allowed_hosts == ["chat.example.com", "::1", "10.1.2.3"]
    assert cfg.web.trusted_proxies == ["127.0.0.1/32", "10.0.0.0/8", "fd00::1/128"]
    assert (cfg.web.max_streams, cfg.web.max_streams_per_client) == (50, 5)
    default = load_config(None, env={}).web
    assert (default.allowed_hosts, default.trusted_proxies) == ([], [])
    assert (default.max_streams, default.max_streams_per_client) == (200, 20)

    found = problems(tmp_path, '[web]\nallowed_hosts = ["https://chat.example.com", "chat.example.com:8443", ""]\n'
                               'trusted_proxies = ["proxy.local", "10.0.0.0/33"]\nmax_streams = 0\n')
    host_hint = 'expected a host name such as "chat.example.com" (no scheme, port or path)'
    net_hint = 'expected an IP address or network such as "127.0.0.1" or "10.0.0.0/8"'
    assert found == [
        f"web.allowed_hosts[0]: {host_hint} (got 'https://chat.example.com')",
        f"web.allowed_hosts[1]: {host_hint} (got 'chat.example.com:8443')",
        f"web.allowed_hosts[2]: {host_hint} (got '')",
        f"web.trusted_proxies[0]: {net_hint} (got 'proxy.local')",
        f"web.trusted_proxies[1]: {net_hint} (got '10.0.0.0/33')",
        "web.max_streams: expected a value >= 1 (got 0)",
    ]
    assert problems(tmp_path, "[web]\nmax_streams = 10\nmax_streams_per_client = 11\n") == [
        "web.max_streams_per_client: must not exceed web.max_streams (10) (got 11)"]
    assert problems(tmp_path, '[web]\nallowed_hosts = "chat.example.com"\n') == [
        "web.allowed_hosts: expected a list (got 'chat.example.com')"]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("10.0.0.1", False), ("example.com", False), ("", False)],
)
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_remote_llm_needs_model_and_key(tmp_path: Path) -> None:
    found = problems(tmp_path, '[llm]\nprovider = "openai"\n')
    assert found[0] == "llm.model: required for provider 'openai' (e.g. 'gpt-4o-mini')"
    assert found[1] == "llm.api_key: environment variable OPENAI_API_KEY is not set"
    text = '[llm]\nprovider = "anthropic"\nmodel = "m"\n'
    cfg = load_config(write(tmp_path, text), env={"ANTHROPIC_API_KEY": "k"})
    assert cfg.llm.api_key == "k"


def test_loopback_llm_server_needs_no_key(tmp_path: Path) -> None:
    text = '[llm]\nprovider = "openai"\nmodel = "llama3.2"\nbase_url = "http://localhost:11434/v1"\n'
    assert load_config(write(tmp_path, text), env={}).llm.api_key == ""
    remote = text.replace("localhost", "10.1.2.3")
    assert problems(tmp_path, remote) == ["llm.api_key: environment variable OPENAI_API_KEY is not set"]


def test_model_path_only_for_local(tmp_path: Path) -> None:
    text = '[llm]\nprovider = "openai"\nmodel = "m"\napi_key = "k"\nmodel_path = "x.gguf"\n'
    assert problems(tmp_path, text) == [
        "llm.model_path: only used with provider 'local' (provider is 'openai')"
    ]
    assert load_config(write(tmp_path, '[llm]\nmodel_path = "x.gguf"\n'), env={}).llm.model_path == "x.gguf"


def test_nothing_enabled_is_an_error(tmp_path: Path) -> None:
    assert problems(tmp_path, "[web]\nenabled = false\n") == [
        "web.enabled: nothing would run: the web chat and every channel are disabled"
    ]


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"web\.auth_token"):
        AppConfig.model_validate({"web": {"host": "0.0.0.0"}})


# ---- secrets -------------------------------------------------------------------------------------------

SECRETS_TOML = """
[llm]
provider = "openai"
model = "gpt-4o-mini"
api_key = "${OPENAI_API_KEY}"
[web]
host = "0.0.0.0"
auth_token = "literal-web-token-123"
[channels.telegram]
enabled = true
token = "${TG}"
webhook_secret = ""
[agent]
system_prompt = "never say literal-web-token-123"
"""


def test_masked_dump_and_secret_values(tmp_path: Path) -> None:
    env = {"OPENAI_API_KEY": "sk-env-secret-456", "TG": "123:tg-secret"}
    cfg = load_config(write(tmp_path, SECRETS_TOML), env=env)
    assert cfg.llm.api_key == "sk-env-secret-456"  # the secret itself stays usable
    dump = cfg.masked_dump()
    assert dump["llm"]["api_key"] == "***"
    assert dump["web"]["auth_token"] == "***"
    assert dump["channels"]["telegram"]["token"] == "***"
    assert dump["channels"]["telegram"]["webhook_secret"] == ""
    assert dump["channels"]["slack"]["signing_secret"] == ""
    assert dump["agent"]["system_prompt"] == "never say ***"
    assert dump["web"]["port"] == 8765
    for secret in [*env.values(), "literal-web-token-123"]:
        assert secret not in repr(dump)
    # repr() (e.g. a config logged by accident) masks the secret fields themselves
    assert "auth_token='***'" in repr(cfg)
    for secret in env.values():
        assert secret not in repr(cfg) and secret not in str(cfg)
    assert cfg.secret_values() == ["literal-web-token-123", "sk-env-secret-456", "123:tg-secret"]


# ---- core mapping --------------------------------------------------------------------------------------


def test_core_settings_mapping(tmp_path: Path) -> None:
    text = """
[bridge]
dedupe_ttl_hours = 30
shutdown_timeout = 3
[llm]
request_timeout = 12.5
retry_delays = [1, 2.5]
context_window = 4096
[agent]
system_prompt = "Be brief."
max_turns = 5
queue_capacity = 7
session_idle_seconds = 60
titles = false
"""
    settings = load_config(write(tmp_path, text), env={}).core_settings()
    assert isinstance(settings, CoreSettings)
    assert settings.system_prompt == "Be brief."
    assert settings.max_turns == 5
    assert settings.queue_capacity == 7
    assert settings.session_idle_seconds == 60.0
    assert settings.context_window == 4096
    assert settings.retry_delays == (1.0, 2.5)
    assert settings.request_timeout == 12.5
    assert settings.dedupe_ttl_seconds == 30 * 3600
    assert settings.shutdown_timeout == 3.0
    assert settings.titles is False


def test_default_core_settings_match_core_defaults() -> None:
    settings = load_config(None, env={}).core_settings()
    defaults = CoreSettings()
    for name in ("system_prompt", "max_turns", "queue_capacity", "session_idle_seconds", "context_window",
                 "retry_delays", "request_timeout", "dedupe_ttl_seconds", "shutdown_timeout", "titles"):
        assert getattr(settings, name) == getattr(defaults, name), name


def test_urls_are_checked_for_enabled_sections(tmp_path: Path) -> None:
    text = (
        '[llm]\nbase_url = "localhost:11434"\n'
        '[channels.telegram]\nenabled = true\ntoken = "t"\napi_base = "ftp://x"\n'
    )
    assert problems(tmp_path, text) == [
        "llm.base_url: expected an http:// or https:// URL (got 'localhost:11434')",
        "channels.telegram.api_base: expected an http:// or https:// URL (got 'ftp://x')",
    ]


# ---- [[agent.mcp_servers]] -----------------------------------------------------------------------------


MCP_OK = """
[[agent.mcp_servers]]
name = "files"
command = "npx"
args = ["-y", "server-filesystem", "/srv"]
env = { API_TOKEN = "${FILES_TOKEN}", MODE = "ro-literal-77" }

[[agent.mcp_servers]]
name = "search-2"
url = "http://127.0.0.1:8931/mcp"
approval = "auto"
call_timeout_seconds = 5
"""


def test_mcp_servers_parse_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MCP_OK), env={"FILES_TOKEN": "tok-env-555"})
    files, search = cfg.agent.mcp_servers
    assert (files.name, files.command, files.args, files.url) == ("files", "npx", ["-y", "server-filesystem", "/srv"],
                                                                  None)
    assert files.env == {"API_TOKEN": "tok-env-555", "MODE": "ro-literal-77"}
    assert (files.approval, files.startup_timeout_seconds, files.call_timeout_seconds) == ("ask", 20, 60)
    assert (search.url, search.approval, search.call_timeout_seconds, search.env) == (
        "http://127.0.0.1:8931/mcp", "auto", 5, {})
    assert load_config(None, env={}).agent.mcp_servers == []


def test_mcp_env_values_are_secrets(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MCP_OK), env={"FILES_TOKEN": "tok-env-555"})
    assert {"tok-env-555", "ro-literal-77"} <= set(cfg.secret_values())
    dumped = cfg.masked_dump()["agent"]["mcp_servers"][0]
    assert dumped["env"] == {"API_TOKEN": "***", "MODE": "***"}
    assert "tok-env-555" not in repr(cfg) and "ro-literal-77" not in repr(cfg)
    assert "tok-env-555" not in str(cfg.masked_dump())


def test_mcp_server_problems_name_their_entry(tmp_path: Path) -> None:
    found = problems(tmp_path, """
[[agent.mcp_servers]]
name = "a"
command = "x"
url = "http://127.0.0.1/mcp"

[[agent.mcp_servers]]
name = "a"
url = "ftp://example"
args = ["-v"]

[[agent.mcp_servers]]
name = "b"

[[agent.mcp_servers]]
name = "c"
command = "x"
env = { TOKEN = "${NOT_SET_ANYWHERE}" }
""")
    assert found == [
        "agent.mcp_servers[0]: give exactly one of command (a stdio server) and url (a streamable-HTTP server)",
        "agent.mcp_servers[1].name: duplicate name 'a' (also agent.mcp_servers[0])",
        "agent.mcp_servers[1].url: expected an http:// or https:// URL (got 'ftp://example')",
        "agent.mcp_servers[1].args: only used with command (a stdio server); this one has url",
        "agent.mcp_servers[2]: give exactly one of command (a stdio server) and url (a streamable-HTTP server)",
        "agent.mcp_servers[3].env.TOKEN: environment variable NOT_SET_ANYWHERE is not set",
    ]


def test_mcp_server_field_errors(tmp_path: Path) -> None:
    found = problems(tmp_path, """
[[agent.mcp_servers]]
command = "x"

[[agent.mcp_servers]]
name = "has space"
command = "x"
aproval = "auto"
startup_timeout_seconds = 0
env = { TOKEN = 12345678 }
""")
    assert "agent.mcp_servers[0].name: required key is missing" in found
    assert ("agent.mcp_servers[1].name: expected letters, digits, '_' or '-' (it prefixes the tool names) "
            "(got 'has space')") in found
    assert "agent.mcp_servers[1].aproval: unknown key (did you mean 'approval'?)" in found
    assert "agent.mcp_servers[1].startup_timeout_seconds: expected a value > 0 (got 0)" in found
    assert "agent.mcp_servers[1].env.TOKEN: expected a string" in found
    assert not any("12345678" in line for line in found)


# ---- secrets in error messages, unset keys -------------------------------------------------------------

PASTED = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
TG_TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"


@pytest.mark.parametrize("text", [
    f'[web]\nport = "{PASTED}"\n',
    f'[llm]\nprovider = "{PASTED}"\n',
    f'[llm]\nprovider = "openai"\nmodel = "m"\napi_key = "x"\nbase_url = "{PASTED}"\n',
    f'[bridge]\nlog_level = "{PASTED}"\n',
    f'[channels.telegram]\nenabled = true\ntoken = "{TG_TOKEN}"\napi_base = "{TG_TOKEN}"\n',
    '[channels.feishu]\nenabled = true\napp_id = "a"\napp_secret = "plainsecret"\ndomain = "plainsecret"\n',
    '[llm]\nprovider = "openai"\nmodel = "m"\napi_key = "x"\nbase_url = "${OPENAI_API_KEY}"\n',
    '[[agent.mcp_servers]]\nname = "m"\nurl = "localhost/mcp?key=${MCP_KEY}"\n',
])
def test_a_secret_in_the_wrong_key_is_never_echoed(tmp_path: Path, text: str) -> None:
    env = {"OPENAI_API_KEY": "env-key-value-000", "MCP_KEY": "mcp-key-value-111"}
    found = problems(tmp_path, text, env=env)
    assert found  # each is an error...
    joined = "\n".join(found)
    for secret in (PASTED, TG_TOKEN, "plainsecret", "env-key-value-000", "mcp-key-value-111", "AbCdEfGh"):
        assert secret not in joined  # ...that does not repeat the secret


def test_the_dump_masks_a_secret_pasted_into_a_free_text_key(tmp_path: Path) -> None:
    text = f'[llm]\nprovider = "openai"\nmodel = "{PASTED}"\napi_key = "k"\n'
    dump = load_config(write(tmp_path, text), env={}).masked_dump()
    assert dump["llm"]["model"] == "***"
    assert load_config(write(tmp_path, '[llm]\nmodel = "Qwen2.5-72B-Instruct"\n'), env={}).masked_dump()[
        "llm"]["model"] == "Qwen2.5-72B-Instruct"  # an ordinary name stays readable


@pytest.mark.parametrize(("llm", "expected"), [
    ('provider = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:11434/v1"',
     "llm.api_key: environment variable NOT_SET_VAR is not set; no key is sent to http://127.0.0.1:11434/v1 "
     "(fine only if that server takes requests without one)"),
    ('provider = "anthropic"\nmodel = "m"\nbase_url = "http://localhost:4000"',
     "llm.api_key: environment variable NOT_SET_VAR is not set; no key is sent to http://localhost:4000 "
     "(fine only if that server takes requests without one)"),
    ('provider = "local"', "llm.api_key: environment variable NOT_SET_VAR is not set; the local provider uses no key"),
])
def test_an_unset_key_variable_that_is_not_required_is_a_warning(tmp_path: Path, llm: str, expected: str) -> None:
    warnings: list[str] = []
    load_config(write(tmp_path, f'[llm]\n{llm}\napi_key = "${{NOT_SET_VAR}}"\n'), env={}, warnings=warnings)
    assert warnings == [expected]


@pytest.mark.parametrize("llm", [
    'provider = "openai"\nmodel = "m"',  # the official endpoint
    'provider = "openai"\nmodel = "m"\nbase_url = "https://llm.example.com/v1"',
    'provider = "openai"\nmodel = "m"\nbase_url = "http://10.1.2.3:8000/v1"',  # not this machine
    'provider = "anthropic"\nmodel = "m"',
])
def test_an_unset_key_variable_is_an_error_where_the_provider_needs_a_key(tmp_path: Path, llm: str) -> None:
    assert problems(tmp_path, f'[llm]\n{llm}\napi_key = "${{NOT_SET_VAR}}"\n') == [
        "llm.api_key: environment variable NOT_SET_VAR is not set"]
    assert problems(tmp_path, f'[llm]\n{llm}\napi_key = "${{EMPTY_VAR}}"\n', env={"EMPTY_VAR": ""}) == [
        "llm.api_key: environment variable EMPTY_VAR is empty"]


def test_no_warning_for_a_fallback_the_operator_did_not_write(tmp_path: Path) -> None:
    warnings: list[str] = []
    text = '[llm]\nprovider = "openai"\nmodel = "m"\nbase_url = "http://localhost:11434/v1"\n'
    load_config(write(tmp_path, text), env={}, warnings=warnings)
    assert warnings == []


def test_slack_tokens_pasted_into_the_wrong_key_are_refused_without_echoing_them(tmp_path: Path) -> None:
    text = '[channels.slack]\nenabled = true\nbot_token = "xapp-1-A0-secret"\napp_token = "xoxb-2-secret"\n'
    found = problems(tmp_path, text)
    assert found == [
        "channels.slack.bot_token: expected the Bot User OAuth Token (OAuth & Permissions), which starts with 'xoxb-'",
        "channels.slack.app_token: expected an app-level token (Basic Information), which starts with 'xapp-'",
    ]
    assert not any("secret" in line.split(":", 1)[1] for line in found)


def test_media_keys_reach_core_and_vision_takes_auto_true_or_false(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, '[llm]\nvision = "AUTO"\n[media]\nmax_bytes = 10000000\nmax_files = 3\n'
                                      'keep_hours = 2\n'), env={})
    core = cfg.core_settings()
    assert (core.vision, core.media_max_bytes, core.media_max_files, core.media_keep_seconds) == (
        "auto", 10_000_000, 3, 7200.0)
    assert load_config(write(tmp_path, "[llm]\nvision = false\n"), env={}).core_settings().vision is False
    assert problems(tmp_path, '[llm]\nvision = "sometimes"\n') == [
        "llm.vision: expected \"auto\", true or false (got 'sometimes')"]
    assert problems(tmp_path, "[media]\nmax_bytes = 0\n") == ["media.max_bytes: expected a value >= 1 (got 0)"]


def test_transcription_needs_a_model_an_endpoint_and_a_key_off_this_machine_which_is_masked(tmp_path: Path) -> None:
    assert problems(tmp_path, '[media.transcription]\nmodel = "whisper-1"\n') == [
        'media.transcription.base_url: required when model is set (e.g. "https://api.openai.com/v1")']
    assert problems(tmp_path, '[media.transcription]\nmodel = "whisper-1"\nbase_url = "https://api.openai.com/v1"\n'
                    'api_key = "${WHISPER_KEY}"\n', env={}) == [
        "media.transcription.api_key: environment variable WHISPER_KEY is not set"]
    assert problems(tmp_path, '[media.transcription]\nbase_url = "http://127.0.0.1:9000/v1"\n') == [
        'media.transcription.model: required to transcribe (e.g. "whisper-1"); without it base_url and api_key '
        'are not used']
    local = load_config(write(tmp_path, '[media.transcription]\nmodel = "base"\nbase_url = "http://127.0.0.1:9000/v1"\n'),
                        env={})
    assert local.media.transcription.enabled
    key = "sk-whisper-SECRET-0123456789abcdef"
    cfg = load_config(write(tmp_path, '[media.transcription]\nmodel = "whisper-1"\n'
                                      'base_url = "https://api.openai.com/v1"\napi_key = "${K}"\n'), env={"K": key})
    assert cfg.masked_dump()["media"]["transcription"]["api_key"] == "***"
    assert key in cfg.secret_values()
