"""Triton model repositories: render one from templates, and check one without a server.

Rendering: every `*.tmpl` file under the template folder is written without its suffix, with
each `${key}` replaced by its value; other files are copied (links followed). The folder named
`ensemble` is written under the value of `model_name`, which is the name clients ask for. Every
key used by a template must be given and every key given must be used; either mistake is refused
with the keys named, before anything is written.

Checking: every `config.pbtxt` must parse into Triton's own `ModelConfig` message, and every
ensemble step must be wired consistently: the step's model exists, each mapped tensor exists on
that model, and each tensor flows between tensors of the same data type.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from scheduler_svc.errors import ConfigError

_KEY = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATE_SUFFIX = ".tmpl"
ENSEMBLE_DIR = "ensemble"


def template_keys(template_dir: Path) -> set[str]:
    """Every `${key}` the templates under `template_dir` use."""
    keys: set[str] = set()
    for path in sorted(template_dir.rglob(f"*{TEMPLATE_SUFFIX}")):
        keys.update(_KEY.findall(path.read_text()))
    return keys | {"model_name"}


def render(template_dir: Path, values: Mapping[str, object], out_dir: Path) -> list[Path]:
    """Write the repository; returns the files written. ConfigError on a bad key or folder."""
    if not template_dir.is_dir():
        raise ConfigError(f"template folder {template_dir} does not exist")
    needed = template_keys(template_dir)
    missing = sorted(needed - set(values))
    unknown = sorted(set(values) - needed)
    if missing:
        raise ConfigError(f"missing values for {', '.join(missing)} (templates in {template_dir})")
    if unknown:
        raise ConfigError(
            f"unknown keys {', '.join(unknown)}: no template in {template_dir} uses them"
        )
    text = {key: str(value) for key, value in values.items()}
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text["model_name"]):
        raise ConfigError(f"model_name {text['model_name']!r}: use letters, digits, '_', '.', '-'")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"output folder {out_dir} is not empty")
    written: list[Path] = []
    for source in sorted(p for p in template_dir.rglob("*") if p.is_file()):
        if "__pycache__" in source.parts or source.name == "values.yaml":
            continue
        parts = list(source.relative_to(template_dir).parts)
        if parts[0] == ENSEMBLE_DIR:
            parts[0] = text["model_name"]
        target = out_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == TEMPLATE_SUFFIX:
            target = target.with_suffix("")
            target.write_text(_KEY.sub(lambda m: text[m.group(1)], source.read_text()))
        else:
            shutil.copyfile(source, target)
        written.append(target)
    return written


@dataclass(frozen=True)
class Problem:
    model: str
    message: str

    def __str__(self) -> str:
        return f"{self.model}: {self.message}"


def load_configs(repo: Path) -> tuple[dict[str, mc.ModelConfig], list[Problem]]:
    """Parse every `<model>/config.pbtxt` of a repository."""
    configs: dict[str, mc.ModelConfig] = {}
    problems: list[Problem] = []
    for path in sorted(repo.glob("*/config.pbtxt")):
        model = path.parent.name
        try:
            config = text_format.Parse(path.read_text(), mc.ModelConfig())
        except text_format.ParseError as exc:
            problems.append(Problem(model, f"config.pbtxt does not parse: {exc}"))
            continue
        if config.name and config.name != model:
            problems.append(Problem(model, f"name {config.name!r} differs from its folder"))
        configs[model] = config
    if not configs and not problems:
        problems.append(Problem(str(repo), "no <model>/config.pbtxt found"))
    return configs, problems


def _tensors(
    tensors: list[mc.ModelInput] | list[mc.ModelOutput],
) -> dict[str, int]:
    return {t.name: t.data_type for t in tensors}


def check_ensembles(configs: Mapping[str, mc.ModelConfig]) -> list[Problem]:
    """Every ensemble step maps existing tensors of matching data types, in order."""
    problems: list[Problem] = []
    name = mc.DataType.Name
    for model, config in configs.items():
        if config.platform != "ensemble":
            continue
        available = _tensors(list(config.input))  # tensor name -> data type, as they appear
        for i, step in enumerate(config.ensemble_scheduling.step):
            where = f"step {i} ({step.model_name})"
            target = configs.get(step.model_name)
            if target is None:
                problems.append(Problem(model, f"{where}: no model {step.model_name!r}"))
                continue
            inputs, outputs = _tensors(list(target.input)), _tensors(list(target.output))
            for key, value in step.input_map.items():
                if key not in inputs:
                    problems.append(
                        Problem(model, f"{where}: {step.model_name} has no input {key!r}")
                    )
                elif value not in available:
                    problems.append(Problem(model, f"{where}: {value!r} is not produced before it"))
                elif available[value] != inputs[key]:
                    problems.append(
                        Problem(
                            model,
                            f"{where}: {value!r} is {name(available[value])} but "
                            f"{step.model_name}.{key} wants {name(inputs[key])}",
                        )
                    )
            required = {t.name for t in target.input if not t.optional}
            for key in sorted(required - set(step.input_map)):
                problems.append(Problem(model, f"{where}: required input {key!r} is not mapped"))
            for key, value in step.output_map.items():
                if key not in outputs:
                    problems.append(
                        Problem(model, f"{where}: {step.model_name} has no output {key!r}")
                    )
                else:
                    available[value] = outputs[key]
        for tensor in config.output:
            if tensor.name not in available:
                problems.append(Problem(model, f"output {tensor.name!r} is produced by no step"))
            elif available[tensor.name] != tensor.data_type:
                problems.append(Problem(model, f"output {tensor.name!r} has the wrong data type"))
    return problems


def check(repo: Path) -> list[Problem]:
    """Everything wrong with a repository that can be known without starting Triton."""
    configs, problems = load_configs(repo)
    return problems + check_ensembles(configs)


# The CPU engine as a static (V1) batcher: a static batch prefills whole, so no chunked
# context, and one step must hold the longest prompt.
STATIC_ENGINE: dict[str, str] = {
    "gpt_model_type": "V1",
    "enable_chunked_context": "false",
    "max_num_tokens": "4096",
}


def copy_engine_variant(
    src: Path, dst_repo: Path, name: str, overrides: Mapping[str, str], extra: str = ""
) -> Path:
    """Copy the engine model at `src` into `dst_repo` as `name`, with some of its `parameters`
    given new values and `extra` appended to its config (a `dynamic_batching` block, say).
    A parameter that the config does not have is refused."""
    dst = dst_repo / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    config = (dst / "config.pbtxt").read_text()
    config = re.sub(r'^name: ".*"$', f'name: "{name}"', config, count=1, flags=re.M)
    config = _with_parameters(config, overrides, src / "config.pbtxt")
    (dst / "config.pbtxt").write_text(config + extra)
    return dst


def copy_repo_with(
    src_repo: Path, dst_repo: Path, model: str, overrides: Mapping[str, str]
) -> Path:
    """Copy a whole model repository (linked files copied as files) with some `parameters`
    of its model `model` given new values; a parameter it does not have is refused."""
    shutil.copytree(src_repo, dst_repo, ignore=shutil.ignore_patterns("__pycache__"))
    path = dst_repo / model / "config.pbtxt"
    if not path.is_file():
        raise ConfigError(f"{src_repo}: no model {model!r} to set {sorted(overrides)} on")
    path.write_text(
        _with_parameters(path.read_text(), overrides, src_repo / model / "config.pbtxt")
    )
    return dst_repo


def _with_parameters(config: str, overrides: Mapping[str, str], where: Path) -> str:
    for key, value in overrides.items():
        pattern = rf'(key: "{key}"\s+value: {{ string_value: )"[^"]*"'
        config, count = re.subn(pattern, rf'\1"{value}"', config)
        if count != 1:
            raise ConfigError(f"{where}: no parameter {key!r} to override")
    return config
