"""scripts/gpu_check.sh's Python side: the machine line, and the summary it rewrites after every
step (so that a check cut short still leaves one).

    python scripts/gpu_check.py machine WORK     # prints the machine; writes WORK/machine.json
    python scripts/gpu_check.py report WORK OUT  # WORK/steps.tsv + logs -> OUT/summary.md

A step's status says what was checked, never more: PASS only for a step that ran its check on
a CUDA device and passed it whole (a `cuda` test skipped there makes it PARTIAL); DONE for a
benchmark beside torchrun that ran and gave its figures (whether they meet their targets is in
its table); where torch sees no CUDA device the `cuda` tests report SKIPPED and the GPU
benchmarks run their CPU stand-in (STAND-IN OK / STAND-IN FAILED), which measures no GPU.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

# name -> (issue item, what it checks), in the order gpu_check.sh runs them
STEPS = {
    "machine": ("-", "nvidia-smi, torch, CUDA, NCCL"),
    "env": ("-", "the carried wheels installed; every pin and floor met; the imports"),
    "oom-hang": (
        "1",
        "benchmarks/gpu_oom_hang.py: a real CUDA OOM on rank 1 of DDP (NCCL, 2 ranks "
        "on the GPU), then the desync (OOM caught, backward() skipped), the GPU after",
    ),
    "nccl-timeout": (
        "2",
        "tests/test_cuda.py: a real NCCL collective timeout, --async-error-handling 0-3",
    ),
    "cuda-tests": (
        "3, 4",
        "every other test marked cuda (memory: --memory-history snapshot, "
        "samples, a real OOM's figures)",
    ),
    "p2-failure": ("5", "benchmarks/failure.py: P2, failure -> error, beside torchrun"),
    "p6-throughput": ("5", "benchmarks/throughput.py: P6, DDP steps/s, beside torchrun"),
    "p1-launch": ("5", "benchmarks/launch.py --warm-only: P1, warm launch, beside torchrun"),
}
NEEDS_CUDA = {"oom-hang", "nccl-timeout", "cuda-tests", "p2-failure", "p6-throughput", "p1-launch"}
GOOD = ("PASS", "DONE", "STAND-IN OK", "SKIPPED (needs CUDA)", "not selected")


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({cmd[0]}: {e})"


def machine(work: Path) -> int:
    """Print the machine line (and nvidia-smi's view) and write machine.json; CUDA is looked at
    in this process only, which ends before any step runs."""
    info: dict[str, object] = {"python": platform.python_version(), "executable": sys.executable}
    with open("/proc/cpuinfo") as f:
        cpu = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "?")
    memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    smi = ""
    if _which("nvidia-smi"):
        query = "--query-gpu=name,memory.total,memory.used,driver_version"
        smi = _run("nvidia-smi", query, "--format=csv,noheader")
    info.update(cpu=cpu, cores=len(os.sched_getaffinity(0)), memory_gib=memory, nvidia_smi=smi)
    devices: list[str] = []
    facts = []
    try:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # a CPU build: no NCCL in it
            info["nccl"] = f"none ({type(e).__name__})"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = [torch.cuda.get_device_name(i) for i in range(count)]
        if count and smi:
            # Does NVML name this process's pid (a container without the host's PID namespace
            # lists none, or the host's)? The checks that no rank holds the GPU read those pids.
            held = torch.zeros(1, device="cuda")
            pids = _run("nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader")
            info["nvml_sees_our_pids"] = str(os.getpid()) in pids.split()
            facts.append(f"NVML lists this machine's pids: {info['nvml_sees_our_pids']}")
            del held
    except Exception as e:
        info["torch"] = f"not importable: {e!r}"
        count = 0
    info.update(cuda_devices=count, devices=devices)
    line = (
        f"{cpu}, {info['cores']} cores, {memory} GiB, Linux {platform.release()}, "
        f"Python {info['python']}, torch {info.get('torch')}, CUDA {info.get('torch_cuda')}, "
        f"NCCL {info.get('nccl')}; CUDA devices: {count}"
        + (f" ({'; '.join(devices)})" if devices else "")
        + (f"; nvidia-smi (name, total, used, driver): {smi}" if smi else "; no nvidia-smi")
        + "".join(f"; {x}" for x in facts)
    )
    info["line"] = line
    (work / "machine.json").write_text(json.dumps(info, indent=1))
    print(f"Machine: {line}")
    if smi:
        print(_run("nvidia-smi"))
    if str(info.get("torch", "")).startswith("not importable"):
        return 1
    if smi and not count:
        # A driver older than this torch's CUDA, say: everything after would be the rehearsal.
        print("nvidia-smi sees a GPU, but torch sees no CUDA device: the GPU steps cannot run")
        return 1
    return 0


def _which(name: str) -> bool:
    return any(Path(d, name).exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def _junit(path: Path) -> tuple[dict[str, int], list[tuple[str, str, float, str]]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    tests: list[tuple[str, str, float, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message") or ""
            elif child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        counts[outcome] += 1
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        first = message.splitlines()[0] if message.strip() else ""
        tests.append((name, outcome, float(case.get("time") or 0), first[:160]))
    return counts, tests


def status(step: dict[str, str], cuda: bool, work: Path) -> tuple[str, str]:
    """(status, what the counts were) of one recorded step."""
    rc, name = step["rc"], step["name"]
    if rc == "notrun":
        return "NOT RUN", step["note"]
    if rc == "notselected":
        return "not selected", ""
    if rc in ("124", "137"):
        return "TIMEOUT", f"killed at its {step['limit']} s limit"
    junit = work / "logs" / f"{name}.xml"
    if step["kind"] == "pytest":
        if not junit.exists():
            return "FAIL", f"exit {rc}, no junit report"
        counts, _ = _junit(junit)
        said = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        if not sum(counts.values()):
            return "FAIL", f"exit {rc}; no test was collected"
        if counts["failed"] or rc != "0":
            return "FAIL", f"exit {rc}; {said}"
        if not cuda:
            return ("SKIPPED (needs CUDA)" if not counts["passed"] else "FAIL"), said
        if counts["skipped"] or not counts["passed"]:
            return "PARTIAL", said
        return "PASS", said
    if step["kind"] in ("gpu", "bench") and not cuda:
        return ("STAND-IN OK" if rc == "0" else "STAND-IN FAILED"), f"exit {rc}, on the CPU"
    if step["kind"] == "bench":  # figures beside torchrun: its targets are read in its table
        return ("DONE" if rc == "0" else "FAIL"), f"exit {rc}; figures and targets below"
    return ("PASS" if rc == "0" else "FAIL"), f"exit {rc}"


def report(work: Path, out: Path) -> int:
    """Rewrite out/summary.md; exit 0 when every step is as good as this machine allows."""
    minfo = (
        json.loads((work / "machine.json").read_text()) if (work / "machine.json").exists() else {}
    )
    cuda = int(minfo.get("cuda_devices") or 0) > 0
    rows = []
    tsv = work / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        fields = ("name", "kind", "rc", "seconds", "limit", "left", "gpu", "note")  # record()'s
        rows.append(
            dict(zip(fields, (line.split("\t") + [""] * len(fields))[: len(fields)], strict=True))
        )
    done = {r["name"] for r in rows}
    for name in STEPS:
        if name not in done:
            rows.append(
                dict(
                    name=name,
                    kind="",
                    rc="pending",
                    seconds="",
                    limit="",
                    left="",
                    gpu="",
                    note="not reached yet",
                )
            )
    lines = [
        f"# GPU check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        "",
        f"Machine: {minfo.get('line', '(the machine step has not run)')}",
        "",
        "Mode: "
        + (
            "CUDA: the real checks."
            if cuda
            else "**CPU rehearsal: torch sees no CUDA device.** The GPU steps ran their CPU "
            "stand-ins or were skipped; nothing below is a GPU result."
        ),
        "",
        "| step | issue item | what | status | seconds | limit | left behind | GPU after | detail |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    bad = []
    for r in rows:
        item, what = STEPS.get(r["name"], ("?", ""))
        if r["rc"] == "pending":
            st, detail = "NOT RUN", "not reached (the check was cut short)"
        else:
            st, detail = status(r, cuda, work)
        if st not in GOOD:
            bad.append(r["name"])
        detail = "; ".join(x for x in (detail, r["note"] if r["rc"] != "notrun" else "") if x)
        lines.append(
            f"| {r['name']} | {item} | {what} | {st} | {r['seconds']} | {r['limit']} "
            f"| {r['left'] or '-'} | {r['gpu'] or '-'} | {detail} |"
        )
    lines.append("")
    need = [n for n in STEPS if n in NEEDS_CUDA]
    if cuda:
        verdict = (
            "every step passed (the benchmarks: done, their targets in their tables)"
            if not bad
            else f"did not pass: {', '.join(bad)}"
        )
    else:
        verdict = (
            "the rehearsal ran clean" if not bad else f"the rehearsal failed: {', '.join(bad)}"
        ) + f"; these steps need CUDA and were not checked here: {', '.join(need)}"
    lines += [f"Verdict: {verdict}.", ""]
    lines += _details(rows, work)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


def _details(rows: list[dict[str, str]], work: Path) -> list[str]:
    """Each step's tables and verdict lines from its log, and each test's outcome."""
    lines: list[str] = []
    keep = re.compile(
        r"^\s*(\||Machine:|On GPUs:|run \d+,|desync median|elastic_nb median|"
        r"elastic_nb named|torchrun named|torchrun's ranks|P15:|\(idle|[a-z]+: check failed|"
        r"problem:|ok$|\d+ problems|\d+ wheels|met by|wheels:|installed|alert:|error \()"
    )
    for r in rows:
        log = work / "logs" / f"{r['name']}.log"
        junit = work / "logs" / f"{r['name']}.xml"
        if not log.exists() and not junit.exists():
            continue
        lines += [f"## {r['name']}", ""]
        if junit.exists():
            _, tests = _junit(junit)
            lines += ["| test | outcome | seconds | message |", "| --- | --- | --- | --- |"]
            lines += [f"| {n} | {o} | {t:.1f} | {m.replace('|', '/')} |" for n, o, t, m in tests]
            lines.append("")
        text = log.read_text(errors="replace").splitlines() if log.exists() else []
        if r["kind"] == "plain":  # machine, env: short, every line of it (but the command)
            picked = [x for x in text if not x.startswith("$ ")][:60]
        else:
            picked = [x for x in text if keep.match(x)][:80]
        if picked:
            lines += [*picked, ""]
        if text and r["rc"] not in ("0", "notrun", "notselected"):
            lines += ["Last lines of its log:", "```", *text[-40:], "```", ""]
    return lines


def main() -> int:
    cmd, work = sys.argv[1], Path(sys.argv[2])
    if cmd == "machine":
        return machine(work)
    if cmd == "report":
        return report(work, Path(sys.argv[3]))
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(main())
