"""Serve a saved view with Model Explorer, on 127.0.0.1, in a child process that always stops.

Note [The viewer runs in a child process]: Model Explorer's server (`visualize_from_config`)
blocks until Ctrl+C, keeps a Flask thread that cannot be stopped from the same process, and
exits the process when its port is taken. So fxamp runs it in a child process of its own
(`_serve.py`, by path: no torch to import), waits until it answers, and stops it by closing
its standard input (it exits at end of file), then terminating and killing it if need be. The
port goes with the process: `Viewer.stop()`, leaving a `with` block, garbage collection, the
end of the interpreter and the death of the parent all free it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
import webbrowser
from typing import Any, Optional, Union

from fxamp.errors import ConfigError

__all__ = ["Viewer", "ViewerMissing", "serve", "show", "port_is_free", "check_port",
           "check_installed", "INSTALL_HINT", "HOST"]

HOST = "127.0.0.1"
INSTALL_HINT = ('pip install "fxamp[viewer]", or pip install -e ".[viewer]" in a checkout '
                "(Model Explorer, the package ai-edge-model-explorer); .save(path) writes the "
                "same view without it")
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_serve.py")
_URL_PREFIX = "FXAMP_VIEWER_URL "


def port_is_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:`port` and it can be bound."""
    with socket.socket() as s:
        if s.connect_ex((HOST, port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def check_port(port: Optional[int], *, free: str = "port=None") -> None:
    """ConfigError unless `port` is None (a free one) or a free port of 1-65535 on 127.0.0.1;
    `free` is how the caller asks for a free port ("port=None", or the shell's words)."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError(f"port {port!r} is not one to serve on: pass one of 1-65535, or "
                          f"{free} for a free one")
    if not port_is_free(port):
        raise ConfigError(f"port {port} on {HOST} is in use: pass another, or {free} for a "
                          "free one")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen, own_dir: Optional[str]) -> None:
    try:
        if process.stdin is not None:
            process.stdin.close()  # the child exits at end of file
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


class Viewer:
    """A running Model Explorer server showing one view: open `url` in a browser.

    `stop()` (or leaving a `with` block) stops it and frees `port`; so do garbage collection
    and the end of the process (Note [The viewer runs in a child process])."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: str,
                 own_dir: Optional[str]):
        self.process, self.port, self.log_path = process, port, log_path
        self.url = ""
        self._stop = weakref.finalize(self, _stop, process, own_dir)

    @property
    def running(self) -> bool:
        return self._stop.alive and self.process.poll() is None

    def stop(self) -> None:
        """Stop the server and free its port (again: nothing)."""
        self._stop()

    def wait(self) -> None:
        """Block until Ctrl+C (or the server exits), then stop it."""
        try:
            self.process.wait()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def log(self) -> str:
        """What the server printed."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def __enter__(self) -> "Viewer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Viewer({self.url or self.port!r}, {'running' if self.running else 'stopped'})"


class ViewerMissing(ImportError):
    """Model Explorer, which shows fxamp's graphs, is not installed (the message says how)."""


def check_installed() -> None:
    """ViewerMissing, saying how to install it, unless Model Explorer is installed."""
    if importlib.util.find_spec("model_explorer") is None:
        raise ViewerMissing(f"fxamp's graph viewer needs Model Explorer: {INSTALL_HINT}",
                            name="model_explorer")


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/check_health", timeout=1) as r:
            return r.read() == b"model_explorer_ok"
    except OSError:
        return False


def _url(viewer: Viewer) -> str:
    for line in viewer.log().splitlines():
        if line.startswith(_URL_PREFIX):
            return line[len(_URL_PREFIX):]
    raise RuntimeError(f"Model Explorer gave no URL; it printed:\n{viewer.log()[-2000:]}")


def _await(viewer: Viewer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _answers(viewer.port):
        if viewer.process.poll() is not None:
            raise RuntimeError(f"Model Explorer exited with status {viewer.process.returncode}"
                               f" before it served; it printed:\n{viewer.log()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Model Explorer did not answer on {HOST}:{viewer.port} within "
                               f"{timeout:g} s; it printed:\n{viewer.log()[-2000:]}")
        time.sleep(0.1)
    viewer.url = _url(viewer)


def serve(path: str, *, port: Optional[int] = None, timeout: float = 60.0,
          own_dir: Optional[str] = None) -> Viewer:
    """Start Model Explorer on 127.0.0.1 showing the view saved at `path`; returns once it
    answers. `port`: None picks a free one. `own_dir`, if given, is deleted at stop."""
    check_port(port)  # the user's value first: it needs no install
    check_installed()
    port = _free_port() if port is None else port
    log_dir = own_dir or tempfile.mkdtemp(prefix="fxamp-viewer-")
    log_path = os.path.join(log_dir, "server.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, _CHILD, os.path.abspath(path), str(port)],
                                   stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # Ctrl+C is the parent's to handle
    viewer = Viewer(process, port, log_path, log_dir)
    try:
        _await(viewer, timeout)
    except BaseException:
        viewer.stop()
        raise
    return viewer


def show(view: Union[str, Any], *, port: Optional[int] = None, open_browser: bool = True,
         wait: bool = True, timeout: float = 60.0) -> Viewer:
    """Show a GraphView (or a file `save()` wrote) in Model Explorer on 127.0.0.1.

    Args:
        view: a `GraphView` (`explanation.view()` passes its own) or the path of a saved one.
        port: the port to serve on, 1-65535 (ConfigError at once for another or one in use);
            None picks a free one.
        open_browser: open the page in the default web browser.
        wait: block until Ctrl+C, then stop the server (a script's use); False returns the
            running `Viewer` at once (a notebook's): stop it with `.stop()` or a `with` block.
        timeout: seconds to wait for the server to answer.

    Returns:
        The Viewer (`.url`, `.port`), stopped if `wait`.
    """
    check_port(port)  # the user's value first: it needs no install
    check_installed()
    own_dir = tempfile.mkdtemp(prefix="fxamp-viewer-")
    path = view if isinstance(view, str) else view.save(os.path.join(own_dir, "view.json"))
    try:
        viewer = serve(path, port=port, timeout=timeout, own_dir=own_dir)
    except BaseException:
        shutil.rmtree(own_dir, ignore_errors=True)
        raise
    if open_browser:
        webbrowser.open(viewer.url)
    if wait:
        sys.stderr.write(f"fxamp: Model Explorer at {viewer.url}\n(Ctrl+C stops it)\n")
        viewer.wait()
    return viewer
