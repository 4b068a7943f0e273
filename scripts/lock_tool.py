"""uv.lock, read for the repo's scripts: the versions it pins, and whether it still matches setup.py.

    python scripts/lock_tool.py check               # the lock against setup.py's ranges (make lock, tests)
    python scripts/lock_tool.py uv-requirement [--hashes]   # uv's pinned line, for scripts/setup.sh
    python scripts/lock_tool.py gpu-wheels          # NAME==VERSION of scripts/gpu_wheels.sh's NAMES

Pure standard library plus `packaging` (for `check`), so it runs before any install with the
machine's Python >= 3.11 (tomllib).
"""
from __future__ import annotations

import ast
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(ROOT, "uv.lock")
SETUP = os.path.join(ROOT, "setup.py")
WHEELS_SCRIPT = os.path.join(ROOT, "scripts", "gpu_wheels.sh")


def norm(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_packages(path: str = LOCK) -> list[dict]:
    with open(path, "rb") as f:
        return tomllib.load(f)["package"]


def locked_versions(path: str = LOCK) -> dict[str, list[str]]:
    """{normalised name: [versions]} (a universal lock may hold two versions of one package, each for
    its own markers)."""
    out: dict[str, list[str]] = {}
    for p in lock_packages(path):
        if "version" in p and p["name"] != "k3jax":
            out.setdefault(norm(p["name"]), []).append(p["version"])
    return out


def setup_requirements(path: str = SETUP) -> dict[str, list[str]]:
    """setup.py's ranges as {"": install_requires, extra: [...]}: the literal lists of its setup() call,
    read with ast (nothing in setup.py runs)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    out = {"": ast.literal_eval(kw["install_requires"])}
    out.update(ast.literal_eval(kw.get("extras_require", ast.Constant({}))))
    return out


def check(lock_path: str = LOCK, setup_path: str = SETUP) -> list[str]:
    """Errors, empty if the lock was made from this setup.py and pins a version inside every range."""
    from packaging.requirements import Requirement

    errors = []
    reqs = setup_requirements(setup_path)
    k3 = next((p for p in lock_packages(lock_path) if p["name"] == "k3jax"), None)
    if k3 is None:
        return ["uv.lock has no k3jax package: it was not made from this repository; run make lock"]
    locked_dist = {(norm(r["name"]), tuple(sorted(r.get("extras", []))), r.get("specifier", ""), r.get("marker", ""))
                   for r in k3.get("metadata", {}).get("requires-dist", [])}
    want_dist = set()
    for extra, lines in reqs.items():
        for line in lines:
            r = Requirement(line)
            spec = ",".join(sorted(str(s) for s in r.specifier))
            want_dist.add((norm(r.name), tuple(sorted(r.extras)), spec, f"extra == '{extra}'" if extra else ""))
    norm_spec = lambda t: (t[0], t[1], ",".join(sorted(t[2].split(","))) if t[2] else "", t[3])  # noqa: E731
    locked_dist = {norm_spec(t) for t in locked_dist}
    for t in sorted(want_dist - locked_dist):
        errors.append(f"setup.py requires {t[0]}{list(t[1]) or ''} {t[2] or '(any)'}"
                      f"{' for extra ' + repr(t[3].split(chr(39))[1]) if t[3] else ''}, which uv.lock was not "
                      "made from: run make lock")
    for t in sorted(locked_dist - want_dist):
        errors.append(f"uv.lock was made from a requirement {t[0]} {t[2] or '(any)'} that setup.py no longer has: "
                      "run make lock")
    versions = locked_versions(lock_path)
    for extra, lines in reqs.items():
        for line in lines:
            r = Requirement(line)
            have = versions.get(norm(r.name))
            if not have:
                errors.append(f"{r.name} (setup.py{' extra ' + extra if extra else ''}) is not in uv.lock: run make lock")
                continue
            for v in have:
                if not r.specifier.contains(v, prereleases=True):
                    errors.append(f"uv.lock pins {r.name}=={v}, outside setup.py's {r}: run make lock")
    return errors


def uv_requirement(hashes: bool) -> str:
    """The lock's uv as a requirements line (with every wheel's and the sdist's hash for pip's
    --require-hashes)."""
    p = next(p for p in lock_packages() if p["name"] == "uv")
    line = f"uv=={p['version']}"
    if not hashes:
        return line
    files = p.get("wheels", []) + ([p["sdist"]] if "sdist" in p else [])
    return " \\\n".join([line] + [f"    --hash={f['hash']}" for f in files if "hash" in f])


def gpu_wheel_names(path: str = WHEELS_SCRIPT) -> list[str]:
    """The names in scripts/gpu_wheels.sh's NAMES=( ... ) block."""
    block = re.search(r"NAMES=\(([^)]*)\)", open(path).read())
    if not block:
        raise SystemExit("error: no NAMES=( ... ) list in scripts/gpu_wheels.sh")
    return re.sub(r"#[^\n]*", "", block.group(1)).split()


def gpu_wheels(path: str = WHEELS_SCRIPT) -> dict[str, str]:
    """{normalised name: locked version} for the GPU wheel list: the versions come from uv.lock."""
    versions = locked_versions()
    out, missing = {}, []
    for name in gpu_wheel_names(path):
        have = versions.get(norm(name))
        if not have:
            missing.append(name)
        elif len(set(have)) > 1:
            raise SystemExit(f"error: uv.lock holds {name} at {sorted(set(have))}; the GPU wheel list needs one")
        else:
            out[norm(name)] = have[0]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} (scripts/gpu_wheels.sh) not in uv.lock: add them to a "
                         "setup.py extra (e.g. 'fla') and run make lock")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        errors = check()
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        if not errors:
            n = sum(len(v) for v in locked_versions().values())
            print(f"uv.lock: {n} pinned packages, every setup.py range satisfied")
        return 1 if errors else 0
    if argv[:1] == ["uv-requirement"]:
        print(uv_requirement("--hashes" in argv))
        return 0
    if argv[:1] == ["gpu-wheels"]:
        print(" ".join(f"{k}=={v}" for k, v in gpu_wheels().items()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
