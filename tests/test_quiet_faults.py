"""Faults stay quiet and honest (issue 27, item 4): SIGTERM during ``export`` and ``merge`` removes what they had
half-written and says so in one line (exit code 143), and the launcher names the rank whose death ended a job.

The rank-death case itself (a 2-process job, rank 1 SIGKILLed: the survivor's one line and the launcher's exit code
137) shares the launch of ``test_resume.py::test_ddp_lora_resumes_exactly``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.trainutil import REPO, make_lora_adapter, shardtune_env

# Loaded by the command's interpreter (sitecustomize on PYTHONPATH): a temporary file or folder about to be renamed
# into place waits there, complete, so that the test's SIGTERM finds the write in progress however fast it ran.
HOLD_RENAMES = '''
import os
import time


def _held(rename):
    def rename_later(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(src)).startswith(".tmp"):
            time.sleep(3600)  # a signal handler that raises ends the wait
        return rename(src, dst, *args, **kwargs)
    return rename_later


os.rename, os.replace = _held(os.rename), _held(os.replace)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from shardtune.testing.tiny import make_model_folder

    root = tmp_path_factory.mktemp("sigterm")
    make_model_folder(root / "model")
    make_lora_adapter(root / "model", root / "adapter")
    (root / "hold").mkdir()
    (root / "hold" / "sitecustomize.py").write_text(HOLD_RENAMES)
    return root


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".tmp"))


@pytest.mark.parametrize("command,out", [
    (["export", "{model}", "out.gguf", "--format", "gguf", "--quantize", "f16"], "out.gguf"),  # write_gguf's file
    (["merge", "{adapter}", "--base", "{model}", "merged"], "merged"),  # write_export's folder
])
def test_sigterm_during_export_removes_its_temporary_files_and_says_so(models, tmp_path, command, out):
    argv = [a.format(model=models / "model", adapter=models / "adapter") for a in command]
    env = shardtune_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(models / "hold"), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "shardtune", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a guard against a command that never writes, not a measured bound
        while not temporaries(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert temporaries(tmp_path), f"no temporary appeared; {proc.poll()=}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    said = [line for line in err.splitlines() if line.startswith("shardtune")]
    assert said == [f"shardtune {argv[0]}: stopped by SIGTERM before {out} was complete; the temporary files of the "
                    f"write in progress were removed: run the command again"], err
    assert "Traceback" not in err
    assert temporaries(tmp_path) == [] and not (tmp_path / out).exists()


def test_a_sigterm_that_lands_in_a_finalizer_still_stops_the_command():
    """Python only prints an exception raised in a finalizer (``__del__``, a weakref callback): a SIGTERM whose
    handler ran inside one, as it did in 3 of 3 kills of ``shardtune export`` at one moment of a 1.2 GB checkpoint's
    load (a regex object's ``__del__``), was printed as 'Exception ignored' and lost, and the handler had already
    set SIGTERM aside, so the export ran on deaf to every later one and wrote OUT. It is delivered again."""
    from shardtune.cli.common import sigterm_raises
    from shardtune.errors import Terminated
    from shardtune.train.loop import SigtermFlag

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, inside the finalizer

    def carry_on() -> None:
        Dropped()
        deadline = time.monotonic() + 5  # the command carrying on
        while time.monotonic() < deadline:
            time.sleep(0.01)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_raises():
        carry_on()
    assert signal.getsignal(signal.SIGTERM) == before
    # Training's start-up handler (it raises until the loop runs, then a checkpoint answers SIGTERM) stays the one
    # that answers: the signal is sent again to it, not to one put in its place.
    with pytest.raises(Terminated), sigterm_raises():
        flag = SigtermFlag()
        try:
            carry_on()
        finally:
            answering = signal.getsignal(signal.SIGTERM)
            flag.restore()
    assert answering == flag._handle


def failure(timestamp: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(timestamp=timestamp, exitcode=exitcode)


def test_the_launcher_names_the_rank_that_died_not_the_one_that_lost_it(monkeypatch, capsys):
    """torchrun stamps failures in whole seconds and lists ranks in order: rank 1 SIGKILLed and rank 0 exiting
    (its collective failed) in the same second tie, and the killed rank is the news, with 128 + 9."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardtune.cli import launch

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<N/A>")
                for rank, code in ((0, 1), (1, -9))}
    for each in failures.values():
        each.timestamp = 5

    def torchrun(args):
        raise ChildFailedError("shardtune", failures)

    monkeypatch.setattr(torch.distributed.run, "run", torchrun)
    assert launch.run_torchrun(["--standalone", "--nproc_per_node", "2", "-m", "shardtune", "train"]) == 137
    assert capsys.readouterr().err == "shardtune launch: rank 1 was killed by signal 9 (see its messages above)\n"
    first_failure = launch.first_failure
    assert first_failure({0: failure(5, 1), 1: failure(5, -9)})[0] == 1
    assert first_failure({0: failure(4, 1), 1: failure(5, -9)})[0] == 0  # rank 0 failed first, on its own
    # Rank 1 exited with its own error, rank 0 then lost it: the agent saw rank 1 first, and says so.
    assert first_failure({1: failure(5, 17), 0: failure(5, 1)})[0] == 1
    # The agent's own SIGTERM to the others never wins a tie.
    assert first_failure({0: failure(5, -15), 1: failure(5, 1)})[0] == 1


