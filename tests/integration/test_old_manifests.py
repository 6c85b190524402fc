"""Manifests of an object's old version stop counting as kept: after a source changes and the
server restarts on the same cache, the old chunks' manifests become evictable."""

from __future__ import annotations

import re
import shutil
import time

from support import ServerProcess, job_spec, write_config, write_jsonl


def test_manifests_of_a_changed_object_become_evictable(tmp_path, corpus, texts):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    jobs = {"main": job_spec([data / "*"])}
    cfg = write_config(tmp_path / "tf.yaml", jobs, tmp_path / "cache")
    first = ServerProcess(cfg, tmp_path / "first.log")
    assert first.wait_ready("main")["state"] == "JOB_STATE_READY", first.log()
    chunks_before = int(first.client("main").describe()["num_chunks"])
    assert first.stop() == 0
    assert "evictable now" not in first.log()  # every manifest is referenced
    write_jsonl(data / "part-0.jsonl", texts[:50])  # a new version of one object
    second = ServerProcess(cfg, tmp_path / "second.log")
    try:
        assert second.wait_ready("main")["state"] == "JOB_STATE_READY", second.log()
        log = ""
        for _ in range(100):
            log = second.log()
            if "evictable now" in log:
                break
            time.sleep(0.1)
        found = re.search(r"cache: (\d+) manifests of chunks no job reads are evictable", log)
        assert found, log
        assert 0 < int(found.group(1)) < chunks_before
    finally:
        assert second.stop() == 0
