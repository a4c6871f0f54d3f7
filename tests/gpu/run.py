"""The GPU check (issue #49): ``tests/gpu`` on a CUDA device, a race check, and the figures.

Run from anywhere, on a machine with CUDA torch (no vLLM, no network, no ``make`` needed)::

    python3 tests/gpu/run.py                   # everything, in under 5 minutes on an H200
    python3 tests/gpu/run.py --json out.json   # the same, and its results as JSON
    python3 tests/gpu/run.py --device cpu --smoke --skip-racecheck   # its code paths on CPU

It uses this checkout's ``src`` (nothing is installed) and needs beside torch only what the
hook's modules and the tests import: numpy, msgpack, pytest and pytest-timeout (the project's
pytest settings name its option). It checks for them first and, if one is missing, says how to
carry its wheel. Then, in order:

1. ``python -m pytest tests/gpu`` (every CUDA test, and their CPU counterparts);
2. the figures (``tests/gpu/figures.py``): the time the hook adds to a step, and the copy of a
   64 MiB matrix, each against a comparable forward;
3. ``compute-sanitizer --tool racecheck`` over the copier's stress test, where the tool is
   there and time is left (it finds shared-memory races inside kernels: in the gather, cast and
   reductions the hook launches; the stream order between the copy and the next step is the
   tests' to prove, not the tool's).

Exit status: 0 all passed (racecheck clean or not run), 1 a test failed or racecheck found
hazards, 2 no CUDA device (without ``--device cpu``), 3 a package is missing.
The output format is in CONTRIBUTING.md ("The GPU check").
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
#: What must be importable beside torch, by module name -> the distribution to carry.
NEEDED = {
    "numpy": "numpy",
    "msgpack": "msgpack",
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
}
#: The whole check's budget; racecheck runs only in what is left of it.
BUDGET_S = 290
WHEEL_COMMAND = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
    "--platform manylinux2014_x86_64 -d .whl {names}   # where pip reaches PyPI, then there:\n"
    "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
    "export PYTHONPATH=/tmp/site"
)


def _environment() -> dict[str, str]:
    """This checkout's ``src`` and root first on the path (of this process and of children);
    not this script's folder, whose modules (``model``, ``batch``) would shadow any of that
    name."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
    for path in (str(ROOT), str(SRC)):
        if path not in sys.path:
            sys.path.insert(0, path)
    env = dict(os.environ)
    paths = [str(SRC), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _say(line: str = "") -> None:
    print(line, flush=True)


def _missing() -> list[str]:
    return [dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None]


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _header(torch: Any, device: Any) -> dict[str, str]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = (
            f"{props.name} (cuda:{device.index}, sm_{props.major}{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB)"
        )
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": where,
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": platform.python_version(),
        "commit": _commit(),
    }


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_tests(env: dict[str, str], timeout: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else ""
        return {"ok": False, "summary": f"timed out after {timeout:.0f} s", "log": output}
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    last = _tail(done.stdout, 1)  # pytest's "12 passed, 3 skipped in 30.1s"
    counts = {
        word: int(number)
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", last)
    }
    summary = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no summary"
    skipped: dict[str, int] = {}  # why -> how many; from "SKIPPED [n] file:line: why"
    for number, why in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", output, re.M):
        skipped[why] = skipped.get(why, 0) + int(number)
    return {
        "ok": done.returncode == 0,
        "exit": done.returncode,
        "summary": f"{summary} in {seconds:.1f} s",
        "counts": counts,
        "skipped": skipped,
        "log": output,
    }


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")):
        return str(candidate)
    for candidate in sorted(Path("/opt/nvidia").glob("**/compute-sanitizer")):
        if candidate.is_file():
            return str(candidate)
    return None


def run_racecheck(env: dict[str, str], steps: int, timeout: float) -> dict[str, Any]:
    tool = _sanitizer()
    if tool is None:
        return {"ok": True, "summary": "not run: compute-sanitizer is not on this machine"}
    if timeout < 30:
        return {"ok": True, "summary": "not run: too little of the 5-minute budget left"}
    command = [
        tool,
        "--tool",
        "racecheck",
        "--error-exitcode",
        "99",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/gpu/test_copier.py",
        "-k",
        "in_flight and cuda",
    ]
    child_env = {**env, "HSP_GPU_STRESS_STEPS": str(steps), "HSP_GPU_SANITIZER": "1"}
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"ok": True, "summary": f"no verdict: stopped after {timeout:.0f} s"}
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    verdict = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed[^\n]*", output)
    passed = "1 passed" in output
    if verdict is None:
        summary = f"no verdict (exit {done.returncode}): {_tail(output, 1)}"
        return {"ok": True, "summary": summary, "log": output}
    hazards = int(verdict.group(1))
    summary = f"{verdict.group(0)}; the stress test {'passed' if passed else 'FAILED'}"
    summary += f" ({steps} steps, {seconds:.0f} s)"
    return {"ok": hazards == 0 and passed, "summary": summary, "hazards": hazards, "log": output}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--smoke", action="store_true", help="tiny figures (seconds, any device)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-figures", action="store_true")
    parser.add_argument("--skip-racecheck", action="store_true")
    parser.add_argument("--racecheck-steps", type=int, default=40)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    env = _environment()
    if importlib.util.find_spec("torch") is None:
        _say(f"[gpu-check] {sys.executable} has no torch: run this with the Python that has")
        _say("[gpu-check] CUDA torch (make gpu-check GPU_PYTHON=/path/to/python)")
        return 3
    missing = _missing()
    if missing:
        _say(f"[gpu-check] missing: {', '.join(missing)}. Carry the wheels:")
        _say(WHEEL_COMMAND.format(names=" ".join(missing)))
        return 3
    import torch

    from tests.gpu.devices import CUDA_MISSING

    if args.device == "cpu":
        device = torch.device("cpu")
    elif CUDA_MISSING is not None:
        _say(f"[gpu-check] {CUDA_MISSING}")
        _say("[gpu-check] its code paths on CPU: python3 tests/gpu/run.py --device cpu --smoke")
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    header = _header(torch, device)
    results: dict[str, Any] = {"header": header}
    _say("== vllm-hidden-state-proxy GPU check (issue #49) ==")
    _say(" | ".join(f"{name} {value}" for name, value in header.items()))
    ok = True

    if not args.skip_tests:
        tests = run_tests(env, timeout=max(60.0, BUDGET_S - 90 - (time.monotonic() - started)))
        ok &= tests["ok"]
        _say(f"[tests] python -m pytest tests/gpu: {tests['summary']}")
        for why, number in tests.get("skipped", {}).items():
            _say(f"[tests]   {number} skipped: {why}")
        if not tests["ok"]:
            _say(_tail(tests["log"], 60))
        results["tests"] = {k: v for k, v in tests.items() if k != "log"}

    if not args.skip_figures:
        from tests.gpu import figures

        sizes = figures.SMOKE if args.smoke else figures.FULL
        steps = figures.step_figures(device, sizes)
        _say(
            f"[figures] added time per step: T = {sizes.tokens} tokens of bfloat16 states; "
            f"forward = one [T, H] x [H, {figures.WIDTH}H] bfloat16 matmul (a decoder layer's "
            "dense FLOPs); hook and output thread as in vLLM V2 with async scheduling"
        )
        for line in figures.step_table(steps):
            _say(line)
        copies = figures.copy_figures(device, sizes)
        _say(
            f"[figures] a {sizes.matrix_mib} MiB float32 matrix to the host "
            f"([{(sizes.matrix_mib << 20) // (4 * sizes.matrix_hidden)}, {sizes.matrix_hidden}]"
            f" from bfloat16), against the forward of its positions ([rows, H] x "
            f"[H, {figures.WIDTH}H] bfloat16: {copies[0].forward_ms:.2f} ms)"
        )
        for line in figures.copy_table(copies):
            _say(line)
        if args.smoke:
            _say("[figures] --smoke: tiny sizes, figures not meaningful")
        results["figures"] = figures.as_json(steps, copies)

    if not args.skip_racecheck and device.type == "cuda":
        left = BUDGET_S - (time.monotonic() - started)
        race = run_racecheck(env, args.racecheck_steps, timeout=min(150.0, left))
        ok &= race["ok"]
        _say(f"[racecheck] compute-sanitizer --tool racecheck: {race['summary']}")
        if not race["ok"] and "log" in race:
            _say(_tail(race["log"], 40))
        results["racecheck"] = {k: v for k, v in race.items() if k != "log"}

    seconds = time.monotonic() - started
    verdict = "PASS" if ok else "FAIL"
    _say(f"[gpu-check] {verdict} in {seconds:.0f} s")
    results["verdict"] = verdict
    results["seconds"] = round(seconds, 1)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