# A rank that notes each SIGTERM it gets and keeps running, as one still saving does.
SAVING_RANK = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "a").write("TERM\\n"))
open(sys.argv[1], "a").write("up\\n")
time.sleep(120)
"""


def test_a_second_sigterm_ends_the_launchers_wait_for_its_workers(monkeypatch, capsys, tmp_path):
    """The launcher passes a SIGTERM on to its ranks (not to other children of its own) and waits for them to save;
    a second SIGTERM stops that wait at once. Without the launcher's handler, this test's own handler raises."""
    import threading

    import torch.distributed.run

    from shardtune.cli import launch
    from shardtune.dist import process_state

    started = []

    def torchrun(args):
        assert "SIGTERM" not in args.signals_to_handle  # the agent leaves SIGTERM to the launcher
        for name, env in (("rank", {"LOCAL_RANK": "0"}), ("other", {})):
            log = tmp_path / name
            started.append((log, subprocess.Popen([sys.executable, "-c", SAVING_RANK, str(log)],
                                                  env={**os.environ, **env})))
        while not all(log.is_file() for log, _ in started):
            time.sleep(0.05)
        # the second, during the wait (sooner, it would be the first one delivered again: the test below)
        threading.Timer(launch.SIGTERM_REPEAT_S + 1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the launcher's SIGTERM handler returned")

    def not_handled(signum, frame):
        raise AssertionError("SIGTERM reached the test, not the launcher")

    monkeypatch.setattr(torch.distributed.run, "run", torchrun)
    previous = signal.signal(signal.SIGTERM, not_handled)
    begun = time.monotonic()
    try:
        code = launch.run_torchrun(["--standalone", "--nproc_per_node", "1", "-m", "shardtune", "train"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, proc in started:
            proc.kill()
            proc.wait()
    assert time.monotonic() - begun < 30  # not the rank's 120 s, nor the launcher's 30 minutes
    assert code == 1 and "stopped by SIGTERM before the workers saved a checkpoint" in capsys.readouterr().err
    assert [log.read_text() for log, _ in started] == ["up\nTERM\n", "up\n"]
    assert all(process_state(proc.pid) == "gone" for _, proc in started)


# A rank that takes 3 s to save after SIGTERM, then reports its checkpoint as a stopped worker does.
SLOW_SAVING_RANK = """
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1], "a").write("TERM\\n"))
open(sys.argv[1], "a").write("up\\n")
while "TERM" not in open(sys.argv[1]).read():
    time.sleep(0.05)
time.sleep(3)
with open(os.environ["SHARDTUNE_STOP_REPORT"], "w") as f:
    json.dump({"steps": 5, "max_steps": 10, "last_checkpoint": "out/checkpoints/step-5"}, f)
sys.exit(143)
"""


def test_a_sigterm_delivered_twice_still_waits_for_the_save(monkeypatch, capsys, tmp_path):
    """On scancel or preemption Slurm sends SIGTERM to every process of the job: each node's launcher gets one, and
    srun, in the batch step, forwards its own a moment later. The launcher took that copy for a second SIGTERM and
    stopped its workers in their save (torchrun's 30 s, not the preemption's grace). It waits on for the save."""
    import threading

    import torch.distributed.run

    from shardtune.cli import launch

    started = []

    def torchrun(args):
        log = tmp_path / "rank"
        started.append(subprocess.Popen([sys.executable, "-c", SLOW_SAVING_RANK, str(log)],
                                        env={**os.environ, "LOCAL_RANK": "0"}))
        while not log.is_file():
            time.sleep(0.05)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # srun's copy
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the launcher's SIGTERM handler returned")

    monkeypatch.setattr(torch.distributed.run, "run", torchrun)
    try:
        code = launch.run_torchrun(["--standalone", "--nproc_per_node", "1", "-m", "shardtune", "train"])
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
    err = capsys.readouterr().err
    assert code == 143 and "stopped by SIGTERM at step 5 of 10; checkpoint out/checkpoints/step-5 saved" in err, err
    assert started[0].returncode == 143  # it ended on its own, its save done
