"""The configuration both engine adapters (kvwire.sglang, kvwire.vllm) read from the environment
alike, from kvwire itself: the key (or none), the host a listener is published at, and
``host:port``. No engine needed."""

import kvwire


def test_insecure_only_when_asked_and_no_key_is_set(monkeypatch):
    for var in ("KVWIRE_INSECURE_NO_AUTH", "KVWIRE_PSK", "KVWIRE_PSK_FILE"):
        monkeypatch.delenv(var, raising=False)
    options = {}
    kvwire._insecure_from_env(options)
    assert options == {}

    monkeypatch.setenv("KVWIRE_INSECURE_NO_AUTH", "1")
    kvwire._insecure_from_env(options)
    assert options == {"insecure_no_auth": True}

    # A key in the options or the environment wins: never both.
    options = {"psk": b"\x01" * 32}
    kvwire._insecure_from_env(options)
    assert "insecure_no_auth" not in options
    monkeypatch.setenv("KVWIRE_PSK", "ab" * 32)
    options = {}
    kvwire._insecure_from_env(options)
    assert options == {}


def test_the_advertised_host_is_the_environments_then_the_listen_host(monkeypatch):
    monkeypatch.delenv("KVWIRE_ADVERTISE_HOST", raising=False)
    assert kvwire._advertise_host("10.1.2.3") == "10.1.2.3"
    wildcard = kvwire._advertise_host("0.0.0.0")
    assert wildcard not in ("0.0.0.0", "")  # an address another host can reach
    monkeypatch.setenv("KVWIRE_ADVERTISE_HOST", "decode-7.example")
    assert kvwire._advertise_host("0.0.0.0") == "decode-7.example"
    assert kvwire._advertise_host("10.1.2.3") == "decode-7.example"


def test_host_port_brackets_ipv6():
    assert kvwire._join_host_port("10.0.0.1", 7500) == "10.0.0.1:7500"
    assert kvwire._join_host_port("::1", 0) == "[::1]:0"
    assert kvwire._join_host_port("[::1]", 9) == "[::1]:9"
    assert kvwire._join_host_port("node-a", "80") == "node-a:80"
