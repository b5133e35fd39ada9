"""The replicas behind the SGLang Model Gateway: deploy/gateway/Dockerfile,
deploy/docker-compose.replicas.yml and deploy/kubernetes/gateway.yaml, checked as test_deploy.py
checks the one-server files (no Docker engine or cluster runs in CI), against the one-server files
they extend; the gateway's arguments are parsed by smg's own command-line parser.
"""

from __future__ import annotations

import re

import pytest
import yaml  # dev extra (pyyaml)
from deploy_util import (
    COMPOSE,
    DOCKERFILE,
    GATEWAY_DOCKERFILE,
    GATEWAY_KUBE,
    HEALTH,
    LIVENESS,
    PORT,
    READINESS,
    REPLICAS_COMPOSE,
    built_from,
    compose_service,
    deployed_container,
    dockerfile_values,
    exec_form,
    kube_docs,
)


def _smg_pin() -> str:
    """The smg version the gateway image installs (`pip install ... smg==X`)."""
    pins = [m.group(1) for run in dockerfile_values("RUN", GATEWAY_DOCKERFILE) for m in re.finditer(r"\bsmg==([\w.]+)", run)]
    assert len(pins) == 1, f"pin smg exactly once in {GATEWAY_DOCKERFILE}: {pins}"
    return pins[0]


def _gateway_image() -> str:
    return f"siesta-gateway:{_smg_pin()}"


def _gateway_args(argv: list) -> object:
    """The gateway's arguments as `python -m smg.launch_router` reads them: smg's own parser
    (RouterArgs.add_cli_args and RouterArgs.from_cli_args); a flag it does not know fails."""
    launch_router = pytest.importorskip("smg.launch_router")
    return launch_router.parse_router_args([str(a) for a in argv])


def _seconds(value: object) -> float:
    """A compose duration such as `200s` or `3m`, in seconds."""
    match = re.fullmatch(r"(\d+)(s|m)", str(value))
    assert match, f"unsupported duration {value!r}"
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_gateway_dockerfile_shape():
    from importlib.metadata import version

    (base,) = dockerfile_values("FROM", GATEWAY_DOCKERFILE)
    name, _, tag = base.partition(":")
    assert name == "python" and "slim" in tag, base

    runs = [run for run in dockerfile_values("RUN", GATEWAY_DOCKERFILE) if "smg==" in run]
    assert runs and all("--no-cache-dir" in run for run in runs), runs
    # The manifests' arguments are checked with the smg installed here: it must be the image's.
    assert _smg_pin() == version("smg"), "the image's smg differs from the one the tests parse with"

    users = dockerfile_values("USER", GATEWAY_DOCKERFILE)
    assert users and users[-1].split(":")[0] not in ("root", "0"), users

    assert dockerfile_values("EXPOSE", GATEWAY_DOCKERFILE) == [str(PORT)]
    (healthcheck,) = dockerfile_values("HEALTHCHECK", GATEWAY_DOCKERFILE)
    assert f"http://127.0.0.1:{PORT}{READINESS}" in healthcheck and "urllib" in healthcheck, healthcheck

    (entrypoint,) = dockerfile_values("ENTRYPOINT", GATEWAY_DOCKERFILE)
    assert exec_form(entrypoint) in (["python", "-m", "smg.launch_router"], ["smg", "launch"])
    (cmd,) = dockerfile_values("CMD", GATEWAY_DOCKERFILE)
    args = _gateway_args(exec_form(cmd))
    assert (args.host, args.port) == ("0.0.0.0", PORT)
    assert not dockerfile_values("COPY", GATEWAY_DOCKERFILE), "the build context (deploy/gateway) holds only the Dockerfile"


def _replicas_compose() -> tuple[dict[str, dict], dict]:
    """The Siesta replicas (services built from the repository's Dockerfile) and the gateway."""
    services = yaml.safe_load(REPLICAS_COMPOSE.read_text())["services"]
    replicas = {name: svc for name, svc in services.items() if name != "gateway"}
    for name, svc in replicas.items():
        assert built_from(REPLICAS_COMPOSE, svc) == DOCKERFILE, name
    return replicas, services["gateway"]


def test_replicas_compose_replicas_match_the_one_gpu_file():
    one = compose_service()
    replicas, _ = _replicas_compose()
    assert len(replicas) >= 2, list(replicas)

    gpus = []
    for name, svc in replicas.items():
        for key in ("image", "command", "volumes", "healthcheck", "shm_size", "restart"):
            assert svc.get(key) == one[key], f"{name}.{key} differs from {COMPOSE.name}"
        assert "ports" not in svc, f"{name} publishes a port: only the gateway should"

        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia", name
        assert "count" not in device, f"{name}: pin one GPU with device_ids, not count"
        (gpu,) = device["device_ids"]
        gpus.append(str(gpu))
    assert len(set(gpus)) == len(gpus), f"replicas share a GPU: {gpus}"


