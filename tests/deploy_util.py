"""What the deployment tests (test_deploy.py, test_deploy_gateway.py) read: the files' paths, the
ports and routes they must agree on, and parsers for the Dockerfiles, compose files and
Kubernetes manifests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import dockerfile_parse  # dev extra
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


def project_version() -> str:
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "no version in pyproject.toml"
    return match.group(1)


IMAGE = f"siesta-serve:{project_version()}"


def instructions(dockerfile: Path = DOCKERFILE) -> list[dict]:
    parser = dockerfile_parse.DockerfileParser(path=str(dockerfile))
    return parser.structure


def dockerfile_values(instruction: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    return [i["value"] for i in instructions(dockerfile) if i["instruction"] == instruction]


def exec_form(value: str) -> list[str]:
    """An instruction's JSON (exec) form as a list; fails on the shell form."""
    parsed = json.loads(value)
    assert isinstance(parsed, list), value
    return parsed


def built_from(compose: Path, svc: dict) -> Path:
    """The Dockerfile a compose service builds."""
    build = svc["build"]
    return (compose.parent / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()


def compose_service() -> dict:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert list(services) == ["siesta"], list(services)
    return services["siesta"]


def kube_docs(*paths: Path) -> dict[tuple[str, str], dict]:
    """The manifests' documents by (kind, name): of `paths`, or of every file in KUBE_DIR."""
    docs = {}
    for path in paths or sorted(KUBE_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def deployed_container() -> tuple[dict, dict]:
    deployment = kube_docs()[("Deployment", "siesta")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return deployment, container
