"""Per-rank, per-attempt log paths in the run directory, kept across restarts."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

from elastic_nb.common.rundir import RunDir, attempt_of


class RunDirLogsSpecs(LogsSpecs):
    """torchelastic's DefaultLogsSpecs puts logs under a random directory and deletes an
    attempt's directory when it restarts (multiprocessing/api.py, reify: shutil.rmtree).
    We want deterministic paths the supervisor can tail, and every attempt kept."""

    def __init__(self, run_dir: RunDir) -> None:
        super().__init__(log_dir=str(run_dir.path), redirects=Std.ALL, tee=Std.NONE)
        self._run_dir = run_dir

    @property
    def root_log_dir(self) -> str:
        return str(self._run_dir.path)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        stdouts: dict[int, str] = {}
        stderrs: dict[int, str] = {}
        error_files: dict[int, str] = {}
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            attempt = attempt_of(env)
            self._run_dir.attempt(attempt).mkdir(parents=True, exist_ok=True)
            stdouts[local_rank] = str(self._run_dir.log(attempt, rank, "out"))
            stderrs[local_rank] = str(self._run_dir.log(attempt, rank, "err"))
            error_files[local_rank] = str(self._run_dir.torch_error(attempt, rank))
            env["TORCHELASTIC_ERROR_FILE"] = error_files[local_rank]
        return LogsDest(
            stdouts=stdouts,
            stderrs=stderrs,
            tee_stdouts={},
            tee_stderrs={},
            error_files=error_files,
        )
