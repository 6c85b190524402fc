"""The command line as users run it: inspect, describe, config errors, JSON logs, the demo."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys

from s3env import s3_client
from support import TOKENIZER, ServerProcess, job_spec, write_config, write_jsonl
from tokenfeed.server.commands import democorpus


def tokenfeed(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfeed.server.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_inspect_prints_rows_decoded_back_to_text(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:60])
    cfg = write_config(tmp_path / "tf.yaml", {"j": job_spec([corpus])}, tmp_path / "cache")
    out = tokenfeed(
        "inspect", "--config", str(cfg), "--job", "j", "--step", "2", "--rows", "3", "--chars", "0"
    )
    assert out.returncode == 0, out.stderr
    assert "job j step 2 rank 0/1: 8 rows x 64 tokens" in out.stdout
    # before it tokenizes, it says so and how to avoid it; after, what it built
    notice, *_, done = [ln for ln in out.stderr.splitlines() if ln.startswith("inspect:")]
    assert "building job j's index here first" in notice and "--target" in notice, out.stderr
    assert re.fullmatch(r"inspect: job j: \d+ chunks indexed in [\d.]+s", done), out.stderr
    rows = out.stdout.split("--- row ")[1:]
    assert len(rows) == 3
    for row in rows:
        body = row.split("\n", 1)[1].strip()
        # every decoded row is real text from the corpus (pieces joined by EOS)
        pieces = [p.strip() for p in body.split(democorpus.EOS) if len(p.strip()) > 20]
        assert pieces and all(any(p in t for t in texts[:60]) for p in pieces), body[:200]


def test_a_slow_local_inspect_prints_progress_lines(tmp_path, corpus, faults, s3_bucket):
    """Sources behind a slow object store: the index takes seconds to build, and says how far
    it is while it does (stderr), before the rows (stdout)."""
    client = s3_client(faults.endpoint)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"c/{path.name}", Body=path.read_bytes())
    client.put_object(Bucket=s3_bucket, Key="tokenizer.json", Body=TOKENIZER.read_bytes())
    faults.set_faults(1.0, ("delay",), key_filter="/c/", delay_seconds=0.08)
    spec = job_spec(
        [f"s3://{s3_bucket}/c/*"], tokenizer=f"s3://{s3_bucket}/tokenizer.json", chunk_bytes="8KiB"
    )
    store = {"endpoint_url": faults.endpoint, "addressing_style": "path", "block_bytes": "4KiB"}
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"j": spec},
        tmp_path / "cache",
        object_store=store,
        tokenize_threads=1,
    )
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed.server.commands.cli",
            "inspect",
            "--config",
            str(cfg),
            "--job",
            "j",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "AWS_DEFAULT_REGION": "us-east-1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("job j step 0 rank 0/1: 8 rows x 64 tokens"), out.stdout
    progress = re.findall(r"inspect: job j: (\d+)/(\d+) chunks indexed, (\d+)s", out.stderr)
    assert progress, out.stderr
    done = [int(n) for n, _, _ in progress]
    assert done == sorted(done) and all(int(total) > int(n) for n, total, _ in progress)


def test_inspect_through_a_server_matches_local(server, corpus, tmp_path):
    cfg = server.log_path.parent / "tf.yaml"
    # The server's cache directory is its own: a local inspect there refuses, naming --target.
    busy = tokenfeed("inspect", "--config", str(cfg), "--job", "main", "--step", "4")
    assert busy.returncode == 2 and "--target" in busy.stderr and "in use" in busy.stderr, busy
    local = tokenfeed(
        "inspect",
        "--config",
        str(cfg),
        "--job",
        "main",
        "--step",
        "4",
        "--tokens",
        "32",
        "--cache-dir",
        str(tmp_path / "own"),
    )
    remote = tokenfeed(
        "inspect",
        "--config",
        str(cfg),
        "--job",
        "main",
        "--step",
        "4",
        "--tokens",
        "32",
        "--target",
        server.address,
    )
    assert local.returncode == 0 and remote.returncode == 0, local.stderr + remote.stderr
    assert local.stdout == remote.stdout


def test_describe_prints_the_jobs(server):
    out = tokenfeed("describe", "--target", server.address)
    assert out.returncode == 0, out.stderr
    (job,) = json.loads(out.stdout)
    assert job["name"] == "main" and job["state"] == "JOB_STATE_READY"
    assert int(job["steps_per_epoch"]) == int(job["rows_per_epoch"]) // 8


def test_config_errors_name_the_key_and_value(tmp_path, corpus):
    cases = {
        "seq_len": (job_spec([corpus / "*"], seq_len=-3), "jobs.j.seq_len", "-3"),
        "packing": (job_spec([corpus / "*"], packing="zigzag"), "jobs.j.packing", "'zigzag'"),
        "unknown": (job_spec([corpus / "*"], sqe_len=5), "jobs.j.sqe_len", "unknown key"),
    }
    for name, (spec, where, value) in cases.items():
        cfg = write_config(tmp_path / f"{name}.yaml", {"j": spec}, tmp_path / "cache")
        out = tokenfeed("serve", "--config", str(cfg))
        assert out.returncode == 2, (name, out.stderr)
        assert where in out.stderr and value in out.stderr, (name, out.stderr)
    # a source that matches nothing is the job's failure, reported as such by a one-shot command
    cfg = write_config(
        tmp_path / "nomatch.yaml",
        {"j": job_spec([tmp_path / "nothing-*.jsonl"])},
        tmp_path / "cache",
    )
    out = tokenfeed("inspect", "--config", str(cfg), "--job", "j")
    assert out.returncode == 2 and "matched no objects" in out.stderr and "nothing-" in out.stderr


def test_a_busy_listen_address_is_a_clear_error(server, tmp_path, corpus):
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"j": job_spec([corpus / "*"])},
        tmp_path / "cache",
        listen=server.address,
    )
    out = tokenfeed("serve", "--config", str(cfg), "--listen", server.address)
    assert out.returncode == 2
    assert f"server.listen: cannot listen on '{server.address}'" in out.stderr


def test_json_logs_locate_each_skipped_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine text here, long enough"}\n{"text": 1}\n' * 30)
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"j": job_spec([path], seq_len=8)},
        tmp_path / "cache",
        log_format="json",
    )
    proc = ServerProcess(cfg, tmp_path / "log.txt")
    try:
        proc.wait_ready("j")
    finally:
        assert proc.stop() == 0
    records = [json.loads(line) for line in proc.log().splitlines() if line.startswith("{")]
    skipped = [r for r in records if r.get("reason") == "not_text"]
    assert [r["location"] for r in skipped] == [f"{path}:{2 * i + 2}" for i in range(30)]
    assert all(r["job"] == "j" and r["level"] == "warning" for r in skipped)


def test_demo_runs_end_to_end(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed.server.commands.demo",
            "--out",
            str(tmp_path),
            "--steps",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # the job is described once built: the whole corpus's sizes, never 0 steps per epoch
    sizes = re.search(
        r"job demo: \d+ chunks, (\d+) documents, .* (\d+) steps per epoch", out.stdout
    )
    assert sizes, out.stdout
    documents, steps = (int(n) for n in sizes.groups())
    assert steps > 0 and documents == int(re.search(r"corpus: (\d+) documents", out.stdout)[1])
    assert "same request again, same bytes: True" in out.stdout
    assert "streamed 30 steps:" in out.stdout and "M tokens/s" in out.stdout
    assert "server drained and exited with code 0" in out.stdout


def test_version():
    out = tokenfeed("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"tokenfeed {importlib.metadata.version('tokenfeed')}\n"


def with_stdout_closed(*args: str) -> tuple[int, str]:
    """The command run with nobody reading its output: the pipe is closed before it writes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfeed.server.commands.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


