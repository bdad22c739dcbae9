"""The production stack, validated without a GPU or a container engine: model repositories,
docker-compose.yml, the Kubernetes manifests, the scripts, the alert rules and the dashboard.

Over 500 lines: one flat test per deployed file, sharing the parsed stack; read by file."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from scheduler_svc.cli import _overrides, build_parser
from scheduler_svc.config import load_config
from scheduler_svc.core.routing import RouteClass
from scheduler_svc.core.types import KvStats, SchedulerStats
from scheduler_svc.errors import ConfigError
from scheduler_svc.serving.metrics import SidecarMetrics
from scheduler_svc.tools import modelrepo

ROOT = Path(__file__).resolve().parents[2]
CPU_REPO = ROOT / "model_repo" / "cpu"
TEMPLATES = ROOT / "model_repo" / "trtllm"
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"


def versions() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in (DEPLOY / "versions.env").read_text().splitlines())
    return {k: v for k, v in (p for p in pairs if len(p) == 2) if not k.startswith("#")}


def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((TEMPLATES / "values.yaml").read_text())
    return loaded


@pytest.fixture
def rendered(tmp_path: Path) -> Path:
    out = tmp_path / "repo"
    modelrepo.render(TEMPLATES, values(), out)
    return out


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


# -- model repositories --------------------------------------------------------------------


def test_the_cpu_repository_parses_and_its_ensemble_is_wired() -> None:
    assert modelrepo.check(CPU_REPO) == []


def test_the_trtllm_repository_renders_parses_and_is_wired(rendered: Path) -> None:
    assert sorted(p.name for p in rendered.iterdir()) == [
        "ensemble",
        "postprocessing",
        "preprocessing",
        "tensorrt_llm",
    ]
    assert modelrepo.check(rendered) == []
    assert (rendered / "tensorrt_llm" / "1").is_dir()  # Triton needs the version folder
    assert "load_tokenizer" in (rendered / "preprocessing" / "1" / "model.py").read_text()


def test_the_trtllm_engine_carries_the_source_documents_settings(rendered: Path) -> None:
    config = parse(rendered / "tensorrt_llm" / "config.pbtxt")
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert config.backend == "tensorrtllm" and config.model_transaction_policy.decoupled
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.85"
    assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
    assert params["enable_chunked_context"] == "true"
    assert params["exclude_input_in_output"] == "true"
    assert params["gpt_model_type"] == "inflight_fused_batching"
    # TensorRT-LLM's backend reads the queue bound from the queue policy, not a parameter.
    assert "max_queue_size" not in params
    queue = config.dynamic_batching.default_queue_policy
    assert 0 < queue.max_queue_size <= 4096 and queue.max_queue_size == values()["max_queue_size"]
    assert int(params["cancellation_check_period_ms"]) > 0
    assert params["gpt_model_path"] == values()["engine_dir"]


def test_both_repositories_offer_clients_the_same_text_contract(rendered: Path) -> None:
    cpu, gpu = (
        parse(CPU_REPO / "ensemble" / "config.pbtxt"),
        parse(rendered / "ensemble" / "config.pbtxt"),
    )
    assert list(cpu.input) == list(gpu.input) and list(cpu.output) == list(gpu.output)
    assert cpu.ensemble_scheduling == gpu.ensemble_scheduling
    engine_cpu, engine_gpu = (
        parse(repo / "tensorrt_llm" / "config.pbtxt") for repo in (CPU_REPO, rendered)
    )
    assert [(t.name, t.data_type) for t in engine_cpu.input] == [
        (t.name, t.data_type) for t in engine_gpu.input
    ]
    assert [(t.name, t.data_type) for t in engine_cpu.output] == [
        (t.name, t.data_type) for t in engine_gpu.output
    ]


def test_render_names_a_missing_or_unknown_key_and_writes_nothing(tmp_path: Path) -> None:
    some = values()
    del some["engine_dir"]
    with pytest.raises(ConfigError, match="missing values for engine_dir"):
        modelrepo.render(TEMPLATES, some, tmp_path / "a")
    with pytest.raises(ConfigError, match="unknown keys engine_dirr"):
        modelrepo.render(TEMPLATES, {**values(), "engine_dirr": "/x"}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    modelrepo.render(TEMPLATES, {**values(), "model_name": "llama"}, tmp_path / "c")
    assert (tmp_path / "c" / "llama" / "config.pbtxt").is_file()
    assert parse(tmp_path / "c" / "llama" / "config.pbtxt").name == "llama"
    with pytest.raises(ConfigError, match="is not empty"):
        modelrepo.render(TEMPLATES, values(), tmp_path / "c")


def test_check_finds_a_miswired_ensemble(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(CPU_REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    ensemble = repo / "ensemble" / "config.pbtxt"
    text = ensemble.read_text()
    text = text.replace(
        'key: "input_lengths"      value: "_REQUEST_INPUT_LEN"',
        'key: "input_lengths"      value: "_NOWHERE"',
    )
    text = re.sub(r'(name: "max_tokens"\s+data_type: )TYPE_INT32', r"\1TYPE_FP32", text)
    ensemble.write_text(text)
    (repo / "postprocessing" / "config.pbtxt").write_text("name: 'postprocessing' nonsense {")
    problems = [str(p) for p in modelrepo.check(repo)]
    assert any("postprocessing: config.pbtxt does not parse" in p for p in problems), problems
    assert any("'max_tokens' is TYPE_FP32" in p for p in problems), problems
    assert any("'_NOWHERE' is not produced before it" in p for p in problems), problems


# -- the sidecar's configs -------------------------------------------------------------------


def test_the_sidecar_configs_load_and_agree_with_their_repositories() -> None:
    gpu = load_config(K8S / "overlays" / "gpu" / "sidecar.yaml")
    cpu = load_config(K8S / "overlays" / "cpu" / "sidecar.yaml")
    v = values()
    assert gpu.model.kserve_model == v["model_name"]
    assert (gpu.model.tokenizer_dir, gpu.model.end_id, gpu.model.pad_id) == (
        v["tokenizer_dir"],
        v["end_id"],
        v["pad_id"],
    )
    assert gpu.queue.max_in_flight == v["max_batch_size"]
    # The sidecar tokenizes as the repository's preprocessing does (BOS or not).
    assert gpu.model.add_special_tokens is v["add_special_tokens"]
    assert gpu.model.end_id not in gpu.model.stop_token_ids  # the others, not end_id again
    preprocessing = parse(CPU_REPO / "preprocessing" / "config.pbtxt").parameters
    assert cpu.model.add_special_tokens is (
        preprocessing["add_special_tokens"].string_value == "true"
    )
    engine = parse(CPU_REPO / "tensorrt_llm" / "config.pbtxt")
    assert cpu.queue.max_in_flight == int(engine.parameters["max_num_sequences"].string_value)
    for cfg in (gpu, cpu):  # the same fronts and metrics on both stacks
        assert (cfg.server.port, cfg.server.http_port, cfg.server.metrics_port) == (
            50051,
            8080,
            9464,
        )
        assert cfg.triton.engine_model == "tensorrt_llm"
        assert cfg.triton.metrics_url == "http://triton:8002/metrics"


# -- docker-compose ----------------------------------------------------------------------------


def compose(profile: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            "docker-compose",
            "--env-file",
            str(DEPLOY / "versions.env"),
            "--profile",
            profile,
            "config",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "GRAFANA_ADMIN_PASSWORD": "from-the-environment"},
    ).stdout
    loaded: dict[str, Any] = yaml.safe_load(out)
    return loaded


def test_compose_validates_and_the_cpu_profile_serves_the_tested_repository() -> None:
    cfg = compose("cpu")
    services = cfg["services"]
    assert {"triton-cpu", "sidecar-cpu", "prometheus", "grafana"} <= set(services)
    mounts = {
        target: Path(source)
        for source, target, *_ in (v.split(":") for v in services["triton-cpu"]["volumes"])
    }
    assert mounts["/models"] == CPU_REPO
    assert services["triton-cpu"]["build"]["args"]["BASE_IMAGE"] == versions()["TRITON_CPU_IMAGE"]
    assert "prometheus" in services["prometheus"]["image"]


def test_compose_gpu_profile_reserves_a_gpu_and_pins_the_trtllm_image() -> None:
    gpu = compose("gpu")["services"]["triton-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["shm_size"] and gpu["ulimits"]["memlock"] == -1
    assert gpu["build"]["args"]["BASE_IMAGE"] == versions()["TRITON_TRTLLM_IMAGE"]
    assert versions()["TRTLLM_VERSION"] in gpu["image"]


def test_compose_precision_profile_pairs_an_fp16_engine_with_the_awq_one() -> None:
    services = compose("gpu-precision")["services"]
    fp16, awq = services["triton-fp16"], services["triton-gpu"]
    for triton in (fp16, awq):
        devices = triton["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert fp16["networks"]["default"]["aliases"] == ["triton-fp16"]
    repos = {v.split(":")[1]: Path(v.split(":")[0]).name for v in fp16["volumes"]}
    assert repos["/models"] == "model_repo_trtllm_fp16"
    sidecar = services["sidecar-precision"]
    assert any("deploy/precision/sidecar.yaml" in v for v in sidecar["volumes"])
    cfg = load_config(DEPLOY / "precision" / "sidecar.yaml")
    assert cfg.groups["fp16"].url == "triton-fp16:8001"
    router = cfg.router(0.0)
    assert router.choose(RouteClass(lane="hot")) == "fp16"
    assert router.choose(RouteClass(lane="warm")) == "main"
    assert router.choose(RouteClass(lane="hot", precision="awq")) == "main"
    assert router.choose(RouteClass(lane="cold", precision="fp16")) == "fp16"
    # The same model and tokenizer settings as the single-engine stack.
    gpu = load_config(K8S / "overlays" / "gpu" / "sidecar.yaml")
    assert cfg.model == gpu.model


def test_compose_refuses_to_run_without_the_pinned_versions() -> None:
    result = subprocess.run(
        ["docker-compose", "config"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode != 0 and "deploy/versions.env" in result.stderr


# -- Kubernetes ----------------------------------------------------------------------------


def k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_base_manifests_pass_the_kubernetes_schema() -> None:
    base = K8S / "base"
    kustomization = k8s_docs(base / "kustomization.yaml")[0]
    checked = 0
    for name in kustomization["resources"]:
        for doc in k8s_docs(base / name):
            kubernetes_validate.validate(doc, "1.30", strict=True)
            checked += 1
    assert checked == 4


def test_the_sidecar_is_a_real_sidecar_probed_by_grpc_health() -> None:
    deployment = k8s_docs(K8S / "base" / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    [sidecar] = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar (Kubernetes >= 1.29)
    assert "127.0.0.1:8001" in sidecar["args"]  # Triton on localhost, same pod
    assert "http://127.0.0.1:8002/metrics" in sidecar["args"]  # its KV counts, for the policy
    assert sidecar["readinessProbe"]["grpc"] == {"port": 50051}
    assert sidecar["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    service = k8s_docs(K8S / "base" / "service.yaml")[0]
    sidecar_ports = {p["name"] for p in sidecar["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= sidecar_ports
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9464"
    hpa = k8s_docs(K8S / "base" / "hpa.yaml")[0]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "scheduler_svc_queue_depth"


def test_the_pod_drains_the_sidecar_first_and_runs_locked_down() -> None:
    deployment = k8s_docs(K8S / "base" / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]["spec"]
    [sidecar], [triton] = pod["initContainers"], pod["containers"]
    # Native sidecars get SIGTERM only after Triton exits: Triton's preStop drains them first.
    drain = triton["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:2] == ["scheduler-svc", "drain"] and "127.0.0.1:50052" in drain
    drain_s = float(drain[drain.index("--timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 15
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in (sidecar, triton):
        security = container["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsNonRoot"]
        assert security["allowPrivilegeEscalation"] is False
    assert "--grpc-address=127.0.0.1" in triton["args"]
    args = sidecar["args"]
    secret = next(v for v in pod["volumes"] if v["name"] == "sidecar-credentials")
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "sidecar-credentials")
    assert args[args.index("--credentials-file") + 1].startswith(mount["mountPath"])
    assert secret["secret"]["secretName"] == "scheduler-svc-credentials"
    with pytest.raises(ConfigError, match="serves other hosts"):
        load_config(None, {"server": {"host": "0.0.0.0"}})  # anonymous, never by default
    cfg = load_config(None, {"server": {"host": "0.0.0.0"}, "auth": {"anonymous": "client"}})
    assert cfg.server.admin_host == "127.0.0.1"  # Admin never leaves the pod
    policy = k8s_docs(K8S / "base" / "networkpolicy.yaml")[0]
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    anyone = [rule for rule in policy["spec"]["ingress"] if "from" not in rule]
    assert {p["port"] for rule in anyone for p in rule["ports"]} == {50051, 8080}
    assert not open_ports & {8000, 8001}


def test_gpu_pods_roll_without_a_surge_pod_waiting_for_a_gpu() -> None:
    patch = k8s_docs(K8S / "overlays" / "gpu" / "gpu.yaml")[0]
    strategy = patch["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_compose_binds_loopback_and_keeps_monitoring_closed() -> None:
    services = compose("cpu")["services"]
    for name in ("sidecar-cpu", "prometheus", "grafana"):
        for port in services[name]["ports"]:
            assert str(port).startswith("127.0.0.1:"), (name, port)
        assert services[name]["deploy"]["resources"]["limits"]["memory"]
    assert "--web.enable-lifecycle" not in services["prometheus"]["command"]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "from-the-environment"


@pytest.mark.parametrize("overlay", ["gpu", "cpu"])
def test_overlays_patch_what_exists_and_name_the_pinned_images(overlay: str) -> None:
    folder = K8S / "overlays" / overlay
    kustomization = k8s_docs(folder / "kustomization.yaml")[0]
    assert kustomization["resources"] == ["../../base"]
    base_names = {
        (d["kind"], d["metadata"]["name"])
        for n in ("deployment.yaml", "service.yaml", "hpa.yaml", "networkpolicy.yaml")
        for d in k8s_docs(K8S / "base" / n)
    }
    base_pod = k8s_docs(K8S / "base" / "deployment.yaml")[0]["spec"]["template"]["spec"]
    containers = {c["name"] for c in base_pod["containers"] + base_pod["initContainers"]}
    for patch in kustomization["patches"]:
        doc = k8s_docs(folder / patch["path"])[0]
        assert (doc["kind"], doc["metadata"]["name"]) in base_names
        spec = doc["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            assert c["name"] in containers
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec["volumes"]} | {"sidecar-config"}
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    v = versions()
    assert images["scheduler-svc"] == v["SIDECAR_IMAGE"]
    triton = (
        f"scheduler-svc-triton-trtllm:{v['TRTLLM_VERSION']}"
        if overlay == "gpu"
        else v["TRITON_CPU_BUILD_IMAGE"]
    )
    assert images["triton"] == triton
    [generator] = kustomization["configMapGenerator"]
    assert generator["name"] == "scheduler-svc-config"
    assert (folder / generator["files"][0].split("=")[1]).is_file()


# -- scripts, rules, dashboard, image ------------------------------------------------------


@pytest.mark.parametrize("script", ["build_engine.sh", "gpu_check.sh"])
def test_scripts_pass_bash_n_and_shellcheck(script: str) -> None:
    path = DEPLOY / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    result = subprocess.run(
        ["shellcheck", "-x", str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout
    assert "versions.env" in path.read_text()


def test_build_script_quantizes_awq_and_builds_paged_16_token_blocks() -> None:
    text = (DEPLOY / "build_engine.sh").read_text()
    # int4 AWQ by default; an unquantized FP16 engine too, or both (the precision pair).
    assert '--qformat "${qformat}"' in text
    assert 'awq) build int4_awq "${engine_dir}"' in text
    assert 'fp16) build full_prec "${engine_dir}"' in text
    assert (
        'build int4_awq "${engine_dir}/awq"' in text
        and 'build full_prec "${engine_dir}/fp16"' in text
    )
    for flag in (
        "--kv_cache_type paged",  # not the deprecated --paged_kv_cache
        "--use_paged_context_fmha enable",
        "--tokens_per_block 16",
        "--max_num_tokens",
    ):
        assert flag in text
    for script in ("build_engine.sh", "gpu_check.sh"):
        assert "--paged_kv_cache" not in (DEPLOY / script).read_text()
    assert re.search(r'max_batch_size="\$\{MAX_BATCH_SIZE:-64\}"', text)


def test_promtool_accepts_the_rules_and_the_scrape_config(tmp_path: Path) -> None:
    rules = DEPLOY / "prometheus" / "alerts.yml"
    subprocess.run(["promtool", "check", "rules", str(rules)], check=True, capture_output=True)
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/", ""))
    shutil.copy(rules, tmp_path / "alerts.yml")
    subprocess.run(
        ["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
        check=True,
        capture_output=True,
    )


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "scheduler-svc.json").read_text())
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = provisioned["datasources"][0]["uid"]
    assert dashboard["panels"] and all(p["datasource"]["uid"] == uid for p in dashboard["panels"])
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])


def test_the_sidecar_image_is_slim_non_root_and_health_checked() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert re.search(r"^USER 10001$", text, re.M)
    assert 'CMD ["scheduler-svc", "health", "--address", "127.0.0.1:50052"]' in text  # plaintext


def _served(command: list[str]) -> Any:
    """The config a `scheduler-svc serve ...` command line would run with (files as shipped)."""
    args = build_parser().parse_args(command)
    assert args.config == "/etc/scheduler-svc/config.yaml"  # the image's baked cpu config
    return load_config(ROOT / "deploy/k8s/overlays/cpu/sidecar.yaml", _overrides(args))


def test_the_image_and_compose_serve_other_hosts_anonymously_only_when_told() -> None:
    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="serves other hosts"):
        _served(cmd)  # the image's default: 0.0.0.0 and no credentials file
    assert _served([*cmd, "--credentials-file", "/run/creds.yaml"]).auth.anonymous == "auto"
    sidecar = compose("cpu")["services"]["sidecar-cpu"]
    assert _served(sidecar["command"]).auth.anonymous == "client"  # said on purpose


# -- behind a gateway: llm-d / the Gateway API Inference Extension -----------------------------

LLMD = K8S / "overlays" / "llm-d"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253}
_META = {"type": "object", "required": ["name"], "properties": {"name": _NAME}}
# The fields of InferencePool inference.networking.k8s.io/v1 (GIE v1.0) and of Gateway API's
# HTTPRoute v1 that these manifests use, with the API's own constraints; anything else refused.
INFERENCE_POOL_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "required": ["number"],
                        "additionalProperties": False,
                        "properties": {"number": _PORT},
                    },
                },
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name", "port"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"const": "Service"},
                        "name": _NAME,
                        "port": {
                            "type": "object",
                            "required": ["number"],
                            "additionalProperties": False,
                            "properties": {"number": _PORT},
                        },
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
HTTP_ROUTE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["parentRefs", "rules"],
            "additionalProperties": False,
            "properties": {
                "parentRefs": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {
                            "group": {"const": "gateway.networking.k8s.io"},
                            "kind": {"const": "Gateway"},
                            "name": _NAME,
                        },
                    },
                },
                "rules": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {"type": "array"},
                            "backendRefs": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "required": ["group", "kind", "name"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "group": {"const": "inference.networking.k8s.io"},
                                        "kind": {"const": "InferencePool"},
                                        "name": _NAME,
                                    },
                                },
                            },
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "request": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def llmd_docs() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = k8s_docs(LLMD / "kustomization.yaml")[0]
    assert kustomization["resources"][0] == "../gpu"
    docs = {}
    for name in kustomization["resources"][1:]:
        for doc in k8s_docs(LLMD / name):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_the_llmd_overlay_passes_its_schemas() -> None:
    checked = set()
    for (kind, _), doc in llmd_docs().items():
        if kind == "InferencePool":
            jsonschema.validate(doc, INFERENCE_POOL_SCHEMA)
        elif kind == "HTTPRoute":
            jsonschema.validate(doc, HTTP_ROUTE_SCHEMA)
        else:
            kubernetes_validate.validate(doc, "1.30", strict=True)
        checked.add(kind)
    assert checked == {
        "InferencePool",
        "HTTPRoute",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "NetworkPolicy",
    }
    bad = json.loads(json.dumps(llmd_docs()[("InferencePool", "scheduler-svc")]))
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail
        jsonschema.validate(bad, INFERENCE_POOL_SCHEMA)


def _exported_metric_names() -> set[str]:
    metrics = SidecarMetrics()
    kv = KvStats(1024, 512, 100, 0, 16, 0.1, False)
    metrics.snapshot = SchedulerStats(queued=3, in_flight=2, max_queued=8, max_in_flight=4, kv=kv)
    return {family.name for family in metrics.registry.collect()}


def test_the_pool_the_picker_and_the_route_point_at_what_exists() -> None:
    docs = llmd_docs()
    pool = docs[("InferencePool", "scheduler-svc")]["spec"]
    base = k8s_docs(K8S / "base" / "deployment.yaml")[0]["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= base["metadata"]["labels"].items()
    sidecar = next(c for c in base["spec"]["initContainers"] if c["name"] == "scheduler-svc")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    gpu = load_config(K8S / "overlays" / "gpu" / "sidecar.yaml")
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]] == [gpu.server.http_port]
    picker = pool["endpointPickerRef"]
    service = docs[("Service", picker["name"])]["spec"]
    assert picker["port"]["number"] in {p["port"] for p in service["ports"]}
    epp = docs[("Deployment", picker["name"])]["spec"]["template"]
    assert service["selector"].items() <= epp["metadata"]["labels"].items()
    flags = dict(a.removeprefix("--").split("=", 1) for a in epp["spec"]["containers"][0]["args"])
    assert flags["pool-name"] == docs[("InferencePool", "scheduler-svc")]["metadata"]["name"]
    assert f"--grpc-port={picker['port']['number']}" in epp["spec"]["containers"][0]["args"]
    assert int(flags["model-server-metrics-port"]) == ports["metrics"] == gpu.server.metrics_port
    exported = _exported_metric_names()
    for flag in (
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    ):
        assert flags[flag] in exported, flag
    route = docs[("HTTPRoute", "scheduler-svc")]["spec"]
    assert route["rules"][0]["backendRefs"][0]["name"] == "scheduler-svc"
    assert route["rules"][0]["timeouts"]["request"] == f"{gpu.server.max_request_s:g}s"
    # The picker may scrape the sidecars' metrics port; the pool's port is open to clients.
    allow = docs[("NetworkPolicy", "llm-metrics-for-the-endpoint-picker")]["spec"]
    assert allow["podSelector"]["matchLabels"] == pool["selector"]["matchLabels"]
    assert allow["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == epp["metadata"]["labels"]
    images = k8s_docs(LLMD / "kustomization.yaml")[0]["images"]
    assert {i["name"]: f"{i['newName']}:{i['newTag']}" for i in images} == {
        "epp": versions()["EPP_IMAGE"]
    }


# What tensorrtllm_backend 0.17.0 (deploy/versions.env) exports under these two metrics' labels.
TRTLLM_017_LABELS = {
    "kv_cache_block_type": {"used", "free", "max", "tokens_per"},
    "request_type": {"active", "max", "scheduled", "context"},
}


def test_alerts_and_dashboard_use_only_labels_the_pinned_trtllm_exports() -> None:
    assert versions()["TRTLLM_VERSION"] == "0.17.0"
    texts = {
        "alerts": (DEPLOY / "prometheus" / "alerts.yml").read_text(),
        "dashboard": json.dumps(
            json.loads((DEPLOY / "grafana" / "dashboards" / "scheduler-svc.json").read_text())
        ).replace('\\"', '"'),
    }
    seen = 0
    for where, text in texts.items():
        for label, exported in TRTLLM_017_LABELS.items():
            for values in re.findall(label + r'=~?"([^"]+)"', text):
                assert set(values.split("|")) <= exported, (where, label, values)
                seen += 1
    assert seen >= 4


def test_the_tenant_share_rule_divides_a_lanes_tokens_between_its_tenants(tmp_path: Path) -> None:
    """promtool's rule unit test: two tenants serving 3:1 tokens in the hot lane, one alone in
    the cold lane."""
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    series = 'scheduler_svc_tenant_tokens_total{{tenant="{}",lane="{}"}}'
    share = 'scheduler_svc:tenant_lane_share:rate5m{{tenant="{}",lane="{}"}}'
    expected = [("a", "hot", 0.75), ("b", "hot", 0.25), ("a", "cold", 1.0)]
    case = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": series.format("a", "hot"), "values": "0+300x10"},
                    {"series": series.format("b", "hot"), "values": "0+100x10"},
                    {"series": series.format("a", "cold"), "values": "0+50x10"},
                ],
                "promql_expr_test": [
                    {
                        "expr": "scheduler_svc:tenant_lane_share:rate5m",
                        "eval_time": "10m",
                        "exp_samples": [
                            {"labels": share.format(t, lane), "value": v} for t, lane, v in expected
                        ],
                    }
                ],
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(case))
    run = subprocess.run(
        ["promtool", "test", "rules", "test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
