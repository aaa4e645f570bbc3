"""charts/kvfabric renders, lints and validates offline; the rendered objects fit together as a user's
cluster needs them to (names, ports, mounts, selectors), with default values and with every feature on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_support import (
    ALL_FEATURES,
    CHART,
    MONITOR_APIS,
    by_kind,
    fabric_toml,
    one,
    pod_specs,
    render,
    run_helm,
    validate,
)

from transports.trust.certs import CA_CERT, CA_KEY, CRL

CASES = {"default": {}, "all-features": ALL_FEATURES}


@pytest.fixture(scope="module", params=list(CASES))
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp(request.param)
    return render(tmp, CASES[request.param], api_versions=MONITOR_APIS)


@pytest.mark.parametrize("case", list(CASES))
def test_helm_lint_strict(case: str, tmp_path: Path) -> None:
    result = run_helm("lint", "--strict", str(CHART), values=CASES[case], tmp=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_every_object_validates_offline(rendered: list[dict[str, Any]]) -> None:
    assert rendered
    for obj in rendered:
        validate(obj)


def test_a_kind_without_a_schema_fails_validation() -> None:
    # The guarantee the test above leans on: an unknown kind is an error, not a pass.
    import kubernetes_validate

    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_a_typo_in_a_custom_resource_fails_validation(rendered: list[dict[str, Any]]) -> None:
    cluster = one(rendered, "RayCluster")
    typo = {**cluster, "spec": {**cluster["spec"], "workerGroupSpec": []}}
    with pytest.raises(AssertionError, match="workerGroupSpec"):
        validate(typo)


def test_kinds_rendered_with_every_feature_on(tmp_path: Path) -> None:
    objects = render(tmp_path, ALL_FEATURES, api_versions=MONITOR_APIS)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["ConfigMap", "ConfigMap", "Service", "Service", "RayCluster", "RayJob", "ServiceMonitor",
                            "PodMonitor", "Issuer", "Issuer", "Certificate"])


def test_monitors_only_when_the_api_exists(tmp_path: Path) -> None:
    objects = render(tmp_path, ALL_FEATURES)  # no --api-versions: prometheus-operator is not installed
    assert not by_kind(objects, "ServiceMonitor") and not by_kind(objects, "PodMonitor")
    assert by_kind(objects, "RayCluster")


def test_every_object_and_pod_carries_the_standard_labels(rendered: list[dict[str, Any]]) -> None:
    required = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by", "app.kubernetes.io/part-of", "app.kubernetes.io/component"}
    for obj in rendered:
        assert required <= set(obj["metadata"]["labels"]), obj["metadata"]["name"]
    for pod in pod_specs(one(rendered, "RayCluster")):
        assert required <= set(pod["metadata"]["labels"])


def test_raycluster_image_and_gpus(rendered: list[dict[str, Any]]) -> None:
    cluster = one(rendered, "RayCluster")
    values_image = ALL_FEATURES["image"] if len(cluster["spec"]["workerGroupSpecs"]) > 1 else None
    expected_image = (f"{values_image['repository']}:{values_image['tag']}" if values_image
                      else "ghcr.io/kvfabric/kvfabric:0.1.0")
    for pod in pod_specs(cluster):
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert container["image"] == expected_image
        assert "command" not in pod["spec"]["containers"][0], "KubeRay would block on a foreground command"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    for group in cluster["spec"]["workerGroupSpecs"]:
        res = group["template"]["spec"]["containers"][0]["resources"]
        gpus = res["limits"]["nvidia.com/gpu"]
        assert gpus >= 1
        assert res["requests"]["nvidia.com/gpu"] == gpus, "GPU requests must equal limits"
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_volumes_match_the_config_paths(rendered: list[dict[str, Any]]) -> None:
    cfg = fabric_toml(rendered)
    cluster = one(rendered, "RayCluster")
    cert_dir = cfg["transport"]["cert_dir"]
    for pod in pod_specs(cluster):
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert set(volumes) == set(mounts) == {"config", "node-tls", "crl", "certs", "ssd", "dshm"}
        # The config file the bootstrap job names is the ConfigMap's key under its mount.
        assert volumes["config"]["configMap"]["name"] == one(rendered, "ConfigMap", "-config")["metadata"]["name"]
        assert mounts["config"] + "/kvfabric.toml" == "/etc/kvfabric/kvfabric.toml"
        # SSD tier and index live on the SSD volume.
        for key in ("ssd_dir", "index_dir"):
            assert Path(cfg["kv"][key]).is_relative_to(mounts["ssd"])
        # Certificates: tls-setup links the pod's own certificate (csi-driver), the CA certificate and the
        # revocation list into cert_dir under the names transports/trust/certs.py and the NodeActor open.
        assert mounts["certs"] == cert_dir
        assert volumes["certs"]["emptyDir"]["medium"] == "Memory"
        setup = next(c for c in pod["spec"]["initContainers"] if c["name"] == "tls-setup")
        script = setup["command"][-1]
        attrs = volumes["node-tls"]["csi"]["volumeAttributes"]
        tls_dir = mounts["node-tls"]
        assert f"{tls_dir}/{attrs['csi.cert-manager.io/ca-file']} {cert_dir}/{CA_CERT}" in script
        assert f"{tls_dir}/{attrs['csi.cert-manager.io/certificate-file']} {cert_dir}/$KVFABRIC_NODE_NAME.pem" in script
        assert f"{tls_dir}/{attrs['csi.cert-manager.io/privatekey-file']} {cert_dir}/$KVFABRIC_NODE_NAME.key" in script
        assert f"{mounts['crl']}/{CRL} {cert_dir}/{CRL}" in script
        assert volumes["crl"]["secret"]["optional"] is True
        setup_mounts = {m["name"]: m["mountPath"] for m in setup["volumeMounts"]}
        assert setup_mounts == {"node-tls": mounts["node-tls"], "crl": mounts["crl"], "certs": cert_dir}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert mounts["dshm"] == "/dev/shm"


def test_ssd_volume_kinds(tmp_path: Path) -> None:
    for kind, key in (("hostPath", "hostPath"), ("ephemeralVolume", "ephemeral"), ("emptyDir", "emptyDir")):
        objects = render(tmp_path, {"ssd": {"type": kind}})
        for pod in pod_specs(one(objects, "RayCluster")):
            ssd = next(v for v in pod["spec"]["volumes"] if v["name"] == "ssd")
            assert key in ssd, (kind, ssd)
            init = {c["name"] for c in pod["spec"]["initContainers"]}
            assert ("ssd-permissions" in init) == (kind == "hostPath"), "only a hostPath folder needs its owner fixed"


def test_ports_are_named_as_services_and_monitors_select_them(tmp_path: Path) -> None:
    objects = render(tmp_path, ALL_FEATURES, api_versions=MONITOR_APIS)
    cfg = fabric_toml(objects)
    service = one(objects, "Service", "-metrics")
    port = service["spec"]["ports"][0]
    assert port["port"] == cfg["cluster"]["metrics_port"]
    for pod in pod_specs(one(objects, "RayCluster")):
        labels = pod["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), "the metrics Service selects every Ray pod"
        ports = {p["name"]: p for p in pod["spec"]["containers"][0]["ports"]}
        assert ports[port["targetPort"]]["containerPort"] == cfg["cluster"]["metrics_port"]
        assert ports["kvf-tls"]["containerPort"] == cfg["transport"]["tcp_port"]
        assert (ports["kvf-quic"]["containerPort"], ports["kvf-quic"]["protocol"]) == (
            cfg["transport"]["quic_port"], "UDP")
        assert all(len(name) <= 15 for name in ports)
        podmonitor = one(objects, "PodMonitor")
        assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert podmonitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_bootstrap_job_targets_the_cluster_and_keeps_it(rendered: list[dict[str, Any]]) -> None:
    cluster, job = one(rendered, "RayCluster"), one(rendered, "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["spec"]["shutdownAfterJobFinishes"] is False
    assert "rayClusterSpec" not in job["spec"]
    assert job["spec"]["entrypoint"] == "kvfabric start --address auto --config /etc/kvfabric/kvfabric.toml"


def pod_env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_each_pod_gets_its_own_certificate_naming_it_and_the_name_it_advertises(tmp_path: Path) -> None:
    objects = render(tmp_path, ALL_FEATURES)
    issuer = one(objects, "Issuer", "-ca")
    service = one(objects, "Service", "-nodes")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    for pod in pod_specs(one(objects, "RayCluster")):
        assert pod["spec"]["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        csi = next(v for v in pod["spec"]["volumes"] if v["name"] == "node-tls")["csi"]
        attrs = csi["volumeAttributes"]
        assert csi["driver"] == "csi.cert-manager.io" and csi["readOnly"] is True
        assert attrs["csi.cert-manager.io/issuer-name"] == issuer["metadata"]["name"]
        names = attrs["csi.cert-manager.io/dns-names"].split(",")
        env = pod_env(pod["spec"]["containers"][0])
        # transports/certs.node_name_of: the first DNS name is the node; the NodeActor advertises the second.
        assert names[0] == "${POD_NAME}" and env["KVFABRIC_NODE_NAME"] == "$(POD_NAME)"
        assert names[1].replace("${", "$(").replace("}", ")") == env["KVFABRIC_ADVERTISE_HOST"]
        assert names[1] == f"${{POD_NAME}}.{service['metadata']['name']}.${{POD_NAMESPACE}}.svc"
        assert {"server auth", "client auth"} <= set(attrs["csi.cert-manager.io/key-usages"].split(","))
        assert "csi.cert-manager.io/is-ca" not in attrs


@pytest.mark.parametrize("tls", [ALL_FEATURES["tls"], {"existingSecret": "corp-kvfabric-ca"}])
def test_no_pod_or_job_mounts_the_ca_private_key(tmp_path: Path, tls: dict[str, Any]) -> None:
    """The CA key is in one Secret, read by cert-manager's CA Issuer alone."""
    objects = render(tmp_path, {**ALL_FEATURES, "tls": tls})
    ca_secret = one(objects, "Issuer", "-ca")["spec"]["ca"]["secretName"]
    assert ca_secret == (tls["existingSecret"] or one(objects, "Certificate", "-ca")["spec"]["secretName"])
    templates = [*pod_specs(one(objects, "RayCluster"))]
    job = one(objects, "RayJob")
    if "submitterPodTemplate" in job["spec"]:
        templates.append(job["spec"]["submitterPodTemplate"])
    assert templates
    for pod in templates:
        for volume in pod["spec"].get("volumes", []):
            assert volume.get("secret", {}).get("secretName") != ca_secret, volume
            for source in volume.get("projected", {}).get("sources", []):
                assert source.get("secret", {}).get("name") != ca_secret, volume
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert CA_KEY not in repr(container.get("command", [])) + repr(container.get("args", []))
            for ref in container.get("envFrom", []):
                assert ref.get("secretRef", {}).get("name") != ca_secret
            for value in pod_env(container).values():
                assert ca_secret not in repr(value)