def test_output_cut_short_ends_quietly(server):
    """`tokenfeed explain ... | head`: the reader leaves early; no traceback, the exit status of
    a process that SIGPIPE ended, like any command in a pipeline."""
    cfg = server.log_path.parent / "tf.yaml"
    target = ("--target", server.address)
    commands = {
        "explain": ("explain", *target, "--job", "main", "--step", "3"),
        "explain --json": ("explain", *target, "--job", "main", "--json"),
        "describe": ("describe", *target),
        "inspect": ("inspect", "--config", str(cfg), "--job", "main", *target),
    }
    for name, args in commands.items():
        code, err = with_stdout_closed(*args)
        assert code == 128 + signal.SIGPIPE, (name, code, err)
        assert "Traceback" not in err and "Broken" not in err and "ignored" not in err, err
    head = subprocess.run(
        [sys.executable, "-m", "tokenfeed.server.commands.cli", *commands["explain"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert head.returncode == 0 and head.stdout.startswith("job main step 3 rank 0/1"), head


def test_a_missing_tokenizer_names_its_key_and_file(tmp_path, corpus):
    missing = tmp_path / "models" / "tokenizer.json"
    cfg = write_config(
        tmp_path / "tf.yaml",
        {"j": job_spec([corpus / "*"], tokenizer=str(missing))},
        tmp_path / "cache",
    )
    out = tokenfeed("inspect", "--config", str(cfg), "--job", "j")
    assert out.returncode == 2, out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert "jobs.j.tokenizer.path" in error and str(missing) in error, error
    assert "No such file" in error and "path or object-store URI of a tokenizer.json" in error
    assert "source" not in error, error
