"""A Deployment that `helm template` rendered, run as a podman container the way the kubelet
runs its pod: the same command and args (`$(VAR)` expanded), env from its ConfigMap and Secret,
user and group, read-only root filesystem, dropped capabilities, no privilege escalation, a
tmpfs for each emptyDir and the Secret's files mounted read-only. Probes, resources and the
preStop sleep are not translated (the tests call the image's HEALTHCHECK and send SIGTERM)."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.chart import find

Doc = dict[str, Any]


@dataclass
class PodRun:
    """The podman run flags of one Deployment's single container, and what they came from."""

    image: str
    flags: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    user: tuple[int, int] = (0, 0)
    tmpfs: list[str] = field(default_factory=list)

    def argv(self, name: str, network: str, *extra: str) -> list[str]:
        flags = ["--name", name, "--network", network, *self.flags, *extra]
        return ["run", "-d", *flags, self.image, *self.args]


def _named(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _secret(docs: list[Doc], name: str, key: str) -> str:
    return base64.b64decode(_named(docs, "Secret", name)["data"][key]).decode()


def container_env(docs: list[Doc], container: Doc) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_named(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = _secret(docs, ref["name"], ref["key"]) if ref else item["value"]
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def security_flags(pod: Doc, container: Doc) -> tuple[list[str], tuple[int, int]]:
    sc = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    user = (int(sc.get("runAsUser", 0)), int(sc.get("runAsGroup", 0)))
    assert not sc.get("runAsNonRoot") or user[0] != 0, "runAsNonRoot without a runAsUser"
    flags = ["--user", f"{user[0]}:{user[1]}"]
    if sc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    for cap in sc.get("capabilities", {}).get("drop", []):
        flags += ["--cap-drop", cap.lower()]
    if sc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    return flags, user


def volume_flags(
    docs: list[Doc], pod: Doc, container: Doc, files: Path
) -> tuple[list[str], list[str]]:
    """(flags, tmpfs paths). emptyDir: a tmpfs; secret: its items written under `files` and
    mounted read-only."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    flags: list[str] = []
    tmpfs: list[str] = []
    for mount in container.get("volumeMounts", []):
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if "emptyDir" in volume:
            flags += ["--tmpfs", f"{path}:rw,mode=1777"]  # an emptyDir is world-writable
            tmpfs.append(path)
        elif "secret" in volume:
            folder = files / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for item in volume["secret"]["items"]:
                target = folder / item["path"]
                target.write_text(_secret(docs, volume["secret"]["secretName"], item["key"]))
                target.chmod(0o644)  # a Secret volume's default mode
            flags += ["-v", f"{folder}:{path}:ro"]
        else:
            raise NotImplementedError(f"volume {mount['name']}: {sorted(volume)}")
    return flags, tmpfs


def pod_run(docs: list[Doc], deployment: str, files: Path) -> PodRun:
    pod = find(docs, "Deployment", deployment)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(docs, container)
    flags, user = security_flags(pod, container)
    mounts, tmpfs = volume_flags(docs, pod, container, files)
    flags += mounts
    for name, value in env.items():
        flags += ["-e", f"{name}={value}"]
    grace = str(pod.get("terminationGracePeriodSeconds", 30))
    flags += ["--stop-timeout", grace, "--entrypoint", json.dumps(container["command"])]
    args = [expand(a, env) for a in container["args"]]
    return PodRun(container["image"], flags, args, env, user, tmpfs)
