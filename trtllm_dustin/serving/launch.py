"""Launching a tritonserver on a generated repository: the binary shipped by `nvidia-pytriton`, or a stock one.

nvidia-pytriton's wheel carries `tritonserver`, the Python backend (`backends/python/libtriton_python.so`) and one
backend stub per Python version in `python_backend_stubs/<X.Y>/`. The stub must sit beside the backend library,
so `prepare_pytriton_server` copies the distribution with the stub of this interpreter's version in place. The
stub embeds the system's libpython; it finds this environment's site-packages (torch, trtllm_dustin) through the
environment's `bin/` put first on PATH (it resolves `python3` there and reads pyvenv.cfg), as pytriton does.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from trtllm_dustin.serving.stats import METRICS_DIR_ENV

__all__ = ["ServerError", "TritonServer", "check_endpoints", "free_port", "prepare_pytriton_server",
           "processes_in_group", "pytriton_distribution"]

DRAIN_MARGIN_S = 10.0  # of the exit timeout, left for cutting running requests and unloading every model


class ServerError(RuntimeError):
    """The server could not be prepared, did not start, or did not stop."""


def pytriton_distribution() -> tuple[Path, Path]:
    """(the tritonserver distribution folder, the folder of its bundled shared libraries) of nvidia-pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed; `pip install nvidia-pytriton==0.7.0` (it ships the "
                          "tritonserver binary), or pass a stock tritonserver with --tritonserver")
    root = Path(next(iter(spec.submodule_search_locations)))
    dist, libs = root / "tritonserver", root.parent / "nvidia_pytriton.libs"
    if not (dist / "bin" / "tritonserver").is_file():
        raise ServerError(f"{dist}/bin/tritonserver is missing; reinstall nvidia-pytriton")
    return dist, libs


