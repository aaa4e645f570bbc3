"""The pure half of the network test bed: profiles, the address plan and the commands it runs."""

from __future__ import annotations

import pytest

from cluster.netbed.plan import (
    PROFILES,
    BedPlan,
    NetbedError,
    choose_subnet,
    create_commands,
    delete_commands,
    nft_ruleset,
    parse_profile,
    ray_start_command,
    shape_commands,
)

PLAN = BedPlan("kvb0a1f", 3, "10.213.7.0/24")


def test_named_profiles_carry_rate_delay_and_loss() -> None:
    assert parse_profile("wan") == PROFILES["wan"]
    wan = PROFILES["wan"]
    assert (wan.rate_bps, wan.delay_ms, wan.loss_per_mille) == (200_000_000, 20.0, 1)
    assert PROFILES["lossy"].loss_per_mille == 10 and PROFILES["lan"].rate_bps == 10_000_000_000


def test_a_custom_profile_is_parsed_field_by_field() -> None:
    p = parse_profile("rate=40mbit,delay=2ms,loss=0.5%")
    assert (p.rate_bps, p.delay_ms, p.loss_per_mille) == (40_000_000, 2.0, 5)


@pytest.mark.parametrize("bad, words", [("fast", "unknown link profile"), ("rate=12", "bad rate"),
                                        ("delay=1ms", "needs a rate"), ("rate=1gbit,jitter=1ms", "bad link field"),
                                        ("rate=1gbit,loss=150%", "within 0..100")])
def test_a_bad_profile_is_refused_with_what_is_wrong(bad: str, words: str) -> None:
    with pytest.raises(NetbedError, match=words):
        parse_profile(bad)


def test_the_plan_names_every_host_under_the_bed_prefix_with_its_own_address() -> None:
    assert PLAN.namespaces() == ["kvb0a1fh0", "kvb0a1fh1", "kvb0a1fh2"]
    assert [PLAN.address(i) for i in range(3)] == ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
    assert (PLAN.bridge, PLAN.bridge_address, PLAN.veth(2)) == ("kvb0a1fbr", "10.213.7.254", "kvb0a1fv2")
    assert all(len(name) <= 15 for name in [PLAN.bridge, PLAN.veth(2)])   # Linux interface names
    with pytest.raises(NetbedError, match="no host 3"):
        PLAN.address(3)


@pytest.mark.parametrize("prefix, hosts, subnet", [("kvb0A1F", 1, "10.0.0.0/24"), ("bed0001", 1, "10.0.0.0/24"),
                                                   ("kvb0a1f", 0, "10.0.0.0/24"), ("kvb0a1f", 1, "8.8.8.0/24"),
                                                   ("kvb0a1f", 1, "10.0.0.0/16")])
def test_a_plan_that_could_touch_something_else_is_refused(prefix: str, hosts: int, subnet: str) -> None:
    with pytest.raises(NetbedError):
        BedPlan(prefix, hosts, subnet)


def test_the_subnet_avoids_networks_already_on_the_machine() -> None:
    seed = bytes([13, 7, 13, 8])
    assert choose_subnet(seed, []) == "10.213.7.0/24"
    assert choose_subnet(seed, ["10.213.7.5/24", "127.0.0.1/8"]) == "10.213.8.0/24"
    with pytest.raises(NetbedError, match="no free"):
        choose_subnet(bytes([13, 7]), ["10.0.0.0/8"])


def test_create_and_delete_touch_only_the_beds_names() -> None:
    made = {arg for cmd in create_commands(PLAN) for arg in cmd if arg.startswith("kvb")}
    removed = {cmd[-1] for cmd in delete_commands(PLAN)}
    assert made == removed == {PLAN.bridge, *PLAN.namespaces(), *(PLAN.veth(i) for i in range(3))}
    assert ["ip", "-n", "kvb0a1fh1", "addr", "add", "10.213.7.2/24", "dev", "eth0"] in create_commands(PLAN)


def test_shaping_limits_both_directions_of_a_hosts_link() -> None:
    inside, outside = shape_commands(PLAN, 1, PROFILES["wan"])
    assert inside[:4] == ["ip", "netns", "exec", "kvb0a1fh1"] and "eth0" in inside
    assert "kvb0a1fv1" in outside
    for cmd in (inside, outside):
        assert cmd[cmd.index("rate") + 1] == "200000000bit"
        assert int(cmd[cmd.index("burst") + 1]) >= 64 << 10


def test_the_ruleset_drops_random_egress_and_everything_to_and_from_a_cut_peer() -> None:
    rules = nft_ruleset(10, ["10.213.7.3"])
    assert 'oifname "eth0" numgen random mod 1000 < 10 drop' in rules
    assert "ip daddr 10.213.7.3 drop" in rules and "ip saddr 10.213.7.3 drop" in rules
    assert rules.index("delete table") < rules.index("table inet kvfabric_bed {")   # replaced atomically
    clean = nft_ruleset(0, [])
    assert "drop" not in clean
    with pytest.raises(ValueError):
        nft_ruleset(0, ["10.213.7.3; flush ruleset"])


def test_ray_starts_the_head_on_host_0_and_joins_the_others_to_its_address() -> None:
    head = ray_start_command("/v/ray", PLAN, 0, "/tmp/kvb0a1f", port=6379, num_cpus=1,
                             object_store_bytes=1 << 27, system_config="{}")
    worker = ray_start_command("/v/ray", PLAN, 2, "/tmp/kvb0a1f", port=6379, num_cpus=1,
                               object_store_bytes=1 << 27, system_config="{}")
    assert "--head" in head and "--include-dashboard=false" in head
    assert worker[worker.index("--address") + 1] == "10.213.7.1:6379"
    assert worker[worker.index("--node-ip-address") + 1] == "10.213.7.3"
    assert all(cmd[cmd.index("--temp-dir") + 1] == "/tmp/kvb0a1f" for cmd in (head, worker))
    assert "stop" not in head + worker
