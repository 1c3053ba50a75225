"""Experiment trackers named by ``report_to``: TensorBoard, Weights & Biases, MLflow and Trackio.

Each gets what ``metrics.jsonl`` gets (every numeric value of every record, at the record's ``step``, under
the name a Trainer run gives it in that tracker: ``trainer_names``) and the resolved config, on rank 0 only.
Each is one small class: ``start(run_name, config)`` returns where the run is written, ``log(scalars, step)``,
``finish(failed)``. None of them needs the network: W&B runs offline unless it has credentials or WANDB_MODE says
otherwise, MLflow writes a file store in the output folder unless MLFLOW_TRACKING_URI names another, Trackio
writes its local SQLite store, TensorBoard event files. Their packages
are optional (``pip install 'shardtune[trackers]'``) and imported only when named.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from shardtune.config.validation import missing_tracker_message, mlflow_tags
from shardtune.errors import TrainingStopped, UsageError, first_line

log = logging.getLogger("shardtune")

PROJECT = "shardtune"  # the W&B project, MLflow experiment and Trackio project unless their env variables say
MLFLOW_MAX_PARAMS = 100  # MLflow's limit of params in one log_batch call


class Tracker(Protocol):
    name: str
    # Whether Transformers' callback for this tracker writes its logs as train/<name> and eval/<name>
    # (``trainer_names``): TensorBoard's, W&B's and Trackio's do, MLflow's keeps the names as logged.
    prefixed: bool

    def start(self, run_name: str, config: dict[str, Any], resumed_at: int) -> str:
        """Open the run with ``config`` as its parameters; returns where it is written, in words. ``resumed_at``:
        the step a resumed run carries on from (0 for a fresh one): what was logged after it is logged again.
        W&B, MLflow and Trackio open a run of their own each time (an earlier one where WANDB_RUN_ID with
        WANDB_RESUME, or MLFLOW_RUN_ID, names it: they cannot take back what it logged after ``resumed_at``, so a
        redone step is logged twice there); TensorBoard writes into the same folder."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def finish(self, failed: bool) -> None: ...


