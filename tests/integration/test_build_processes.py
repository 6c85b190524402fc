"""`tokenfeed build` on several processes: this one builds from the start and worker processes
join as each is up; the store is the same bytes as one process's, and a worker's failure is the
build's. A corpus this small, or a machine this small, gets one process by itself
(`build.PROCESS_BYTES`, `build.CORES_PER_PROCESS`), so the tests lower those thresholds to make
the workers start."""

from __future__ import annotations

import io
import json
import multiprocessing
from pathlib import Path

import pytest
from support import job_spec, write_config
from tokenfeed.server.errors import BadRecordError, JobFailedError
from tokenfeed.server.offline import build, buildpool
from tokenfeed.server.settings import config as configmod


def corpus(root: Path, texts: list[str], bad_line: int | None = None) -> Path:
    root.mkdir()
    for part in range(2):
        lines = [json.dumps({"text": f"{t}\n[part {part}]"}) + "\n" for t in texts]
        if bad_line is not None and part == 1:
            lines[bad_line] = '{"text": "cut short\n'
        (root / f"part-{part}.jsonl").write_text("".join(lines))
    return root


def store_files(cache: Path) -> dict[str, bytes]:
    root = cache / "tokens"
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def run(tmp: Path, name: str, source: Path, workers: int, **spec) -> tuple[str, Path]:
    cache = tmp / f"cache-{name}"
    cfg = write_config(
        tmp / f"{name}.yaml", {"main": job_spec([source / "*.jsonl"], **spec)}, cache
    )
    out = io.StringIO()
    build.build(configmod.load(cfg), ["main"], workers, out)
    return out.getvalue(), cache


def test_processes_are_bounded_by_chunks_sources_and_cores():
    mib, plenty = 2**20, 1000 * build.PROCESS_BYTES
    cores = 8 * build.CORES_PER_PROCESS
    assert build.processes(8, 100, plenty, cores) == 8
    assert build.processes(8, 3, plenty, cores) == 3
    assert build.processes(8, 100, 2 * build.PROCESS_BYTES + mib, cores) == 3
    assert build.processes(8, 100, build.PROCESS_BYTES - 1, cores) == 1
    assert build.processes(1, 100, plenty, cores) == 1
    assert build.processes(4, 0, 0, cores) == 1
    assert build.processes(8, 100, plenty, 3 * build.CORES_PER_PROCESS) == 3
    assert build.processes(2, 100, plenty, build.CORES_PER_PROCESS) == 1


def test_workers_start_before_planning_and_only_those_worth_it_take_chunks(
    tmp_path, texts, monkeypatch
):
    assert buildpool.most_processes(16, 16) == 16 // buildpool.CORES_PER_PROCESS
    assert buildpool.most_processes(3, 64) == 3 and buildpool.most_processes(8, 1) == 1
    source = corpus(tmp_path / "corpus", texts)
    _, cache_one = run(tmp_path, "one", source, 1)
    monkeypatch.setattr(build, "available_cores", lambda: 3 * build.CORES_PER_PROCESS)
    planned: list[int] = []
    real = build.planned_job

    def planning(config, name):  # how many workers were asked for when planning began
        planned.append(len(multiprocessing.active_children()))
        return real(config, name)

    monkeypatch.setattr(build, "planned_job", planning)
    # Two workers start; the sources are worth one process (this one): no chunk goes to them.
    small, cache_small = run(tmp_path, "small", source, 3)
    assert planned == [2] and "with 1 of 3 process(es)" in small, (planned, small)
    assert store_files(cache_small) == store_files(cache_one)
    assert not multiprocessing.active_children()  # the build ended its workers
    monkeypatch.setattr(build, "PROCESS_BYTES", 1)
    shared, cache_shared = run(tmp_path, "shared", source, 3)
    assert planned == [2, 2] and "with 3 process(es)" in shared, (planned, shared)
    assert store_files(cache_shared) == store_files(cache_one)
    assert not multiprocessing.active_children()


def test_threads_and_worker_processes_write_the_bytes_one_thread_writes(
    tmp_path, texts, monkeypatch
):
    source = corpus(tmp_path / "corpus", texts)
    with monkeypatch.context() as m:
        m.setattr(build, "LOCAL_THREADS", 1)
        _, cache_one = run(tmp_path, "one", source, 1)
    alone, cache_alone = run(tmp_path, "alone", source, 3)
    assert "with 1 of 3 process(es)" in alone, alone
    assert store_files(cache_alone) == store_files(cache_one)
    monkeypatch.setattr(build, "PROCESS_BYTES", 1)
    monkeypatch.setattr(build, "available_cores", lambda: 3 * build.CORES_PER_PROCESS)
    shared, cache_shared = run(tmp_path, "shared", source, 3)
    first = next(line for line in shared.splitlines() if line.startswith("job main: "))
    total = int(first.split(": ")[1].split(" chunks")[0])
    assert total > 20 and "with 3 process(es)" in first, first
    assert f"tokenized {total} chunks, 0 were already in the store" in shared, shared
    assert store_files(cache_shared) == store_files(cache_one)


def test_a_bad_record_fails_the_build_with_its_location_whichever_process_reads_it(
    tmp_path, texts, monkeypatch
):
    source = corpus(tmp_path / "corpus", texts, bad_line=len(texts) - 3)
    monkeypatch.setattr(build, "PROCESS_BYTES", 1)
    monkeypatch.setattr(build, "available_cores", lambda: 3 * build.CORES_PER_PROCESS)
    with pytest.raises(BadRecordError) as failed:
        run(tmp_path, "strict", source, 3, bad_records="strict")
    assert f"part-1.jsonl:{len(texts) - 2}: malformed_json" in str(failed.value)


def test_a_config_the_workers_cannot_open_is_reported_once_by_the_parent(
    tmp_path, texts, monkeypatch, capfd
):
    # The workers start before the parent plans: a tokenizer nobody can read fails in each.
    source = corpus(tmp_path / "corpus", texts)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    monkeypatch.setattr(build, "available_cores", lambda: 3 * build.CORES_PER_PROCESS)
    with pytest.raises(JobFailedError, match="is not a tokenizer.json"):
        run(tmp_path, "bad", source, 3, tokenizer=str(bad))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "tokenizer.json" not in err, err  # the workers said nothing
    assert not multiprocessing.active_children()
