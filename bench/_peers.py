"""The peer CKA packages, installed at run time into a temporary directory (never a dependency)."""
from __future__ import annotations

import subprocess
import sys

PEERS = ("torch_cka", "pytorch-cka")


def install_peers(target: str, packages: tuple[str, ...] = PEERS) -> dict[str, str]:
    """``pip install --no-deps --target target`` each package (torch, tqdm, matplotlib are already
    here) and put ``target`` first on ``sys.path``; returns {package: "installed" | why not}."""
    status = {}
    for pkg in packages:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, pkg]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            status[pkg] = "installed" if r.returncode == 0 else f"pip failed: {r.stderr.strip()[-200:]}"
        except Exception as e:  # noqa: BLE001
            status[pkg] = f"pip failed: {e}"
    sys.path.insert(0, target)
    return status