def prepare_pytriton_server(dest: str | Path) -> Path:
    """Copy nvidia-pytriton's server into `dest` with this Python's backend stub beside the backend library.

    Returns `dest`; the binary is `dest/bin/tritonserver`, backends `dest/backends`, caches `dest/caches`."""
    dist, _ = pytriton_distribution()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (dist / "python_backend_stubs").iterdir() if p.is_dir())
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {version} (it has {have}); use one "
                          "of those Python versions")
    dest = Path(dest)
    for part in ("bin", "backends", "caches"):
        if (dist / part).is_dir():
            shutil.copytree(dist / part, dest / part, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(stub, dest / "backends" / "python" / "triton_python_backend_stub")
    return dest


def free_port() -> int:
    """An ephemeral port on 127.0.0.1 that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_endpoints(address: str, http_port: int, grpc_port: int) -> None:
    """Refuse, before tritonserver starts (it would print its --help, or "Socket already in use" for an address it
    cannot bind), an --address that is no address of this host and a port that is taken, privileged or given twice
    (0: any free port, picked at start)."""
    from trtllm_dustin.validation import InputError

    if http_port == grpc_port != 0:
        raise InputError(f"--http-port {http_port} and --grpc-port {grpc_port} are the same port; pass another "
                         "--grpc-port (or 0 for any free port)")
    local = "pass 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or an address of this host"
    dotted = address.replace(".", "").isdigit()
    try:
        if dotted:
            ipaddress.ip_address(address)
        family, _, _, _, sockaddr = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0]
    except (ValueError, socket.gaierror) as e:
        why = "not a valid IPv4 address" if dotted else f"not found: {getattr(e, 'strerror', e)}"
        raise InputError(f"--address {address} is {why}; {local}") from None
    for option, port in (("--http-port", http_port), ("--grpc-port", grpc_port)):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: a closing port is free
            try:
                s.bind((sockaddr[0], port))
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    raise InputError(f"--address {address} is not an address of this host ({e.strerror}); "
                                     f"{local}") from None
                if e.errno == errno.EADDRINUSE:
                    raise InputError(f"{option} {port} is in use on {address} (another server listens there); pass "
                                     "another port, or 0 for any free port") from None
                if e.errno == errno.EACCES:
                    raise InputError(f"{option} {port} needs privileges here ({e.strerror}); pass a port >= 1024, "
                                     "or 0 for any free port") from None
                raise InputError(f"{option} {port} on {address} cannot be bound ({e.strerror}); pass another port or "
                                 "--address") from None


def processes_in_group(pgid: int) -> list[int]:
    """Process ids whose process group is `pgid` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when the launching process dies (a killed test run leaves no server)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TritonServer:
    """A tritonserver child process on 127.0.0.1 with ephemeral HTTP and gRPC ports, in its own process group.

    `with TritonServer(repo, server_dir) as server:` starts it and waits until the repository's models are ready;
    leaving the block stops it (SIGTERM, then SIGKILL of the whole group) and checks that nothing is left."""

    def __init__(self, repository: str | Path, server_dir: str | Path, log_path: str | Path,
                 python_env: str | Path = sys.prefix, start_timeout_s: float = 180.0, stop_timeout_s: float = 60.0,
                 exit_timeout_s: float = 20.0, extra_args: tuple[str, ...] = (), address: str = "127.0.0.1",
                 http_port: int = 0, grpc_port: int = 0, keep_going: bool = False, http_address: str | None = None,
                 metrics_dir: str | Path | None = None) -> None:
        self.repository, self.server_dir = Path(repository).resolve(), Path(server_dir).resolve()
        self.log_path, self.python_env = Path(log_path), Path(python_env)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.exit_timeout_s = exit_timeout_s  # Triton's own wait for open connections and running requests at exit
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self.address = address  # the interface both endpoints bind (127.0.0.1: this machine only)
        # HTTP's own interface, when not `address`: serve keeps it on 127.0.0.1 behind its front (front.py)
        self.http_address = http_address or address
        self.metrics_dir = metrics_dir  # where the engines write their metrics snapshots (stats.py); None: nowhere
        self.requested_ports = (http_port, grpc_port)  # 0: an ephemeral port, picked at start
        self.http_port = self.grpc_port = 0
        # keep_going: a model that fails to load leaves the server serving the others (model_states() says which
        # failed and why); otherwise the server exits at start, and start() raises with its log.
        self.keep_going = keep_going
        # Written at stop(): the serving engines then give running requests exit_timeout_s - DRAIN_MARGIN_S and cut
        # the rest, so that Triton's exit wait ends with every model unloaded (finalize() run), not its forced exit.
        self.drain_file = self.server_dir / f".stopping-{os.getpid()}-{id(self):x}"

    @property
    def host(self) -> str:
        """Where clients on this machine reach the server (a wildcard bind is reached on 127.0.0.1)."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "::") else self.address

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.http_address in ("0.0.0.0", "::") else self.http_address
        return f"{host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [env.get("LD_LIBRARY_PATH")]
        try:
            _, libs = pytriton_distribution()
            paths.append(str(libs))
        except ServerError:
            pass  # a stock server brings its own libraries
        # The backend stub links libpython3.X.so by name: put this interpreter's own first, so that the extension
        # modules it imports (_ssl, ...) were built for the libpython that runs them. A system libpython of another
        # patch release fails them (`_ssl...so: undefined symbol: _PyModule_Add` under a pyenv 3.11.7 with Debian's
        # 3.11.2 library), and with them every model that imports the Hugging Face stack.
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):
            paths.insert(0, sysconfig.get_config_var("LIBDIR"))
        env["LD_LIBRARY_PATH"] = ":".join(p for p in paths if p)
        env["PATH"] = f"{self.python_env / 'bin'}:{env.get('PATH', '')}"
        env["TRTLLM_DUSTIN_DRAIN_FILE"] = str(self.drain_file)  # serving/engine.py DRAIN_FILE_ENV
        if self.metrics_dir is not None:
            env[METRICS_DIR_ENV] = str(self.metrics_dir)
        return env

    def command(self) -> list[str]:
        return [str(self.server_dir / "bin" / "tritonserver"), "--model-repository", str(self.repository),
                "--backend-directory", str(self.server_dir / "backends"),
                "--cache-directory", str(self.server_dir / "caches"),
                "--http-address", self.http_address, "--http-port", str(self.http_port),
                "--grpc-address", self.address, "--grpc-port", str(self.grpc_port),
                "--allow-metrics", "false", "--exit-on-error", str(not self.keep_going).lower(),
                "--strict-readiness", str(not self.keep_going).lower(),
                "--exit-timeout-secs", str(int(self.exit_timeout_s)),
                *self.extra_args]

    def start(self) -> TritonServer:
        self.http_port, self.grpc_port = (port or free_port() for port in self.requested_ports)
        self.requested_ports = (self.http_port, self.grpc_port)  # a restart comes back where clients know it
        self.drain_file.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True,
                                            preexec_fn=_terminate_with_parent)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with {self.process.returncode} while starting; see "
                                  f"{self.log_path}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver was not ready after {self.start_timeout_s:.0f} s; see {self.log_path}:\n"
                          f"{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def model_states(self) -> dict[str, tuple[str, str]]:
        """model name -> (state, reason) from the repository index: READY, or UNAVAILABLE with why it failed."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            index = json.loads(r.read())
        return {entry["name"]: (entry.get("state", ""), entry.get("reason", "")) for entry in index}

    def stop(self) -> None:
        """SIGTERM (Triton unloads the models, finalize() runs), then SIGKILL the group if it hangs."""
        if self.process is None:
            return
        pgid = self.process.pid
        if self.process.poll() is None:
            # 10 s of the exit timeout stay for cutting the running requests and unloading every model (5 s was
            # too few for two models on a loaded 2-core machine: Triton then exited by force)
            self.drain_file.write_text(f"{max(0.0, self.exit_timeout_s - DRAIN_MARGIN_S):g}")
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.process.wait(10)
        deadline = time.monotonic() + 10  # the backend stubs exit once their parent is gone
        while processes_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.drain_file.unlink(missing_ok=True)
        left = processes_in_group(pgid)
        if left:
            os.killpg(pgid, signal.SIGKILL)
            raise ServerError(f"processes {left} of the server's group outlived it (killed now)")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
