"""The judge: a process of its own that imports the course's checks before any student code
runs, and judges one exercise's answers per request, each in a child forked for it (on Linux).

``python -m course.classroom.judge NN ...`` (the grader starts it) says hello (the exercises'
titles) on stdout, then answers one JSON request per line of stdin.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import queue
import secrets
import select
import signal
import subprocess
import sys
import threading
import time

from course.runtime import interrupts

SEALED = "COURSE_JUDGE_SEALED"  # set by the grader when the judge runs in a sandbox of its own
VERDICTS = {"correct": "correct", "wrong": "wrong", "todo": "not attempted", "error": "error"}
WAKE = 0.2  # seconds: the longest the judge waits on a check's child without looking for a Ctrl-C


def match(line, token: str):
    """The reply in ``line`` if it answers the request ``token``, else None (a forged, garbled or
    stale line: ignored). A reply is a JSON object with ``id``, ``status`` and ``message``."""
    try:
        reply = json.loads(line)
    except (TypeError, ValueError):
        return None
    if not isinstance(reply, dict) or reply.get("id") != token:
        return None
    if reply.get("status") not in VERDICTS or not isinstance(reply.get("message"), str):
        return None
    return reply


class Judge:
    """The judge process, seen from the grader: ``Judge(["01", "03"])`` imports those
    notebooks' checks in a new process; ``judge("01", "weight_grad", answers, timeout)``.

    Each request carries a fresh random token, and only a reply that names it counts: a line
    written into the reply pipe by anyone else (a forged verdict) is ignored. A judge that dies
    (an answer killed it) costs the exercise it was judging; the next request starts a new one.
    ``command`` starts the process (default: ``python -m course.classroom.judge``, sandboxed by
    the grader when it can be)."""

    def __init__(self, numbers, command=None, env=None):
        self.numbers, self.env, self.lock = list(numbers), env, threading.Lock()  # one request at a time
        self.command = command or (lambda argv: argv)
        self.ignored, self.restarts = 0, 0  # lines that answered no request; judges started again
        self.stopped = False
        self._start()

    def _start(self):
        argv = self.command([sys.executable, "-m", "course.classroom.judge", *self.numbers])
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, bufsize=1, env=self.env, start_new_session=True)
        self.lines = queue.Queue()
        try:
            threading.Thread(target=self._read, args=(self.process, self.lines), daemon=True).start()
            hello = json.loads(self.lines.get(timeout=600) or "null")
        except (queue.Empty, ValueError):
            hello = None
        except BaseException:  # Ctrl-C while it starts (it imports the checks: seconds): not left running
            with interrupts.noted():
                self._stop()
            raise
        if not isinstance(hello, dict):
            self._stop()
            raise RuntimeError("the judge process did not start: run `python -m course doctor`")
        self.titles, self.broken = hello.get("titles", {}), hello.get("broken", {})

    @staticmethod
    def _read(process, lines):
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    def _reply(self, token, timeout):
        """The reply to request ``token``, or None if the judge stopped or ran past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                return None
            reply = match(line, token)
            if reply is not None:
                return reply
            self.ignored += 1

    def title(self, number, check) -> str:
        return self.titles.get(number, {}).get(check, check)

    def judge(self, number, check, answers: str, timeout: float) -> tuple[str, str]:
        """(verdict, feedback) for one exercise's answers (base64 cloudpickle of a tuple)."""
        if number in self.broken:
            return "error", f"the checks of notebook {number} cannot be imported here: {self.broken[number]}"
        if self.stopped:
            return "error", "grading was stopped before this answer was judged"
        with self.lock:
            if self.stopped:
                return "error", "grading was stopped before this answer was judged"
            if self.process.poll() is not None:  # the last answer killed it
                self._stop()
                self.restarts += 1
                try:
                    self._start()
                except RuntimeError as e:
                    return "error", f"the judge stopped and could not be started again: {e}"
            token = secrets.token_hex(16)
            try:
                self.process.stdin.write(json.dumps({"id": token, "notebook": number, "check": check,
                                                     "answers": answers, "timeout": timeout}) + "\n")
                self.process.stdin.flush()
            except OSError:
                pass  # it died: no reply comes
            reply = self._reply(token, timeout + 60)
            if reply is None:
                self._stop()  # dead, or stuck: the next request starts a new one
        if reply is None:
            return "error", "the judge stopped while judging this answer (the answer killed it, or it ran out of time)"
        return VERDICTS[reply["status"]], reply["message"]

    def kill(self):
        """Stop the judge now (kills what it judges); ``stopped`` (grading was stopped): start no other."""
        self.stopped = True
        self._stop()

    def _stop(self):
        if self.process.poll() is None:  # not reaped yet: its process group id is still its own
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # its sandbox, or the children it forked
            except OSError:
                pass
        self.process.wait()

    def close(self):
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._stop()


