"""`kvfabric purge --producer NODE` and `kvfabric unbind NODE_ID` as a user runs them: separate
processes, a real local Ray cluster that requires tenants, so purge, stats and unbind work only with
the operator's credential."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli_cluster import run

from transports.trust.certs import issue_tenant


def test_purge_and_stats_carry_the_operator_credential_and_bad_input_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    blank = run(["purge", "--producer", " "], home)
    assert blank.returncode == 2 and "--producer needs a node name" in blank.stderr
    assert "Traceback" not in blank.stderr
    config = tmp_path / "tenants.toml"
    config.write_text("[tenancy]\nrequired = true\n")
    root = tmp_path / "fabric"
    up = run(["up", "--nodes", "2", "--root", str(root), "--config", str(config)], home)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        # the CLI holds the local cluster's CA, so it issues itself the operator credential
        purge = run(["purge", "--producer", "node-gone", "--json"], home)
        assert purge.returncode == 0, purge.stderr[-3000:]
        report = json.loads(purge.stdout.strip().splitlines()[-1])
        assert report["producer"] == "node-gone"
        assert len(report["removed"]) == 2 and set(report["removed"].values()) == {0}
        assert (root / "certs" / "operator.operator.pem").exists()
        stats = run(["stats", "--json"], home)
        assert stats.returncode == 0, stats.stderr[-3000:]
        nodes = json.loads(stats.stdout.strip().splitlines()[-1])["nodes"]
        assert len(nodes) == 2 and all("store" in n for n in nodes), nodes
        tenant, _ = issue_tenant(root / "certs", "bob", out_dir=tmp_path / "bob")
        refused = run(["purge", "--producer", "node-gone", "--json", "--credential", str(tenant)], home)
        assert refused.returncode == 1, refused.stderr[-3000:]
        report = json.loads(refused.stdout.strip().splitlines()[-1])
        assert all(v.startswith("refused:") and "operator call" in v for v in report["removed"].values())
        release = run(["release", "--producer", "node-gone", "--json"], home)   # nothing quarantined: no-op
        assert release.returncode == 0, release.stderr[-3000:]
        assert set(json.loads(release.stdout.strip().splitlines()[-1])["released"].values()) == {False}
        refused = run(["release", "--producer", "node-gone", "--json", "--credential", str(tenant)], home)
        assert refused.returncode == 1 and "operator call" in refused.stdout, refused.stderr[-3000:]
        # the operator clears a node id's binding in the directory (the node binds it again when it reports)
        node = nodes[0]
        unbind = run(["unbind", node["node_id"], "--json"], home)
        assert unbind.returncode == 0, unbind.stderr[-3000:]
        assert json.loads(unbind.stdout.strip().splitlines()[-1])["was_bound_to"] == {"0": node["node_name"]}
        refused = run(["unbind", node["node_id"], "--credential", str(tenant)], home)
        assert refused.returncode == 2 and "operator call" in refused.stderr and "Traceback" not in refused.stderr
    finally:
        down = run(["down"], home)
    assert down.returncode == 0, down.stderr[-3000:]
