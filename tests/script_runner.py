"""`python SCRIPT ARGS` (or `python -c SOURCE ARGS`) for the suite's many short command lines, without
starting Python and torch for each one. A server process imports torch and the distributed modules the
trainer uses, once; each command runs in a child forked from it, as `python SCRIPT` runs: its own
process, directory and environment, as __main__, with sys.argv, sys.path (the script's directory or, for
-c, the working directory, PYTHONPATH, the installation's), the warning filters of PYTHONWARNINGS,
atexit, and the exit status of the real thing (SystemExit's, os._exit's, 1 after a traceback, -N after
signal N). The project's own modules are not preloaded: a child imports them from the script's
directory, as a user's copy of the trainer does.

For commands whose environment differs from the server's only in variables read after start-up:
OMP_NUM_THREADS is 1 (read when torch loads) and TORCH_LOGS unset. run() waits for the command; start()
returns a Popen-like handle at once, to signal or kill the command alone or in a process group of ranks.
torchrun keeps real processes (subprocess).

The server: python tests/script_runner.py SOCKET (one per test process, started on first use)."""
import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
import warnings

PRELOAD = ["numpy", "torch", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.nn.parallel", "torch.utils.checkpoint",
           "torch._dynamo", "torch.distributed.fsdp.sharded_grad_scaler", "sentencepiece", "tomllib", "tqdm"]
_server, _lock = None, threading.Lock()


def run(script, args, cwd, env, timeout=300):
    """subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout), run by a child of the server."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = start(script, args, cwd, env, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        with open(out) as fo, open(err) as fe:
            return subprocess.CompletedProcess(proc.args, code, fo.read(), fe.read())


def start(script, args, cwd, env, out, err, group=None):
    """subprocess.Popen([sys.executable, script, *args], cwd=cwd, env=env, stdout=open(out, "w"),
    stderr=open(err, "w"), process_group=group), run by a child of the server: a handle with the pid,
    poll(), kill(), wait(timeout) and returncode of a Popen. Without a group the child has a session of its own."""
    assert env.get("OMP_NUM_THREADS") == "1" and "TORCH_LOGS" not in env, "this command needs a real process"
    args = [str(a) for a in args]
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(_socket_path())
    conn.sendall(json.dumps([str(script), args, str(cwd), dict(env), str(out), str(err), group]).encode() + b"\n")
    return Forked([sys.executable, script, *args], conn)


class Forked:
    """A command forked by the server: its pid, and its exit status once the server sends it."""

    def __init__(self, args, conn):
        self.args, self.conn, self.returncode, self.received = args, conn, None, b""
        self.pid = int(self._line(None))

    def _line(self, timeout):
        """The server's next line, or None if it has not come within `timeout` seconds (None: no limit)."""
        while b"\n" not in self.received:
            if not select.select([self.conn], [], [], timeout)[0]:
                return None
            chunk = self.conn.recv(64)
            assert chunk, "the script server closed the connection"
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return line

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout=None):
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self.conn.close()
        return self.returncode


def _socket_path():
    global _server
    with _lock:
        if _server is None or _server[0].poll() is not None:
            folder = tempfile.mkdtemp(prefix="script_runner")
            path = os.path.join(folder, "socket")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("TORCH_LOGS", None)
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdout=subprocess.PIPE,
                                    env=env, text=True)
            assert proc.stdout.readline() == "ready\n", "the script server did not start"
            atexit.register(shutil.rmtree, folder, True)
            atexit.register(proc.kill)  # runs first
            _server = (proc, path)
        return _server[1]


def _serve(path):
    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers below are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:  # a handler: forks the command, sends its pid, waits for it and sends its status
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                conn.close()
                _command(*request)
            if request[-1] is not None:  # as the child does: in the group before anyone may signal it
                os.setpgid(pid, request[-1] or pid)
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        conn.close()


def _command(script, args, cwd, env, out, err, group):
    if group is None:
        os.setsid()  # its own session, as a process of its own; the server's stdout is not its
    else:
        os.setpgid(0, group)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((0, os.devnull), (1, out), (2, err)):
        f = os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    warnings.resetwarnings()
    sys.warnoptions[:] = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
    warnings._processoptions(sys.warnoptions)
    if script == "-c":  # python -c SOURCE ARGS: the working directory first on sys.path, as ''
        source, *args = args
        sys.argv, first = ["-c", *args], ""
        sys.modules["__main__"] = main = types.ModuleType("__main__")
    else:
        path = os.path.abspath(script)
        sys.argv, first = [script, *args], os.path.dirname(path)
    sys.path[:] = [first, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
                   *(p for p in sys.path[1:] if p.startswith((sys.prefix, sys.base_prefix)))]
    code = 0
    try:
        if script == "-c":
            exec(compile(source, "<string>", "exec"), vars(main))
        else:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if e.code is None or isinstance(e.code, int) else print(e.code, file=sys.stderr) or 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    _serve(sys.argv[1])
