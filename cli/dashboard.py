"""`train-ledger dashboard`: the Streamlit app over the run directories under one root.

The process replaces itself with `python -m streamlit run dashboard/app.py` (exec), so that the pid a script or test
holds is the server's own and a signal sent to it stops the server, never an orphaned child. The runs root and the run
to open first travel in environment variables (dashboard.state reads them), because Streamlit keeps its own command line
for its own flags (dashboard.launch names them). It binds to 127.0.0.1 unless --host says otherwise: run directories
carry argv, host names and paths, which are nobody else's business.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path

from cli.args import CommandParser
from common.errors import ConfigError, InputError
from dashboard.launch import DEFAULT_ROOT, RUN_ENV, RUNS_ROOT_ENV, app_path


def streamlit_argv(app: Path, host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.runOnSave", "false",
            "--client.toolbarMode", "viewer"]  # viewer: no "Deploy" button, no developer menu


def checked_root(root: Path) -> Path:
    if not root.exists():
        raise InputError(root, "runs root does not exist")
    if not root.is_dir():
        raise InputError(root, "runs root is not a directory")
    return root.resolve()


def check_run(root: Path, name: str) -> None:
    """--run must name a run directory under the root (ours or a Megatron-LM one), not merely any path."""
    from ledger.present.loaders import list_runs

    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(f"--run {name!r} is not under the runs root {root}")
    runs = [Path(r["path"]).resolve() for r in list_runs(str(root))]
    if path not in runs:
        known = ", ".join(sorted(str(p.relative_to(root)) for p in runs)[:8]) or "none"
        raise ConfigError(f"--run {name!r}: no run directory of that name under {root} (runs there: {known})")


def check_address(host: str, port: int) -> None:
    """--host and --port must be an address this machine can listen on, now, in this process: after the exec a bad
    one is Streamlit's traceback. Bound once with the server's own SO_REUSEADDR and released at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r}: not an address or a known host name ({exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def main(argv: list[str]) -> int:
    p = CommandParser("dashboard", description=__doc__.splitlines()[0])
    p.add_argument("--runs-root", type=Path, default=DEFAULT_ROOT, help=f"default: {DEFAULT_ROOT}")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument("--run", help="the run (a directory name under the runs root) to open first")
    a = p.parse_args(argv)
    if not 1 <= a.port <= 65535:
        raise ConfigError(f"--port {a.port}: expected 1..65535")
    root = checked_root(a.runs_root)
    if a.run is not None:
        check_run(root, a.run)
    if importlib.util.find_spec("streamlit") is None:
        raise ConfigError("streamlit is not installed: pip install -e '.[dashboard]'")
    check_address(a.host, a.port)
    cmd = streamlit_argv(app_path(), a.host, a.port)
    env = {**os.environ, RUNS_ROOT_ENV: str(root)}
    if a.run is not None:
        env[RUN_ENV] = a.run
    print(f"train-ledger dashboard: http://{a.host}:{a.port}  (runs root {root})", flush=True)
    os.execve(sys.executable, cmd, env)  # NoReturn: the server takes this process over
