#!/usr/bin/env python3
"""Runs the README's quick starts exactly as written (scripts/test-package.sh calls it).

A block is checked when the line before its opening fence is a comment
`<!-- scripts/check-readme.py: NAME, prints "TEXT" -->`: its shell commands run with bash
(-e -u -o pipefail) from the checkout's root, and must exit 0 and print TEXT. The block
`rust-source` must be the text of examples/quickstart.rs instead. Each block runs with HOME set
to a fresh temporary directory (so `~/.local` is a throw-away prefix; cargo and rustup keep their
own homes), a timeout, and with --venv DIR the Python block runs in that virtual environment.
Files and ignored directories a block adds to the checkout (a binary, pip's build/) are removed
afterwards; target/ was there before and stays.

    scripts/check-readme.py [--venv DIR] [NAME ...]      (no NAME: every checked block)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARK = re.compile(r'^<!-- scripts/check-readme\.py: ([\w-]+)(?:, prints "([^"]*)")?.*-->$')


def blocks(readme: str) -> dict[str, tuple[str, str | None]]:
    """NAME -> (the block's text, the text it must print)."""
    lines, found = readme.splitlines(keepends=True), {}
    for i, line in enumerate(lines):
        m = MARK.match(line.strip())
        if not m:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"README.md:{i + 1}: the marker is not followed by a code block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise SystemExit(f"README.md:{i + 2}: the code block does not end")
        found[m.group(1)] = ("".join(lines[i + 2:end]), m.group(2))
    return found


def untracked() -> set[str]:
    """Files git does not track, and ignored directories (as `dir/`): what a block may add."""
    found = set()
    for extra in ([], ["--ignored", "--directory"]):
        out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z", *extra], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        found |= {f for f in out.split("\0") if f}
    return found


def run(name: str, text: str, expect: str | None, venv: str | None, timeout: float) -> bool:
    env = dict(os.environ)
    home = pathlib.Path(env.get("HOME", "~")).expanduser()
    env.setdefault("CARGO_HOME", str(home / ".cargo"))
    env.setdefault("RUSTUP_HOME", str(home / ".rustup"))
    if venv:
        env["VIRTUAL_ENV"] = venv
        env["PATH"] = os.pathsep.join([str(pathlib.Path(venv) / "bin"), env["PATH"]])
        env.pop("PYTHONHOME", None)
    env.pop("PYTHONPATH", None)  # the block must not see this checkout's package by accident
    env.pop("TOROID_LIBRARY", None)
    before = untracked()
    with tempfile.TemporaryDirectory(prefix=f"toroid-readme-{name}-") as tmp:
        env["HOME"] = tmp
        print(f"check-readme.py: {name}:\n{text}", flush=True)
        # Its own session, so that at the timeout the whole block goes (ranks and launchers
        # included), not only bash.
        p = subprocess.Popen(["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            code = None
    for f in untracked() - before:  # (e.g. ./quickstart, and build/ and *.egg-info from pip install .)
        path = ROOT / f
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    ok = code == 0 and (expect is None or expect in out)
    why = "timed out" if code is None else f"exit {code}" if code else f'did not print "{expect}"'
    print(out[-8000:] if not ok else "\n".join(out.splitlines()[-6:]))
    print(f"check-readme.py: {name}: {'ok' if ok else 'FAILED (' + why + ')'}", flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--venv", help="the virtual environment for the python block")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per block")
    a = ap.parse_args()
    found = blocks((ROOT / "README.md").read_text())
    names = a.names or list(found)
    missing = [n for n in names if n not in found]
    if missing or not found:
        print(f"check-readme.py: README.md has no checked block {missing or '(none at all)'}; it has {list(found)}")
        return 1
    ok = True
    for name in names:
        text, expect = found[name]
        if name == "rust-source":
            same = text == (ROOT / "examples" / "quickstart.rs").read_text()
            print(f"check-readme.py: rust-source: {'ok' if same else 'FAILED (differs from examples/quickstart.rs)'}")
            ok &= same
            continue
        ok &= run(name, text, expect, a.venv if name == "python" else None, a.timeout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