def _judge_one(exercise, answers: str) -> dict:
    """Inside the judge's child: load one exercise's answers, call the real check."""
    import cloudpickle

    try:
        loaded = cloudpickle.loads(base64.b64decode(answers))
        if not isinstance(loaded, tuple):
            raise TypeError(f"expected a tuple of answers, got {type(loaded).__name__}")
    except BaseException as e:
        return {"status": "error", "message": f"the answer could not be loaded for judging: {type(e).__name__}: {e}"}
    for answer in loaded:  # e.g. the notebook's own `from course.parallel.zero import zero1_step`, after the exercise
        module = getattr(answer, "__module__", None)
        if callable(answer) and isinstance(module, str) and module.split(".")[0] == "course":
            return {"status": "error", "message": f"the answer is the course's own {module}.{getattr(answer, '__qualname__', '')}, "
                                                  "not one written in the notebook"}
    try:
        feedback = exercise(*loaded)
    except BaseException as e:  # what the student sees in the notebook: a traceback, not a verdict
        return {"status": "error", "message": f"the check raised {type(e).__name__}: {e}"}
    return {"status": feedback.status, "message": feedback.message}


def _in_child(fn, timeout: float, keep_closed=()) -> dict:
    """``fn()`` (a dict) in a forked child of its own process group, killed after ``timeout`` s.
    Ctrl-C (SIGINT to this process's group) is noted, as course.launch notes it: the child is
    killed and reaped, then KeyboardInterrupt raised; the child drops a press that came before it
    left this group (it starts with SIGINT blocked), so none is lost in the fork or the cleanup."""
    sys.stdout.flush()
    sys.stderr.flush()
    with interrupts.noted() as pressed:
        read_end, write_end = os.pipe()
        with interrupts.held_back():
            pid = os.fork()
        if pid == 0:  # the child: no way back to the grader but its pipe
            code = 1
            try:
                os.close(read_end)
                for fd in keep_closed:
                    os.close(fd)
                os.setpgid(0, 0)
                interrupts.let_through()
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                data = json.dumps(fn()).encode()
                with os.fdopen(write_end, "wb") as pipe:
                    pipe.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        chunks, deadline, late = [], time.monotonic() + timeout, False
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while not pressed:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = True
                    break
                # A press wakes select through ``pressed``, unless another thread took the signal:
                # then Python runs the handler only at the main thread's next bytecode, so look often.
                if not select.select([pipe, pressed], [], [], min(left, WAKE))[0] or pressed:
                    continue
                data = pipe.read(1 << 16)
                if not data:
                    break
                chunks.append(data)
        try:
            os.killpg(pid, signal.SIGKILL)  # the check's ranks, if any are left
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)  # pressed before it had a group of its own
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
    if pressed:
        raise KeyboardInterrupt("interrupted while judging: the check's process was stopped")
    if late:
        return {"status": "error", "message": f"the check ran past its {timeout:g} s limit"}
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else f"exit code {os.waitstatus_to_exitcode(status)}"
        return {"status": "error", "message": f"the check's process died ({how})"}


def serve(numbers) -> int:
    """The judge (``python -m course.classroom.judge NN ...``): imports those notebooks' checks,
    says hello (their titles) on stdout, then answers one JSON request per line of stdin."""
    from course.classroom.exercises import Exercise

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr, never into the replies
    modules, titles, broken = {}, {}, {}
    for number in numbers:
        try:
            modules[number] = importlib.import_module(f"course.checks.nb{number}")
        except Exception as e:
            broken[number] = f"{type(e).__name__}: {e}"
            continue
        titles[number] = {name: x.name for name, x in vars(modules[number]).items() if isinstance(x, Exercise)}
    proto.write(json.dumps({"titles": titles, "broken": broken}) + "\n")
    isolate = sys.platform == "linux"  # fork each exercise; elsewhere judge in this process
    sealed = os.environ.get(SEALED) == "1"  # alone in a PID namespace of its own (see course.classroom.sandbox)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            request = {key: request[key] for key in ("id", "notebook", "check", "answers", "timeout")}
        except (ValueError, TypeError, KeyError):  # not the grader's (a line written into the pipe): no reply
            continue
        exercise = getattr(modules.get(request["notebook"]), request["check"], None)
        if not isinstance(exercise, Exercise):
            reply = {"status": "error", "message": f"notebook {request['notebook']} has no exercise {request['check']}"}
        elif isolate:
            reply = _in_child(lambda: _judge_one(exercise, request["answers"]), request["timeout"],
                              keep_closed=(proto.fileno(), sys.stdin.fileno()))
        else:
            reply = _judge_one(exercise, request["answers"])
        proto.write(json.dumps({**reply, "id": request["id"]}) + "\n")
        if sealed:
            _kill_strangers()
    return 0


def _kill_strangers():
    """In the judge's own PID namespace, every process but the judge and the namespace's first
    (bubblewrap's) one is left over from an answer (a child that left its process group): killed,
    so it cannot touch a later student's judging."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, os.getpid()):
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m course.classroom.judge NN [NN ...]  (the grader starts this; see python -m course grade)")
    try:
        sys.exit(serve(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C, the check being judged stopped (_in_child): no traceback
        sys.exit(130)
