"""The service's deploy files: the Kubernetes manifests fit together, the Dockerfile installs
pinned torch before the project and copies paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def _docs() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"]] = doc
    return out


def test_manifests_fit_together():
    docs = _docs()
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim", "Secret"}
    dep, svc = docs["Deployment"], docs["Service"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert container["args"][:2] == ["autopar", "serve"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e for e in container["env"]}
    token = env["AUTOPAR_API_TOKENS"]["valueFrom"]["secretKeyRef"]
    assert token["name"] == docs["Secret"]["metadata"]["name"]
    assert token["key"] in docs["Secret"]["stringData"]
    claim = pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    mount = container["volumeMounts"][0]["mountPath"]
    assert env["AUTOPAR_DATA_DIR"]["value"] == mount


def test_dockerfile_pins_torch_first_and_copies_existing_paths():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    torch_at = text.index("pip install torch==2.13.0")
    project_at = text.index("pip install .")
    assert torch_at < project_at
    for src in re.findall(r"^COPY (\S+)", text, flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    assert '"autopar", "serve"' in text and "EXPOSE 8000" in text
