"""The deployment guide, the README link, the tool installer and the Makefile wiring."""

from __future__ import annotations

import re
import time

from deploy_support import DEPLOY, K8S, ROOT, manifest, run
from tokenfeed.server.jobs.stack import check_budget
from tokenfeed.server.settings import config as configmod

GUIDE = ROOT / "docs" / "deployment.md"


def test_readme_links_the_guide():
    assert "(docs/deployment.md)" in (ROOT / "README.md").read_text()


def test_guide_cites_only_measured_figures():
    """Sizing figures in the guide are the README's `make bench` figures."""
    guide = " ".join(GUIDE.read_text().split())
    readme = (ROOT / "README.md").read_text()
    figures = ("4.58 MB/s", "17.54 MB/s", "212.3 M tokens/s", "304.7 M", "4.87 MB/s", "20.45 MB/s")
    for figure in figures:
        assert figure in guide and figure in readme, figure
    assert "make bench" in guide and "2-core machine" in guide


def test_readme_scale_figures_are_the_recorded_run():
    """The README's GetBatch-at-scale table is bench/results/scale-2core.txt's run: every
    latency and ratio of the table's rows is in that output."""
    readme = (ROOT / "README.md").read_text()
    recorded = (ROOT / "bench" / "results" / "scale-2core.txt").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| GetBatch p50 / p99")]
    assert len(rows) == 2, rows
    found = [f for row in rows for f in re.findall(r"\b\d+\.\d+\b", row)]
    figures = [f for f in found if f != "1.2"]  # 1.2: the target
    assert len(figures) == 12, found  # tokenfeed, reference and ratio, at p50 and p99
    for figure in figures:
        assert figure in recorded, figure


def test_guide_names_existing_files():
    for path in re.findall(r"`((?:deploy|docs|scripts)/[\w./-]+)`", GUIDE.read_text()):
        assert (ROOT / path).exists(), path


def test_every_deploy_config_passes_the_servers_budget_check(tmp_path):
    configs = [configmod.load(DEPLOY / "compose" / "tokenfeed.yaml")]
    for directory in ("sidecar", "fleet"):
        path = tmp_path / f"{directory}.yaml"
        path.write_text(manifest("ConfigMap", directory)["data"]["config.yaml"])
        configs.append(configmod.load(path))
    for cfg in configs:
        check_budget(cfg)  # raises ConfigError when cache_bytes is too small
    assert K8S.is_dir()


def test_install_tools_is_valid_and_fast_when_installed():
    script = ROOT / "scripts" / "install_tools.sh"
    run(["bash", "-n", script])
    start = time.monotonic()
    out = run(["bash", script], timeout=600).stdout
    assert time.monotonic() - start < 10, "install_tools.sh is slow with everything installed"
    assert "promtool, version" in out and "Docker Compose version v2" in out
    assert "Chromium" in out


def test_make_test_installs_the_tools_first():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: .*\btools\b", makefile, re.M)
    assert re.search(r"^tools:\n\tbash scripts/install_tools.sh$", makefile, re.M)
    assert ".tools/" in (ROOT / ".gitignore").read_text().splitlines()


def test_readme_serving_figures_are_the_recorded_run():
    """The README's serving table is bench/results/wire-2core.txt's first run (the text before
    the next run's heading: a commit's code, or another run of the same command): every rate,
    ratio, rounds' range and CPU figure of its rows is in that output (targets and the computed
    `Nx less` aside)."""
    readme = (ROOT / "README.md").read_text()
    recorded = (ROOT / "bench" / "results" / "wire-2core.txt").read_text()
    heading = re.compile(
        r"^(?:[0-9a-f]{7}(?:'s | \()|A run of the same command|The same command)", re.M
    )
    runs = [m.start() for m in heading.finditer(recorded)]
    assert runs[0] == 0 and len(runs) > 1, runs[:2]
    first = recorded[: runs[1]]
    start = readme.index("| measure | tokenfeed | bare transport | ratio (rounds; target) |")
    table = readme[start : readme.index("\n\n", start)].splitlines()[2:]
    assert len(table) == 11, table
    figures = [
        f for row in table for f in re.findall(r"\b\d+\.\d+\b(?!x)", row) if f not in ("0.6", "0.8")
    ]
    assert len(figures) > 40, figures
    for figure in figures:
        assert figure in first, figure


def test_readme_tokenization_figures_are_the_recorded_run():
    """The README's tokenization table is bench/results/tokenization-2core.txt's first run (up
    to the next run's heading): every rate and ratio of its rows is in that output (targets
    aside)."""
    readme = (ROOT / "README.md").read_text()
    recorded = (ROOT / "bench" / "results" / "tokenization-2core.txt").read_text()
    first = recorded[: recorded.index("\nThe run before")]
    start = readme.index("| measure | tokenfeed | bare engine | ratio (target) |")
    table = readme[start : readme.index("\n\n", start)].splitlines()[2:]
    assert len(table) == 6, table
    figures = [f for row in table for f in re.findall(r"\b\d+\.\d+\b", row) if f != "0.9"]
    assert len(figures) == 21, figures
    for figure in figures:
        assert figure in first, figure


def test_readme_16_core_figures_are_the_recorded_run():
    """The README's 16-core serving table is bench/results/cores16-serving.txt's first run:
    every rate, ratio, scaling and CPU figure of its rows is in that output (the bare
    transport's own scaling, a quotient of two of them, aside)."""
    readme = (ROOT / "README.md").read_text()
    recorded = (ROOT / "bench" / "results" / "cores16-serving.txt").read_text()
    first = recorded[: recorded.index("\n\n", recorded.index("server.workers (now)"))]
    start = readme.index("| `server.workers` | tokenfeed | bare transport (as many processes) |")
    rows = readme[start : readme.index("\n\n", start)].splitlines()[2:]
    assert len(rows) == 5, rows
    figures = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 7, cells
        kept = cells[1:5] + cells[6:]  # cells[5]: bare vs 1 process, computed
        figures += [f for c in kept for f in re.findall(r"\b\d[\d,]*\.\d+\b", c) if f != "0.7"]
    assert len(figures) >= 25, figures
    for figure in figures:
        assert figure in first, figure
