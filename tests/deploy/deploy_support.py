"""Helpers for the deploy tests: the external tools, the repository's deploy files, PromQL names.

The tools (promtool, prometheus, docker compose, the operator-models virtualenv) come from
`scripts/install_tools.sh` (`make tools`, which `make test` runs first). A missing tool fails
the test that needs it, with the command that installs it: a deploy file that was never checked
must not pass as green.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOOLS = ROOT / ".tools"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tokenfeed.json"
SERVER_DOCKERFILE = DEPLOY / "docker" / "server.Dockerfile"
CLIENT_DOCKERFILE = DEPLOY / "docker" / "client.Dockerfile"
SERVER_IMAGE = "tokenfeed/server:0.1.0"
CLIENT_IMAGE = "tokenfeed/client:0.1.0"


def tool(relative: str) -> Path:
    """A tool under .tools/, or a failed test saying how to install it."""
    path = TOOLS / relative
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make tools` (scripts/install_tools.sh)")
    return path


def run(cmd: list, *, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{shlex.join(map(str, cmd))} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


# ---------------------------------------------------------------- kubernetes manifests


def manifests() -> list[tuple[Path, dict]]:
    """Every document of every YAML file under deploy/k8s, with its file."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        docs.extend((path, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def manifest(kind: str, directory: str) -> dict:
    (doc,) = [d for p, d in manifests() if d["kind"] == kind and p.parent.name == directory]
    return doc


# ---------------------------------------------------------------- docker-compose


@cache
def compose_config(*profiles: str) -> dict:
    """`docker compose config` of the repository's docker-compose.yml, as JSON."""
    args = [tool("bin/docker-compose"), "-f", ROOT / "docker-compose.yml"]
    for profile in profiles:
        args += ["--profile", profile]
    proc = run([*args, "config", "--format", "json"], cwd=ROOT, timeout=30)
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- Dockerfiles


@dataclass
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to

    def json_args(self) -> list[str] | None:
        """The exec form's list, or None for the shell form."""
        text = self.args
        for flag in re.findall(r"^(?:--\S+\s+)+", text):  # HEALTHCHECK --interval=... CMD [...]
            text = text[len(flag) :]
        text = re.sub(r"^CMD\s+", "", text)
        if text.startswith("["):
            return json.loads(text)
        return None


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str] = field(default_factory=dict)  # ARG defaults before the first FROM
    instructions: list[Instruction] = field(default_factory=list)

    def final(self, keyword: str) -> list[Instruction]:
        last = max(i.stage for i in self.instructions)
        return [i for i in self.instructions if i.keyword == keyword and i.stage == last]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def base_images(self) -> list[str]:
        stages = {i.args.split()[-1] for i in self.all("FROM") if " AS " in i.args.upper()}
        images = []
        for i in self.all("FROM"):
            image = re.split(r"\s+AS\s+", i.args, flags=re.I)[0].strip()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args[m[1] or m[2]], image)
            if image.split(":")[0] not in stages:
                images.append(image)
        return images


def parse_dockerfile(path: Path) -> Dockerfile:
    text = re.sub(r"\\\n", " ", path.read_text())  # line continuations
    result = Dockerfile(path)
    stage = -1
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        if keyword == "ARG" and stage < 0 and "=" in args:
            name, _, value = args.partition("=")
            result.args[name.strip()] = value.strip()
        result.instructions.append(Instruction(keyword, args.strip(), stage))
    return result


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker's .dockerignore rules exclude `path` (relative, '/'-separated): the last
    pattern that matches the path or one of its parent directories wins; `!` re-includes."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = _glob_regex(pattern.strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def _glob_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]


# ---------------------------------------------------------------- PromQL


@dataclass
class PromQLNames:
    metrics: set[str] = field(default_factory=set)
    # (metric or "", label) for every label matcher inside a selector's braces
    matchers: set[tuple[str, str]] = field(default_factory=set)
    # labels named by by / without / on / ignoring / group_left / group_right
    grouping: set[str] = field(default_factory=set)


