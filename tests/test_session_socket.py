"""Who may speak on a session's socket: only the process torchelastic started as that rank of the
session's current attempt. Everyone else who says hello as a rank (with the right numbers) is
refused at once, the refusal is in the supervisor's log with its pid, and no cell reaches it: a
local process of the same user, a rank of another job, a process a rank left behind before a
restart."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel import Kernel, wait_for
from tests.test_session import INIT, up

pytestmark = pytest.mark.e2e

# Says hello as a rank, then reports what came back: "refused" (the supervisor closed the
# connection), or whatever it was sent (a cell to run: the impostor was taken for the rank).
IMPOSTOR = """
import json, socket, sys
def claim(path, rank, attempt, wait):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    hello = {"kind": "rank_hello", "rank": rank, "attempt": attempt, "pid": PID}
    s.sendall((json.dumps(hello) + "\\n").encode())
    s.settimeout(wait)
    try:
        data = s.recv(65536)
    except OSError:
        data = b"nothing"
    s.close()
    return "refused" if data == b"" else "answered: " + data.decode(errors="replace").strip()
"""


def _sockets(k: Kernel, session: str) -> tuple[Path, Path]:
    """The session's socket (beside its supervisor's) and the supervisor's log."""
    status = k.ok("%elastic status").stdout
    socket_path = Path(re.search(r"socket: (\S+)", status)[1])
    log = Path(re.search(r"log: +(\S+)", status)[1])
    return socket_path.parent / f"session-{session}.sock", log


def _refused_in(log: Path, pid: int, rank: int, attempt: int) -> bool:
    said = f"refused a connection from pid {pid} as rank {rank} of attempt {attempt}"
    return said in log.read_text()


@pytest.fixture
def session(fresh_kernel: Kernel) -> tuple[Kernel, str]:
    k = fresh_kernel
    session = up(k)
    k.ok(INIT)
    return k, session


def test_a_local_process_that_says_it_is_rank_0_is_refused(session: tuple[Kernel, str]) -> None:
    """Same user, right session, right rank and attempt, and the real rank 0's pid in its hello:
    the supervisor believes the kernel (SO_PEERCRED), not the message."""
    k, sid = session
    path, log = _sockets(k, sid)
    real = int(re.search(r"\[rank 0\] (\d+)", k.ok("%%elastic\nprint(os.getpid())\n").stdout)[1])
    impostor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            IMPOSTOR.replace("PID", str(real))
            + f"print(claim({str(path)!r}, 0, 0, 20), flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        # If it were taken for rank 0, the next cell would be sent to it, not to the rank.
        assert wait_for(lambda: _refused_in(log, impostor.pid, 0, 0), 10), log.read_text()
        ex = k.run("%%elastic --timeout 20\ncounter += 1\ncounter\n")
        assert ex.error is None and ex.result == "1", ex.traceback
        out, _ = impostor.communicate(timeout=30)
        assert out.strip() == "refused"
        assert f"torchelastic started pid {real} as that rank" in log.read_text()
    finally:
        impostor.kill()
        impostor.wait()


def test_a_rank_of_another_job_is_refused(session: tuple[Kernel, str]) -> None:
    """A rank of a one-off job beside the session claims to be the session's rank 1."""
    k, sid = session
    path, log = _sockets(k, sid)
    ex = k.ok(
        "%%elastic --one-off --nproc 1\n"
        + IMPOSTOR.replace("PID", "os.getpid()")
        + "import os\n"
        + f"print('pid', os.getpid(), claim({str(path)!r}, 1, 0, 20), flush=True)\n"
    )
    m = re.search(r"\[rank 0\] pid (\d+) (.*)", ex.stdout)
    assert m and m[2] == "refused", ex.stdout
    assert _refused_in(log, int(m[1]), 1, 0)
    assert k.ok("%%elastic\ncounter += 1\ncounter\n").result == "1"  # the session is whole


LEFT_BEHIND = """
import os, time
go = GO
while not os.path.exists(go):
    time.sleep(0.05)
said = claim(PATH, 0, 0, 10) + "\\n" + claim(PATH, 0, 1, 10) + "\\n"
with open(go + ".tmp", "w") as f:  # the answers first, then the file whole: never read half
    f.write(said)
os.replace(go + ".tmp", go + ".said")
"""


def test_a_process_left_by_a_rank_of_an_earlier_attempt_is_refused(
    session: tuple[Kernel, str], tmp_path: Path
) -> None:
    """Rank 0 of attempt 0 starts a process of its own (a session of its own: it outlives the
    restart). After the restart it claims to be rank 0 of attempt 0 (ended) and of attempt 1
    (another process): refused both times."""
    k, sid = session
    path, log = _sockets(k, sid)
    go = tmp_path / "go"
    child = IMPOSTOR.replace("PID", "os.getpid()") + LEFT_BEHIND.replace(
        "GO", repr(str(go))
    ).replace("PATH", repr(str(path)))
    ex = k.ok(
        "%%elastic --no-replay\n"
        "import subprocess, sys\n"
        "if dist.get_rank() == 0:\n"
        f"    left = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
        "    print('left', left.pid, flush=True)\n"
    )
    left = int(re.search(r"\[rank 0\] left (\d+)", ex.stdout)[1])
    died = k.run(
        "%%elastic\n"
        "import signal, time\n"
        "if dist.get_rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    assert died.ename == "JobFailed"
    assert "attempt 1, restarts 1/3" in k.ok("%elastic session").stdout
    go.touch()
    said = go.with_name("go.said")
    assert wait_for(said.exists, 30)
    assert said.read_text().split("\n")[:2] == ["refused", "refused"]
    assert _refused_in(log, left, 0, 0) and "that rank has ended" in log.read_text()
    assert _refused_in(log, left, 0, 1)
    assert k.ok("%%elastic\ncounter\n").result == "0"  # the ranks of attempt 1 serve on