class TensorBoardTracker:
    """Event files under ``output_dir/tensorboard/RUN_NAME``, or in TENSORBOARD_LOGGING_DIR itself where it is set
    (as Transformers' TensorBoardCallback reads it); the config as a text summary."""

    name = "tensorboard"
    prefixed = True

    def __init__(self, output_dir: Path) -> None:
        chosen = os.environ.get("TENSORBOARD_LOGGING_DIR")
        self.root = Path(chosen).expanduser() if chosen else output_dir / "tensorboard"
        self.folder_is_run = bool(chosen)  # the events go in the folder named, no run's folder under it
        self.writer = None

    def start(self, run_name: str, config: dict[str, Any], resumed_at: int = 0) -> str:
        from torch.utils.tensorboard import SummaryWriter

        folder = self.root if self.folder_is_run else self.root / run_name.replace(os.sep, "_")
        # A resumed run redoes the steps after its checkpoint: the folder's events from them on are purged, so each
        # step is read once, as metrics.jsonl keeps it. That is every step for a resume that found no checkpoint
        # (resumed_at 0: the folder holds what the run logged before it was killed); a fresh run's folder is empty.
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=resumed_at + 1)
        # Markdown shows a code block as it is; the reader strips the fence.
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```")
        return f"event files in {folder} (tensorboard --logdir {self.root})"

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


def wandb_has_credentials() -> bool:
    """An API key or identity token in the environment, or a ~/.netrc login for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    base = os.environ.get("WANDB_BASE_URL")
    hosts = {urlparse(base).hostname} if base else {"api.wandb.ai", wandb_default_host()}
    try:
        logins = netrc.netrc(os.environ.get("NETRC") or None)
    except (OSError, netrc.NetrcParseError):
        return False
    return any(host and logins.authenticators(host) for host in hosts)


def wandb_default_host() -> str | None:
    import wandb

    return urlparse(wandb.Settings().base_url).hostname


class WandbTracker:
    """A W&B run in ``output_dir/wandb`` (in WANDB_DIR/wandb where it is set, as with Transformers); offline unless
    WANDB_MODE is set or credentials are configured."""

    name = "wandb"
    prefixed = True
    name_variable = "WANDB_NAME"

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.run = None
        self.set_up_offline = False

    def start(self, run_name: str, config: dict[str, Any], resumed_at: int = 0) -> str:
        import wandb

        offline = not os.environ.get("WANDB_MODE") and not wandb_has_credentials()
        if offline:  # the global settings too: with only the run's, wandb's telemetry still calls its server
            wandb.setup(settings=wandb.Settings(mode="offline"))
        self.set_up_offline = offline
        # wandb.init's dir would overrule the WANDB_DIR a user set
        where = {} if os.environ.get("WANDB_DIR") else {"dir": str(self.output_dir)}
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, config=config, **where)
        folder = self.run.settings.sync_dir
        if offline:
            return (f"offline run in {folder} (no WANDB_API_KEY or ~/.netrc login, WANDB_MODE unset); "
                    f"'wandb sync {folder}' uploads it")
        if self.run.settings.mode == "disabled":  # wandb still names a folder, which it never writes
            return "disabled by WANDB_MODE=disabled: nothing is logged to W&B (unset it to log)"
        return f"run {self.run.id} ({self.run.settings.mode}), files in {folder}"

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        if self.set_up_offline:
            import wandb

            # wandb keeps those settings for the process's life: a later run in it (a notebook's next train, with
            # a login or WANDB_MODE set by now) would be offline still, and would not read WANDB_DIR again
            wandb.teardown()


class MlflowTracker:
    """An MLflow run at MLFLOW_TRACKING_URI, else in a file store at ``output_dir/mlruns``; as with Transformers,
    MLFLOW_RUN_ID names a run to carry on (a resumed job's) and MLFLOW_TAGS a JSON object of tags to set."""

    name = "mlflow"
    prefixed = False

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.client, self.run_id = None, None

    def start(self, run_name: str, config: dict[str, Any], resumed_at: int = 0) -> str:
        # Before the import: MLflow's usage telemetry would otherwise call its server.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        uri, browse = os.environ.get("MLFLOW_TRACKING_URI"), ""
        if not uri:
            uri = (self.output_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store working only on request; it needs no server and no database package.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # which its own readers refuse as well, unless the user's shell asks for it too
            browse = f" (browse it: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri})"
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        tags = mlflow_tags()
        self.client = MlflowClient(tracking_uri=uri)
        continued = os.environ.get("MLFLOW_RUN_ID")
        if continued:
            run = self.client.get_run(continued)  # one that does not exist stops the run here, naming it
            self.run_id, logged = continued, run.data.params
            self.client.update_run(continued, status="RUNNING")
            experiment_name = self.client.get_experiment(run.info.experiment_id).name
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
            self.run_id, logged = self.client.create_run(experiment_id, run_name=run_name).info.run_id, {}
        # MLflow refuses to change a param a run holds: a continued run keeps those it was first given
        params = [Param(key, str(value)) for key, value in config.items() if key not in logged]
        for first in range(0, len(params), MLFLOW_MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[first:first + MLFLOW_MAX_PARAMS])
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        kept = sorted(key for key, value in config.items() if key in logged and logged[key] != str(value))
        return (f"run {self.run_id}{' (MLFLOW_RUN_ID, carried on)' if continued else ''} in experiment "
                f"{experiment_name} at {uri}{browse}" + (f"; it keeps the params it was first given for "
                                                         f"{', '.join(kept)}" if kept else ""))

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v in scalars.items()])

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class TrackioTracker:
    """A Trackio run in its local store (TRACKIO_DIR, else HF_HOME/trackio); remote only where TRACKIO_SPACE_ID
    or TRACKIO_SERVER_URL ask for it. ``project``: the config's (Transformers 5's key for Trackio's project);
    unset, TRACKIO_PROJECT."""

    name = "trackio"
    prefixed = True

    def __init__(self, output_dir: Path, project: str | None = None) -> None:
        self.run, self.project = None, project

    def start(self, run_name: str, config: dict[str, Any], resumed_at: int = 0) -> str:
        import trackio
        from trackio.utils import TRACKIO_DIR

        project = self.project or os.environ.get("TRACKIO_PROJECT", PROJECT)
        self.run = trackio.init(project=project, name=run_name, config=config, embed=False)
        remote = os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL")
        where = f"sent to {remote}" if remote else f"stored in {TRACKIO_DIR}"
        return f"run {run_name} in project {project}, {where} (trackio show --project {project})"

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, failed: bool) -> None:
        import trackio
        from trackio import context_vars

        if context_vars.current_run.get() is self.run:
            trackio.finish()  # it also forgets the run, which trackio's exit handler would finish (and say so) again
        else:
            self.run.finish()


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
                             "trackio": TrackioTracker}


# metrics.jsonl's names that Transformers' Trainer logs under another name (a step record holds learning_rate
# beside lr as well: mapped onto it, the rate reaches each tracker once).
TRAINER_KEYS = {"lr": "learning_rate", "tokens_seen": "num_input_tokens_seen"}


def trainer_names(scalars: dict[str, float], *, prefixed: bool) -> dict[str, float]:
    """``scalars`` under the names a Trainer (so TRL) run gives them in the same tracker, so that the charts of both
    kinds of run in one project line up: ``learning_rate`` for ``lr``; ``prefixed``, ``eval/loss`` for
    ``eval_loss`` and ``train/<name>`` for the rest (Transformers' ``rewrite_logs``)."""
    named = {TRAINER_KEYS.get(key, key): value for key, value in scalars.items()}
    if not prefixed:
        return named
    return {f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}": value
            for key, value in named.items()}


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record, ``step`` aside (it is the x axis); booleans and text left out."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class Trackers:
    """The started trackers of a run. A tracker that fails mid-run (a full disk, a dropped connection) is warned
    about once and kept; training goes on and metrics.jsonl stays the record."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)
        self._warned: set[str] = set()

    def log(self, record: dict[str, Any]) -> None:
        scalars = scalars_of(record)
        if "step" not in record or not scalars:
            return
        for tracker in self.trackers:
            self._guard(tracker, "log", lambda t=tracker: t.log(trainer_names(scalars, prefixed=t.prefixed),
                                                                int(record["step"])))

    def finish(self, failed: bool = False) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            self._guard(tracker, "finish", lambda t=tracker: t.finish(failed))

    def _guard(self, tracker: Tracker, what: str, call) -> None:
        try:
            call()
        except Exception as exc:  # a tracker's trouble must never stop training
            if tracker.name not in self._warned:
                log.warning("report_to %s: %s failed (%s); training goes on, metrics.jsonl keeps every record",
                            tracker.name, what, first_line(str(exc), type(exc).__name__))
            self._warned.add(tracker.name)


def start_trackers(names: Sequence[str], output_dir: str | Path, run_name: str | None, config: dict[str, Any],
                   *, enabled: bool, resumed_at: int = 0, project: str | None = None) -> Trackers:
    """Start the trackers ``report_to`` names (``enabled``: on rank 0 only). One that cannot start stops the run
    in one line, after the ones already started are closed. ``project``: the config's, Trackio's project."""
    started = Trackers()
    if not enabled:
        return started
    output_dir = Path(output_dir)
    name_of_run = run_name or output_dir.resolve().name
    for name in names:
        tracker = TRACKERS[name](output_dir, project) if name == "trackio" else TRACKERS[name](output_dir)
        try:
            # a tracker's own variable for the name (WANDB_NAME), as Transformers leaves it to where run_name is unset
            own = os.environ.get(getattr(tracker, "name_variable", "")) if run_name is None else None
            where = tracker.start(own or name_of_run, config, resumed_at)
        except ImportError:
            started.finish(failed=True)
            raise UsageError(missing_tracker_message(name)) from None
        except UsageError:
            started.finish(failed=True)
            raise
        except Exception as exc:
            started.finish(failed=True)
            why = first_line(str(exc), type(exc).__name__)
            raise TrainingStopped(f"report_to {name}: could not start the run ({why}); fix that, or remove {name} "
                                  f"from report_to") from exc
        log.info("report_to %s: %s", name, where)
        started.trackers.append(tracker)
    return started
