"""``python -m colocate.sandbox.detach MODULE STATE_DIR --lock-fd FD``: the launcher ``up`` runs to
start a runner (``python -m MODULE run STATE_DIR --lock-fd FD``) detached. It prints the runner's
pid and exits at once, so ``up`` learns the pid and the runner is nobody's child. It imports
nothing of the sandbox: the launcher costs an interpreter's start, not the runner's imports."""

from __future__ import annotations

import os
import subprocess
import sys


def launch_detached(module: str, state_dir: str | os.PathLike, lock_fd: int) -> None:
    """Start ``python -m MODULE run STATE_DIR --lock-fd FD`` (it inherits the lock), print its
    pid and exit."""
    child = subprocess.Popen([sys.executable, "-m", module, "run", str(state_dir), "--lock-fd", str(lock_fd)],
                             stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, pass_fds=(lock_fd,))
    print(child.pid, flush=True)
    os._exit(0)  # leave the runner running; no destructor waits on it


def command(module: str, state_dir: str | os.PathLike, lock_fd: int) -> list[str]:
    """The launcher's argv, for ``subprocess.run(..., pass_fds=(lock_fd,), start_new_session=True)``."""
    return [sys.executable, "-m", __name__, module, str(state_dir), "--lock-fd", str(lock_fd)]


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description="start a sandbox runner detached "
                                "and print its pid (used by sandbox.py up; not for direct use)")
    p.add_argument("module", choices=("colocate.sandbox.supervisor", "colocate.sandbox.fleet_front"))
    p.add_argument("state_dir")
    p.add_argument("--lock-fd", type=int, required=True)
    a = p.parse_args()
    launch_detached(a.module, a.state_dir, a.lock_fd)
