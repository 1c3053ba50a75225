"""Many ``shardtune train`` jobs in one process, one after another, each as the command runs it.

Run as ``python -m tests.jobs_worker JOBS_JSON`` by one process, or by two with RANK 0 and 1 (tests/trainutil.py
``train_jobs`` starts them). JOBS_JSON holds ``{"results": PATH, "jobs": [{"name", "argv", "port"}, ...]}``:
each job is ``shardtune train ARGV`` through the command's own entry point (its config checks, its exit codes),
in this process. Importing torch and transformers is most of a tiny run's time, so a test module's runs share
one process (or one pair) instead of starting one each. A two-process job joins a new process group on the
TCPStore the test holds at ``port`` and leaves it at its end, as a launched run does (gloo cannot rejoin the group
it left on the same store). Each rank appends its exit code of each job, or the exception that escaped it, to the
results file as soon as the job ends; a failed job does not stop the next.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(jobs_file: Path) -> None:
    from shardtune.cli import main as shardtune
    from tests.trainutil import JOB_MARK

    spec = json.loads(jobs_file.read_text())
    rank = int(os.environ.get("RANK", "0"))
    for job in spec["jobs"]:
        print(f"{JOB_MARK}{job['name']}", flush=True)
        if job["port"] is not None:
            os.environ["MASTER_PORT"] = str(job["port"])
        try:
            outcome = {"code": shardtune(["train", *job["argv"]])}
        except Exception:  # noqa: BLE001 - recorded for the test that owns this job; the others go on
            outcome = {"code": None, "error": traceback.format_exc()[-3000:]}
        with open(spec["results"], "a") as f:  # one short line per write: the ranks' lines do not interleave
            f.write(json.dumps({"name": job["name"], "rank": rank, **outcome}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