def test_cert_manager_ca_is_self_signed_and_feeds_the_node_issuer(tmp_path: Path) -> None:
    objects = render(tmp_path, ALL_FEATURES)
    ca_cert = one(objects, "Certificate", "-ca")
    assert ca_cert["spec"]["isCA"] is True
    assert "cert sign" in ca_cert["spec"]["usages"] and "crl sign" in ca_cert["spec"]["usages"]
    # `kvfabric certs revoke` checks CRL signatures with an EC CA key (transports/certs.revoked_serials).
    assert ca_cert["spec"]["privateKey"]["algorithm"] == "ECDSA"
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(objects, "Issuer")}
    assert issuers[ca_cert["spec"]["issuerRef"]["name"]] == {"selfSigned": {}}
    assert {"ca": {"secretName": ca_cert["spec"]["secretName"]}} in issuers.values()


def test_an_existing_ca_secret_is_only_the_issuers(tmp_path: Path) -> None:
    objects = render(tmp_path, {"tls": {"existingSecret": "corp-kvfabric-ca"}})
    assert not by_kind(objects, "Certificate")
    assert [i["spec"] for i in by_kind(objects, "Issuer")] == [{"ca": {"secretName": "corp-kvfabric-ca"}}]


def test_gcs_fault_tolerance_wiring(tmp_path: Path) -> None:
    cluster = one(render(tmp_path, ALL_FEATURES), "RayCluster")
    ft = cluster["spec"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] == "redis.infra.svc:6379"
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "password"}
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert "gcsFaultToleranceOptions" not in one(render(tmp_path, {}), "RayCluster")["spec"]


def test_config_change_rolls_the_pods(tmp_path: Path) -> None:
    def checksum(values: dict[str, Any]) -> str:
        cluster = one(render(tmp_path, values), "RayCluster")
        return str(cluster["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) != checksum({"config": {"kv": {"ram_gib": 48}}})
