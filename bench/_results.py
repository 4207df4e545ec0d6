"""bench/RESULTS.md: one ``## <name>`` section per benchmark, rewritten in place by its script; and the
provenance every results JSON records (:func:`provenance`) and the rule for when a run may record (:func:`records`)."""
from __future__ import annotations

from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(name: str, section: str, path: Path = RESULTS_MD) -> None:
    """Put ``section`` (starting with ``## name``) in place of the file's ``## name`` section, or
    append it; the other sections are left as they are."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    start = text.find(f"## {name}\n")
    if start >= 0:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text)


def _git(*args: str) -> str | None:
    import subprocess

    try:
        r = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _cpu() -> dict:
    """CPU model and a summary of the vector extensions that decide BLAS kernels, from /proc/cpuinfo."""
    import platform

    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(val.split())
                if model is not None and flags:
                    break
    except OSError:
        pass
    wanted = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile",
              "neon", "asimd", "sve")
    return {"model": model or platform.processor() or platform.machine(), "machine": platform.machine(),
            "flags": [f for f in wanted if f in flags]}


def provenance() -> dict:
    """What a results JSON needs to be judged later: the commit (and whether the tree was dirty), the date,
    the CPU model and its vector extensions, the BLAS libraries and kernels (threadpoolctl), thread counts
    (BLAS, OpenMP, torch if it is already imported, the environment's thread variables) and the load average.
    Cheap: no heavy imports (numpy is imported so that its BLAS is visible)."""
    import datetime
    import os
    import platform
    import sys

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    blas = []
    try:
        import numpy  # noqa: F401  (loads the BLAS that threadpoolctl reports)
        from threadpoolctl import threadpool_info

        blas = [{k: i.get(k) for k in ("user_api", "internal_api", "version", "architecture", "num_threads")}
                for i in threadpool_info()]
    except Exception:  # noqa: BLE001  (provenance must never fail a benchmark)
        pass
    threads = {"cpus": os.cpu_count(),
               "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
               "blas": max((i["num_threads"] for i in blas if i["user_api"] == "blas"), default=None),
               "openmp": max((i["num_threads"] for i in blas if i["user_api"] == "openmp"), default=None),
               "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                                  "OPENBLAS_CORETYPE") if k in os.environ}}
    if "torch" in sys.modules:
        try:
            threads["torch"] = sys.modules["torch"].get_num_threads()
        except Exception:  # noqa: BLE001
            pass
    return {"commit": commit, "dirty": bool(status) if status is not None else None,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host_python": platform.python_version(), "cpu": _cpu(), "blas": blas, "threads": threads,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def provenance_line(p: dict) -> str:
    """One line for a RESULTS.md section: commit, date, CPU, BLAS kernel, load."""
    blas = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']}" for b in p.get("blas", [])
                     if b.get("user_api") == "blas") or "BLAS unknown"
    load = p.get("loadavg")
    load_s = f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end" if load else "load unknown"
    return (f"Provenance: commit {(p.get('commit') or '?')[:10]}{' (dirty tree)' if p.get('dirty') else ''}, "
            f"{p.get('date_utc')}, {p['cpu']['model']} ({' '.join(p['cpu']['flags']) or 'no flags read'}), {blas}, "
            f"{p['threads']['cpus']} CPUs, {load_s}.")


def records(out: str | Path, default: str | Path, quick: bool = False, no_markdown: bool = False) -> bool:
    """The recording rule every benchmark follows (as cka_allpairs did first): the RESULTS.md section is
    rewritten only by a full run whose ``--out`` is the default file under bench/results/; a quick run or an
    ``--out`` elsewhere is a trial and leaves the recorded results alone."""
    import os

    return (not quick and not no_markdown
            and os.path.abspath(str(out)) == os.path.abspath(str(default)))


def json_out(out: str | Path, default: str | Path, quick: bool = False) -> str:
    """Where a run writes its JSON: ``out``, except that a quick run never writes the recorded file
    (default ``--out``): it goes to the temporary directory instead."""
    import os
    import tempfile

    if quick and os.path.abspath(str(out)) == os.path.abspath(str(default)):
        return os.path.join(tempfile.gettempdir(), "quick-" + os.path.basename(str(default)))
    return str(out)
