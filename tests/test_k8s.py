"""The Kubernetes patch (``config/k8s/``) applied to a sample vLLM Deployment, checked offline.

No cluster needed. ``kubectl kustomize`` (kustomize built into kubectl, >= 1.21 for Components)
applies ``config/k8s/patch`` (native sidecar, Kubernetes >= 1.29) and ``config/k8s/
patch-pre-1.29`` (a plain container) to the sample Deployment and Service in
``config/k8s/example/vllm.yaml``. Every rendered document is validated with kubernetes-validate
(strict: an unknown field fails) against the schemas of the Kubernetes versions it is for; the
sidecar config in the generated ConfigMap goes through :func:`sidecar.config.parse_config`; the
ports, paths and flags the pod uses are compared with that config and the Dockerfile; vLLM's
container is compared with the sample's, so the patch's changes to it are exactly the documented
ones (no client-auth change). One test (marked ``e2e``) also feeds vLLM's args to vLLM's own
argument parser when vLLM is installed. Skipped as a module without kubectl.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from sidecar.app import ABORT_DRAIN_S
from sidecar.config import Settings, open_cancel_api, parse_config
from sidecar.runtime import CANCEL_WAIT_S

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "config" / "k8s"
SAMPLE = K8S / "example" / "vllm.yaml"
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SIDECAR_NAME = "cancel-sidecar"
VLLM_IMAGE = "vllm/vllm-openai"
VLLM_DEFAULT_PORT = 8000  # vLLM's --port default (vllm/entrypoints/launchers/cli_args.py)
EXPECTED_KINDS = {"ConfigMap": "v1", "Deployment": "apps/v1", "Service": "v1"}
# What the patch adds to vLLM's args, in order (config/k8s/patch/vllm-loopback.yaml).
ADDED_ARGS = ["--host", "127.0.0.1", "--enable-scale-out"]
# Native sidecars (an init container's restartPolicy) are on by default from 1.29; the schemas
# kubernetes-validate ships start at 1.25.
NATIVE_VERSIONS = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0",
                   "1.36.0", "1.37.0"]
PRE_129_VERSIONS = ["1.25.0", "1.26.0", "1.27.0", "1.28.0"]
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="needs kubectl >= 1.21 for `kubectl kustomize` (its built-in kustomize)")

Doc = dict[str, Any]


def kustomize(directory: Path) -> list[Doc]:
    """``kubectl kustomize DIRECTORY``, parsed: every rendered document."""
    assert KUBECTL is not None
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, (
        f"expected kubectl kustomize {directory} to render, got exit {result.returncode}:\n"
        f"{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@dataclass(frozen=True)
class Rendered:
    """One rendering of the sample with one of the patches."""

    name: str
    docs: list[Doc]
    versions: list[str]

    def one(self, kind: str) -> Doc:
        found = [doc for doc in self.docs if doc.get("kind") == kind]
        assert len(found) == 1, f"{self.name}: expected exactly one {kind}, got {len(found)}"
        return found[0]

    def pod_spec(self) -> Doc:
        spec: Doc = self.one("Deployment")["spec"]["template"]["spec"]
        return spec

    def sidecar(self) -> Doc:
        spec = self.pod_spec()
        found: list[Doc] = [c for c in spec.get("initContainers", []) + spec["containers"]
                            if c["name"] == SIDECAR_NAME]
        assert len(found) == 1, f"{self.name}: expected one container named {SIDECAR_NAME}"
        return found[0]

    def vllm(self) -> Doc:
        found: list[Doc] = [c for c in self.pod_spec()["containers"]
                            if c["image"].startswith(VLLM_IMAGE)]
        assert len(found) == 1, (
            f"{self.name}: expected one container running {VLLM_IMAGE}, got images "
            f"{[c['image'] for c in self.pod_spec()['containers']]}")
        return found[0]

    def settings(self) -> Settings:
        """The generated config, with every ``${VAR}`` it reads given only by the sidecar
        container's own env (each as ``x``): a variable the container does not set fails here."""
        data = self.one("ConfigMap")["data"]
        assert "sidecar.yaml" in data, (
            f"expected key sidecar.yaml in the ConfigMap, got {list(data)}")
        env = {e["name"]: "x" for e in self.sidecar().get("env", [])}
        return parse_config(data["sidecar.yaml"], "ConfigMap sidecar.yaml", env=env)


