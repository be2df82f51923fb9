"""deploy/kubernetes: the DaemonSet is valid against the Kubernetes schema (offline: the schemas
ship in kubernetes-validate), and its parts agree with each other and with ipcpool's config."""

from pathlib import Path

import pytest

from ipcpool.config import parse

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "ipcpool-daemonset.yaml"
KUBERNETES = "1.30.0"


def documents() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_every_resource_is_valid_against_the_kubernetes_schema():
    docs = documents()
    assert sorted(docs) == ["ConfigMap", "DaemonSet", "Namespace"]
    for doc in docs.values():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)   # unknown fields refused too


def test_a_broken_manifest_is_refused():
    ds = documents()["DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][1]["ports"][0]["containerPort"] = "5555"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(ds, KUBERNETES, strict=True)


def test_the_daemonset_the_config_and_the_sockets_agree():
    import tomllib

    docs = documents()
    config = parse(tomllib.loads(docs["ConfigMap"]["data"]["broker.toml"]))
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    broker, serve_peer = pod["containers"]
    assert broker["command"][:2] == ["ipcpool", "broker"] and serve_peer["command"][:2] == ["ipcpool", "serve-peer"]
    (port,) = serve_peer["ports"]
    assert port["containerPort"] == port["hostPort"] == config.fleet.port            # the NIXL listener
    sockets = {v["name"]: v for v in pod["volumes"]}["sockets"]["hostPath"]["path"]
    assert str(config.socket_dir) == sockets
    for c in (broker, serve_peer):                                                     # one directory, one config
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {"sockets": sockets, "config": "/etc/ipcpool"}
        assert c["command"][c["command"].index("--socket-dir") + 1] == sockets
    assert config.allow_gids == set(pod["securityContext"]["supplementalGroups"])      # access by group
    assert pod["hostNetwork"] and config.fleet.serve and config.fleet.peers