_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
   |(?P<range>\[[^\]]*\])
   |(?P<number>\d[\w.]*|\.\d[\w.]*)
   |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
   |(?P<op>=~|!~|!=|==|<=|>=|[{}(),=<>+\-*/%^@])
   |(?P<space>\s+)
   |(?P<comment>\#[^\n]*)
    """,
    re.X,
)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}
_AGGREGATIONS = set(
    "sum min max avg group stddev stdvar count count_values bottomk topk quantile".split()
)


def promql_names(expr: str) -> PromQLNames:
    """The metric names and label names an expression refers to. A small lexer, enough for
    the expressions of this repository; promtool checks the syntax itself."""
    tokens = []
    for m in _TOKEN.finditer(expr):
        if m.lastgroup not in ("space", "comment"):
            tokens.append((m.lastgroup, m.group()))
    if sum(len(m.group()) for m in _TOKEN.finditer(expr)) != len(expr):
        raise ValueError(f"cannot lex {expr!r}")
    names = PromQLNames()
    i, in_braces, selector_metric = 0, False, ""
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text == "{":
            in_braces = True
            prev = tokens[i - 1] if i else ("", "")
            selector_metric = prev[1] if prev[1] in names.metrics else ""
        elif text == "}":
            in_braces, selector_metric = False, ""
        elif kind == "ident" and in_braces:
            names.matchers.add((selector_metric, text))
        elif kind == "ident" and text.lower() in _GROUPING:
            if nxt == "(":
                i += 2
                while tokens[i][1] != ")":
                    if tokens[i][0] == "ident":
                        names.grouping.add(tokens[i][1])
                    i += 1
        elif kind == "ident" and (text.lower() in _KEYWORDS or text in _AGGREGATIONS):
            pass
        elif kind == "ident" and nxt != "(":
            names.metrics.add(text)
        i += 1
    return names


@cache
def metric_families() -> dict[str, tuple[str, ...]]:
    """{sample name: its label names} for every sample tokenfeed's registry can export, as
    stored by Prometheus (which adds the TARGET_LABELS)."""
    from prometheus_client.metrics import MetricWrapperBase
    from tokenfeed.server.telemetry import metrics
    from tokenfeed.server.telemetry.bucketed import BucketedHistogram

    families: dict[str, tuple[str, ...]] = {}
    for obj in vars(metrics).values():
        if isinstance(obj, BucketedHistogram):  # a histogram whose buckets arrive counted
            families[obj.name + "_bucket"] = (obj.label, "le")
            families[obj.name + "_sum"] = families[obj.name + "_count"] = (obj.label,)
            continue
        if not isinstance(obj, MetricWrapperBase):
            continue
        labels = tuple(obj._labelnames)
        if obj._type == "counter":
            families[obj._name + "_total"] = labels
        elif obj._type == "histogram":
            families[obj._name + "_bucket"] = (*labels, "le")
            families[obj._name + "_sum"] = labels
            families[obj._name + "_count"] = labels
        else:
            families[obj._name] = labels
    # The standard process collector: no labels of its own.
    for name in metrics.exported_names():
        if name.startswith("process_") and not name.endswith("_created"):
            if name + "_total" not in metrics.exported_names():
                families.setdefault(name, ())
    return families


TARGET_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
BUILTIN_SERIES = {"up": ()}  # synthesized by Prometheus for every target


def recording_rules() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def alerting_rules() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def name_problems(expr: str) -> list[str]:
    """Metric and label names in `expr` that tokenfeed does not export (empty: all known)."""
    from tokenfeed.server.telemetry import metrics

    exported = metrics.exported_names()
    families = metric_families()
    recorded = recording_rules()
    names = promql_names(expr)
    problems, known_labels = [], set(TARGET_LABELS)
    for metric in sorted(names.metrics):
        if metric in recorded:
            labels = promql_names(recorded[metric]).grouping - {"le"}
        elif metric in BUILTIN_SERIES:
            labels = set(BUILTIN_SERIES[metric])
        elif metric in families and metric in exported:
            labels = set(families[metric])
        else:
            problems.append(f"unknown metric {metric}")
            continue
        known_labels |= labels
        for selector_metric, label in names.matchers:
            if selector_metric == metric and label not in labels | TARGET_LABELS:
                problems.append(f"{metric} has no label {label}")
    for label in sorted(names.grouping - known_labels):
        problems.append(f"no metric of the expression has label {label}")
    return problems


GRAFANA_RANGES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable, Grafana's range variables
    replaced by durations; label_values(selector, label) yields its selector."""
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            queries.append((f"variable {var['name']}", f"count by ({m[2]}) ({m[1]})"))
    out = []
    for where, expr in queries:
        for var, value in GRAFANA_RANGES.items():
            expr = expr.replace(var, value)
        out.append((where, expr))
    return out


def promtool_parse(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`promtool check rules` over the expressions as recording rules: parses each one."""
    rules = [{"record": f"check:expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    return run([tool("bin/promtool"), "check", "rules", path], check=False)