@pytest.fixture(scope="module")
def native() -> Rendered:
    return Rendered("patch", kustomize(K8S / "example"), NATIVE_VERSIONS)


@pytest.fixture(scope="module")
def pre_129(tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    """The sample with ``patch-pre-1.29``, as a user's kustomization names it (a Component's
    path must be relative)."""
    app = tmp_path_factory.mktemp("pre-1.29")
    shutil.copy(SAMPLE, app / "vllm.yaml")
    component = os.path.relpath(K8S / "patch-pre-1.29", app)
    (app / "kustomization.yaml").write_text(
        f"resources: [vllm.yaml]\ncomponents: [{component}]\n")
    return Rendered("patch-pre-1.29", kustomize(app), PRE_129_VERSIONS)


@pytest.fixture(params=["patch", "patch-pre-1.29"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """Each rendering in turn, for the checks both must pass."""
    fixture = "native" if request.param == "patch" else "pre_129"
    result: Rendered = request.getfixturevalue(fixture)
    return result


def _sample() -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(SAMPLE.read_text()) if doc is not None]


def _sample_vllm() -> Doc:
    deployment = next(d for d in _sample() if d["kind"] == "Deployment")
    container: Doc = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _port_of(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _flag(args: list[str], name: str) -> str | None:
    """The value of the last ``--name value`` or ``--name=value`` in ``args`` (argparse keeps the
    last), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _container_port(container: Doc, port: int | str) -> int:
    """Resolve a probe's or a Service's port (a number or a port name) in ``container``."""
    if isinstance(port, int):
        return port
    names = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in names, f"port name {port!r} not declared by {container['name']}: got {names}"
    return int(names[port])


def _secret_ref(container: Doc, var: str) -> Doc | None:
    for env in container.get("env", []):
        if env["name"] == var:
            ref: Doc | None = env.get("valueFrom", {}).get("secretKeyRef")
            return ref
    return None


def _dockerfile_config_path() -> str:
    cmds = re.findall(r"^CMD\s+(\[.*\])\s*$", DOCKERFILE, re.M)
    assert cmds, "expected an exec-form CMD in the Dockerfile, got none"
    cmd: list[str] = json.loads(cmds[-1])
    path = _flag(cmd, "--config")
    assert path, f"expected --config PATH in the Dockerfile's CMD, got {cmd}"
    return path


def _dockerfile_env() -> dict[str, str]:
    """The ``ENV KEY=VALUE ...`` of the Dockerfile's last stage (the image's environment)."""
    stage = DOCKERFILE.rsplit("\nFROM ", 1)[-1]
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.*)$", re.sub(r"\\\n\s*", " ", stage), re.M):
        for pair in shlex.split(line):
            key, sep, value = pair.partition("=")
            assert sep, f"expected ENV in KEY=VALUE form, got {pair!r}"
            env[key] = value
    return env


def _engine_ports(settings: Settings) -> set[int]:
    return {_port_of(str(e.url)) for e in settings.engines.values()}


# --- the schemas ----------------------------------------------------------------------------

def test_the_result_is_a_configmap_a_deployment_and_a_service(rendered: Rendered) -> None:
    got = sorted((doc.get("kind"), doc.get("apiVersion")) for doc in rendered.docs)
    assert got == sorted(EXPECTED_KINDS.items()), (
        f"{rendered.name}: expected one each of {EXPECTED_KINDS} (Secrets are created with "
        f"kubectl, never a key in the repo), got {got}")


def test_the_result_validates_against_the_kubernetes_schemas(rendered: Rendered) -> None:
    """Strict: a field a version does not know fails (kubernetes-validate's ``--strict``)."""
    failures = []
    for version in rendered.versions:
        for doc in rendered.docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                failures.append(f"{version} {doc['kind']}: {list(exc.path)}: {exc.message}")
    assert not failures, f"{rendered.name}: expected valid documents, got:\n" + "\n".join(failures)


def test_the_native_sidecar_needs_1_29(native: Rendered) -> None:
    """The reason for patch-pre-1.29: 1.27's schema has no restartPolicy on a container (1.28
    has the field, behind a feature gate that is off by default)."""
    deployment = native.one("Deployment")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(deployment, "1.27.0", strict=True)


# --- the sidecar ----------------------------------------------------------------------------

def test_sidecar_is_a_native_sidecar_init_container(native: Rendered) -> None:
    sidecar = native.sidecar()
    assert sidecar.get("restartPolicy") == "Always", (
        f"expected restartPolicy: Always on initContainer {SIDECAR_NAME} (native sidecar: starts "
        f"before vLLM, stops after it), got {sidecar.get('restartPolicy')!r}")
    main = [c["name"] for c in native.pod_spec()["containers"]]
    assert SIDECAR_NAME not in main, f"expected {SIDECAR_NAME} only in initContainers, got {main}"


def test_before_1_29_the_sidecar_is_a_plain_container_with_a_pre_stop(pre_129: Rendered) -> None:
    spec = pre_129.pod_spec()
    inits = [c["name"] for c in spec.get("initContainers", [])]
    sidecar = pre_129.sidecar()
    assert SIDECAR_NAME not in inits and "restartPolicy" not in sidecar, (
        f"expected {SIDECAR_NAME} among the containers without restartPolicy, got init "
        f"containers {inits}, restartPolicy {sidecar.get('restartPolicy')!r}")
    command = sidecar.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    assert command == ["sleep", "5"], (
        f"expected a 5 s preStop (it gets SIGTERM with vLLM, while endpoints are withdrawn), got "
        f"{sidecar.get('lifecycle')}")


def test_config_listens_in_the_pod_and_reaches_vllm_on_loopback(rendered: Rendered) -> None:
    settings = rendered.settings()
    assert settings.listen.host == "0.0.0.0", (
        f"expected listen.host 0.0.0.0 (the Service sends to the pod IP), got "
        f"{settings.listen.host}")
    assert settings.admin is not None and settings.admin.host == "0.0.0.0", (
        f"expected admin on 0.0.0.0 for kubelet probes, got {settings.admin}")
    for name, engine in settings.engines.items():
        url = urlsplit(str(engine.url))
        assert url.hostname == "127.0.0.1", (
            f"expected engines.{name}.url on 127.0.0.1 (vLLM in the same pod), got {url.geturl()}")


def test_the_abort_key_follows_vllm_and_client_auth_is_unchanged(rendered: Rendered) -> None:
    """The patch adds no key to vLLM (a key there would turn every keyless client away with
    401), and the sidecar's key is vLLM's own if it has one: the same Secret, else an optional
    one that may be absent."""
    vllm, sample = rendered.vllm(), _sample_vllm()
    assert vllm.get("env") == sample.get("env") and vllm.get("envFrom") == sample.get("envFrom"), (
        f"expected vLLM's environment unchanged by the patch, got {vllm.get('env')} (sample "
        f"{sample.get('env')})")
    args = [str(a) for a in vllm.get("args", [])]
    assert args == [str(a) for a in sample.get("args", [])] + ADDED_ARGS, (
        f"expected the sample's args plus {ADDED_ARGS} (no --api-key), got {args}")
    sidecar_ref = _secret_ref(rendered.sidecar(), "VLLM_API_KEY")
    vllm_ref = _secret_ref(vllm, "VLLM_API_KEY")
    assert sidecar_ref is not None, f"expected VLLM_API_KEY from a Secret in {SIDECAR_NAME}"
    if vllm_ref is not None:
        assert (sidecar_ref["name"], sidecar_ref["key"]) == (vllm_ref["name"], vllm_ref["key"]), (
            f"expected the sidecar's key from vLLM's Secret {vllm_ref}, got {sidecar_ref}")
    else:
        assert sidecar_ref.get("optional") is True, (
            f"vLLM has no key: expected the sidecar's Secret optional, got {sidecar_ref}")
        config = rendered.one("ConfigMap")["data"]["sidecar.yaml"]
        assert "${VLLM_API_KEY:-}" in config, (
            f"expected api_key: ${{VLLM_API_KEY:-}} (empty when the Secret is absent), got:\n"
            f"{config}")
    key = rendered.settings().engines["local"].abort.api_key
    assert key is not None and key.get_secret_value() == "x", (
        "expected engines.local.abort.api_key read from the container's VLLM_API_KEY")


def test_cancel_api_on_the_pod_ip_needs_a_token_from_a_secret(rendered: Rendered) -> None:
    """The admin listener is on 0.0.0.0 for the kubelet; the cancel API shares it, so the
    config sets admin.cancel_token, read from a Secret that must exist (never a literal)."""
    settings = rendered.settings()
    assert settings.admin is not None and open_cancel_api(settings) is None, (
        f"expected the cancel API on a non-loopback admin listener to need a token, got "
        f"admin {settings.admin}")
    token = settings.admin.cancel_token
    assert token is not None and token.get_secret_value() == "x", (
        "expected admin.cancel_token to be a ${VAR} the container's env sets")
    config = rendered.one("ConfigMap")["data"]["sidecar.yaml"]
    var = re.search(r"cancel_token:\s*\$\{([A-Za-z_][A-Za-z0-9_]*)\}", config)
    assert var is not None, f"expected cancel_token: ${{VAR}} with no default, got:\n{config}"
    ref = _secret_ref(rendered.sidecar(), var[1])
    assert ref is not None and not ref.get("optional"), (
        f"expected {var[1]} from a required secretKeyRef in {SIDECAR_NAME}'s env, got {ref}")


@pytest.mark.parametrize(("probe", "path"), [
    ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")])
def test_sidecar_probes_hit_the_admin_listener(rendered: Rendered, probe: str, path: str) -> None:
    sidecar, settings = rendered.sidecar(), rendered.settings()
    assert settings.admin is not None, "expected an admin listener in the ConfigMap, got null"
    http = sidecar.get(probe, {}).get("httpGet")
    assert http is not None, f"expected {probe}.httpGet on {SIDECAR_NAME}, got {sidecar.get(probe)}"
    got = (http.get("path"), _container_port(sidecar, http["port"]))
    assert got == (path, settings.admin.port), (
        f"expected {probe} on GET {path} port {settings.admin.port} (admin.port), got {got}")


def test_service_targets_the_sidecar_proxy_port_not_vllm(rendered: Rendered) -> None:
    service, settings = rendered.one("Service"), rendered.settings()
    labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= labels.items(), (
        f"expected the Service selector {selector} to match the pod labels {labels}")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        assert isinstance(target, int), (
            f"expected a numeric targetPort (Services resolve native sidecars' port names only "
            f"from 1.32), got {target!r}")
        assert target == settings.listen.port and target not in _engine_ports(settings), (
            f"expected targetPort {settings.listen.port} (listen.port), never the engine's "
            f"{sorted(_engine_ports(settings))}, got {target}")


# --- vLLM -----------------------------------------------------------------------------------

def test_vllm_args_enable_the_abort_route_on_loopback_on_the_engine_url_port(
        rendered: Rendered) -> None:
    vllm, settings = rendered.vllm(), rendered.settings()
    args = [str(a) for a in vllm.get("command", []) + vllm.get("args", [])]
    assert "--enable-scale-out" in args, (
        f"expected --enable-scale-out (serves /inference/v1/abort_requests), got {args}")
    assert _flag(args, "--host") == "127.0.0.1", (
        f"expected the last --host to be 127.0.0.1 (clients reach vLLM only through the "
        f"sidecar), got {args}")
    port = int(_flag(args, "--port") or VLLM_DEFAULT_PORT)
    assert {port} == _engine_ports(settings), (
        f"expected vLLM's port {port} to be engines.*.url's {sorted(_engine_ports(settings))}")
    assert _flag(args, "--model"), f"expected --model MODEL, got {args}"


@pytest.mark.parametrize("probe", ["livenessProbe", "readinessProbe", "startupProbe"])
def test_vllm_probes_reach_it_on_loopback_or_through_the_sidecar(
        rendered: Rendered, probe: str) -> None:
    """vLLM listens on 127.0.0.1: the kubelet's HTTP probes go to the pod IP, so they must ask
    the sidecar's proxy port (which proxies every path, /health included) or run inside the
    container (exec)."""
    vllm, settings = rendered.vllm(), rendered.settings()
    spec = vllm.get(probe)
    assert spec is not None, f"expected a {probe} on vLLM, got none"
    if "exec" in spec:
        command = " ".join(spec["exec"]["command"])
        assert f"127.0.0.1:{min(_engine_ports(settings))}" in command, (
            f"expected the exec {probe} to ask vLLM on loopback, got {command}")
        return
    http = spec.get("httpGet")
    assert http is not None, f"expected an httpGet or exec {probe}, got {spec}"
    port = http["port"] if isinstance(http["port"], int) else _container_port(vllm, http["port"])
    assert port == settings.listen.port, (
        f"expected vLLM's {probe} through the sidecar on {settings.listen.port}, got {port}")
    assert any(http.get("path", "/").startswith(r.prefix) for r in settings.routes), (
        f"expected the probe's path {http.get('path')} on a proxied route")


def test_prometheus_annotation_scrapes_vllm_through_the_sidecar(rendered: Rendered) -> None:
    annotations = rendered.one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    port = int(annotations["prometheus.io/port"])
    assert port == rendered.settings().listen.port, (
        f"expected vLLM's /metrics scraped through the sidecar on listen.port, got {port}")


# --- the image and the pod's life -----------------------------------------------------------

def test_config_mount_is_the_path_the_image_reads(rendered: Rendered) -> None:
    expected = _dockerfile_config_path()
    sidecar = rendered.sidecar()
    args = [str(a) for a in sidecar.get("command", []) + sidecar.get("args", [])]
    assert _flag(args, "--config") in (None, expected), (
        f"expected the image's --config {expected} (or no override), got {args}")
    configmap = rendered.one("ConfigMap")["metadata"]["name"]
    volumes = {v["name"]: v["configMap"] for v in rendered.pod_spec()["volumes"]
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


def test_the_record_of_in_flight_work_is_on_an_empty_dir(
        rendered: Rendered, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lifecycle.record_dir`` as the container finds it (the config in the image's
    environment: the Dockerfile's ENV, then the container's own env) is on a writable emptyDir,
    which outlives a restart of the sidecar's container within the pod: the next start aborts
    what the killed sidecar left (sidecar.inflight). The root is read-only: without the mount
    no record is kept."""
    sidecar = rendered.sidecar()
    env = {**_dockerfile_env(), **{e["name"]: e["value"] for e in sidecar.get("env", [])
                                   if "value" in e}}
    assert "XDG_STATE_HOME" in env, (
        f"expected the image (or the container) to set XDG_STATE_HOME, the record's default "
        f"place (its user has no home directory), got {sorted(env)}")
    monkeypatch.setenv("XDG_STATE_HOME", env["XDG_STATE_HOME"])
    record_dir = rendered.settings().lifecycle.record_dir
    assert record_dir is not None, "expected a record kept (lifecycle.record_dir not null)"
    mounts = [m for m in sidecar.get("volumeMounts", [])
              if Path(m["mountPath"]) in (record_dir, *record_dir.parents)]
    assert mounts, (
        f"expected a volume mounted at {record_dir} (lifecycle.record_dir) or above it, got "
        f"{[m['mountPath'] for m in sidecar.get('volumeMounts', [])]}")
    mount = max(mounts, key=lambda m: len(Path(m["mountPath"]).parts))  # the one that holds it
    assert not mount.get("readOnly") and not mount.get("subPath"), (
        f"expected {mount['mountPath']} writable and whole (no subPath), got {mount}")
    volume = next(v for v in rendered.pod_spec()["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume, (
        f"expected volume {mount['name']} at {mount['mountPath']} to be an emptyDir (it "
        f"outlives the container, not the pod), got {volume}")


def test_sidecar_runs_non_root_read_only_without_privileges(rendered: Rendered) -> None:
    sidecar = rendered.sidecar()
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


def test_termination_grace_outlasts_vllm_drain_and_sidecar_drain(native: Rendered) -> None:
    """Native sidecars get SIGTERM only after the main containers exit: the pod's grace period
    covers vLLM's preStop, vLLM's --shutdown-timeout and then the sidecar's own drain (its grace
    period, the bounds on cancelled handlers and on the last abort calls, and the calls'
    timeout: docs/operations.md, signals), in that order."""
    spec, vllm, settings = native.pod_spec(), native.vllm(), native.settings()
    sidecar_drain = settings.lifecycle.grace_period_s + CANCEL_WAIT_S + ABORT_DRAIN_S + max(
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
        f"--shutdown-timeout {vllm_drain:g} + sidecar lifecycle.grace_period_s, its two 5 s "
        f"bounds and abort.timeout_s {sidecar_drain:g}), got {got}")


def test_before_1_29_the_sidecar_drains_as_long_as_vllm(pre_129: Rendered) -> None:
    """A plain container gets SIGTERM together with vLLM: its grace period must cover vLLM's
    drain, or it cuts (cancels and aborts) requests vLLM would still have finished."""
    args = [str(a) for a in pre_129.vllm().get("args", [])]
    vllm_drain = float(_flag(args, "--shutdown-timeout") or 0)
    grace = pre_129.settings().lifecycle.grace_period_s
    assert grace >= vllm_drain, (
        f"expected lifecycle.grace_period_s >= vLLM's --shutdown-timeout {vllm_drain:g}, got "
        f"{grace:g}")


@pytest.mark.e2e
def test_vllm_accepts_the_container_args(native: Rendered) -> None:
    """vLLM's own parser (the version installed for the e2e tests) takes every flag, and the
    patch's --host, appended after the sample's own flags, is the one it keeps."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser
    except (ImportError, RuntimeError, OSError) as exc:
        pytest.skip(f"needs vLLM (pip install '.[e2e]'): {exc!r}")
    args = [str(a) for a in native.vllm().get("args", [])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
        parsed = make_arg_parser(parser).parse_args(args)
    got = (parsed.enable_scale_out, parsed.host, parsed.port)
    expected = (True, "127.0.0.1", int(_flag(args, "--port") or VLLM_DEFAULT_PORT))
    assert got == expected, f"expected vLLM to parse {expected} from {args}, got {got}"


def test_only_the_deployment_and_service_labelled_for_it_are_patched(
        tmp_path: Path) -> None:
    """The patch's targets are the label ``cancel-sidecar/inject: "true"``: a second vLLM
    Deployment and Service without it, in the same kustomization, come out as they went in."""
    other = [copy.deepcopy(doc) for doc in _sample()]
    for doc in other:
        doc["metadata"]["name"] = "other"
        del doc["metadata"]["labels"]["cancel-sidecar/inject"]
    shutil.copy(SAMPLE, tmp_path / "vllm.yaml")
    (tmp_path / "other.yaml").write_text(yaml.safe_dump_all(other))
    component = os.path.relpath(K8S / "patch", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [vllm.yaml, other.yaml]\ncomponents: [{component}]\n")
    docs = kustomize(tmp_path)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for doc in other:
        assert by_name[doc["kind"], "other"] == doc, f"unlabelled {doc['kind']} was changed"
    patched = by_name["Deployment", "vllm"]["spec"]["template"]["spec"]
    assert [c["name"] for c in patched.get("initContainers", [])] == ["cancel-sidecar"]
