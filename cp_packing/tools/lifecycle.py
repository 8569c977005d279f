"""How a launcher's ranks start and stop: SIGTERM as a request to stop (a flag, installed before anything else in a
rank), a watchdog that stops a rank whose launching parent is gone (no orphan training after ``kill -9`` of torchrun
or of a ``--nproc`` parent), and, on the ``--nproc`` parent, the forwarding of SIGTERM / SIGINT to the ranks with a
grace period long enough for their checkpoint (docs/launcher.md, "SIGTERM and orphans").
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["PREEMPTION", "Preemption", "forward_signals_to_ranks", "watch_parent"]


class Preemption:
    """SIGTERM (a scheduler's preemption) sets ``requested``; the handler does nothing else, so it is safe whatever
    the rank is doing. The training loop agrees on the flag over the world once per step."""

    def __init__(self) -> None:
        self.requested = False
        self.previous: Any = None

    def handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def install(self, early: list | None = None) -> None:
        """Take SIGTERM (main thread only; a no-op elsewhere: a test thread, a library user). ``early``: the signals
        a stdlib handler caught before this module could be imported (``launch/train.py``), now requests too."""
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self.handler)
        if early:
            self.requested = True

    def restore(self) -> None:
        """Give SIGTERM back to the handler ``install`` replaced, and clear the flag (the run it stopped is over)."""
        if self.previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None
        self.requested = False


PREEMPTION = Preemption()
"""The process's one SIGTERM flag (a forked rank inherits it, cleared, with its handler)."""


@contextlib.contextmanager
def watch_parent(grace: float, *, poll: float = 0.5, label: str = "rank") -> Iterator[None]:
    """While inside: a daemon thread that, once this process's parent is gone (``os.getppid()`` changed: the
    launcher was killed, even by SIGKILL, and this process was re-parented), sends this process SIGTERM (the run
    stops after its step and saves, as on a preemption) and, if it is still running ``grace`` seconds later (stuck
    in a collective with a dead peer), ends it with ``os._exit(1)``. Portable (no ``prctl``), and blind to a parent
    THREAD's exit, unlike ``PR_SET_PDEATHSIG``."""
    parent = os.getppid()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll):
            if os.getppid() != parent:
                print(f"{label} (pid {os.getpid()}): its launcher (pid {parent}) is gone; stopping after this step "
                      f"(as on SIGTERM), at most {grace:g} s", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                if not done.wait(grace):
                    print(f"{label} (pid {os.getpid()}): still running {grace:g} s after its launcher died: exiting",
                          file=sys.stderr, flush=True)
                    os._exit(1)
                return

    thread = threading.Thread(target=watch, name="cp-packing-parent-watchdog", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _ranks() -> list:
    return [p for p in multiprocessing.active_children() if p.is_alive()]


def forward_signals_to_ranks(run: Callable[[], Any], grace: float) -> Any:
    """Run ``run()`` (which forks and waits for the ranks) in a worker thread while this, the main thread, forwards
    SIGTERM and SIGINT to every live rank: after a SIGTERM the ranks get ``grace`` seconds to finish their step and
    save before they are killed; after a SIGINT 5 s, then this process exits with status 130. A rank forked while
    this is installed inherits the handler, which there hands the signal to the handler this one replaced (the
    rank's own ``Preemption`` flag, or the default action). Returns what ``run`` returned (or raises what it
    raised). From the main thread only (signal handlers); elsewhere ``run()`` is called directly."""
    if threading.current_thread() is not threading.main_thread():
        return run()
    parent, out, deadline = os.getpid(), {}, [None]
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, frame: Any) -> None:
        if os.getpid() != parent:  # in a rank forked while this was installed: what it had before
            before = previous[signum]
            if callable(before):
                before(signum, frame)
            elif before != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        for p in _ranks():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)
        if signum == signal.SIGINT:
            _kill_after(5.0)
            raise SystemExit(128 + signum)
        deadline[0] = time.monotonic() + grace

    def target() -> None:
        try:
            out["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = exc

    for s in previous:
        signal.signal(s, on_signal)
    try:
        worker = threading.Thread(target=target, name="cp-packing-ranks", daemon=True)
        worker.start()
        gone = None  # when the last rank ended after a SIGTERM
        while worker.is_alive():
            worker.join(0.2)
            if deadline[0] is None:
                continue
            if time.monotonic() > deadline[0] and _ranks():
                print(f"error: the ranks did not stop within {grace:g} s of SIGTERM: killed", file=sys.stderr,
                      flush=True)
                _kill_after(0.0)
            gone = gone or (time.monotonic() if not _ranks() else None)
            if gone and time.monotonic() > gone + 2.0:  # dead without a word: the runner would wait out its grace
                print("error: the ranks ended on SIGTERM without reporting back", file=sys.stderr, flush=True)
                raise SystemExit(1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _kill_after(seconds: float) -> None:
    """SIGKILL every rank still alive ``seconds`` from now (joined meanwhile)."""
    end = time.monotonic() + seconds
    for p in _ranks():
        p.join(max(0.0, end - time.monotonic()))
    for p in _ranks():
        p.kill()
