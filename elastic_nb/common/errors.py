"""What a %%elastic cell raises. IPython renders these without the magic's own frames."""

from __future__ import annotations

from elastic_nb.common import report
from elastic_nb.protocol.records import Summary

__all__ = ["CellError", "ElasticError", "JobFailed", "JobStopped", "JobTimeout", "SupervisorDied"]

_RED, _RESET = "\x1b[0;31m", "\x1b[0m"


class ElasticError(Exception):
    """Base of elastic_nb's errors."""

    def _detail(self) -> list[str]:
        return []

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of formatting a traceback (interactiveshell.showtraceback).
        return [f"{_RED}{type(self).__name__}{_RESET}: {self}", *self._detail()]


class CellError(ElasticError):
    """The cell cannot be sent to the ranks; nothing was launched."""

    def __init__(self, message: str, detail: list[str] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or []

    def _detail(self) -> list[str]:
        return self.detail

    @classmethod
    def from_syntax_error(cls, e: SyntaxError) -> CellError:
        detail = []
        if e.text:
            text = e.text.rstrip("\n")
            detail.append(f"    {text}")
            if e.offset:
                detail.append("    " + " " * (e.offset - 1) + "^")
        detail.append("Nothing was launched. The cell runs as plain Python in every rank, so")
        detail.append("IPython syntax (%magics, !shell) is not available inside it.")
        return cls(f"{e.msg} (cell line {e.lineno})", detail)


class JobFailed(ElasticError):
    """A rank failed (or the launcher did); the message names the rank that failed first."""

    def __init__(self, summary: Summary) -> None:
        super().__init__(report.failure_headline(summary))
        self.summary = summary

    @property
    def job_id(self) -> str:
        return self.summary["job"]

    @property
    def rank(self) -> int | None:
        f = self.summary.get("failure")
        return f["rank"] if f else None

    @property
    def cause(self) -> str | None:
        """The cause class: exception, cuda_oom, desync, ... (report.CAUSE_HINTS)."""
        return self.summary.get("cause")

    @property
    def run_dir(self) -> str:
        return self.summary["run_dir"]

    def _detail(self) -> list[str]:
        return report.failure_report(self.summary)


class JobTimeout(JobFailed):
    """The job ran past --timeout and was stopped."""


class JobStopped(ElasticError):
    """The job was stopped from outside the cell (%elastic stop, another client)."""

    def __init__(self, summary: Summary) -> None:
        super().__init__(f"job {summary['job']} was stopped: {summary['reason']}")
        self.summary = summary

    def _detail(self) -> list[str]:
        return report.failure_report(self.summary)


class Refused(ElasticError):
    """The supervisor said no to a request (e.g. stacks of a job that is not running)."""

    def __init__(self, request: str, reason: str) -> None:
        super().__init__(f"the supervisor refused {request!r}: {reason}")
        self.request, self.reason = request, reason


class SupervisorDied(ElasticError):
    """The supervisor process vanished while a job ran; the job's processes were killed."""