def test_replicas_compose_gateway():
    replicas, gateway = _replicas_compose()
    assert built_from(REPLICAS_COMPOSE, gateway) == GATEWAY_DOCKERFILE
    assert gateway["image"] == _gateway_image()

    args = _gateway_args(gateway["command"])
    replica_ports = set()
    for svc in replicas.values():
        command = [str(c) for c in svc["command"]]
        replica_ports.add(int(command[command.index("--port") + 1]))
    (replica_port,) = replica_ports
    assert sorted(args.worker_urls) == sorted(f"http://{name}:{replica_port}" for name in replicas)
    assert len(args.worker_urls) == len(set(args.worker_urls))
    assert args.policy == "cache_aware"
    assert args.enable_rl is True
    assert not args.service_discovery and not args.disable_health_check
    assert args.health_check_endpoint == HEALTH
    assert (args.host, args.port) == ("0.0.0.0", PORT)

    (published,) = gateway["ports"]
    assert str(published).startswith("127.0.0.1:") and str(published).endswith(f":{args.port}"), published
    depends = gateway["depends_on"]
    assert set(depends) == set(replicas)
    assert all(d["condition"] == "service_healthy" for d in depends.values()), depends
    assert _seconds(gateway["stop_grace_period"]) > args.shutdown_grace_period_secs


def _gateway_kube() -> dict[tuple[str, str], dict]:
    return kube_docs(GATEWAY_KUBE)


def _gateway_deployment() -> tuple[dict, dict, object]:
    (deployment,) = [d for (kind, _), d in _gateway_kube().items() if kind == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container, _gateway_args(container["args"])


def test_kubernetes_gateway_discovers_the_siesta_pods():
    siesta, siesta_container = deployed_container()
    siesta_labels = siesta["spec"]["template"]["metadata"]["labels"]
    deployment, container, args = _gateway_deployment()
    gateway_labels = deployment["spec"]["template"]["metadata"]["labels"]

    assert args.selected_discovery_provider() == "kubernetes"
    assert args.worker_urls == []
    assert args.selector and args.selector.items() <= siesta_labels.items(), args.selector
    assert not args.selector.items() <= gateway_labels.items(), "the gateway would discover itself"
    assert [args.service_discovery_port] == [p["containerPort"] for p in siesta_container["ports"]]
    assert args.health_check_endpoint == siesta_container["readinessProbe"]["httpGet"]["path"]
    assert args.policy == "cache_aware"
    assert args.enable_rl is True

    # Without a namespace smg watches every namespace (and would need a ClusterRole): it must be
    # this pod's own, from the downward API.
    match = re.fullmatch(r"\$\((\w+)\)", args.service_discovery_namespace or "")
    assert match, f"--service-discovery-namespace {args.service_discovery_namespace!r}"
    (env,) = [e for e in container["env"] if e["name"] == match.group(1)]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_kubernetes_gateway_deployment_and_service():
    deployment, container, args = _gateway_deployment()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["replicas"] == 1
    assert container["image"].rsplit("/", 1)[-1] == _gateway_image()
    assert (args.host, args.port) == ("0.0.0.0", PORT)
    (port,) = container["ports"]
    assert port["containerPort"] == args.port

    for probe, path in (("readinessProbe", READINESS), ("livenessProbe", LIVENESS)):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert get["port"] in (args.port, port["name"]), probe
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_grace_period_secs

    service = _gateway_kube()[("Service", "siesta-gateway")]
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == PORT
    assert service_port["targetPort"] in (args.port, port["name"])


# What smg's Kubernetes discovery does with the API (model_gateway/src/service_discovery/
# kubernetes.rs): one kube-runtime watcher on Pods in --service-discovery-namespace, i.e. LIST
# then WATCH; it reads no other resource and writes nothing.
DISCOVERY_ACCESS = {("", "pods", "list"), ("", "pods", "watch")}


def test_kubernetes_gateway_rbac():
    docs = _gateway_kube()
    deployment, _, args = _gateway_deployment()
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in docs

    bindings = [d for (kind, _), d in docs.items() if kind == "RoleBinding"]
    roles = []
    for binding in bindings:
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            ref = binding["roleRef"]
            assert ref["kind"] == "Role", "a namespaced watch needs a Role, not a ClusterRole"
            roles.append(docs[("Role", ref["name"])])
    assert roles, f"no RoleBinding grants anything to {account}"

    granted = set()
    for role in roles:
        for rule in role["rules"]:
            assert "resourceNames" not in rule, rule  # a LIST or WATCH cannot be narrowed by name
            granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == DISCOVERY_ACCESS, f"granted {sorted(granted)}"
    assert args.service_discovery_namespace, "a Role covers one namespace: smg must watch only that"
