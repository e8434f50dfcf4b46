"""Child processes of the tests (torchrun launches, commands under resource limits).

A child runs in its own session, to its end or a generous timeout (the suite shares loaded machines: nothing
here times how fast a child is), with its output captured. When it fails or runs past the timeout the whole
session is killed (torchrun's ranks with it) and the failure message holds the command, its status and the end
of what it printed on stdout and stderr.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess

import pytest

TIMEOUT = 900  # seconds; a tiny two-rank run takes about 20 s on an idle 2-core machine
SHOWN = 6000  # characters of each stream in a failure message


def run_child(cmd: list[str], *, timeout: float = TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` run to its end (stdout and stderr captured as text); ``pytest.fail`` with its output if it runs past
    ``timeout`` seconds. ``kwargs`` go to ``subprocess.Popen`` (env, preexec_fn, ...)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session: a launcher's workers too, which would hold the pipes
        out, err = proc.communicate()
        pytest.fail(
            f"ran past {timeout} s and was killed: {shown(subprocess.CompletedProcess(cmd, None, out, err))}",
            pytrace=False,
        )
    except BaseException:  # Ctrl-C reaches the test's process group only: the child's session goes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def shown(done: subprocess.CompletedProcess) -> str:
    """The command, its exit status and the end of its output, for an assertion message."""
    cmd = shlex.join(str(x) for x in done.args)
    return (
        f"{cmd}\nexit status {done.returncode}\n--- stdout (end) ---\n{(done.stdout or '')[-SHOWN:]}"
        f"\n--- stderr (end) ---\n{(done.stderr or '')[-SHOWN:]}"
    )


def check_child(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``run_child``, failing with the child's output unless it exits with status 0."""
    done = run_child(cmd, **kwargs)
    assert done.returncode == 0, shown(done)
    return done
