"""Config: defaults that work, clear errors for unknown keys and bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric.config import Config, ConfigError, Environment
from fabric.keys import block_hashes
from fabric.layout import KVLayout


def test_defaults_are_valid() -> None:
    cfg = Config()
    cfg.validate()
    assert cfg.kv.block_size == 16 and cfg.kv.gpu_offload_threshold == 0.85
    assert cfg.kv.cpu_offload_threshold == 0.90 and cfg.kv.prefetch_threshold == 0.7


def test_load_toml(tmp_path: Path) -> None:
    p = tmp_path / "kv.toml"
    p.write_text('[kv]\nram_gib = 2\nssd_dir = "/data/ssd"\nmirror_pulls = false\n'
                 '[transport]\nkind = "quic"\nmax_datagram_size = 1452\n[cluster]\nnum_nodes = 4\n')
    cfg = Config.load(p)
    assert cfg.kv.ram_gib == 2.0 and isinstance(cfg.kv.ram_gib, float)
    assert cfg.kv.ssd_dir == "/data/ssd" and cfg.kv.mirror_pulls is False
    assert cfg.transport.kind == "quic" and cfg.transport.max_datagram_size == 1452
    assert cfg.cluster.num_nodes == 4


def test_events_are_off_by_default_and_load_from_their_section(tmp_path: Path) -> None:
    assert Config().events.enabled is False
    p = tmp_path / "events.toml"
    p.write_text('[events]\nenabled = true\nendpoint = "ipc:///run/kvf/{node}.pub"\n'
                 'replay_endpoint = "tcp://127.0.0.1:5558"\ntopic = "kv"\nbuffer_batches = 100\n')
    events = Config.load(p).events
    assert events.enabled and events.endpoint == "ipc:///run/kvf/{node}.pub"
    assert (events.replay_endpoint, events.topic, events.buffer_batches) == ("tcp://127.0.0.1:5558", "kv", 100)


def test_the_default_events_endpoint_is_a_per_node_ipc_socket() -> None:
    events = Config().events
    assert events.endpoint.startswith("ipc://") and "{node}" in events.endpoint and not events.replay_endpoint


@pytest.mark.parametrize(("text", "message"), [
    ('[events]\nenabled = true\nendpoint = "tcp://[::]:5557"\n', "reachable from other hosts"),
    ('[events]\nenabled = true\nendpoint = "tcp://10.0.0.5:5557"\n', "reachable from other hosts"),
    ('[events]\nenabled = true\nreplay_endpoint = "tcp://0.0.0.0:5558"\n', "events.replay_endpoint"),
    ('[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:5557"\n[tenancy]\nrequired = true\n',
     "tenants' prompt token ids"),
    ('[events]\nenabled = true\nendpoint = "tcp://0.0.0.0:5557"\ncurve_secret_key = "n.key_secret"\n',
     "curve_allow_dir"),
])
def test_events_other_hosts_or_tenants_could_read_are_refused(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message):
        Config.load(p)


@pytest.mark.parametrize("text", [
    '[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:5557"\n',
    '[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:5557"\ntoken_ids_tenants = []\n[tenancy]\nrequired = true\n',
    '[events]\nenabled = true\nendpoint = "ipc:///run/kvf/{node}.pub"\n[tenancy]\nrequired = true\n',
    '[events]\nenabled = true\nendpoint = "tcp://0.0.0.0:5557"\ncurve_secret_key = "n.key_secret"\n'
    'curve_allow_dir = "consumers"\n[tenancy]\nrequired = true\n',
])
def test_events_on_loopback_ipc_or_curve_are_allowed(tmp_path: Path, text: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    assert Config.load(p).events.enabled


@pytest.mark.parametrize(("text", "message"), [
    ("[kv]\nram_gb = 1\n", "unknown key 'ram_gb'"),
    ("[kvv]\n", r"unknown section \[kvv\]"),
    ("[kv]\nblock_size = 1.5\n", "block_size: must be an integer"),
    ("[kv]\nmirror_pulls = 1\n", "must be true or false"),
    ("[kv]\nram_gib = -1\n", "kv.ram_gib must be > 0"),
    ("[kv]\nprefetch_threshold = 1.5\n", r"must be in \(0, 1\]"),
    ("[transport]\nkind = \"udp\"\n", "must be one of"),
    ("[transport]\nquic_backend = \"quiche\"\n", "quic_backend: must be one of 'auto', 'aioquic', 'qh3'"),
    ("[transport]\nmax_datagram_size = 100000\n", "max_datagram_size must be in"),
    ("[cluster]\nlease_s = 1\nheartbeat_s = 2\n", "must exceed"),
    ("kv = 3\n", "must be a table"),
    ("[events]\nendpoint = \"127.0.0.1:5557\"\n", "events.endpoint must be a tcp://"),
    ("[events]\nreplay_endpoint = \"http://x\"\n", "events.replay_endpoint must be a tcp://"),
    ("[events]\nbuffer_batches = 0\n", "events.buffer_batches must be > 0"),
    ("[kv\n", "not valid TOML"),
])
def test_bad_config_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        Config.load(p)
    assert str(p) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        Config.load(tmp_path / "nope.toml")


def test_namespaces_take_the_configured_block_size(tmp_path: Path) -> None:
    p = tmp_path / "kv.toml"
    p.write_text("[kv]\nblock_size = 4\n")
    layout = KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=8, dtype="f16")
    ns = Config.load(p).kv.namespace("m", layout, tenant_salt=b"t")
    assert ns.block_size == 4 and ns.tenant_salt == b"t"
    assert len(block_hashes(ns, list(range(10)))) == 2           # full blocks of 4 tokens
    assert ns.root != Config().kv.namespace("m", layout, tenant_salt=b"t").root


def test_tenancy_is_optional_by_default_and_loads_shared_groups(tmp_path: Path) -> None:
    assert (Config().tenancy.required, Config().tenancy.shared) == (False, [])
    p = tmp_path / "tenancy.toml"
    p.write_text('[tenancy]\nrequired = true\nshared = [["a", "b"]]\ncredential = "/etc/kvf/a.tenant.pem"\n')
    tenancy = Config.load(p).tenancy
    assert tenancy.required and tenancy.shared == [["a", "b"]] and tenancy.credential.endswith("a.tenant.pem")
    for bad, message in (('shared = ["a", "b"]', r"shared\[0\]: must be a list"),
                         ('shared = [["a"]]', "two or more tenants"),
                         ('shared = [["a", "b"], ["b", "c"]]', "none in two groups"),
                         ("token_ttl_s = 7200", "token_ttl_s must be in")):
        p.write_text(f"[tenancy]\n{bad}\n")
        with pytest.raises(ConfigError, match=message):
            Config.load(p)


def test_the_environment_names_home_node_and_advertised_host_and_unset_means_the_defaults() -> None:
    env = Environment.read({"KVFABRIC_HOME": "/srv/kv", "KVFABRIC_NODE_NAME": "pod-3",
                            "KVFABRIC_ADVERTISE_HOST": "pod-3.nodes.ml.svc"})
    assert (env.home, env.node_name, env.advertise_host) == (Path("/srv/kv"), "pod-3", "pod-3.nodes.ml.svc")
    bare = Environment.read({})
    assert (bare.home, bare.node_name, bare.advertise_host) == (Path.home() / ".cache" / "kvfabric", "", "")
