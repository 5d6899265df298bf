"""A cell submitted to run, as one record from the magic that prepares it to the job (or the
session cell) that runs it: the kernel's submit request carries it, the supervisor rebuilds it
from that request, and its run directory is written from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec

__all__ = ["Submission"]


@dataclass
class Submission:
    id: str  # the job's (or the session cell's), chosen by the kernel: it listens before submitting
    spec: JobSpec
    source: str  # what the ranks execute (kernel/cell.py: line 1 is the magic line, as a comment)
    meta: dict[str, Any]  # how to run it: display, modules, objects, notebook names
    payload: bytes | None  # the --push objects, cloudpickled
    session: str | None = None  # the session whose ranks run it; None: a job of its own

    def request(self, req: int) -> protocol.kernel.Submit:
        """The kernel's submit request for it (the payload travels as the frame's blob)."""
        return protocol.kernel.Submit(
            kind=protocol.kernel.SUBMIT,
            req=req,
            job=self.id,
            spec=self.spec.to_dict(),
            cell=protocol.kernel.CellSource(source=self.source, meta=self.meta),
            env=dict(os.environ),
            session=self.session,
        )

    @classmethod
    def of(cls, msg: protocol.kernel.Submit, job_id: str, blob: bytes | None) -> Submission:
        """The submission a submit request carries (its job id checked by the supervisor)."""
        spec = JobSpec.from_dict(msg["spec"])
        cell = msg["cell"]
        return cls(job_id, spec, cell["source"], cell["meta"], blob, msg["session"])

    def write(self, rd: RunDir) -> None:
        """What its ranks read, into its run directory; the payload is then dropped: a pushed
        model need not stay in the supervisor's memory."""
        rd.create(self.spec.to_json(), self.source, self.meta, self.payload)
        self.payload = None
